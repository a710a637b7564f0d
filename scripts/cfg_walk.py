"""The walk of the config through a training run: which file and function reads which key of `cfg`, in order.

    python scripts/cfg_walk.py                      # the default run (GDPO, the tiny model, CPU), one step
    python scripts/cfg_walk.py algo=ppo --reads     # another config; every read listed

It runs `mrl.train.loop.train` for one step (with a held-out evaluation at steps 0 and 1) in a temporary run dir and
records, with a profiler (`sys.setprofile`), every call from the repository's code into OmegaConf or Hydra on a
config node (`cfg.algo`, `algo.clip_low`, `cfg.get(...)`, `OmegaConf.to_container(cfg.model...)`,
`instantiate(cfg.rewards.task)`): one read, with the calling file, function and key.  It prints, for the reads of
each part of the run (the check: mrl.train.validation.validate; the build: the rest of the door,
mrl.train.loop.start_run and the step-0 evaluation; the step: mrl.train.loop.train_step) and for the whole run: the
files entered in order, the stays (runs of consecutive reads in one file), the files and the returns (stays in a file
already left: stays - files), and the step's reads one by one.  A run built once from `cfg` reads it at the door
(checking, building), never in the step.

    python scripts/cfg_walk.py --calls 2            # also: the step's walk through mrl's code, to call depth 2

`--calls D` records too every call of a function of mrl made during `train_step`, and prints its walk to each depth
d <= D below it (1: the functions train_step calls) as the reads' are printed: the files, the stays, the switches
(moves from one file to another: stays - 1) and the returns: what a reader opens following one step.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.max_steps=1", "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=4",
         "trainer.eval_every=1", "trainer.eval_prompts=2", "logger=none"]
PARTS = {"validate": "check", "train_step": "step"}  # functions of mrl -> the part of the run they are; else build
LIBRARIES = ("/omegaconf/", "/hydra/")


@dataclass(frozen=True)
class Read:
    file: str  # relative to the repository
    function: str
    key: str
    part: str  # check, build or step


class Recorder:
    """The profiler: a call into OmegaConf or Hydra from outside them whose first argument is a config node; and
    the step's calls of mrl's functions (`calls`: (file, function, depth below train_step))."""

    def __init__(self):
        from omegaconf import Container

        self.container, self.reads, self.parts = Container, [], ["build"]
        self.calls: list[Read] = []  # key: the call's depth below train_step
        self.depth, self.resumed = 0, set()

    def __call__(self, frame, event, arg) -> None:
        code = frame.f_code
        in_mrl = code.co_filename.startswith(str(ROOT / "mrl"))
        if code.co_name in PARTS and in_mrl and event in ("call", "return"):
            if event == "call":
                self.parts.append(PARTS[code.co_name])
            else:
                self.parts.pop()
            return
        if in_mrl and self.parts[-1] == "step" and event in ("call", "return"):
            self.step_call(frame, event)
        if event != "call" or not any(lib in code.co_filename for lib in LIBRARIES):
            return
        caller = frame.f_back
        if caller is None or any(lib in caller.f_code.co_filename for lib in LIBRARIES):
            return
        args = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount]]
        if not args or not isinstance(args[0], self.container):
            return
        while not in_repository(caller.f_code.co_filename):  # copy.deepcopy(cfg): its caller asked
            caller = caller.f_back
            if caller is None or any(lib in caller.f_code.co_filename for lib in LIBRARIES):
                return  # inside a call into the libraries, which was recorded (instantiate's deep copy)
        key = args[1] if len(args) > 1 and isinstance(args[1], (str, int)) else code.co_name
        path = node_path(args[0])
        self.reads.append(Read(relative(caller.f_code.co_filename), caller.f_code.co_qualname,
                               f"{path}.{key}" if path else str(key), self.parts[-1]))


    def step_call(self, frame, event: str) -> None:
        """A call into (or a return from) mrl's code in the step; a generator's resumption is not a new call."""
        if event == "return":
            self.depth -= 1
            return
        self.depth += 1
        if frame.f_code.co_flags & inspect.CO_GENERATOR or frame.f_code.co_flags & inspect.CO_COROUTINE:
            if id(frame) in self.resumed:
                return
            self.resumed.add(id(frame))
        self.calls.append(Read(relative(frame.f_code.co_filename), frame.f_code.co_qualname, str(self.depth), "step"))


def node_path(node) -> str:
    """The node's full key in the config (`algo`, `rewards.channels.correct`), '' for the root."""
    try:
        return node._get_full_key(None) or ""
    except Exception:  # a node without a parent chain
        return ""


def in_repository(filename: str) -> bool:
    return filename.startswith(str(ROOT)) and "site-packages" not in filename


def relative(filename: str) -> str:
    path = Path(filename)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else filename


def walk(reads: list[Read]) -> tuple[list[str], int]:
    """(the files entered, one per stay, in order; the number of distinct files)."""
    stays: list[str] = []
    for read in reads:
        if not stays or stays[-1] != read.file:
            stays.append(read.file)
    return stays, len(set(stays))


def summary(title: str, reads: list[Read], every: bool, what: str = "reads") -> None:
    stays, files = walk(reads)
    print(f"{title}: {len(reads)} {what}, {len(stays)} stays, {files} files, {max(len(stays) - 1, 0)} switches, "
          f"{len(stays) - files} returns")
    entered: dict[str, int] = {}
    for file in stays:
        entered[file] = entered.get(file, 0) + 1
    for file, count in sorted(entered.items(), key=lambda kv: -kv[1]):
        print(f"  {file}: entered {count}x")
    if stays:
        print("  walk: " + " -> ".join(Path(f).name for f in stays))
    if every:
        for read in reads:
            print(f"    {read.file}:{read.function} {read.key}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after the small one-step run's")
    parser.add_argument("--reads", action="store_true", help="list every read of the whole run, not only the step's")
    parser.add_argument("--calls", type=int, default=0, metavar="D",
                        help="also the step's walks through mrl's functions, to 1 .. D calls below train_step")
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    import mrl.core.config  # noqa: F401  registers the schemas
    from mrl.core.config import CONF_DIR
    from mrl.train.loop import train

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, *args.overrides])
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as tmp:
        threading.setprofile(recorder)
        sys.setprofile(recorder)
        try:
            train(cfg, Path(tmp) / "run")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    for part, title in (("check", "the check (mrl.train.validation.validate)"),
                        ("build", "the build (the rest of the door: mrl.train.loop.start_run, the step-0 evaluation)"),
                        ("step", "the step (mrl.train.loop.train_step)")):
        summary(title, [r for r in recorder.reads if r.part == part], every=part == "step")
    summary("the whole run (mrl.train.loop.train)", recorder.reads, every=args.reads)
    for depth in range(1, args.calls + 1):
        calls = [c for c in recorder.calls if int(c.key) <= depth]
        summary(f"the step's calls of mrl's functions, to depth {depth}", calls, every=args.reads, what="calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
