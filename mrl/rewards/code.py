"""Channels of code: pass rate, bug ratio and length.  Programs run in mrl.sandbox (bubblewrap unless
`rewards.sandbox=process`) and are graded in the trainer; the code never runs here.

The two sandbox channels are batched (one call per generation round) and share one cache of results, so a program
is run once per round even though two channels read it, and duplicate completions are run once.  Building a channel
checks the sandbox first: without bwrap it refuses in one line (how to install it, or `rewards.sandbox=process`).
"""

from __future__ import annotations

import json

from mrl.episode import Episode
from mrl.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_tests_many, sandbox_name
from mrl.tasks.code import is_empty, program


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
