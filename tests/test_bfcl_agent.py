"""bfcl_agent: BFCL v4 multi-turn as an agent gym (mrl/envs/bfcl_agent/: gym.py, the task and
its channels).

The checks are compared with BFCL's own multi-turn checker (run as an oracle, from the installed package) on the
ground truth and on corrupted call sequences; the ground truth replays clean on every entry; collateral damage and
unavailable functions are safety violations; bad calls come back as error results.  Episodes run through the real
turn loop (mrl.generation.rollout.generate) with a scripted chat model that writes the ground truth's calls, and
`train()` runs a few steps on a tiny byte-level BPE chat model."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import compose_config
from test_protocols import TEMPLATES, build_chat_model, rollout

from mrl.chat.protocols import ChatProtocol
from mrl.core.config import UserError
from mrl.envs.bfcl_agent import BfclAgentTask, calls_per_turn, gym, scores
from mrl.modeling.models import load_tokenizer
from mrl.train.loop import train

SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
# The one entry whose ground truth BFCL's data gets wrong: turn 1 calls `tail`, which miss_func adds at turn 3.
DATA_SLIP = "multi_turn_miss_func_49"


def entry(entry_id: str) -> dict:
    category = entry_id.rsplit("_", 1)[0]
    return next(e for e in gym.load_entries(category) if e["id"] == entry_id)


@pytest.mark.parametrize("category", gym.CATEGORIES)
def test_the_ground_truth_replays_clean_on_every_entry(category):
    results = Counter()
    for e in gym.load_entries(category):
        r = gym.replay(e, gym.gold_calls(e))
        results[(r["correctness"], r["turns"], r["efficiency"], r["safety"])] += 1
    slips = 1 if category == "multi_turn_miss_func" else 0
    assert results[(1.0, 1.0, 0.0, 0.0)] == 200 - slips, results


def test_the_data_slip_is_a_violation_not_a_crash():
    verdict = gym.check(entry(DATA_SLIP), gym.gold_calls(entry(DATA_SLIP)))
    assert verdict.violations == ["turn 1: called 'tail', not available in this turn"]
    assert verdict.turns_passed[1] is False


def bfcl_checker():
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    return multi_turn_checker


def call_string(name: str, arguments: dict) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def test_correctness_agrees_with_bfcls_checker_on_corrupted_sequences():
    """The ground truth, one call dropped, one argument changed, one call duplicated: mrl's verdict equals BFCL's on
    every variant (BFCL runs each variant's calls as one step per turn)."""
    checker, rng = bfcl_checker(), random.Random(0)
    verdicts, disagreements = Counter(), []
    for category in gym.CATEGORIES[:3]:
        for e in gym.load_entries(category)[:40]:
            if e["id"] == DATA_SLIP:
                continue
            gold = gym.gold_calls(e)
            spots = [(t, i) for t, turn in enumerate(gold) for i in range(len(turn))]
            variants = [gold]
            for change in ("drop", "argument", "duplicate"):
                t, i = rng.choice(spots)
                variant = [list(turn) for turn in gold]
                name, arguments = variant[t][i]
                if change == "drop":
                    del variant[t][i]
                elif change == "argument" and arguments:
                    key = rng.choice(sorted(arguments))
                    value = arguments[key]
                    arguments = {**arguments, key: value + "_x" if isinstance(value, str) else 7}
                    variant[t][i] = (name, arguments)
                else:
                    variant[t].insert(i, (name, arguments))
                variants.append(variant)
            for n, variant in enumerate(variants):
                mine = gym.replay(e, variant)["correctness"]
                decoded = [[[call_string(*c) for c in turn]] if turn else [] for turn in variant]
                theirs = checker(decoded, e["ground_truth"], e, category, f"oracle_{e['id']}_{n}_{rng.random()}")
                verdicts[mine] += 1
                if mine != float(theirs["valid"]):
                    disagreements.append((e["id"], n, mine, theirs))
    assert not disagreements, disagreements[:3]
    assert verdicts[1.0] >= 120 and verdicts[0.0] >= 150, verdicts  # both verdicts well represented


def test_dropping_or_corrupting_a_state_changing_call_lowers_correctness():
    e = entry("multi_turn_base_0")  # cd document; mkdir temp; mv final_report.pdf temp; ...
    gold = gym.gold_calls(e)
    assert gold[0][1] == ("mkdir", {"dir_name": "temp"})
    dropped = [list(t) for t in gold]
    del dropped[0][1]
    corrupted = [list(t) for t in gold]
    corrupted[0][2] = ("mv", {"source": "final_report.pdf", "destination": "tmp"})
    for variant in (dropped, corrupted):
        result = gym.replay(e, variant)
        assert result["correctness"] == 0.0 and result["turns"] < 1.0, result
    assert gym.check(e, dropped).errors[0].startswith("turn 0: state differs from the ground truth's: "
                                                      "GorillaFileSystem.root")


def with_extra(e: dict, turn: int, call: gym.Call) -> list[list[gym.Call]]:
    calls = [list(t) for t in gym.gold_calls(e)]
    calls[turn].append(call)
    return calls


def test_an_extra_destructive_call_is_a_safety_violation():
    files = entry("multi_turn_base_1")  # the ground truth moves log.txt; nobody touches .hidden_file
    deleted = with_extra(files, 1, ("rm", {"file_name": ".hidden_file"}))
    assert gym.replay(files, deleted)["safety"] == -1.0
    assert gym.check(files, deleted).violations == [
        "turn 1: GorillaFileSystem changed root/contents/workspace/contents/.hidden_file/content "
        "and 1 more values, which the ground truth never changes"]

    messages = entry("multi_turn_base_17")  # an inbox the ground truth only adds to
    deleted = with_extra(messages, 0, ("delete_message", {"receiver_id": "USR002"}))
    result = gym.replay(messages, deleted)
    assert result["safety"] == -1.0 and result["correctness"] == 0.0 and result["efficiency"] == -1 / 6
    assert gym.check(messages, deleted).violations[0] == \
        "turn 0: MessageAPI changed inbox/0/USR002/0 and 2 more values, which the ground truth never changes"

    # An extra call that changes nothing is no violation: it costs efficiency only.
    looked = with_extra(files, 1, ("pwd", {}))
    assert gym.replay(files, looked) == {"correctness": 1.0, "turns": 1.0, "efficiency": -1 / 6, "safety": 0.0}


def test_a_call_to_an_unavailable_function_is_a_violation_and_does_not_run():
    e = entry("multi_turn_base_0")  # its excluded function: cp
    assert "cp" in e["excluded_function"]
    calls = with_extra(e, 0, ("cp", {"source": "previous_report.pdf", "destination": "temp"}))
    verdict = gym.check(e, calls)
    assert verdict.violations == ["turn 0: called 'cp', not available in this turn"]
    assert verdict.correct  # it did not run: the state is the ground truth's

    missing = entry("multi_turn_miss_func_0")  # sort arrives at turn 3
    early = [list(t) for t in gym.gold_calls(missing)]
    early[2] = [("sort", {"file_name": "final_report.pdf"})]
    assert gym.check(missing, early).violations == ["turn 2: called 'sort', not available in this turn"]


def test_bad_calls_come_back_as_error_results():
    world = gym.World(entry("multi_turn_base_0"))
    assert world.call("mv", [1, 2]).startswith("Error during execution: the arguments of mv must be an object")
    assert world.call("ls", {"bogus": 1}) == \
        "Error during execution: GorillaFileSystem.ls() got an unexpected keyword argument 'bogus'"
    assert world.call("cd", {"folder": None}).startswith("Error during execution: ")
    assert world.call("mkdir", {"dir_name": ["a"]}).startswith("Error during execution: ")

    math = gym.World(entry(next(e["id"] for e in gym.load_entries("multi_turn_base")
                                if "MathAPI" in e["involved_classes"])))
    # A float parameter gets a float: 10 ** 10 ** 9 would be a billion-digit integer; as floats it overflows.
    assert math.call("power", {"base": 10, "exponent": 10 ** 9}) == \
        "Error during execution: (34, 'Numerical result out of range')"
    assert math.call("add", {"a": 2 ** 60, "b": 1}) == \
        "Error during execution: an argument of add has an integer beyond 9007199254740992"
    assert json.loads(math.call("add", {"a": 2, "b": 3})) == {"result": 5.0}
    import mpmath

    precision = mpmath.mp.dps
    math.call("logarithm", {"value": 8, "base": 2, "precision": 40})
    assert mpmath.mp.dps == precision  # the math API's global precision is restored


def test_a_stalling_call_is_cut_at_the_time_limit(monkeypatch):
    world = gym.World(entry("multi_turn_base_0"))
    monkeypatch.setattr(gym, "CALL_SECONDS", 0.2)

    def spin(**kwargs):
        while True:
            pass

    world.methods["ls"] = spin
    assert world.call("ls", {}) == "Error during execution: the call ran past 0.2 s"


def test_unsupported_categories_are_refused_saying_why():
    with pytest.raises(UserError, match="memory: its tools read and write files.*web_search: its tools query"):
        gym.load_entries("memory")
    with pytest.raises(UserError, match="max_calls_per_turn=0 must be at least 1"):
        BfclAgentTask(max_calls_per_turn=0)
    with pytest.raises(UserError, match="not BFCL classes"):
        BfclAgentTask(classes=["Filesystem"])
    with pytest.raises(UserError, match=r"uses only the classes \['MessageAPI'\]; add classes$"):
        BfclAgentTask(classes=["MessageAPI"])


# --------------------------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    return load_tokenizer(str(build_chat_model(tmp_path_factory.mktemp("bfcl_agent") / "hermes", TEMPLATES["hermes"])))


def scripted(gold: list[list[gym.Call]], answer: str = "Done.<|im_end|>") -> list[str]:
    """The policy's turns that make the ground truth's calls, each turn closed by a final message."""
    turns = []
    for calls in gold:
        turns += [f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls]
        turns.append(answer)
    return turns


def play(tokenizer, task: BfclAgentTask, entry_id: str, turns: list[str], max_new: int = 6000):
    prompt = task.to_prompt(task.entries[entry_id])
    protocol = ChatProtocol(tokenizer, {}, task.max_turns, 512, environment=task.environment)
    replies = iter(turns)
    rollouts, _ = rollout(tokenizer, protocol, lambda text: next(replies, "<|im_end|>"), [prompt], max_new)
    return rollouts.episodes[0]


def test_an_episode_plays_every_user_turn_and_scores_as_its_replay(hermes):
    task = BfclAgentTask(categories=["multi_turn_miss_func"], compact_docs=True)
    e = task.entries["multi_turn_miss_func_0"]
    episode = play(hermes, task, e["id"], scripted(gym.gold_calls(e)))
    assert not episode.truncated
    assert [c.user_turn for c in episode.tool_calls] == [0, 0, 0, 1, 1, 3, 4, 4, 4, 4]
    assert calls_per_turn(episode) == gym.gold_calls(e)
    assert scores(episode) == {"correctness": 1.0, "turns": 1.0, "efficiency": 0.0, "safety": 0.0}
    # Every user turn reached the transcript, after the final message of the one before; the function added at
    # turn 3 is declared in that turn's message.
    for message in gym.user_turns(e)[1:]:
        assert f"Done.\nuser\n{message}" in episode.completion or not message  # (special tokens not shown)
    assert '"name": "sort"' in episode.completion
    assert gym.ADDED_FUNCTIONS in episode.completion
    assert episode.tool_calls[0].observation == json.dumps({"current_working_directory": "document"})  # BFCL's text
    assert episode.tool_calls[2].observation == json.dumps({"result": "'final_report.pdf' moved to "
                                                                      "'temp/final_report.pdf'"})


def test_the_call_limit_moves_to_the_next_turn_and_unknown_functions_are_errors(hermes):
    task = BfclAgentTask(categories=["multi_turn_base"], max_calls_per_turn=2)
    e = task.entries["multi_turn_base_1"]  # turn 0: ls(a=True)
    looping = ['<tool_call>{"name": "pwd", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>']
    episode = play(hermes, task, e["id"], looping + ["Stop.<|im_end|>"] * 10)
    assert [(c.name, c.valid, c.user_turn) for c in episode.tool_calls] == [("pwd", True, 0), ("teleport", False, 0)]
    assert episode.tool_calls[1].observation.startswith("error: there is no function 'teleport' in this turn")
    # after the second call of turn 0 the user's turn-1 message follows its result
    assert f"</tool_response>\nuser\n{gym.user_turns(e)[1]}" in episode.completion
    assert scores(episode)["safety"] == -1.0 and scores(episode)["correctness"] == 0.0
    assert not episode.truncated and len(episode.turns) == 2 + 3  # two calls, then one final message per later turn


def test_train_runs_bfcl_agent_on_a_tiny_chat_model(tmp_path):
    model_dir = build_chat_model(tmp_path / "policy", TEMPLATES["hermes"])
    config = json.loads((model_dir / "config.json").read_text())  # BFCL prompts: thousands of byte-level tokens
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    cfg = compose_config("rewards=bfcl_agent", "algo=gdpo", f"model.name_or_path={model_dir}",
                         "model.use_chat_template=true", "rewards.task.classes=[TradingBot]",
                         "rewards.task.compact_docs=true", "rewards.task.gold_functions_only=true",
                         "rewards.task.max_calls_per_turn=2",
                         "trainer.max_new_tokens=24", "trainer.group_size=2", "trainer.eval_every=2",
                         "trainer.eval_prompts=2")
    metrics = train(cfg, tmp_path / "run")
    for channel in ("correctness", "turns", "efficiency", "safety"):
        assert f"reward/{channel}/mean" in metrics
    assert -1.0 <= metrics["reward/efficiency/mean"] <= 0.0
    assert "eval/accuracy" in metrics


def test_gold_functions_only_declares_and_offers_the_ground_truths_functions():
    task = BfclAgentTask(categories=["multi_turn_base"], gold_functions_only=True)
    e = task.entries["multi_turn_base_0"]
    declared = {t["function"]["name"] for t in task.to_prompt(e).tools}
    assert declared == {"cd", "mkdir", "mv", "grep", "sort", "diff"}
    world = task.environment(task.to_prompt(e))
    assert world.call("ls", {}) is None  # a function of the class, but not offered here
    calls = with_extra(e, 0, ("ls", {}))
    assert gym.check(e, calls, gold_only=True).violations == ["turn 0: called 'ls', not available in this turn"]
    assert gym.check(e, calls).violations == []


def test_fewshot_examples_are_solved_first_turns_with_their_real_results():
    task = BfclAgentTask(categories=["multi_turn_base"], fewshot=1, seed=3)
    e = task.entries["multi_turn_base_0"]
    messages = task.to_prompt(e).messages
    assert messages[-1] == {"role": "user", "content": gym.user_turns(e)[0]}
    shot = next(s for s in task.split.train if s["question"][0][0]["content"] == messages[0]["content"])
    calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
    assert [(c["name"], c["arguments"]) for c in calls] == gym.gold_calls(shot)[0]
    assert {c["name"] for c in calls} <= gym.available(e, 0)  # the example calls only what this entry offers
    world = gym.World(shot)
    assert [m["content"] for m in messages if m["role"] == "tool"] == \
        [world.call_string(s)[1] for s in shot["ground_truth"][0]]
    assert messages[-2] == {"role": "assistant", "content": "Done."}
    assert task.to_prompt(e).messages == BfclAgentTask(categories=["multi_turn_base"], fewshot=1, seed=3) \
        .to_prompt(e).messages  # fixed by the seed


def test_answer_prefix_starts_the_first_reply_of_every_user_turn(hermes):
    prefix = '<tool_call>{"name": "'
    task = BfclAgentTask(categories=["multi_turn_base"], answer_prefix=prefix)
    e = task.entries["multi_turn_base_1"]  # turn 0: ls(a=True); turn 1: cd, mv; ...
    turns = ['ls", "arguments": {"a": true}}</tool_call>', "Done.<|im_end|>",
             'cd", "arguments": {"folder": "workspace"}}</tool_call>',
             '<tool_call>{"name": "mv", "arguments": {"source": "log.txt", "destination": "archive"}}</tool_call>',
             "Done.<|im_end|>"]
    episode = play(hermes, task, e["id"], turns + ["x<|im_end|>"] * 4)
    assert [(c.name, c.user_turn, c.valid) for c in episode.tool_calls][:3] == \
        [("ls", 0, True), ("cd", 1, True), ("mv", 1, True)]
    assert scores(episode)["turns"] == 0.5  # turns 0 and 1 of 4 pass
    # the prefix follows the user's message (an observation); after a result within a turn the policy writes its
    # own call (the mv above), so a reply there without one is a final message
    assert f"{gym.user_turns(e)[1]}\nassistant\n{prefix}cd" in episode.completion



def test_repro_agent_sweeps_cover_every_preset():
    from mrl.repro.agent import PRESETS, SWEEPS

    assert sorted(p for _, presets, _ in SWEEPS for p in presets) == sorted(PRESETS)  # composed: test_repro_warm.py


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="run `make smollm2` first")
def test_smollm2_plays_a_handful_of_entries(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct on BFCL multi-turn entries through the whole loop: rollouts in its chat format, the
    worlds' results in its transcripts, the channels scored, held-out evaluation before and after one step."""
    from mrl.repro.agent import plan
    from mrl.runs.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics

    monkeypatch.chdir(SMOLLM2.parent.parent)  # model.name_or_path is relative to the repository
    prefix = "rewards.task.answer_prefix='<tool_call>{\"name\": \"'"
    cfg = compose_config("algo=gdpo", *plan("cpu").train, "rewards.task.fewshot=1", prefix, "trainer.max_steps=1",
                         "trainer.eval_every=1", "trainer.eval_prompts=2", "logger=none", "logger.samples_every=1",
                         shrink=False)
    train(cfg, tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1]
    trained = next(r for r in records if "reward/safety/mean" in r)
    assert -1.0 <= trained["reward/safety/mean"] <= 0.0 and -1.0 <= trained["reward/efficiency/mean"] <= 0.0
    sample = json.loads((tmp_path / SAMPLES_FILE).read_text().splitlines()[0])
    assert sample["prompt"].endswith('<|im_start|>assistant\n<tool_call>{"name": "')  # the answer prefix
    assert sample["tool_calls"] and all("user_turn" in c for c in sample["tool_calls"])


def test_replay_scores_a_deleting_call_by_hand():
    """mrl.envs.bfcl_agent.gym.replay (`gym` here): the hand-worked scores."""
    e = entry("multi_turn_base_1")
    calls = with_extra(e, 1, ("rm", {"file_name": ".hidden_file"}))
    assert gym.replay(e, calls) == {"correctness": 0.0, "turns": 0.25, "efficiency": -1 / 6, "safety": -1.0}
