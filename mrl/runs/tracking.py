"""Where metrics go: metrics.jsonl in the run dir (always), W&B (logger=wandb), and the terminal.

Every step's metrics reach all sinks under the same keys.  metrics.jsonl is appended and flushed line by line, so a
crash loses at most the step in flight; a last line cut mid-write (a kill, a full disk) is dropped, with a warning, by
every reader (resume, `mrl report`, mrl.repro).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from mrl.core.config import UserError
from mrl.core.distributed import warn
from mrl.runs.rundir import METRICS_FILE, atomic_write_jsonl, atomic_write_text, disk_faults, open_nofollow

SAMPLES_FILE = "samples.jsonl"  # a few transcripts every logger.samples_every steps (mrl.core.episode.sample_records)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl.  Its last line, when cut short mid-write, is dropped with a warning; a damaged
    line before it is an error naming the line."""
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except ValueError as err:
            if n != lines[-1][0]:
                raise UserError(f"{path}:{n}: not a JSON record ({err}); only a last line cut mid-write is "
                                "skipped") from None
            warn(f"{path}: dropped its last line (line {n}, {len(line)} bytes), cut short mid-write")
            continue
        if problem := _record_problem(record):
            raise UserError(f"{path}:{n}: {problem}; each line is one step's record as mrl writes it, e.g. "
                            '{"step": 1, "reward/format/mean": 0.5}: fix or delete that line')
        records.append(record)
    return records


def _record_problem(record: Any) -> str | None:
    """Why a parsed line is not a metrics record (an object with an int step and numbers or nulls for its metric
    keys), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    if type(record.get("step")) is not int:
        return f"its step is {json.dumps(record.get('step'))[:40]}, not an int"
    for key, value in record.items():
        if "/" in key and value is not None and type(value) not in (int, float):
            return f"{key} is {json.dumps(value)[:40]}, not a number or null"
    return None


# What to do once a full disk has space again (the run stopped; its checkpoints are as they were).
RESUME_AGAIN = "continue from the last checkpoint with trainer.resume=true"


class MetricsFile:
    def __init__(self, run_dir: Path, resume_step: int | None = None, previous: Path | None = None):
        """Open run_dir/metrics.jsonl.  On resume from step k, keep the lines of steps <= k (from `previous`, the
        file of the run being resumed) and drop any later ones, which the resumed run logs again."""
        self.path = run_dir / METRICS_FILE
        if resume_step is not None:
            kept = [r for r in read_metrics(previous or self.path) if r["step"] <= resume_step]
            atomic_write_jsonl(self.path, kept, RESUME_AGAIN)
        with disk_faults(self.path, RESUME_AGAIN):
            self.file = os.fdopen(open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")

    def log(self, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with disk_faults(self.path, RESUME_AGAIN):  # a line cut short by a full disk is dropped when it is read
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # the flush of a line `log` could not write, and said so (DiskFault)
            pass


def write_samples(run_dir: Path, records: list[dict[str, Any]]) -> None:
    with disk_faults(run_dir / SAMPLES_FILE, RESUME_AGAIN):
        with os.fdopen(open_nofollow(run_dir / SAMPLES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def run_labels(cfg, config: dict[str, Any]) -> tuple[str, str | None]:
    """W&B's run name and group: `logger.name` and `logger.group` where set; else the name `<algo>/seed<n>` (`mrl sft`:
    `sft/seed<n>`; a sweep job: its own dir's name, e.g. `0_gdpo_seed1`) and, in a sweep (-m), the sweep dir as the
    group, so that one sweep's runs sit together."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    stage = "sft" if config.get("stage") == "sft" else config["algo"]["name"]
    name = f"{stage}/seed{config['trainer']['seed']}"
    group = None
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        hydra = HydraConfig.get()
        name, group = Path(hydra.runtime.output_dir).name, str(hydra.sweep.dir)
    return cfg.name or name, cfg.get("group") or group


def trl_key(key: str) -> str:
    """`logger.trl_names`: a channel's reward under TRL's key, as TRL's dashboards read it.

    >>> trl_key("reward/correct/mean"), trl_key("reward/total/mean"), trl_key("loss/policy")
    ('rewards/correct/mean', 'reward', 'loss/policy')
    """
    if key == "reward/total/mean":  # TRL's `reward`: the weighted sum's mean
        return "reward"
    return "rewards/" + key[len("reward/"):] if key.startswith("reward/") else key


class WandbSink:
    """W&B in the run dir; offline by default (no login needed).  The run id is kept in the run dir, so a resumed run
    continues the same W&B run."""

    def __init__(self, cfg, run_dir: Path, config: dict[str, Any]):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        atomic_write_text(id_file, run_id)
        name, group = run_labels(cfg, config)
        self.trl_names = bool(cfg.get("trl_names", False))
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=name, group=group, tags=list(cfg.tags),
                              mode=cfg.mode, dir=str(run_dir), config=config, id=run_id, resume="allow")

    def log(self, metrics: dict[str, Any]) -> None:
        named = {trl_key(k) if self.trl_names else k: v for k, v in metrics.items()}
        self.run.log({k: v for k, v in named.items() if v is not None}, step=metrics["step"])

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """Transcripts as a W&B table `samples` (one row per episode)."""
        import wandb

        columns = ["step", "prompt", "completion", "tool_calls", "rewards"]
        rows = [[r["step"], r["prompt"], r["completion"], json.dumps(r["tool_calls"]), json.dumps(r["rewards"])]
                for r in records]
        self.run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Progress:
    """A rich progress bar (step, ETA, per-channel rewards) on a terminal; a plain line every `every` steps
    otherwise (CI logs, pipes)."""

    def __init__(self, total: int, start: int, channels: list[str], every: int, name: str = "train",
                 shown: dict[str, str] | None = None):
        """`shown`: {label: metric key} next to the bar (default: each channel's mean reward)."""
        self.total, self.every = total, max(every, 1)
        self.shown = shown if shown is not None else {c: f"reward/{c}/mean" for c in channels}
        self.interactive = sys.stdout.isatty()
        self.started = time.perf_counter()
        self.first = start
        if self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(),
                                    TimeRemainingColumn(), TextColumn("{task.fields[rewards]}"))
            self.task = self.bar.add_task(name, total=total, completed=start, rewards="")
            self.bar.start()

    def _rewards(self, metrics: dict[str, Any]) -> str:
        values = {label: metrics.get(key) for label, key in self.shown.items()}
        return " ".join(f"{c}={'-' if v is None else f'{v:.3g}'}" for c, v in values.items())

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self.interactive:
            self.bar.update(self.task, completed=step, rewards=self._rewards(metrics))
        elif step % self.every == 0 or step == self.total:
            elapsed = time.perf_counter() - self.started
            eta = elapsed / (step - self.first) * (self.total - step) if step > self.first else 0.0
            print(f"step {step}/{self.total} eta {eta:.0f}s {self._rewards(metrics)}", flush=True)

    def close(self) -> None:
        if self.interactive:
            self.bar.stop()
