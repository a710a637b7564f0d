"""What the reproductions share: running an `mrl train` multirun, reading its runs, writing the report files."""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from mrl.core.stats import HELD, NOT_HELD, NOT_RESOLVED, mean_se, two_se_verdict  # noqa: F401 (the repros' names)
from mrl.runs.tracking import METRICS_FILE, read_metrics

REPORTS = Path("reports")
# SCALE=gpu: a real model; the rest of each target's config stays as it is.
SCALES = {
    "cpu": [],
    "gpu": ["model=qwen2_5_1_5b_instruct", "trainer.max_new_tokens=64", "trainer.lr=1e-6",
            "trainer.micro_batch_size=16", "deepspeed=zero2"],
}


@dataclass
class Run:
    overrides: dict[str, Any]  # the swept keys as Hydra printed them
    config: Any
    records: list[dict[str, Any]]
    path: Path | None = None  # the run dir

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.records if r.get(key) is not None]

    def mean_last(self, key: str, n: int) -> float:
        values = self.series(key)[-n:]
        return sum(values) / len(values) if values else float("nan")


Item, Result = TypeVar("Item"), TypeVar("Result")


def jobs() -> int:
    """$JOBS: how many chains of `mrl` processes a target runs side by side (1 unless set); anything but a whole
    number from 1 stops the target in one line."""
    value = os.environ.get("JOBS", "1")
    if not value.isdecimal() or not value.isascii() or int(value) < 1:
        raise SystemExit(f"JOBS={value!r}: how many jobs run side by side, a whole number from 1 (e.g. JOBS=2)")
    return int(value)


def side_by_side(work: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
    """`work(item)` for every item, $JOBS at a time, in order of `items`.  With more than one at a time the children
    started meanwhile share the cores as torch threads (OMP_NUM_THREADS, unless set; unset again after): a torch
    thread waiting on a core another job holds stalls at every op (measured: 4x slower).  A job that fails stops the
    target once the jobs beside it have ended, with its own error."""
    count = jobs()
    threads = "OMP_NUM_THREADS" not in os.environ and count > 1
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    try:
        with ThreadPoolExecutor(max_workers=count) as pool:
            return list(pool.map(work, items))
    finally:
        if threads:
            del os.environ["OMP_NUM_THREADS"]


def scale_overrides() -> list[str]:
    scale = os.environ.get("SCALE", "cpu")
    if scale not in SCALES:
        raise SystemExit(f"SCALE={scale!r}: choose one of {sorted(SCALES)}")
    return SCALES[scale]


def multirun(name: str, sweep: list[str]) -> tuple[list[Run], str]:
    """Run `mrl train -m <sweep>` into reports/<name>/runs; return its runs and the exact command."""
    sweep_dir = REPORTS / name / "runs"
    shutil.rmtree(sweep_dir, ignore_errors=True)  # this target's own runs from a previous invocation
    command = sweep_command(name, sweep)
    print(f"$ {command}", flush=True)
    subprocess.run([sys.executable, "-m", "mrl.cli", *sweep_args(name, sweep)], check=True)
    return read_runs(sweep_dir), command


def read_runs(sweep_dir: Path) -> list[Run]:
    """The runs of a finished multirun, in job order."""
    runs = []
    for metrics in sorted(sweep_dir.glob(f"*/{METRICS_FILE}"), key=lambda p: int(p.parent.name.split("_")[0])):
        hydra_dir = metrics.parent / ".hydra"
        task = OmegaConf.load(hydra_dir / "overrides.yaml")
        swept = {item.split("=", 1)[0]: item.split("=", 1)[1] for item in task}
        runs.append(Run(swept, OmegaConf.load(hydra_dir / "config.yaml"), read_metrics(metrics), metrics.parent))
    return runs


def sweep_args(name: str, sweep: list[str]) -> list[str]:
    """`mrl` arguments of the multirun `name`: the sweep, the scale's overrides, quiet logs, no checkpoints."""
    return ["train", "-m", *sweep, *scale_overrides(), "logger=none", "logger.log_every=100",
            "trainer.save_every=100000", f"hydra.sweep.dir={REPORTS / name / 'runs'}"]


def sweep_command(name: str, sweep: list[str]) -> str:
    """The command line `multirun(name, sweep)` runs, as the reports print it."""
    return "mrl " + " ".join(shlex.quote(a) for a in sweep_args(name, sweep))


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows `write_csv` wrote, or [] when there is no file."""
    if not path.exists():
        return []
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def combined_verdict(parts: list[str]) -> str:
    """A claim made of several parts (GDPO ahead on correctness *and* format): HELD when every part is, NOT HELD
    when any part is not, NOT RESOLVED otherwise."""
    if all(p == HELD for p in parts):
        return HELD
    return NOT_HELD if NOT_HELD in parts else NOT_RESOLVED


def overall(parts: list[bool]) -> bool | None:
    """A claim made of several parts: held if all hold, did not hold if none does, mixed otherwise."""
    return True if all(parts) else False if not any(parts) else None


CONF = Path(__file__).resolve().parent.parent.parent / "conf"
PRESETS_HEADING = "**Presets.**"


def named_presets(text: str) -> list[str]:
    """The preset files the `mrl train` and `mrl sft` command lines in `text` compose: conf/train.yaml (and
    conf/sft.yaml), each `algo=` and `rewards=` value (the defaults where a command names none), e.g.
    ["conf/algo/grpo.yaml", ...]."""
    commands = [line for line in text.splitlines() if line.startswith(("mrl train", "mrl sft"))]
    defaults = dict(re.findall(r"^  - (algo|rewards): (\w+)", (CONF / "train.yaml").read_text(), re.MULTILINE))
    files = {"conf/train.yaml"} if commands else set()
    files |= {"conf/sft.yaml"} if any(line.startswith("mrl sft") for line in commands) else set()
    for command in commands:
        own = {**defaults, "algo": "grpo"} if command.startswith("mrl sft") else defaults  # conf/sft.yaml's algo
        for group in ("algo", "rewards"):
            values = re.findall(rf"(?:^|\s){group}=([\w,]+)", command) or [own[group]]
            files |= {f"conf/{group}/{v}.yaml" for value in values for v in value.split(",")}
    return sorted(files)


def preset_fingerprint(text: str) -> dict[str, str]:
    """{preset file: the first 12 hex digits of its sha256 now} for the presets `text`'s commands name."""
    root = CONF.parent
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12] for f in named_presets(text)}


def recorded_fingerprint(summary: str) -> dict[str, str] | None:
    """The {preset file: sha256 prefix} a summary.md recorded when it was written; None if it recorded none."""
    section = summary.partition(PRESETS_HEADING)[2]
    if not section:
        return None
    return dict(re.findall(r"`(conf/[\w/.]+)` ([0-9a-f]{12})", section))


def write_summary(name: str, claim: str, setup: str, numbers: str, verdict: str, held: bool | str | None,
                  cost: str = "") -> Path:
    """reports/<name>/summary.md, with the fingerprint of the presets its commands ran (tests/test_repro.py compares
    it with the presets of the day: a report older than its presets fails there).  `held`: True/False/None (held,
    did not hold, mixed), or a `two_se_verdict` word; `cost`: what the run took (wall time), said after the verdict."""
    status = held if isinstance(held, str) else {True: "HELD", False: "DID NOT HOLD", None: "MIXED"}[held]
    presets = ", ".join(f"`{f}` {sha}" for f, sha in preset_fingerprint(setup).items()) or "none (no training)"
    cost = f"**Cost.** {cost}\n\n" if cost else ""
    text = (f"# {name}\n\n**Claim.** {claim}\n\n**Setup.**\n\n{setup}\n\n**Measured.**\n\n{numbers}\n\n"
            f"**Verdict: {status}.** {verdict}\n\n{cost}{PRESETS_HEADING} Run with (sha256, first 12 hex digits): "
            f"{presets}\n")
    path = REPORTS / name / "summary.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)

