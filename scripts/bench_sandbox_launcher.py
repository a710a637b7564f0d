"""The bwrap sandbox's cost per program, this tree's launcher against a git revision's, interleaved in one process.

    python scripts/bench_sandbox_launcher.py --baseline 8b63511 --rounds 10 --per-round 15

A trivial program with one test through mrl.sandbox.launcher.run (start-up, set-up, the call, teardown); the two
launchers alternate round by round (the order flipped every other round), so load from other jobs hits both alike.
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

from mrl.sandbox import SandboxLimits  # noqa: E402
from mrl.sandbox import launcher as current  # noqa: E402

PROGRAM, TESTS = "def f(x):\n    return x\n", ["f(1) == 1"]


def launcher_at(rev: str):
    """mrl/sandbox/launcher.py (and the child.py beside it) as of `rev`, imported under another name."""
    folder = Path(tempfile.mkdtemp())
    for name in ("launcher.py", "child.py"):
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mrl/sandbox/{name}"], capture_output=True,
                                text=True, check=True).stdout
        (folder / name).write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_launcher", folder / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git revision whose launcher to compare with")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=15, help="programs per arm and round")
    args = parser.parse_args()
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0, memory_mb=256)
    arms = {"before": launcher_at(args.baseline), "after": current}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            for _ in range(args.per_round):
                start = time.perf_counter()
                result = arms[name].run(PROGRAM, TESTS, limits, "bwrap")
                times[name].append(time.perf_counter() - start)
                assert result.pass_rate == 1.0, (name, result)
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"{name}: median {1000 * statistics.median(ts):.1f} ms, p10 {1000 * ts[len(ts) // 10]:.1f}, "
              f"p90 {1000 * ts[9 * len(ts) // 10]:.1f} over {len(ts)} programs")


if __name__ == "__main__":
    main()
