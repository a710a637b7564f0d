"""Count the exits of N tiny two-rank trainings run one after the other beside one busy process per core (issue 43).

    python scripts/exit_under_load.py --runs 100              # the issue's command, 100 times, under load
    python scripts/exit_under_load.py --runs 5 --no-load      # on a quiet machine

Each run is the issue's command, unchanged, in a scratch directory of its own (its default run dir goes there and is
removed after the run):

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m mrl train deepspeed=zero2 trainer.max_steps=2
        trainer.device=cpu logger=none trainer.prompts_per_step=4 trainer.group_size=4 trainer.micro_batch_size=8
        trainer.max_new_tokens=6

with this checkout first on PYTHONPATH and core dumps allowed (RLIMIT_CORE unlimited: where
/proc/sys/kernel/core_pattern names a file path, an aborting rank leaves a core for gdb).  After every run it
prints one line (exit code, seconds, the load average) and writes the counts, each failure's last stderr lines and
the compiler lines seen, to outputs/exit_under_load/<time>.json.  Exits 1 if any run exited non-zero.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flaky import burn  # noqa: E402  (scripts/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mrl", "train",
           "deepspeed=zero2", "trainer.max_steps=2", "trainer.device=cpu", "logger=none",
           "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.micro_batch_size=8",
           "trainer.max_new_tokens=6"]
COMPILER_SIGNS = ("gcc ", "g++ ", "ninja", "c++ ")


def allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(scratch: Path, timeout: int) -> dict:
    """One launch of the issue's command in `scratch`: exit code, seconds, the load average, its stderr's tail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    load = os.getloadavg()[0]
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *COMMAND], cwd=scratch, capture_output=True, text=True, env=env,
                              timeout=timeout, preexec_fn=allow_cores)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as late:
        code, out, err = "timeout", str(late.stdout or ""), str(late.stderr or "")
    shutil.rmtree(scratch / "outputs", ignore_errors=True)
    return {"exit": code, "seconds": round(time.monotonic() - start, 1), "load": round(load, 2),
            "aborted": "terminate called" in err,
            "compiler_lines": sum(any(s in line for s in COMPILER_SIGNS) for line in (out + err).splitlines()),
            "tail": "" if code == 0 else err[-2500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--no-load", action="store_true", help="no busy processes beside the runs")
    parser.add_argument("--timeout", type=int, default=900, help="seconds before a run counts as hung")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/exit_under_load/<time>.json")
    args = parser.parse_args()
    out = args.out or ROOT / "outputs" / "exit_under_load" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    load = [] if args.no_load else [multiprocessing.Process(target=burn, daemon=True)
                                    for _ in range(os.cpu_count() or 1)]
    for p in load:
        p.start()
    runs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="mrl-exit-") as scratch:
            for i in range(args.runs):
                result = run_once(Path(scratch), args.timeout)
                runs.append(result)
                failed = sum(r["exit"] != 0 for r in runs)
                print(f"run {i + 1}/{args.runs}: exit {result['exit']}, {result['seconds']} s, load "
                      f"{result['load']}, compiler lines {result['compiler_lines']}; {failed} failed so far",
                      flush=True)
                if result["exit"] != 0:
                    print("    " + result["tail"][-1200:].replace("\n", "\n    "), flush=True)
                out.write_text(json.dumps({"command": " ".join(["python", *COMMAND]), "busy_processes": len(load),
                                           "runs": len(runs), "failed": failed,
                                           "aborted": sum(r["aborted"] for r in runs), "each": runs}, indent=1))
    finally:
        for p in load:
            p.terminate()
    failed = sum(r["exit"] != 0 for r in runs)
    print(f"{failed} of {len(runs)} runs exited non-zero ({sum(r['aborted'] for r in runs)} aborted); written: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
