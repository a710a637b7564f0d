"""Sandbox overhead per program and code-task throughput: bwrap vs the process sandbox vs a baseline revision.

    python scripts/bench_sandbox.py                      # 50 trivial programs, 5 batches of 16, per mode
    python scripts/bench_sandbox.py --baseline 0e8059d   # also the mrl/sandbox.py of that git revision ("today's")

Overhead: median wall time of `run_tests` on a trivial program (one test), which is all process start-up, sandbox
set-up and teardown.  Throughput: a batch of 16 programs of the built-in code task (a mix of right, wrong, broken
and looping-free completions) x their 3 tests, scored through the PassRate channel with an empty cache, as the
trainer does once per step (2 workers).  The modes are interleaved run by run, so load from other jobs on the
machine hits them alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mrl.core.episode import Episode  # noqa: E402
from mrl.envs.code import (  # noqa: E402
    CodeTask,
    PassRate,  # noqa: E402
    program,
)
from mrl.sandbox import SandboxLimits, check_sandbox, run_tests  # noqa: E402

TRIVIAL = ("def f(x):\n    return x\n", ["f(1) == 1"])
LIMITS = dict(cpu_seconds=1.0, wall_seconds=3.0, memory_mb=256)  # conf/rewards/code.yaml's


def baseline_module(rev: str):
    """mrl/sandbox.py as of `rev`, imported under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mrl/sandbox.py"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def batch(step: int, size: int = 16) -> list[Episode]:
    task = CodeTask(seed=step)
    completions = []
    for i in range(size):
        p = task.prompt(step * size + i)
        x, op, k, _ = p.text.split()
        completions.append((p, [f"x {op} {k}", "x", "x +", f"{k} {op} x", "x * x"][i % 5]))
    return [Episode(prompt=p, completion=c, completion_ids=[], num_tokens=3, truncated=False, max_new_tokens=10)
            for p, c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="trivial programs per mode")
    parser.add_argument("--batches", type=int, default=5, help="batches of 16 programs per mode")
    parser.add_argument("--baseline", default=None, help="a git revision whose mrl/sandbox.py to compare with")
    args = parser.parse_args()

    limits = SandboxLimits(**LIMITS)
    modes = {}
    try:
        check_sandbox("bwrap")
        modes["bwrap"] = lambda code, tests: run_tests(code, tests, limits, sandbox="bwrap")
    except Exception as err:  # noqa: BLE001 - report and go on with the others
        print(f"bwrap: not measured ({err})")
    modes["process"] = lambda code, tests: run_tests(code, tests, limits, sandbox="process")
    old = baseline_module(args.baseline) if args.baseline else None
    if old is not None:
        old_limits = old.SandboxLimits(**LIMITS)
        modes[f"baseline {args.baseline}"] = lambda code, tests: old.run_tests(code, tests, old_limits)

    times = {name: [] for name in modes}
    for _ in range(args.runs):
        for name, run in modes.items():
            start = time.perf_counter()
            result = run(*TRIVIAL)
            times[name].append(time.perf_counter() - start)
            assert result.pass_rate == 1.0, (name, result)
    print(f"overhead per program (median of {args.runs} trivial programs, one test each):")
    for name, ts in times.items():
        print(f"  {name:<20} {1000 * statistics.median(ts):7.1f} ms   (p10 {1000 * sorted(ts)[len(ts) // 10]:.1f}, "
              f"p90 {1000 * sorted(ts)[9 * len(ts) // 10]:.1f})")

    channels = {name: PassRate(**LIMITS, sandbox=name) for name in modes if name in ("bwrap", "process")}
    if old is not None:
        def old_channel(episodes):
            items = list(dict.fromkeys((program(e), tuple(e.prompt.meta["tests"])) for e in episodes))
            results = dict(zip(items, old.run_tests_many([(c, list(t)) for c, t in items], old_limits, 2)))
            return [results[(program(e), tuple(e.prompt.meta["tests"]))].pass_rate for e in episodes]
        channels[f"baseline {args.baseline}"] = old_channel
    batch_times = {name: [] for name in channels}
    scores = {}
    for step in range(args.batches):
        episodes = batch(step)
        for name, channel in channels.items():
            if hasattr(channel, "runs"):
                channel.runs.cache.clear()
            start = time.perf_counter()
            scores.setdefault(name, []).append(channel(episodes))
            batch_times[name].append(time.perf_counter() - start)
    print(f"\ncode task: a batch of 16 programs x 3 tests through PassRate (median of {args.batches}, 2 workers):")
    reference = statistics.median(batch_times["process" if old is None else f"baseline {args.baseline}"])
    for name, ts in batch_times.items():
        med = statistics.median(ts)
        print(f"  {name:<20} {med:6.2f} s   {16 / med:5.1f} programs/s   x{med / reference:.2f} the time of "
              f"{'process' if old is None else 'the baseline'}")
    first = next(iter(scores.values()))
    assert all(s == first for s in scores.values()), "the modes scored the same batch differently"


if __name__ == "__main__":
    main()
