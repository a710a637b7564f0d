"""code (GDPO paper, coding): write code that passes unit tests, without bugs, briefly.

Built-in generator, sized for the tiny model: prompt `x + 3 =` asks for the body of `f(x)`, i.e. the expression
`x + 3` (or `x * 3`), checked by tests such as `f(4) == 7`.  Real data (`data.path=...`): each record has
`prompt` and `tests` (Python expressions that must be true, e.g. `"f(2) == 4"`, or `assert` statements, or
`{"stdin": ..., "stdout": ...}` runs), and optionally either
  * `wrap`, a template turning the completion into a program (`"def f(x):\\n    return {completion}"`): the literal
    `{completion}` is replaced and nothing else in it is read, so other braces are kept as written; or
  * `prefix` and `entry_point`: the code the completion continues (imports, helpers, the signature and docstring of
    the function, as HumanEval's prompts) and the function's name; see mrl.sandbox.programs.complete_function.
Without either, the completion, minus any Markdown code fence, is the program.
Code only ever runs in mrl.sandbox (bubblewrap by default); the tests are graded in the trainer.

Channels: pass rate, bug ratio and length.  The two sandbox channels are batched (one call per generation round)
and share one cache of results, so a program is run once per round even though two channels read it, and duplicate
completions are run once.  Building a channel checks the sandbox first: without bwrap it refuses in one line (how to
install it, or `rewards.sandbox=process`).  HumanEval (mrl.envs.humaneval) is graded by these channels too.
"""

from __future__ import annotations

import json
import random

from mrl.core.config import UserError
from mrl.core.episode import Episode, Prompt
from mrl.envs.task import TaskBase
from mrl.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_tests_many, sandbox_name
from mrl.sandbox.programs import complete_function, unfence

TINY_WRAP = "def f(x):\n    return {completion}\n"
PLACEHOLDER = "{completion}"


class CodeTask(TaskBase):
    record_fields = ("tests",)  # what its channels read from a dataset record (mrl.envs.task.check)
    OPS = {"+": lambda x, k: x + k, "*": lambda x, k: x * k}

    def __init__(self, seed: int = 0, num_tests: int = 3):
        self.seed, self.num_tests = seed, num_tests

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"code/{self.seed}/{index}")
        op, k = rng.choice(sorted(self.OPS)), rng.randint(0, 9)
        inputs = rng.sample(range(10), self.num_tests)
        tests = [f"f({x}) == {self.OPS[op](x, k)}" for x in inputs]
        return Prompt(text=f"x {op} {k} =", meta={"tests": tests, "wrap": TINY_WRAP})


def program(episode: Episode) -> str:
    """The program a completion stands for: the record's `prefix` completed, its `wrap` filled in, or the
    (un-fenced) completion."""
    meta = episode.prompt.meta
    if meta.get("prefix") is not None:
        if not meta.get("entry_point"):
            raise UserError(f"a code record with a prefix needs its entry_point (the function's name); it has "
                            f"fields {sorted(meta)}: add entry_point to the record")
        return complete_function(meta["prefix"], meta["entry_point"], episode.completion)
    wrap = meta.get("wrap")
    if wrap:
        if PLACEHOLDER not in wrap:
            raise UserError(f"a code record's wrap {wrap!r:.80} has no {PLACEHOLDER} placeholder; put it where the "
                            "completion goes, e.g. 'def f(x):\\n    return {completion}'")
        return wrap.replace(PLACEHOLDER, episode.completion.strip())
    return unfence(episode.completion)


def is_empty(episode: Episode) -> bool:
    """True when the completion holds no code: nothing but whitespace and comments, or an empty Markdown fence (a
    comment-only body runs as `return` alone, bug-free: it must not earn the bug ratio that an honest program does)."""
    code = unfence(episode.completion)
    return not any(line.strip() and not line.strip().startswith("#") for line in code.splitlines())


# -------------------------------------------------------------------------------------------------------- the channels

def _tests_key(tests: list) -> str:
    return json.dumps(tests, sort_keys=True)  # tests may hold {"stdin", "stdout"} dicts: not hashable


class _SandboxRuns:
    """Results of (program, tests) pairs, run in parallel sandboxes; the cache is cleared when it grows large."""

    def __init__(self, limits: SandboxLimits, workers: int, max_entries: int = 4096, sandbox: str = "bwrap"):
        self.limits, self.workers, self.max_entries, self.sandbox = limits, workers, max_entries, sandbox
        self.cache: dict[tuple[str, str], SandboxResult] = {}

    def results(self, episodes: list[Episode]) -> list[SandboxResult]:
        pairs = [(program(e), list(e.prompt.meta["tests"])) for e in episodes]
        keys = [(code, _tests_key(tests)) for code, tests in pairs]
        items = dict(zip(keys, pairs))
        missing = list(dict.fromkeys(k for k in keys if k not in self.cache))
        if len(self.cache) + len(missing) > self.max_entries:
            self.cache.clear()  # and so this batch's keys found in it are missing again
            missing = list(dict.fromkeys(keys))
        for key, result in zip(missing, run_tests_many([items[k] for k in missing], self.limits,
                                                       max_workers=self.workers, sandbox=self.sandbox)):
            self.cache[key] = result
        return [self.cache[k] for k in keys]


_RUNS: dict[tuple, _SandboxRuns] = {}


def _runs(cpu_seconds: float, wall_seconds: float, memory_mb: int, workers: int, sandbox: str) -> _SandboxRuns:
    key = (cpu_seconds, wall_seconds, memory_mb, workers, sandbox)
    if key not in _RUNS:
        _RUNS[key] = _SandboxRuns(SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds,
                                                memory_mb=memory_mb), workers, sandbox=sandbox)
    return _RUNS[key]


class _SandboxChannel:
    batched = True

    def __init__(self, cpu_seconds: float = 1.0, wall_seconds: float = 3.0, memory_mb: int = 256, workers: int = 2,
                 sandbox: str = "bwrap"):
        sandbox = sandbox_name(sandbox)  # rewards.sandbox arrives as the config's enum: one cache key for both
        check_sandbox(sandbox)  # at the channel's construction: a run without bwrap stops before it starts
        self.runs = _runs(cpu_seconds, wall_seconds, memory_mb, workers, sandbox)


class PassRate(_SandboxChannel):
    """Share of the record's tests the program passes: `x + 3` on f(4) == 7, f(0) == 3 -> 1.0; `x` -> 0.0."""

    def __call__(self, episodes: list[Episode]) -> list[float]:
        return [r.pass_rate for r in self.runs.results(episodes)]


class BugRatio(_SandboxChannel):
    """Minus the share of tests on which the program raised (a syntax error fails them all): `x + 3` -> 0.0,
    `x +` -> -1.0, `x` (wrong but runs) -> 0.0, and an empty completion -> -1.0: the body `return` (None) runs
    without an error, and a policy learned to write nothing to collect a perfect bug ratio."""

    def __call__(self, episodes: list[Episode]) -> list[float]:
        return [-1.0 if is_empty(e) else -r.error_rate for e, r in zip(episodes, self.runs.results(episodes))]


class Length:
    """Minus the generated tokens, end-of-sequence included: `x + 3 <eos>` -> -4.0."""

    def __call__(self, episode: Episode) -> float:
        return -float(episode.num_tokens)
