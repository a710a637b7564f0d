"""A TRL user's reward functions and datasets, unchanged (mrl.rewards.trl, mrl.core.data), and every mistake of their
first ten minutes refused in one line before anything is written (mrl.rewards.targets, mrl.overrides, the Hub
checks)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trl_style_rewards as trl_fns
import yaml
from conftest import compose_config

from mrl.core import data
from mrl.core.config import UserError
from mrl.core.data import DatasetTask, conversation_messages, conversation_prompt, load_records, records_to_prompts
from mrl.core.episode import Episode, Prompt
from mrl.envs.task import build_task
from mrl.modeling import models
from mrl.overrides import check_groups, expand_resume
from mrl.rewards.channels import ChannelSpec, RewardSet
from mrl.rewards.targets import locate
from mrl.rewards.trl import TrlReward, trl_inputs
from mrl.runs.tracking import run_labels, trl_key
from mrl.train.demonstrations import conversation
from mrl.train.loop import train
from mrl.train.validation import validate

TESTS = Path(__file__).resolve().parent
SEARCH = f"hydra.searchpath=[file://{TESTS / 'conf'}]"
MRL = [sys.executable, "-m", "mrl.cli"]
TINY = ["trainer.max_steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2", "logger=none"]


def episode(prompt: Prompt, completion: str, ids=(1, 2, 3)) -> Episode:
    return Episode(prompt, completion, list(ids), len(ids), False, 8)


def chat(text: str, **meta) -> Prompt:
    return Prompt(text, meta, messages=[{"role": "user", "content": text}])


# --- the adapter: TRL's call, TRL's forms, values mapped back to episodes

def test_trl_functions_score_standard_prompts_as_strings_and_abstain_with_none():
    episodes = [episode(Prompt("2+3=", {"solution": "5"}), "5"),
                episode(Prompt("2+3=", {"solution": "5"}), "I think 6"),
                episode(Prompt("1+1=", {"solution": None}), "2")]
    reward_set = RewardSet([ChannelSpec("accuracy", TrlReward(trl_fns.accuracy_reward), 1.0),
                            ChannelSpec("length", TrlReward("trl_style_rewards.reward_len"), 0.1)])
    rewards, failed = reward_set.score(episodes)
    # accuracy: last number == solution (5 / 6 / no solution: abstains); length: -|10 - len| of "5", "I think 6", "2"
    assert rewards[:, 0].tolist()[:2] == [1.0, 0.0] and math.isnan(rewards[2, 0])
    assert rewards[:, 1].tolist() == [-9.0, -1.0, -9.0]
    assert not failed.any()


def test_trl_functions_get_message_lists_for_conversational_prompts():
    episodes = [episode(chat("2+3?", solution="5"), "<think>add</think><answer>5</answer>"),
                episode(chat("2+3?", solution="5"), "<answer>6</answer>")]
    reward_set = RewardSet([ChannelSpec("format", TrlReward(trl_fns.format_reward), 1.0),
                            ChannelSpec("accuracy", TrlReward(trl_fns.accuracy_reward), 1.0)])
    rewards, _ = reward_set.score(episodes)
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    inputs = trl_inputs(episodes[:1])
    assert inputs["prompts"] == [[{"role": "user", "content": "2+3?"}]]
    assert inputs["completions"] == [[{"role": "assistant", "content": "<think>add</think><answer>5</answer>"}]]
    # forced to strings (conversational=false): TRL's standard form for the same episodes
    assert trl_inputs(episodes[:1], conversational=False)["prompts"] == ["2+3?"]


def test_one_call_per_scoring_with_every_column_and_the_completion_ids():
    calls = []

    def counted(**kwargs):
        calls.append(sorted(kwargs))
        return trl_fns.seen(**kwargs)

    episodes = [episode(Prompt("2+3=", {"solution": "5", "level": 2}), "5", ids=(7, 8, 9)),
                episode(chat("2+3=", solution="5"), "5", ids=(7,))]
    rewards, _ = RewardSet([ChannelSpec("seen", TrlReward(counted), 1.0)]).score(episodes)
    assert calls == [["completion_ids", "completions", "level", "prompts", "solution"]]  # once, for both episodes
    # len(prompt) + 10 * len(ids) + 100 * columns (level, solution): "2+3=" is 4 characters, a message list 1 entry
    assert rewards[:, 0].tolist() == [4 + 30 + 200, 1 + 10 + 200]
    assert trl_inputs(episodes)["level"] == [2, None]  # a column a record lacks: None there


def test_a_trl_function_returning_too_few_values_names_the_channel():
    reward_set = RewardSet([ChannelSpec("short", TrlReward(lambda completions, **kw: [1.0]), 1.0)])
    with pytest.raises(Exception, match="'short' returned 1 values for 2 episodes"):
        reward_set.score([episode(Prompt("a"), "x"), episode(Prompt("b"), "y")])


# --- every _target_ imported, each failure one line naming the key, the module and the cause

def test_locate_names_the_key_the_module_and_the_cause(tmp_path, monkeypatch):
    assert locate("trl_style_rewards.reward_len", "k") is trl_fns.reward_len
    assert locate("mrl.rewards.trl.TrlReward", "k") is TrlReward
    with pytest.raises(UserError, match=r"^k='nowhere_xyz.f': no module named 'nowhere_xyz' on the Python path; .*"
                                        r"PYTHONPATH=\."):
        locate("nowhere_xyz.f", "k")
    with pytest.raises(UserError, match=r"has no 'reward_lenn'; did you mean trl_style_rewards.reward_len\?"):
        locate("trl_style_rewards.reward_lenn", "k")
    with pytest.raises(UserError, match=r"'mrl.rewards.trl' is a module, not a function or class; .*TrlReward"):
        locate("mrl.rewards.trl", "k")
    (tmp_path / "raises_on_import.py").write_text("import numpyy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"importing 'raises_on_import' raised ModuleNotFoundError: No module named "
                                        r"'numpyy' \(.*raises_on_import.py:1\); install 'numpyy'"):
        locate("raises_on_import.f", "k")


def test_a_trl_function_named_without_the_adapter_is_refused_with_the_wrapping():
    from omegaconf import OmegaConf

    from mrl.rewards.targets import check_not_trl

    check_not_trl(OmegaConf.create({"_target_": "mrl.envs.math_length.AnswerCorrect"}), "f")  # a plain channel
    wrapped = r"f=\{_target_: mrl.rewards.trl.TrlReward, fn: trl_style_rewards.reward_len\}$"
    with pytest.raises(UserError, match=r"^f._target_='trl_style_rewards.reward_len' takes `completions`: .* write "
                                        + wrapped):
        check_not_trl(OmegaConf.create({"_target_": "trl_style_rewards.reward_len", "_partial_": True}), "f")


# --- TRL datasets as they are

def test_a_conversational_prompt_is_the_messages_and_other_columns_reach_the_channels():
    record = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
              "solution": "5"}
    (prompt,) = records_to_prompts([record])
    assert prompt.text == "2+3?" and prompt.messages == record["prompt"] and prompt.meta == {"solution": "5"}


def test_sft_reads_trl_prompt_completion_records_standard_and_conversational():
    standard = {"prompt": "2+3?", "completion": "5"}
    assert conversation_messages(standard, "r") == [{"role": "user", "content": "2+3?"},
                                                    {"role": "assistant", "content": "5"}]
    conversational = {"prompt": [{"role": "user", "content": "2+3?"}],
                      "completion": [{"role": "assistant", "content": "5"}], "solution": "5"}
    demo, _ = conversation(conversational, "r")
    assert demo.prompt.messages == [{"role": "user", "content": "2+3?"}] and demo.replies[0].content == "5"
    assert conversation_prompt(conversational, "r") == {"solution": "5",
                                                        "messages": [{"role": "user", "content": "2+3?"}]}
    with pytest.raises(UserError, match=r"^r: a conversation needs `messages` .* or `prompt` and `completion`"):
        conversation_messages({"text": "just text"}, "r")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mrl_sfts_held_out_prompts_are_the_turns_before_the_answer(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{a}+1?", "completion": str(a + 1)} for a in range(4)])
    task = DatasetTask(str(path), eval_fraction=0.5, conversations=True)
    held_out = task.eval_prompts()
    assert len(held_out) == 2 and all(p.messages == [{"role": "user", "content": p.text}] for p in held_out)
    assert {p.text for p in [*held_out, *task.split.train]} == {"0+1?", "1+1?", "2+1?", "3+1?"}


CONVERSATIONAL = [{"prompt": [{"role": "user", "content": f"add {a} {b} ="}], "solution": str((a + b) % 10)}
                  for a in range(3) for b in range(3)]


def test_a_preset_of_trl_channels_alone_trains_on_data_path(tmp_path):
    path = write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONAL)
    cfg = compose_config(SEARCH, "rewards=trl_style", f"data.path={path}", "algo=gdpo", "trainer.max_steps=1")
    validate(cfg)
    task = build_task(cfg)
    assert isinstance(task.dataset, DatasetTask) and len(task.dataset.split.train) + len(task.dataset.split.eval) == 9
    metrics = train(cfg, tmp_path / "run")
    assert metrics["step"] == 1 and math.isfinite(metrics["reward/accuracy/mean"])
    assert metrics["reward/length/mean"] <= 0  # -|10 - len|, never above 0
    with pytest.raises(UserError, match=r"^rewards=trl_style names no task and data.path is not set"):
        validate(compose_config(SEARCH, "rewards=trl_style"))


def test_a_hub_dataset_id_loads_through_datasets_or_fails_at_once_offline(monkeypatch):
    import datasets

    asked = []

    def load_dataset(name, split):
        asked.append((name, split))
        return datasets.Dataset.from_list([{"prompt": "2+3?", "solution": "5"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(data, "hub_unreachable", lambda: None)
    assert load_records("someorg/somedata::test") == [{"prompt": "2+3?", "solution": "5"}]
    assert load_records("someorg/somedata") and asked == [("someorg/somedata", "test"), ("someorg/somedata", "train")]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"^data.path='someorg/somedata' is not a local path.*HF_HUB_OFFLINE is set.*"
                                        r"load_dataset\('someorg/somedata'\).save_to_disk\('data/somedata'\)"):
        load_records("someorg/somedata")
    assert time.perf_counter() - start < 1.0


def test_an_uncached_hub_model_fails_at_once_without_a_network(monkeypatch):
    monkeypatch.setattr(models, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    cfg = compose_config("model.name_or_path=nobody/no-such-model")
    with pytest.raises(UserError, match=r"'nobody/no-such-model' is not a local directory nor in the HF cache.*"
                                        r"hf download nobody/no-such-model"):
        models.resolve_model_path(cfg.model)


# --- the command line: resume, typos

def saved_run(run: Path, overrides: list[str], config_dir: str | None = None) -> Path:
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    sources = [{"path": "/x/conf", "schema": "file", "provider": "main"}]
    sources += [{"path": config_dir, "schema": "file", "provider": "command-line"}] if config_dir else []
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"config_sources": sources}}}))
    return run


def test_a_resume_rereads_the_saved_overrides_and_refuses_only_a_contradiction(tmp_path):
    run = saved_run(tmp_path / "run", ["algo=grpo", "trainer.seed=3"], config_dir="/my/conf")
    expected = ["--config-dir", "/my/conf", "algo=grpo", "trainer.seed=3", "trainer.resume=true",
                f"hydra.run.dir={run}"]
    # the recorded config dir is re-read only with --trust-config (tests/test_probe5_trust.py), or given again
    assert expand_resume(["trainer.resume=true", f"hydra.run.dir={run}", "--trust-config"]) == expected
    assert expand_resume(["--resume", str(run), "trainer.max_steps=9", "--config-dir", "/my/conf"]) == [
        "algo=grpo", "trainer.seed=3", "trainer.resume=true", f"hydra.run.dir={run}", "trainer.max_steps=9",
        "--config-dir", "/my/conf"]
    sft_run = saved_run(tmp_path / "sft", ["sft.steps=10", "sft.save_every=5"])
    assert expand_resume(["--resume", str(sft_run), "sft.steps=30", "sft.save_every=10"])[-2:] == [
        "sft.steps=30", "sft.save_every=10"]  # mrl sft goes on for longer, as mrl train does
    assert expand_resume(["--resume", str(run), "algo=grpo", "-cd", "c"]).count("algo=grpo") == 1  # a repeat: once
    assert expand_resume(["algo=ppo", f"hydra.run.dir={run}"]) == ["algo=ppo", f"hydra.run.dir={run}"]  # no resume
    with pytest.raises(UserError, match=rf"^trainer.resume: {run} was started with algo=grpo; this command gives "
                                        r"algo=gdpo: .* drop algo=gdpo"):
        expand_resume(["--resume", str(run), "algo=gdpo", "--trust-config"])


@pytest.mark.parametrize("arg, message", [
    ("reward=agent_triple", "reward=agent_triple: there is no config group or key 'reward'; did you mean "
                            "rewards=agent_triple? (a new key: +reward=agent_triple)"),
    ("algo=gdop", "algo=gdop: there is no algo/gdop.yaml; did you mean algo=gdpo? choose one of corrgrpo, dapo, "
                  "gd2po, gd2po_snr, gdpo, "),
    ("algo=grpo,gdpp", "algo=gdpp: there is no algo/gdpp.yaml; did you mean algo=gdpo?"),
])
def test_a_misspelt_group_or_choice_names_the_nearest(arg, message):
    with pytest.raises(UserError) as err:
        check_groups([arg], [])
    assert str(err.value).startswith(message)


def test_real_groups_keys_and_sweeps_pass_the_typo_check():
    check_groups(["algo=gdpo,grpo", "rewards=agent_triple", "trainer.lr=1e-5", "stage=rl", "+extra=1",
                  "model=tiny", "hydra.run.dir=x", "--config-dir", "conf"], [])


def test_wandb_names_a_run_by_algorithm_and_seed_unless_told(tmp_path):
    from omegaconf import OmegaConf

    config = {"algo": {"name": "gdpo"}, "trainer": {"seed": 2}}
    assert run_labels(OmegaConf.create({"name": None, "group": None}), config) == ("gdpo/seed2", None)
    assert run_labels(OmegaConf.create({"name": "mine", "group": "g"}), config) == ("mine", "g")
    assert run_labels(OmegaConf.create({"name": None}), {**config, "stage": "sft"}) == ("sft/seed2", None)
    assert trl_key("reward/accuracy/std") == "rewards/accuracy/std"


# --- through the CLI: one line, exit 2, no run dir

def mrl(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=environ)


def refused(result: subprocess.CompletedProcess, fragment: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("mrl: error: "), result.stderr
    assert fragment in lines[0] and "Traceback" not in result.stdout + result.stderr, lines[0]


@pytest.mark.parametrize("args, env, fragment", [
    (["rewards.channels.accuracy.fn.fn=trl_style_rewards.acuracy_reward"], {},
     "has no 'acuracy_reward'; did you mean trl_style_rewards.accuracy_reward?"),
    (["rewards.channels.accuracy.fn.fn=my_rewards_nowhere.correct"], {},
     "no module named 'my_rewards_nowhere' on the Python path; run from the directory that holds "
     "my_rewards_nowhere.py with PYTHONPATH=."),
    (["rewards.channels.length.fn._target_=raises_on_import.length"], {},
     "rewards.channels.length.fn._target_='raises_on_import.length': importing 'raises_on_import' raised "
     "ModuleNotFoundError: No module named 'numpyy'"),
    (["data.path=null"], {}, "rewards=trl_style names no task and data.path is not set"),
    (["data.path=someorg/somedata"], {"HF_HUB_OFFLINE": "1"}, "save_to_disk('data/somedata')"),
    (["model=smollm2_135m_instruct", "model.name_or_path=nobody/no-such-model"], {"HF_HUB_OFFLINE": "1"},
     "is not a local directory nor in the HF cache"),
    (["reward=agent_triple"], {}, "did you mean rewards=agent_triple?"),
    (["algo=gdop"], {}, "did you mean algo=gdpo?"),
])
def test_cli_refuses_each_trl_users_mistake_in_one_line_before_the_run_dir(args, env, fragment, tmp_path):
    (tmp_path / "raises_on_import.py").write_text("import numpyy\n")
    path = write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONAL)
    run = tmp_path / "run"
    result = mrl("train", SEARCH, "rewards=trl_style", f"data.path={path}", *TINY, *args, f"hydra.run.dir={run}",
                 cwd=tmp_path, **env)
    refused(result, fragment)
    assert not run.exists() and not (tmp_path / "outputs").exists()


def test_cli_resume_refuses_a_contradiction_of_the_saved_overrides(tmp_path):
    run = saved_run(tmp_path / "run", ["algo=grpo", *TINY])
    before = snapshot(run)
    result = mrl("train", "trainer.resume=true", f"hydra.run.dir={run}", "algo=gdpo", cwd=tmp_path)
    refused(result, f"trainer.resume: {run} was started with algo=grpo; this command gives algo=gdpo")
    assert snapshot(run) == before


def snapshot(directory: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.slow  # two short runs (~40 s on quiet cores)
def test_cli_resume_is_the_printed_command(tmp_path):
    run = tmp_path / "run"
    first = mrl("train", "algo=grpo", "trainer.seed=1", *TINY, f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = mrl("train", "--resume", str(run), "trainer.max_steps=2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
