"""What the real-benchmark reproductions share (repro-paper's BFCL setting, repro-agent): one warm-start checkpoint
made once per target by `mrl sft` and reused while intact, the arms trained from it (`mrl train -m ...
trainer.init_from=`), their held-out evaluations as mean ± standard error over seeds beside the start's own numbers,
the 2-SE verdict (common.two_se_verdict), the curves, the CSVs and report.html.

A plan is data: every command a target runs, built without running anything (`Plan`), so a test builds the CPU and
the GPU plan and composes each command's config.  Every arm starts from the same checkpoint: the warm start's
policy sha256 is recorded beside it (warm_start.json) and checked against each arm's lineage.json.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrl.core.config import CONF_DIR, UserError
from mrl.repro.common import Run, mean_se, read_runs, side_by_side, write_csv
from mrl.repro.plots import pyplot, save_curves
from mrl.runs.report import find_runs, write_html_report
from mrl.runs.rundir import CHECKPOINTS, LINEAGE_FILE, intact_checkpoint
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.runs.warm_start import lineage

WARM_FILE = "warm_start.json"  # beside the warm start's run dir: the arguments that made it, its weights' sha256
QUIET = ["logger=none", "logger.log_every=1"]


@dataclass(frozen=True)
class Sweep:
    """One `mrl train -m` multirun from the warm start: its dir under the target's runs, its own overrides."""

    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """Every command of a target at one scale: the warm start (`mrl sft`), the sweeps from it, and with a thinking
    model, each final checkpoint scored with thinking off and on (`mrl eval`)."""

    root: Path  # reports/<target>[/<setting>]/runs: the warm start's dir and the sweeps' dirs
    sft: tuple[str, ...]  # mrl sft overrides
    train: tuple[str, ...]  # mrl train overrides every sweep shares
    sweeps: tuple[Sweep, ...]
    thinking: bool = False  # the model has a thinking switch (Qwen3's enable_thinking)
    eval_prompts: int = 0  # held-out prompts the thinking holdouts score
    thinking_tokens: int = 2048  # new tokens a reply may take with thinking on (the thoughts come first)
    extra: dict[str, Any] = field(default_factory=dict)  # what the target's summary says of its sizes

    @property
    def warm_dir(self) -> Path:
        return self.root / "warm_start"

    def sft_args(self) -> list[str]:
        return ["sft", *self.sft, *QUIET, f"hydra.run.dir={self.warm_dir}"]

    def sweep_args(self, sweep: Sweep) -> list[str]:
        return ["train", "-m", *self.train, *sweep.overrides, f"trainer.init_from={self.warm_dir}", *QUIET,
                "trainer.save_every=100000", f"hydra.sweep.dir={self.root / sweep.name}"]

    def thinking_args(self, run_dir: Path, thinking: bool) -> list[str]:
        flag = str(thinking).lower()
        budget = [f"trainer.max_new_tokens={self.thinking_tokens}"] if thinking else []
        return ["eval", str(run_dir), "--prompts", str(self.eval_prompts), "--samples", "0", "--out",
                str(run_dir / f"eval_thinking_{flag}"), f"model.chat_template_kwargs.enable_thinking={flag}", *budget,
                "--trust-config"]  # a run this plan trained: its chat template is the model's own

    def commands(self) -> list[str]:
        """The command lines as the summary prints them (the thinking holdouts, per run, after the sweeps)."""
        lines = [show(self.sft_args())] + [show(self.sweep_args(s)) for s in self.sweeps]
        if self.thinking:
            lines += [show(self.thinking_args(Path("<each run dir>"), flag)) for flag in (False, True)]
        return lines


def scale(sizes: dict[str, Any]) -> str:
    """$SCALE (cpu unless set): one of `sizes`' keys, or the target stops in one line naming them."""
    value = os.environ.get("SCALE", "cpu")
    if value not in sizes:
        raise SystemExit(f"SCALE={value!r}: choose one of {sorted(sizes)}")
    return value


def gpu_model(default: str) -> list[str]:
    """The model overrides at SCALE=gpu: GPU_MODEL (a conf/model preset; `default` unless set) at MODEL (a local
    dir; the preset's own name_or_path, a hub name, unless set)."""
    preset = os.environ.get("GPU_MODEL", default)
    return [f"model={preset}"] + ([f"model.name_or_path={os.environ['MODEL']}"] if os.environ.get("MODEL") else [])


def has_thinking(model: list[str]) -> bool:
    """Whether the model preset `model=...` names has a thinking switch (chat_template_kwargs.enable_thinking)."""

    preset = next(o.split("=", 1)[1] for o in model if o.startswith("model="))
    kwargs = OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml").get("chat_template_kwargs") or {}
    return "enable_thinking" in kwargs


def show(args: list[str]) -> str:
    return "mrl " + " ".join(shlex.quote(a) for a in args)


def mrl(args: list[str], cwd: Path | None = None) -> None:
    """`mrl <args>` in its own process (in `cwd`, default this one's), its command line printed first."""
    print(f"$ {show(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "mrl.cli", *args], cwd=cwd, check=True)


# ---- the warm start: made once, reused while intact ------------------------------------------------------------

def intact_warm_start(plan: Plan) -> dict[str, Any] | None:
    """What warm_start.json recorded, when the warm start there was made by this plan's `mrl sft` arguments and its
    newest checkpoint is intact (every file matches its sha256) with the policy weights it recorded; else None."""

    record = plan.root / WARM_FILE
    if not record.exists():
        return None
    try:
        recorded = json.loads(record.read_text())
        checkpoint = intact_checkpoint(plan.warm_dir, "the warm start")
    except (ValueError, UserError):
        return None
    same = recorded.get("args") == plan.sft_args() and lineage(checkpoint)["policy_sha256"] == recorded.get(
        "policy_sha256")
    return recorded if same else None


def ensure_warm_start(plan: Plan) -> tuple[dict[str, Any], bool]:
    """(warm_start.json's record, whether it was reused): the plan's warm start, made by `mrl sft` unless an intact
    one made by the same arguments is there (a damaged, partial or differently made one is made again)."""

    recorded = intact_warm_start(plan)
    if recorded is not None:
        print(f"reusing the warm start {plan.warm_dir} (policy sha256 {recorded['policy_sha256'][:12]})", flush=True)
        return recorded, True
    shutil.rmtree(plan.warm_dir, ignore_errors=True)
    start = time.perf_counter()
    mrl(plan.sft_args())
    source = lineage(intact_checkpoint(plan.warm_dir, "the warm start"))
    recorded = {"args": plan.sft_args(), "policy_sha256": source["policy_sha256"], "step": source["step"],
                "wall_s": time.perf_counter() - start}
    plan.root.mkdir(parents=True, exist_ok=True)
    (plan.root / WARM_FILE).write_text(json.dumps(recorded, indent=1) + "\n")
    return recorded, False


def foreign_starts(runs: list[Run], policy_sha256: str) -> list[str]:
    """The run dirs whose lineage.json names other start weights than the warm start's (none, when all is well)."""
    bad = []
    for run in runs:
        lineage = run.path / LINEAGE_FILE
        if not lineage.exists() or json.loads(lineage.read_text()).get("policy_sha256") != policy_sha256:
            bad.append(str(run.path))
    return bad


def provenance(runs: list[Run], policy_sha256: str, thinking: dict[str, dict[bool, float]]) -> str:
    """The summary's paragraphs on where the runs started (all from the warm start's weights, or the runs that did
    not) and, for a model with a thinking switch, each run's held-out accuracy without / with thinking."""
    foreign = foreign_starts(runs, policy_sha256)
    text = (f"\n\nEvery run started from the warm start's weights (lineage.json: policy sha256 {policy_sha256[:12]})."
            if not foreign else f"\n\n**Runs from other weights:** {foreign}")
    if thinking:
        text += "\n\nHeld-out accuracy without / with thinking: " + "; ".join(
            f"{Path(k).name}: {v[False]:.3f} / {v[True]:.3f}" for k, v in thinking.items())
    return text


def run_sweeps(plan: Plan, keep_checkpoints: bool) -> list[Run]:
    """Every sweep of the plan from its warm start, $JOBS side by side (common.side_by_side); their runs, in the
    plan's order (a sweep's old dir is replaced).  The arms' final checkpoints are deleted once read unless kept (the
    thinking holdouts score them)."""
    for sweep in plan.sweeps:
        shutil.rmtree(plan.root / sweep.name, ignore_errors=True)
    side_by_side(lambda sweep: mrl(plan.sweep_args(sweep)), plan.sweeps)
    runs = [run for sweep in plan.sweeps for run in read_runs(plan.root / sweep.name)]
    if not keep_checkpoints:
        for run in runs:
            shutil.rmtree(run.path / CHECKPOINTS, ignore_errors=True)
    return runs


def thinking_holdouts(plan: Plan, runs: list[Run]) -> dict[str, dict[bool, float]]:
    """{run dir: {thinking: held-out accuracy}} of each run's final checkpoint with thinking off and on (`mrl eval`,
    the model's template switch); {} for a model without one."""
    results: dict[str, dict[bool, float]] = {}
    if not plan.thinking:
        return results
    for run in runs:
        for thinking in (False, True):
            args = plan.thinking_args(run.path, thinking)
            mrl(args)
            report = json.loads((Path(args[args.index("--out") + 1]) / "eval.json").read_text())
            results.setdefault(str(run.path), {})[thinking] = report["accuracy"]
    return results


# ---- held-out numbers per arm ----------------------------------------------------------------------------------

def evals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a run that hold a held-out evaluation, in step order."""
    return [r for r in records if r.get("eval/accuracy") is not None or any(
        k.startswith("eval/") and k.endswith("/mean") and r[k] is not None for k in r)]


def start_numbers(plan: Plan) -> dict[str, Any]:
    """The warm start's own held-out numbers: its last evaluation (after its last step), the arms' step 0."""
    found = evals(read_metrics(plan.warm_dir / METRICS_FILE))
    return found[-1] if found else {}


def arm_table(runs: list[Run], arm_of, keys: list[str]) -> dict[str, dict[str, list[float]]]:
    """{arm: {key: each seed's value at its last evaluation}} (a key the evaluation left None is skipped)."""
    table: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        last = (evals(run.records) or [{}])[-1]
        row = table.setdefault(arm_of(run), {k: [] for k in keys})
        for key in keys:
            if last.get(key) is not None:
                row[key].append(float(last[key]))
    return table


def cell(values: list[float]) -> str:
    """mean ± standard error over seeds, e.g. `0.512 ± 0.021`; `n/a` without values."""
    if not values:
        return "n/a"
    mean, se = mean_se(values)
    return f"{mean:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def eval_rows(runs: list[Run], arm_of) -> list[dict[str, Any]]:
    """One CSV row per run and held-out evaluation: arm, seed, step and every eval/ key (the raw numbers)."""
    keys = sorted({k for run in runs for r in evals(run.records) for k in r if k.startswith("eval/")})
    return [{"arm": arm_of(run), "seed": run.config.trainer.seed, "step": r["step"]} | {k: r.get(k, "") for k in keys}
            for run in runs for r in evals(run.records)]


def write_tables(out_dir: Path, stem: str, runs: list[Run], arm_of, keys: list[str], start: dict[str, Any]) -> dict:
    """<stem>.csv (arm, key, n, mean, se, and the start's value) and <stem>_evals.csv (every evaluation of every run);
    returns arm_table's dict."""
    table = arm_table(runs, arm_of, keys)
    rows = [{"arm": "start", "key": k, "n": 1, "mean": start.get(k, ""), "se": ""} for k in keys]
    for arm, values in table.items():
        rows += [{"arm": arm, "key": k, "n": len(v), "mean": mean_se(v)[0] if v else "",
                  "se": mean_se(v)[1] if len(v) > 1 else ""} for k, v in values.items()]
    write_csv(out_dir / f"{stem}.csv", rows)
    raw = eval_rows(runs, arm_of)
    if raw:
        write_csv(out_dir / f"{stem}_evals.csv", raw)
    return table


def plot_curves(path: Path, runs: list[Run], arm_of, keys: list[str], start: dict[str, Any], title: str) -> None:
    """A panel per held-out key: each arm's mean over seeds at each evaluation, ± one standard error shaded, from
    the warm start's value at step 0."""

    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.3), squeeze=False)
    arms = list(dict.fromkeys(arm_of(r) for r in runs))
    for ax, key in zip(axes[0], keys):
        for arm in arms:
            points: dict[int, list[float]] = {}
            if start.get(key) is not None:
                points[0] = []
            for run in (r for r in runs if arm_of(r) == arm):
                for record in evals(run.records):
                    if record.get(key) is not None:
                        points.setdefault(int(record["step"]), []).append(float(record[key]))
            steps = sorted(points)
            means = [mean_se(points[s])[0] if points[s] else float(start[key]) for s in steps]
            ses = [0.0 if len(points[s]) < 2 else mean_se(points[s])[1] for s in steps]
            line, = ax.plot(steps, means, marker="o", label=arm)
            ax.fill_between(steps, [m - e for m, e in zip(means, ses)], [m + e for m, e in zip(means, ses)],
                            color=line.get_color(), alpha=0.15)
        ax.set_title(key.removeprefix("eval/"), fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_curves(fig, axes[0], path)


HTML_NOTE = ("committed; it loads plotly.js from plotly's CDN, and report_offline.html beside it, written by the "
             "target, embeds it and opens offline")


def write_html(plan: Plan, out: Path, title: str) -> Path:
    """The interactive page of the warm start and every sweep (mrl.runs.report: one held-out curve across the stages),
    twice: `out` (report.html, committed) loads plotly.js from its CDN, so it holds only our own content (the curves'
    data, the tables; the CSVs beside it in report_data/); report_offline.html beside it embeds plotly.js (4.5 MB,
    not committed) and opens without a network.  Return `out`."""
    dirs = [plan.warm_dir] + [plan.root / s.name for s in plan.sweeps]
    runs = find_runs([d for d in dirs if d.exists()])
    offline = write_html_report(runs, out.with_name(f"{out.stem}_offline.html"), title=title)
    fallback = (f"{offline.name} beside this page embeds plotly.js and opens offline (written by the target "
                "that wrote this page; not committed).")
    return write_html_report(runs, out, title=title, cdn_fallback=fallback)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"
