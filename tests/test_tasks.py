"""The GDPO-paper tasks (tool_call, math_length, code): generators, parsers, reward channels on hand-made episodes,
2-step runs of every rewards preset, prompts from `data.path`, and held-out prompts.  Expected values are worked out
by hand in the comments."""

from __future__ import annotations

import json
import math
import time

import pytest
from conftest import compose_config

import mrl.envs.code as code_env
import mrl.train.loop
from mrl.core.episode import Episode, Prompt
from mrl.envs.code import TINY_WRAP, BugRatio, CodeTask, Length, PassRate, program
from mrl.envs.math_length import AnswerCorrect, LengthLimit, MathLengthTask, last_number
from mrl.envs.task import build_task, held_out_prompts
from mrl.envs.tool_call import OP_TO_TOOL, TOOL_PARAMS, Correctness, Format, ToolCallTask, parse_call
from mrl.rewards.channels import ChannelSpec, RewardSet, build_reward_set
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train


def episode(prompt: Prompt, completion: str, num_tokens: int = 3, max_new_tokens: int = 10) -> Episode:
    return Episode(prompt=prompt, completion=completion, completion_ids=[], num_tokens=num_tokens, truncated=False,
                   max_new_tokens=max_new_tokens)


# --------------------------------------------------------------------------------------------------- tool_call

# The built-in prompt `add 3 7 =`: expected call `calc 3 7`, tools calc(a, b) and lookup(a, b).
CALC_3_7 = Prompt("add 3 7 =", meta={"call": {"name": "calc", "arguments": ["3", "7"]}, "tools": TOOL_PARAMS})
# A real-data record with named arguments and no `tools`: the declared tools default to the called one alone.
WEATHER = Prompt("Weather in Paris, in C?",
                 meta={"call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}})


def tool_scores(prompt: Prompt, completion: str) -> tuple[float, float]:
    ep = episode(prompt, completion)
    return Format()(ep), Correctness()(ep)


def test_tool_call_generator_is_deterministic_and_its_call_matches_the_prompt():
    task, again, other = ToolCallTask(seed=0), ToolCallTask(seed=0), ToolCallTask(seed=1)
    assert [task.prompt(i) for i in range(20)] == [again.prompt(i) for i in range(20)]
    assert [task.prompt(i) for i in range(20)] != [other.prompt(i) for i in range(20)]
    ops = set()
    for i in range(50):
        p = task.prompt(i)
        op, a, b, eq = p.text.split()  # `add 3 7 =` -> calc 3 7; `max 1 7 =` -> lookup 1 7
        ops.add(op)
        assert eq == "=" and a.isdigit() and b.isdigit() and len(a) == len(b) == 1
        assert p.meta["call"] == {"name": {"add": "calc", "max": "lookup"}[op], "arguments": [a, b]}
        assert p.meta["tools"] == TOOL_PARAMS
    assert ops == set(OP_TO_TOOL) == {"add", "max"}


def test_parse_call():
    assert parse_call('{"name": "calc", "arguments": {"a": 3, "b": 7}}') == ("calc", {"a": 3, "b": 7})
    assert parse_call('  {"name": "calc", "arguments": [3, 7]}\n') == ("calc", [3, 7])
    assert parse_call('{"name": "calc"}') == ("calc", {})  # no arguments: an empty dict
    assert parse_call("calc 3 7") == ("calc", ["3", "7"])
    assert parse_call("  lookup   1 8 \n") == ("lookup", ["1", "8"])
    assert parse_call('{"name": "calc", "arguments": {"a": 3') is None  # malformed JSON
    assert parse_call('{"arguments": {"a": 3}}') is None  # no name
    assert parse_call('{"name": "calc", "arguments": 3}') is None  # arguments neither dict nor list
    assert parse_call("") is None and parse_call("   \n") is None


@pytest.mark.parametrize("completion, expected", [
    ("calc 3 7", (1.0, 1.0)),  # right call: format 1; correctness (1 + 2/2) / 2 = 1
    ("calc 3 9", (1.0, 0.75)),  # wrong argument: well formed; (1 + 1/2) / 2 = 0.75
    ("lookup 3 7", (1.0, 0.5)),  # wrong tool, a declared one with 2 params: format 1; (0 + 2/2) / 2 = 0.5
    ("lookup 1 2", (1.0, 0.0)),  # wrong tool and arguments: (0 + 0) / 2 = 0
    ("calc 3", (0.0, 0.75)),  # missing argument: 1 != 2 params -> format 0; (1 + 1/2) / 2 = 0.75
    ("calc 3 7 9", (0.0, 1.0)),  # extra argument: format 0; both expected positions right -> (1 + 2/2) / 2 = 1
    ("w3 3 7", (0.0, 0.5)),  # undeclared tool: format 0; (0 + 2/2) / 2 = 0.5
    ('{"name": "calc", "arguments": [3, 7]}', (1.0, 1.0)),  # JSON list: compared as strings, "3" == "3"
    ("hello", (0.0, 0.0)),  # not a call: ("hello", []) -> undeclared, no name or argument match
    ("", (0.0, 0.0)),  # parse_call -> None
    ('{"name": "calc", "arguments": {"a": 3', (0.0, 0.0)),  # malformed JSON -> None
])
def test_tool_call_channels_on_words(completion, expected):
    assert tool_scores(CALC_3_7, completion) == pytest.approx(expected)


@pytest.mark.parametrize("arguments, expected", [
    ({"unit": "C", "city": "Paris"}, (1.0, 1.0)),  # by name, order irrelevant: (1 + 2/2) / 2 = 1
    ({"city": "Paris", "unit": "F"}, (1.0, 0.75)),  # one of two right: (1 + 1/2) / 2 = 0.75
    ({"city": "Paris"}, (0.0, 0.75)),  # missing parameter: {city} != {city, unit} -> format 0; 0.75
    ({"city": "Paris", "unit": "C", "days": 3}, (0.0, 1.0)),  # extra parameter: format 0; both right -> 1
    ({"town": "Paris", "unit": "C"}, (0.0, 0.75)),  # wrong parameter name: format 0; only unit matches -> 0.75
    ({"city": "Rome", "unit": "F"}, (1.0, 0.5)),  # well formed, right tool, no argument right: (1 + 0) / 2
])
def test_tool_call_channels_on_json_with_named_arguments(arguments, expected):
    completion = json.dumps({"name": "get_weather", "arguments": arguments})
    assert tool_scores(WEATHER, completion) == pytest.approx(expected)
    # The wrong tool name loses the name half: correctness - 0.5; format 0 (not a declared tool).
    wrong_tool = json.dumps({"name": "get_time", "arguments": arguments})
    assert tool_scores(WEATHER, wrong_tool) == pytest.approx((0.0, expected[1] - 0.5))


def test_tool_call_json_form_of_the_builtin_call_is_fully_correct():
    # mrl/envs/tool_call.py documents `{"name": "calc", "arguments": {"a": 3, "b": 7}}` as the JSON form of the
    # built-in call `calc 3 7` (tools calc(a, b)): Format accepts it (names {a, b} == params), so Correctness should
    # match a -> "3", b -> "7" through the declared parameters: (1 + 2/2) / 2 = 1.0.
    completion = '{"name": "calc", "arguments": {"a": 3, "b": 7}}'
    assert Format()(episode(CALC_3_7, completion)) == 1.0
    assert Correctness()(episode(CALC_3_7, completion)) == 1.0


# ------------------------------------------------------------------------------------------------- math_length

def test_math_length_generator_answers_max_and_min():
    task = MathLengthTask(seed=0)
    assert [task.prompt(i) for i in range(10)] == [MathLengthTask(seed=0).prompt(i) for i in range(10)]
    ops = set()
    for i in range(50):
        p = task.prompt(i)
        op, a, b, eq = p.text.split()  # `max 8 4 =` -> "8"; `min 3 2 =` -> "2"
        ops.add(op)
        assert eq == "="
        assert p.meta["answer"] == str({"max": max, "min": min}[op](int(a), int(b)))
    assert ops == {"max", "min"}


def test_last_number():
    assert last_number("so it is 12.") == "12"
    assert last_number("\\boxed{12}") == "12"
    assert last_number("3 then 7") == "7"
    assert last_number("x is -4") == "-4"
    assert last_number("about 7.0 apples") == "7.0"
    assert last_number("w3") == "3"
    assert last_number("none") is None and last_number("") is None


@pytest.mark.parametrize("completion, answer, expected", [
    ("7", "7", 1.0),
    ("3 then 7", "7", 1.0),  # the last number counts
    ("7 3", "7", 0.0),  # last number 3
    ("8", "7", 0.0),
    ("seven", "7", 0.0),  # no number at all
    ("7.0", "7", 1.0),  # compared numerically: 7.0 == 7
    ("the answer is \\boxed{12}", "12", 1.0),
    ("7", "7.0", 1.0),  # the record's answer may be a float string too
])
def test_answer_correct(completion, answer, expected):
    assert AnswerCorrect()(episode(Prompt("max 3 7 =", meta={"answer": answer}), completion)) == expected


def test_length_limit_and_a_records_own_max_tokens():
    limit = LengthLimit(max_tokens=2)
    plain = Prompt("max 3 7 =", meta={"answer": "7"})
    assert limit(episode(plain, "7", num_tokens=2)) == 0.0  # `7 <eos>`: 2 <= 2
    assert limit(episode(plain, "w1 7", num_tokens=3)) == -1.0  # 3 > 2
    own = Prompt("max 3 7 =", meta={"answer": "7", "max_tokens": 5})
    assert limit(episode(own, "a b 7", num_tokens=5)) == 0.0  # the record's 5 wins over 2
    assert limit(episode(own, "a b c d 7", num_tokens=6)) == -1.0
    strict = Prompt("max 3 7 =", meta={"answer": "7", "max_tokens": 1})
    assert limit(episode(strict, "7", num_tokens=2)) == -1.0  # a stricter record limit wins too


def test_length_constraint_violations_are_counted_in_shape():
    cfg = compose_config("rewards=math_length", "algo=gdpo")
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    assert reward_set.names == ["correctness", "length"]
    assert [s.kind for s in reward_set.specs] == ["reward", "constraint"]
    prompt = Prompt("max 3 7 =", meta={"answer": "7"})
    # 2 prompts x 4 rollouts; max_tokens=2: 3, 4 and 5 tokens violate -> 3 of 8 = 0.375.
    tokens = [1, 2, 3, 4, 2, 2, 5, 2]
    episodes = [episode(prompt, "7", num_tokens=n) for n in tokens]
    rewards, failed = reward_set.score(episodes)
    assert not failed.any()
    assert rewards[:, 0].tolist() == [1.0] * 8
    assert rewards[:, 1].tolist() == [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, -1.0, 0.0]
    shaped, keep, stats = reward_set.shape(rewards.view(2, 4, 2))
    assert stats["constraint/length/violation_frac"] == pytest.approx(0.375)
    assert "constraint/correctness/violation_frac" not in stats
    assert keep.all()  # counted, not enforced: everything enters the update unchanged
    assert shaped.equal(rewards.view(2, 4, 2))

    # The same by hand: a bare constraint ChannelSpec, no config.
    bare = RewardSet([ChannelSpec("length", LengthLimit(max_tokens=2), 1.0, kind="constraint")])
    _, _, stats = bare.shape(bare.score(episodes)[0].view(2, 4, 1))
    assert stats == {"constraint/length/violation_frac": pytest.approx(0.375)}


# -------------------------------------------------------------------------------------------------------- code

# Small limits, and a memory_mb no config uses, so these channels get their own result cache.
LIMITS = {"cpu_seconds": 1, "wall_seconds": 2, "memory_mb": 255}
X_PLUS_3 = Prompt("x + 3 =", meta={"tests": ["f(4) == 7", "f(0) == 3", "f(3) == 6"], "wrap": TINY_WRAP})


def code_scores(episodes: list[Episode]) -> tuple[list[float], list[float]]:
    return PassRate(**LIMITS)(episodes), BugRatio(**LIMITS)(episodes)


def test_code_generator_tests_hold_for_the_intended_expression():
    task = CodeTask(seed=0)
    prompts = [task.prompt(i) for i in range(6)]
    assert prompts == [CodeTask(seed=0).prompt(i) for i in range(6)]
    episodes = []
    for p in prompts:
        x, op, k, eq = p.text.split()  # `x + 1 =` -> completion `x + 1`
        assert (x, eq) == ("x", "=") and op in "+*" and k.isdigit()
        assert len(p.meta["tests"]) == 3
        episodes.append(episode(p, f"x {op} {k}"))
    assert program(episodes[0]) == f"def f(x):\n    return {prompts[0].text[:-2]}\n"
    pass_rate, bug_ratio = code_scores(episodes)
    assert pass_rate == [1.0] * 6
    assert bug_ratio == [0.0] * 6


def test_code_wrong_expressions_syntax_errors_and_partial_bugs():
    completions = [
        "x + 3",  # f(4)=7, f(0)=3, f(3)=6: 3/3, no error
        "2 * x - 1",  # 7 ok, -1 != 3, 5 != 6: 1/3, no error
        "x",  # 4, 0, 3: all wrong, runs -> 0, bug 0
        "x +",  # syntax error: fails every test -> pass 0, bug -1
        "x + 3 if x else 1 / x",  # f(0) raises ZeroDivisionError: pass 2/3, bug -1/3
    ]
    pass_rate, bug_ratio = code_scores([episode(X_PLUS_3, c) for c in completions])
    assert pass_rate == pytest.approx([1.0, 1 / 3, 0.0, 0.0, 2 / 3])
    assert bug_ratio == pytest.approx([0.0, 0.0, 0.0, -1.0, -1 / 3])
    assert Length()(episode(X_PLUS_3, "x + 3", num_tokens=4)) == -4.0  # `x + 3 <eos>`


def test_code_an_empty_body_is_not_a_bug_free_program():
    # The tiny model learned that `return` (an empty completion in the wrap) runs without an error: pass rate 0 but
    # a perfect bug ratio at the lowest length.  Writing nothing now scores as badly as a syntax error.
    fenced = Prompt("write f", meta={"tests": ["f(1) == 1"]})
    pass_rate, bug_ratio = code_scores([episode(X_PLUS_3, ""), episode(X_PLUS_3, "  "), episode(X_PLUS_3, "x"),
                                        episode(fenced, "```python\n```")])
    assert pass_rate == [0.0, 0.0, 0.0, 0.0]
    assert bug_ratio == [-1.0, -1.0, 0.0, -1.0]


def test_code_infinite_loop_times_out_and_the_tests_go_on():
    looping = Prompt("write f", meta={"tests": ["f(1) == 1", "f(2) == 2"]})  # no wrap: the completion is the program
    ep = episode(looping, "def f(x):\n    while True:\n        pass\n")
    start = time.monotonic()
    pass_rate, bug_ratio = code_scores([ep])
    assert pass_rate == [0.0] and bug_ratio == [-1.0]  # both tests lost to the timeout
    assert time.monotonic() - start < 15  # killed by the 1 s CPU / 2 s wall limits (cached for BugRatio)


def test_code_markdown_fence_is_stripped_without_wrap():
    record = Prompt("double x", meta={"tests": ["f(2) == 4", "f(0) == 0"]})
    fenced = episode(record, "Here it is:\n```python\ndef f(x):\n    return x * 2\n```\nDone.")
    bare_fence = episode(record, "```\ndef f(x):\n    return 2 * x\n```")
    plain = episode(record, "def f(x):\n    return x + x\n")
    assert program(fenced) == "def f(x):\n    return x * 2\n"
    assert program(bare_fence) == "def f(x):\n    return 2 * x\n"
    assert program(plain) == plain.completion
    assert code_scores([fenced, bare_fence, plain]) == ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])


def test_code_wrap_replaces_only_its_placeholder_and_a_prefix_is_completed():
    from mrl.core.config import UserError

    braces = Prompt("keys", meta={"tests": ["f(1) == {'k': 1}"], "wrap": "def f(x):\n    return {'k': {completion}}\n"})
    assert program(episode(braces, " x ")) == "def f(x):\n    return {'k': x}\n"  # str.format raised on `{'k'`
    with pytest.raises(UserError, match="no {completion} placeholder"):
        program(episode(Prompt("x", meta={"tests": [], "wrap": "def f(x):\n    return x\n"}), "x"))
    prefix = 'def f(x):\n    """{x}: a docstring with braces."""\n'
    record = Prompt(prefix, meta={"tests": ["f(2) == 4"], "prefix": prefix, "entry_point": "f"})
    assert program(episode(record, "return x * 2")) == prefix + "    return x * 2\n"
    assert code_scores([episode(braces, "x"), episode(record, "return x * 2")])[0] == [1.0, 1.0]
    with pytest.raises(UserError, match="needs its entry_point"):
        program(episode(Prompt(prefix, meta={"tests": [], "prefix": prefix}), "return x"))


def test_code_batched_channels_keep_order_and_run_duplicates_once(monkeypatch):
    runs: list[str] = []
    real = code_env.run_tests_many

    def counting(items, limits, max_workers=2, **kwargs):
        runs.extend(code for code, _ in items)
        return real(items, limits, max_workers=max_workers, **kwargs)

    monkeypatch.setattr(code_env, "run_tests_many", counting)
    limits = dict(LIMITS, memory_mb=254)  # a fresh shared cache
    pass_rate, bug_ratio = PassRate(**limits), BugRatio(**limits)
    assert pass_rate.runs is bug_ratio.runs and pass_rate.batched and bug_ratio.batched
    pass_rate.runs.cache.clear()
    # " x + 3\n" is stripped into the same program as "x + 3": 3 distinct programs among 6 episodes.
    completions = ["x", "x + 3", "x +", " x + 3\n", "x", "x + 3"]
    episodes = [episode(X_PLUS_3, c) for c in completions]
    assert pass_rate(episodes) == pytest.approx([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert bug_ratio(episodes) == pytest.approx([0.0, 0.0, -1.0, 0.0, 0.0, 0.0])  # from the cache
    assert len(pass_rate.runs.cache) == 3
    assert sorted(runs) == sorted(f"def f(x):\n    return {c}\n" for c in ["x", "x + 3", "x +"])  # each run once

    # The same program with other tests is another run.
    other = Prompt("x + 3 =", meta={"tests": ["f(1) == 4"], "wrap": TINY_WRAP})
    assert pass_rate([episode(other, "x + 3")]) == [1.0]
    assert len(pass_rate.runs.cache) == 4 and len(runs) == 4


# ------------------------------------------------------------------------------------------ presets train

@pytest.mark.parametrize("rewards, channels", [
    ("tool_call", ["format", "correctness"]),
    ("math_length", ["correctness", "length"]),
    ("code", ["pass_rate", "bug_ratio", "length"]),
])
def test_every_rewards_preset_trains_two_steps(rewards, channels, tmp_path):
    final = train(compose_config(f"rewards={rewards}", "algo=gdpo"), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]
    for name in channels:
        assert math.isfinite(final[f"reward/{name}/mean"]), name
    for key in ["loss/policy", "entropy", "reward/total/mean"]:
        assert math.isfinite(final[key]), key
    if rewards == "math_length":
        assert 0.0 <= final["constraint/length/violation_frac"] <= 1.0


# ------------------------------------------------------------------------------------------------- data.path

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_data_path_feeds_the_run_only_from_the_file(tmp_path, monkeypatch):
    # agent_triple-style records: `add a b =` with target (a + b) mod 10; 10 records -> 1 eval, 9 train.
    pairs = zip(range(10), [3, 5, 1, 8, 0, 2, 9, 4, 7, 6])
    records = [{"prompt": f"add {a} {b} =", "target": (a + b) % 10} for a, b in pairs]
    data = write_jsonl(tmp_path / "prompts.jsonl", records)
    texts = {r["prompt"] for r in records}
    assert len(texts) == 10

    seen: list[str] = []

    def recording_build_task(cfg):
        task = build_task(cfg)
        prompt = task.prompt

        def recorded(index):
            p = prompt(index)
            seen.append(p.text)
            return p

        task.prompt = recorded
        return task

    monkeypatch.setattr(mrl.train.loop, "build_task", recording_build_task)
    cfg = compose_config(f"data.path={data}")
    final = train(cfg, tmp_path / "run")
    assert math.isfinite(final["loss/policy"])
    assert len(seen) == 2 * 2 and set(seen) <= texts  # 2 steps x 2 prompts, all from the file

    task = build_task(cfg)
    assert task.tools and task.max_turns == 3  # the built-in task's environment, the file's prompts
    train_texts = {task.prompt(i).text for i in range(20)}
    held_out = held_out_prompts(task, 100)
    assert len(held_out) == 1  # round(10 * 0.1)
    held_texts = {p.text for p in held_out}
    assert train_texts <= texts and held_texts <= texts
    assert not train_texts & held_texts  # the eval split is never trained on
    assert train_texts | held_texts == texts  # 20 indices cover both epochs of the 9 train prompts
    assert set(seen) <= train_texts
    assert held_out[0].meta["target"] == next(r["target"] for r in records if r["prompt"] == held_out[0].text)


def test_data_path_math_length_trains(tmp_path):
    records = [{"prompt": f"max {a} {b} =", "answer": str(max(a, b))} for a, b in zip(range(10), range(9, -1, -1))]
    data = write_jsonl(tmp_path / "math.jsonl", records)
    cfg = compose_config("rewards=math_length", "algo=gdpo", f"data.path={data}")
    final = train(cfg, tmp_path / "run")
    assert math.isfinite(final["loss/policy"]) and math.isfinite(final["reward/correctness/mean"])
    task = build_task(cfg)
    assert all(task.prompt(i).text in {r["prompt"] for r in records} for i in range(20))


# ------------------------------------------------------------------------------------------------- held out

@pytest.mark.parametrize("rewards", ["tool_call", "math_length", "code", "agent_triple"])
def test_held_out_prompts_of_a_generator_use_negative_indices(rewards):
    task = build_task(compose_config(f"rewards={rewards}", "algo=gdpo"))
    held_out = held_out_prompts(task, 5)
    assert held_out == [task.prompt(-1), task.prompt(-2), task.prompt(-3), task.prompt(-4), task.prompt(-5)]
    assert held_out_prompts(task, 0) == []


def test_code_cache_clearing_keeps_the_batch_scorable():
    # A full cache is cleared before a batch's missing programs run: the programs of the batch that were cached
    # must be run again, not looked up in the emptied cache (KeyError, seen 150 steps into a code run).
    from mrl.envs.code import _SandboxRuns
    from mrl.sandbox import SandboxLimits

    runs = _SandboxRuns(SandboxLimits(cpu_seconds=1, wall_seconds=2, memory_mb=255), workers=1, max_entries=2)
    first = [episode(X_PLUS_3, "x + 3"), episode(X_PLUS_3, "x")]
    assert [r.pass_rate for r in runs.results(first)] == [1.0, 0.0]
    again = [episode(X_PLUS_3, "x + 3"), episode(X_PLUS_3, "x + 1")]  # one cached, one new: 3 entries > 2
    assert [r.pass_rate for r in runs.results(again)] == [1.0, 0.0]


# -------------------------------------------------------------------------------------------------- calc_agent


def test_calc_agent_prompts_tool_and_channels():
    from mrl.core.episode import ToolCall
    from mrl.envs.calc_agent import CalcAgent, Correctness, Format

    task = CalcAgent(seed=3, fewshot=1)
    p = task.prompt(0)
    assert p == CalcAgent(seed=3, fewshot=1).prompt(0) and p != task.prompt(1)
    a, b = p.meta["a"], p.meta["b"]
    assert 10 <= a <= 99 and 10 <= b <= 99 and p.meta["target"] == a + b
    # One solved example as earlier turns (question, call, result, answer), then the question.
    assert [m["role"] for m in p.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert p.messages[-1]["content"] == f"What is {a} + {b}? Use the calc tool."
    shot = p.messages[1]["tool_calls"][0]["function"]["arguments"]
    assert p.messages[2]["content"] == str(shot["a"] + shot["b"])
    assert task.tools["calc"](p, {"a": 37, "b": "48"}) == "85"
    assert task.tools["calc"](p, {"a": "x", "b": 1}).startswith("error")

    def run(calls, last_turn):
        return Episode(prompt=p, completion="", completion_ids=[], num_tokens=9, truncated=False,
                       max_new_tokens=48, tool_calls=calls, turns=["", last_turn])

    good = ToolCall("calc", {"a": a, "b": b}, str(a + b))
    wrong_args = ToolCall("calc", {"a": a, "b": b + 1}, str(a + b + 1))
    invalid = ToolCall("add", {}, "error: no tool add", valid=False)
    assert Correctness()(run([good], f"{a} + {b} = {a + b}")) == 1.0
    assert Correctness()(run([good], f"It is {a + b + 1}.")) == 0.0
    assert Correctness()(run([good], "")) == 0.0  # ended on the call: no answer
    assert Format()(run([good], "")) == 1.0
    assert Format()(run([wrong_args], "")) == 0.0
    assert Format()(run([invalid, good], "")) == 0.0
    assert Format()(run([], f"{a + b}")) == 0.0
    assert Correctness()(run([], f"{a + b}")) == 0.0  # the right sum without the tool: a guess, not the task
    assert Correctness()(run([invalid], f"The answer is {a + b}.")) == 0.0
    assert Correctness()(run([wrong_args, good], f"The answer is {a + b}.")) == 1.0
    assert p.messages[3]["content"] == f"The answer is {shot['a'] + shot['b']}."
