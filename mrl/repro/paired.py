"""Paired verdicts: two arms that share the warm start, the seeds and the held-out records are compared record by
record, not by their seed means.

The unit is one held-out record under one seed: its outcome in each arm (a channel's value on the greedy episode,
or its mean over the record's k sampled ones, `mean@k`), from each run's held_out/step_<N>.jsonl (mrl.train.evaluate).
The difference ours - theirs per (seed, record) is resampled twice over (Davison & Hinkley 1997, sec. 3.8, the
two-stage bootstrap): seeds with replacement, then records with replacement within each seed drawn; the 2.5th and
97.5th percentiles of the resampled mean difference are the 95% interval.  HELD when it lies above 0, NOT HELD when
below, NOT RESOLVED when it holds 0 (its ends included).  With one seed the interval speaks for that seed's runs:
it counts the records' spread only.  The unpaired 2-SE rule over seed means (common.two_se_verdict) stays beside it:
a record that both arms solve, or both miss, adds nothing to the paired difference but the whole record-to-record
spread to the unpaired one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

import numpy as np

from mrl.repro.common import HELD, NOT_HELD, NOT_RESOLVED, mean_se, two_se_verdict
from mrl.train.evaluate import HELD_OUT_DIR

Outcomes = dict[Hashable, dict[Hashable, float]]  # seed -> record id -> the record's outcome
RESAMPLES = 10_000
LEVEL = 0.95


@dataclass(frozen=True)
class Paired:
    """A paired comparison ours - theirs: the mean difference (over seeds, of the mean over records), its bootstrap
    95% interval and standard deviation, how many seeds and records, and the verdict."""

    diff: float
    low: float
    high: float
    se: float  # the bootstrap distribution's standard deviation: the paired standard error
    seeds: int
    records: int  # (seed, record) pairs in all
    verdict: str

    @property
    def detectable(self) -> float:
        """The interval's half-width: the smallest difference this size resolves (a measured difference within it
        leaves the interval holding 0)."""
        return (self.high - self.low) / 2

    @property
    def scale_to_resolve(self) -> float | None:
        """How many times the seeds x records (the interval narrowing as 1/sqrt(n)) the measured difference needs to
        resolve, where it did not: (half-width / |diff|)^2; None where it resolved or the difference is 0."""
        if self.verdict != NOT_RESOLVED or self.diff == 0:
            return None
        return (self.detectable / abs(self.diff)) ** 2

    def cell(self) -> str:
        """`+0.021 [+0.008, +0.034]`: the difference and its interval."""
        return f"{self.diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"

    def resolution(self) -> str:
        """What this size could see, as a summary prints it."""
        needed = self.scale_to_resolve
        more = f"; this difference needs ~{needed:.1f}x the seeds x records" if needed is not None else ""
        seeds = f"{self.seeds} seed{'s' if self.seeds > 1 else ''}"
        return f"±{self.detectable:.3f} ({seeds} x {self.records // self.seeds} records{more})"


def differences(ours: Outcomes, theirs: Outcomes) -> list[np.ndarray]:
    """Per seed, ours - theirs on each record (records in sorted id order: [R_s] each); the arms must hold the same
    seeds and records, or the pairing would be a guess."""
    if set(ours) != set(theirs) or not ours:
        raise ValueError(f"paired arms need the same seeds, and some: {sorted(map(str, ours))} vs "
                         f"{sorted(map(str, theirs))}")
    out = []
    for seed in sorted(ours, key=str):
        if set(ours[seed]) != set(theirs[seed]) or not ours[seed]:
            odd = sorted(map(str, set(ours[seed]) ^ set(theirs[seed])))[:3]
            raise ValueError(f"seed {seed}: paired arms need the same held-out records, and some (unmatched: {odd})")
        ids = sorted(ours[seed], key=str)
        out.append(np.array([ours[seed][r] - theirs[seed][r] for r in ids], dtype=float))  # [R_s]
    return out


def bootstrap_means(diffs: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """[resamples] mean differences, each over S seeds drawn with replacement, each drawn seed's records drawn with
    replacement (every draw of a seed its own)."""
    S = len(diffs)
    chosen = rng.integers(0, S, size=(resamples, S))  # [B, S]: the seed in each slot
    slot_means = np.empty((resamples, S))
    for s, d in enumerate(diffs):  # d [R_s]
        draws = d[rng.integers(0, len(d), size=(resamples, S, len(d)))].mean(-1)  # [B, S]: seed s in every slot
        slot_means[chosen == s] = draws[chosen == s]
    return slot_means.mean(1)


def paired_verdict(ours: Outcomes, theirs: Outcomes, resamples: int = RESAMPLES, seed: int = 0) -> Paired:
    """The claim "ours above theirs" on per-(seed, record) outcomes: the bootstrap 95% interval of the mean
    difference, HELD above 0, NOT HELD below, NOT RESOLVED holding 0; seeded, so the same tables give the same
    interval.

    >>> paired_verdict({0: {"a": 1.0, "b": 1.0}}, {0: {"a": 0.0, "b": 0.0}}).cell()
    '+1.000 [+1.000, +1.000]'
    """
    diffs = differences(ours, theirs)
    stats = bootstrap_means(diffs, resamples, np.random.default_rng(seed))
    low, high = np.quantile(stats, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    verdict = HELD if low > 0 else NOT_HELD if high < 0 else NOT_RESOLVED
    diff = float(np.mean([d.mean() for d in diffs]))
    return Paired(diff, float(low), float(high), float(stats.std()), len(diffs), sum(len(d) for d in diffs), verdict)


# ---- outcomes from run dirs ------------------------------------------------------------------------------------

def last_outcomes(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's last held-out evaluation (held_out/step_<N>.jsonl, the largest N); [] if it kept none."""
    files = sorted((run_dir / HELD_OUT_DIR).glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(line) for line in files[-1].read_text().splitlines()] if files else []


def record_outcomes(rows: list[dict[str, Any]], channel: str, sampled: bool) -> dict[Hashable, float]:
    """{record id: its outcome on `channel`}: the greedy episode's value, or (`sampled`) the mean of its sampled
    episodes' values; an episode that abstained or failed (None) is left out, a record with none left is dropped."""
    values: dict[Hashable, list[float]] = {}
    for row in rows:
        if (row["sample"] != "greedy") == sampled and row.get(channel) is not None:
            values.setdefault(row["id"], []).append(float(row[channel]))
    return {record: sum(v) / len(v) for record, v in values.items()}


def arm_outcomes(runs: list[Any], arm_of, arm: str, channel: str, sampled: bool,
                 rows_of: Callable[[Path], list[dict[str, Any]]] = last_outcomes) -> Outcomes:
    """{seed: {record: outcome}} of `arm`'s runs (mrl.repro.common.Run) at their last held-out evaluation (or the
    rows `rows_of(run dir)` gives: repro-agent's `mrl eval` of the final checkpoint)."""
    return {run.config.trainer.seed: record_outcomes(rows_of(run.path), channel, sampled)
            for run in runs if arm_of(run) == arm}


# ---- the summary's table -----------------------------------------------------------------------------------------

COLUMNS = ["unpaired: verdict (2 SE of the difference)", "paired: difference [95% interval]",
           "resolves at ± (seeds x records)", "verdict (paired)"]
RULE = ("Verdict per claim, paired (stated before the run): the per-(seed, record) differences resampled by seeds, "
        f"then records within each seed ({RESAMPLES} resamples, seeded); HELD when the 95% interval of the mean "
        "difference lies above 0, NOT HELD below, NOT RESOLVED when it holds 0. Beside it the unpaired rule on the "
        "seed means (HELD beyond two standard errors of the difference). `resolves at` is the interval's half-width: "
        "the smallest difference this size resolves; where a claim is not resolved it says how many times the seeds "
        "x records the measured difference would need (the interval narrowing as 1/sqrt(n)).")


def verdict_cells(ours: list[float], theirs: list[float], paired: Paired) -> list[str]:
    """COLUMNS' cells for one claim: `ours` and `theirs` are the arms' seed means (the unpaired rule's input)."""
    two_se = 2 * math.sqrt(mean_se(ours)[1] ** 2 + mean_se(theirs)[1] ** 2)  # NaN below two seeds an arm
    unpaired = f"{two_se_verdict(ours, theirs)} ({'n/a' if math.isnan(two_se) else f'{two_se:.3f}'})"
    return [unpaired, paired.cell(), paired.resolution(), paired.verdict]
