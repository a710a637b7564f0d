"""`mrl sft` and the warm start (mrl/train/sft.py, mrl/train/demonstrations.py, mrl/runs/warm_start.py): the
assistant-only mask by hand, demonstrations that are the ids a rollout holds and that the environment's own channels
score as solved, the train split only, the loss by hand, exact resume, `trainer.init_from` loading exactly the
checkpoint's weights, and the two stages end to end on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SHRINK
from hydra import compose, initialize_config_dir
from test_protocols import TEMPLATES as CHAT_TEMPLATES
from test_protocols import Scripted, build_chat_model, encode

from mrl.chat.chat_template import CALL_CLOSE
from mrl.chat.protocols import ChatProtocol, ProtocolSettings, chat_protocol
from mrl.core.config import CONF_DIR, UserError
from mrl.core.episode import Demonstration, Prompt, Reply
from mrl.envs.calc_agent import CalcAgent
from mrl.generation.rollout import Sampling, generate
from mrl.modeling.models import load_tokenizer
from mrl.rewards.channels import build_reward_set
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.demonstrations import conversation, play, reply_turns
from mrl.train.sft import batch_of, cut_to_length, sft, sft_loss

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def compose_sft(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("sft", overrides=[*SHRINK, "sft.steps=2", "sft.batch_size=4", "sft.micro_batch_size=2",
                                         "sft.lr=1e-3", "trainer.eval_prompts=4", *overrides])


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    directory = build_chat_model(tmp_path_factory.mktemp("sft_chat") / "hermes", CHAT_TEMPLATES["hermes"])
    return load_tokenizer(str(directory))


def transcript_protocol(tokenizer, environment):
    return chat_protocol(tokenizer, ProtocolSettings(True, {}, {}, 100, (), 1000, False, environment))


# ---- the mask, by hand ------------------------------------------------------------------------------------------

TWO_TURNS = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 3 4"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calc", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "calc", "content": "7"},
        {"role": "assistant", "content": "It is 7."},
        {"role": "user", "content": "and 1 1"},
        {"role": "assistant", "content": "2."},
    ],
    "tools": [{"type": "function", "function": {"name": "calc", "description": "Adds.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}],
}


def test_assistant_only_mask_by_hand_on_a_two_turn_conversation_with_a_tool_result(hermes):
    demo, transcript = conversation(TWO_TURNS, "record 0")
    played = play(transcript_protocol(hermes, lambda prompt: transcript), hermes, demo, [hermes.eos_token_id])
    written = [i for i, m in zip(played.ids, played.mask) if m]
    environment = [i for i, m in zip(played.ids, played.mask) if not m]
    call = '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    # The policy writes its call (the turn stops at </tool_call>), then two answers, each with its end of turn.
    assert hermes.decode(written) == call + "It is 7.<|im_end|>" + "2.<|im_end|>"
    # Everything else is the environment's: the call's end of turn, the tool result, the user's next turn.
    assert hermes.decode(environment) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nand 1 1<|im_end|>\n<|im_start|>assistant\n")
    # The prompt (system, tools, the first user turn) is never trained on.
    assert played.labels_mask[:len(played.prompt_ids)] == [0] * len(played.prompt_ids)
    assert sum(played.labels_mask) == len(written)


def test_a_rollout_that_writes_the_demonstration_holds_exactly_its_ids_and_mask(hermes):
    """The ids SFT trains on are the ids sampled: a scripted policy replying with the demonstration's turns."""
    task = CalcAgent(seed=0, fewshot=0)
    protocol = ChatProtocol(hermes, task.tools, max_turns=task.max_turns)
    demos = task.demonstrations("train", count=3)
    played = [play(protocol, hermes, demo, [hermes.eos_token_id]) for demo in demos]
    replies = {}
    for demo in demos:
        replies[demo.prompt.text] = [
            hermes.decode(encode(hermes, text)) + ("" if text.endswith(CALL_CLOSE) else "<|im_end|>")
            for text in (t for r in demo.replies for t, _ in reply_turns(protocol, r))]

    def reply(transcript: str) -> str:
        prompt = next(p for p in replies if p.split()[1] in transcript and p.split()[2] in transcript)
        return replies[prompt][transcript.count("<|im_start|>assistant") - 1]

    rollouts = generate(Scripted(hermes, reply), hermes, [d.prompt for d in demos], 1, Sampling(200), protocol, CPU)
    for n, p in enumerate(played):
        length = int(rollouts.completion_attention[n].sum())
        assert rollouts.completion_ids[n, :length].tolist() == p.ids
        assert rollouts.completion_mask[n, :length].tolist() == p.mask
        assert rollouts.prompt_ids[n][rollouts.prompt_mask[n].bool()].tolist() == p.prompt_ids


# ---- demonstrations round-trip through the environment's own channels -------------------------------------------

def round_trip(tokenizer, overrides: list[str]) -> tuple[int, list]:
    """Every demonstration of the task played and scored by its reward set: (count, the ones not solved)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    from mrl.envs.task import build_task, episode_protocol

    task = build_task(cfg)
    protocol = episode_protocol(cfg, tokenizer, task)
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    played = [play(protocol, tokenizer, d, [tokenizer.eos_token_id]) for d in task.demonstrations("train", 64)]
    rewards, _ = reward_set.score([p.episode for p in played], "raise")
    bad = []
    for p, row in zip(played, rewards.tolist()):
        values = dict(zip(reward_set.names, row))
        if p.episode.truncated or values[cfg.rewards.pass_channel or "correctness"] < 1 or values.get("safety", 0) < 0:
            bad.append((p.source, values))
    return len(played), bad


def chat_model_overrides(hermes) -> list[str]:
    return [f"model.name_or_path={hermes.name_or_path}", "model.tiny=null", "model.tool_format=chat",
            "model.use_chat_template=true", "logger=none"]


@pytest.mark.parametrize("rewards", ["calc_agent", "agent_triple", "tool_call"])
def test_generator_demonstrations_are_solved_episodes_in_chat(hermes, rewards):
    count, bad = round_trip(hermes, [*chat_model_overrides(hermes), f"rewards={rewards}"])
    assert count == 64 and bad == []


@pytest.mark.parametrize("rewards", ["agent_triple", "tool_call"])
def test_generator_demonstrations_are_solved_episodes_in_the_tiny_models_words(rewards):
    from mrl.modeling.models import resolve_model_path

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["logger=none"])
    count, bad = round_trip(load_tokenizer(resolve_model_path(cfg.model)), [f"rewards={rewards}", "logger=none"])
    assert count == 64 and bad == []


BFCL_SINGLE = ["simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
               "live_parallel", "live_parallel_multiple", "irrelevance", "live_irrelevance"]


def test_every_bfcl_single_turn_train_record_round_trips_to_full_correctness(hermes):
    count, bad = round_trip(hermes, [*chat_model_overrides(hermes), "rewards=bfcl",
                                     f"rewards.task.categories=[{','.join(BFCL_SINGLE)}]"])
    assert count > 1000 and bad == []


def test_every_bfcl_multi_turn_base_train_entry_round_trips_to_full_correctness_and_no_violation(hermes):
    count, bad = round_trip(hermes, [*chat_model_overrides(hermes), "rewards=bfcl_agent"])
    assert count > 150 and bad == []


def test_only_the_train_split_becomes_demonstrations():
    from mrl.envs.bfcl import BfclTask
    from mrl.envs.bfcl_agent import BfclAgentTask

    for task in (BfclTask(["simple_python", "irrelevance"]), BfclAgentTask()):
        sources = {d.source for d in task.demonstrations("train")}
        held_out = {e["id"] for e in task.split.eval}
        assert sources and held_out and not sources & held_out
        assert sources <= {e["id"] for e in task.split.train}
        with pytest.raises(UserError, match="only the 'train' split"):
            task.demonstrations("eval")
    generator = CalcAgent(seed=3)
    assert [d.prompt for d in generator.demonstrations("train", count=5)] == [generator.prompt(i) for i in range(5)]


def test_humaneval_gives_no_demonstrations_and_says_why_in_one_line():
    from mrl.envs.humaneval import HumanEvalTask

    with pytest.raises(UserError) as err:
        HumanEvalTask().demonstrations()
    assert "no train split" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("record, says", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": "zzz"}, "needs `messages`"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "zzz"}]}, "must be a list"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "are not JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}, {"role": "robot"}]},
     "has role 'robot'"),
])
def test_a_bad_conversation_record_is_one_line_naming_it(record, says):
    with pytest.raises(UserError, match=says) as err:
        conversation(record, "data.jsonl record 7")
    assert str(err.value).startswith("data.jsonl record 7") and "\n" not in str(err.value)


# ---- the loss ---------------------------------------------------------------------------------------------------

def test_the_sft_loss_is_the_token_mean_nll_of_the_written_tokens_by_the_models_own_logits(hermes):
    """policy_forward's chunked scoring over a batch of two played rows equals log_softmax of the model's own logits
    at the written positions, averaged over written tokens only."""
    from mrl.modeling.models import Actor, load_causal_lm

    task = CalcAgent(seed=0, fewshot=0)
    protocol = ChatProtocol(hermes, task.tools, max_turns=task.max_turns)
    rows = [play(protocol, hermes, d, [hermes.eos_token_id]) for d in task.demonstrations("train", count=2)]
    model = load_causal_lm(hermes.name_or_path, compose_sft().model, CPU)
    actor = Actor(model).eval()
    batch = batch_of(rows, hermes.pad_token_id, CPU)
    from mrl.train.update import policy_forward

    with torch.no_grad():
        logprobs, _, _ = policy_forward(actor, batch)
        tokens = sum(sum(r.mask) for r in rows)
        loss = sft_loss(logprobs, batch.completion_mask.float(), tokens)
        expected = 0.0
        for r in rows:
            logits = model(torch.tensor([r.input_ids])).logits[0].log_softmax(-1)  # [L, V]
            for t, (token, written) in enumerate(zip(r.input_ids, r.labels_mask)):
                if written:
                    expected -= logits[t - 1, token].item()
    assert loss.item() == pytest.approx(expected / tokens, rel=1e-4)


def test_a_demonstration_over_the_limit_is_cut_with_one_warning_naming_it(capsys):
    from mrl.train.demonstrations import Played

    episode = None
    rows = [Played("short", [1, 2], [3, 4], [1, 1], episode), Played("bfcl_7", [1, 2, 3, 4], [5, 6, 7, 8], [1, 0, 1, 1],
                                                                     episode)]
    out = cut_to_length(rows, 6)
    assert [(r.prompt_ids, r.ids, r.mask) for r in out] == [([1, 2], [3, 4], [1, 1]), ([1, 2, 3, 4], [5, 6], [1, 0])]
    err = capsys.readouterr().err
    assert "sft.max_seq_len=6: 1 of 2 demonstrations are longer and were cut to it (bfcl_7)" in err


# ---- runs: resume, warm start -----------------------------------------------------------------------------------

def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    from mrl.runs.restore import trained_weights

    return trained_weights(checkpoint)


def test_a_resumed_sft_run_equals_an_uninterrupted_one(tmp_path):
    whole = tmp_path / "whole"
    sft(compose_sft("sft.steps=4", "sft.save_every=2"), whole)
    part = tmp_path / "part"
    sft(compose_sft("sft.steps=2"), part)
    sft(compose_sft("sft.steps=4", "sft.save_every=2", "trainer.resume=true"), part)
    a, b = weights_of(whole / "checkpoints" / "step_000004"), weights_of(part / "checkpoints" / "step_000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[r.get("sft/loss") for r in read_metrics(d / METRICS_FILE)] for d in (whole, part)]
    assert losses[0] == losses[1] and len(losses[0]) == 5  # step 0's evaluation, then 4 steps


def test_init_from_loads_exactly_the_checkpoints_weights(tmp_path):
    from mrl.algo.advantages import ESTIMATORS
    from mrl.runs.restore import merged_policy
    from mrl.train.loop import build_models

    source = tmp_path / "sft"
    sft(compose_sft(), source)
    checkpoint = source / "checkpoints" / "step_000002"
    cfg = compose_sft("stage=rl", f"trainer.init_from={source}")
    _, actor, _, reference = build_models(cfg, ESTIMATORS[cfg.algo.advantage], CPU, None, tmp_path / "rl")
    trained = weights_of(checkpoint)
    loaded = actor.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    lineage = json.loads((tmp_path / "rl" / "lineage.json").read_text())
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert (lineage["step"], lineage["stage"], lineage["checkpoint"]) == (2, "sft", str(checkpoint.resolve()))
    assert lineage["policy_sha256"] == manifest["files"]["policy/model.safetensors"]["sha256"]

    lora = ["model.lora.r=4", "model.lora.alpha=8"]  # LoRA adapters are merged into their base for the warm start
    sft(compose_sft(*lora), tmp_path / "sft_lora")
    cfg = compose_sft("stage=rl", f"trainer.init_from={tmp_path / 'sft_lora'}")
    _, actor, _, _ = build_models(cfg, ESTIMATORS[cfg.algo.advantage], CPU, None, tmp_path / "rl_lora")
    merged = merged_policy(tmp_path / "sft_lora" / "checkpoints" / "step_000002", compose_sft(*lora).model)
    expected = merged.state_dict()
    assert all(torch.equal(actor.module.policy.state_dict()[k], v) for k, v in expected.items())


def test_init_from_a_path_without_a_checkpoint_is_refused_in_one_line(tmp_path):
    from mrl.train.validation import validate

    with pytest.raises(UserError, match="trainer.init_from=.*neither a checkpoint nor a run dir"):
        validate(compose_sft("stage=rl", f"trainer.init_from={tmp_path}"))


def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mrl", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_mrl_sft_then_mrl_train_init_from_on_the_tiny_model(tmp_path):
    """The two stages as a user runs them: the SFT run's last held-out score is RL's step-0 score (the same model,
    the same prompts, greedy), and the RL run records where it came from."""
    tiny = ["logger=none", "trainer.eval_prompts=8", "trainer.max_new_tokens=10"]
    done = mrl("sft", *tiny, "sft.steps=6", "sft.batch_size=8", "sft.lr=1e-3", f"hydra.run.dir={tmp_path / 'sft'}",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    sft_evals = [r for r in read_metrics(tmp_path / "sft" / METRICS_FILE) if "eval/accuracy" in r]
    assert [r["step"] for r in sft_evals] == [0, 6]
    assert sft_evals[-1]["eval/accuracy"] > sft_evals[0]["eval/accuracy"]  # it learned to call calc
    done = mrl("train", *tiny, "trainer.max_steps=1", "trainer.eval_every=1", f"trainer.init_from={tmp_path / 'sft'}",
               "trainer.prompts_per_step=2", "trainer.group_size=4", f"hydra.run.dir={tmp_path / 'rl'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rl_evals = [r for r in read_metrics(tmp_path / "rl" / METRICS_FILE) if "eval/accuracy" in r]
    assert rl_evals[0]["step"] == 0 and rl_evals[0]["eval/accuracy"] == sft_evals[-1]["eval/accuracy"]
    assert json.loads((tmp_path / "rl" / "lineage.json").read_text())["stage"] == "sft"


def test_a_users_own_task_returns_plain_demonstrations(hermes):
    """Reply and Demonstration are plain data a user's own task can return from demonstrations(split)."""
    demo = Demonstration(Prompt("q"), (Reply("a"),), "mine")
    protocol = transcript_protocol(hermes, None)
    played = play(protocol, hermes, demo, [hermes.eos_token_id])
    assert hermes.decode([i for i, m in zip(played.ids, played.mask) if m]) == "a<|im_end|>"


def test_the_report_draws_sft_then_rl_as_one_held_out_curve(tmp_path):
    from mrl.runs.report import find_runs

    sft_dir, rl_dir, other = tmp_path / "sft", tmp_path / "rl", tmp_path / "other"
    for run_dir, lines in ((sft_dir, [{"step": 0, "eval/accuracy": 0.0}, {"step": 40, "sft/loss": 0.3,
                                                                           "eval/accuracy": 0.45}]),
                           (rl_dir, [{"step": 0, "eval/accuracy": 0.45}, {"step": 30, "eval/accuracy": 0.55}]),
                           (other, [{"step": 0, "eval/accuracy": 0.45}])):
        run_dir.mkdir()
        (run_dir / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (rl_dir / "lineage.json").write_text(json.dumps({"source_run": str(sft_dir.resolve()), "step": 40}))
    (other / "lineage.json").write_text(json.dumps({"source_run": str(tmp_path / "gone"), "step": 40}))
    runs = {run.path.name: run for run in find_runs([sft_dir, rl_dir, other])}
    assert [r["step"] for r in runs["rl"].records] == [40, 70]  # continues the SFT run's axis
    assert runs["rl"].label == "rl (from step 40)"
    assert [r["step"] for r in runs["other"].records] == [0]  # its source is not in the report: its own axis
    assert [r["step"] for r in runs["sft"].records] == [0, 40]


def test_mrl_sft_on_your_own_conversations_trains_on_their_train_split_only(hermes, tmp_path):
    from mrl.core.data import split_train_eval
    from mrl.modeling.models import load_tokenizer
    from mrl.train.sft import conversation_rows
    from mrl.train.validation import validate

    path = tmp_path / "conversations.jsonl"
    records = [{**TWO_TURNS, "messages": [*TWO_TURNS["messages"][:1], {"role": "user", "content": f"add {i} 4"},
                                          *TWO_TURNS["messages"][2:]]} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = compose_sft(*chat_model_overrides(hermes), "rewards=calc_agent", f"data.path={path}",
                      "data.eval_fraction=0.3")
    validate(cfg)  # conversations, not prompts: they end with the assistant's turn
    rows = conversation_rows(cfg, load_tokenizer(hermes.name_or_path), [hermes.eos_token_id])
    train, held_out = split_train_eval(list(range(10)), 0.3, cfg.trainer.seed)
    assert sorted(int(r.source.rsplit(" ", 1)[1]) for r in rows) == sorted(train) and len(held_out) == 3
    path.write_text(path.read_text() + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="record 10: no assistant turn"):
        validate(cfg)


def test_an_sft_batch_that_does_not_split_over_the_ranks_is_one_line(monkeypatch):
    from mrl.train.validation import validate

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="sft.batch_size=4 does not split over 3 ranks"):
        validate(compose_sft("trainer.prompts_per_step=3", "deepspeed=zero2"))
