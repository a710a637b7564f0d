"""make mutants: apply each one-line mutation of scripts/mutants.yaml to a scratch copy of the working tree, run the
tests it names there, and report per mutation whether the suite caught it (a test failed) or it survived.

    python scripts/mutants.py [--only SUBSTRING] [--list FILE]

The working tree itself is never changed: the copy is made once (git's tracked and untracked, not ignored, files),
each mutation is written into it, tested and reverted.  The tests run with the copy first on sys.path, checked
before anything else (a mutation tested against the real tree would always "survive").  A mutation whose `find`
text is not exactly once in its file is reported as stale: fix the list.  Exit status 1 when any survived or is
stale.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def scratch_copy() -> Path:
    """The working tree's files (tracked and untracked, not ignored) copied into a new temporary directory."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    scratch = Path(tempfile.mkdtemp(prefix="mrl-mutants-"))
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, scratch / name)
    return scratch


def pytest(scratch: Path, args: str, timeout: float) -> tuple[int, float]:
    """Run `pytest -x -q <args>` in the copy; (exit status, seconds).  124 when it ran past `timeout`."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *shlex.split(args)], cwd=scratch, env=env, capture_output=True, timeout=timeout)
        return done.returncode, time.perf_counter() - start
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - start


def check_isolated(scratch: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(scratch)}
    where = subprocess.run([sys.executable, "-c", "import mrl; print(mrl.__file__)"], cwd=scratch, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(scratch.resolve()):
        sys.exit(f"mutants: the tests would import mrl from {where}, not from the scratch copy {scratch}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", default=str(ROOT / "scripts" / "mutants.yaml"))
    parser.add_argument("--only", default="", help="run the mutations whose file or why contains this")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutation's tests")
    args = parser.parse_args()
    mutants = [m for m in yaml.safe_load(Path(args.list).read_text())
               if args.only in m["file"] or args.only in m["why"]]
    scratch = scratch_copy()
    try:
        check_isolated(scratch)
        baseline = sorted({m["tests"] for m in mutants})
        for tests in baseline:  # every test named must pass on the unmutated copy
            status, _ = pytest(scratch, tests, args.timeout)
            if status != 0:
                sys.exit(f"mutants: `pytest {tests}` fails without any mutation (status {status}); fix it first")
        rows, bad = [], 0
        for m in mutants:
            path = scratch / m["file"]
            original = path.read_text()
            count = original.count(m["find"])
            if count != 1:
                rows.append((m["file"], m["why"], f"stale ({count} matches)", "-"))
                bad += 1
                continue
            path.write_text(original.replace(m["find"], m["replace"]))
            try:
                status, seconds = pytest(scratch, m["tests"], args.timeout)
            finally:
                path.write_text(original)
            verdict = "caught" if status in (1, 2) else "SURVIVED" if status == 0 else f"caught? (status {status})"
            bad += verdict != "caught"
            rows.append((m["file"], m["why"], verdict, f"{seconds:.0f} s"))
            print(f"{verdict:>9}  {m['file']}: {m['why']}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n| file | mutation | verdict | tests took |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    caught = sum(r[2] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
