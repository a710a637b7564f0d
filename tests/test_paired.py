"""Paired verdicts (mrl/repro/paired.py) on small tables worked by hand: a tie, a clear win, a sign flip, one seed,
seeds that disagree, and the case the paired rule exists for (a small, steady lead the unpaired 2-SE rule cannot
see); then the outcomes read back from held_out/step_<N>.jsonl."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from mrl.repro.common import HELD, NOT_HELD, NOT_RESOLVED, two_se_verdict
from mrl.repro.paired import (
    arm_outcomes,
    bootstrap_means,
    differences,
    last_outcomes,
    paired_verdict,
    record_outcomes,
)


def table(*seeds: list[float]) -> dict:
    """{seed: {record: outcome}} from one list of outcomes per seed (records r0, r1, ...)."""
    return {s: {f"r{i}": v for i, v in enumerate(values)} for s, values in enumerate(seeds)}


def test_a_tie_is_not_resolved_and_could_see_nothing_smaller_than_zero():
    same = table([1, 0, 1], [0, 0, 1])
    result = paired_verdict(same, same)
    assert (result.diff, result.low, result.high, result.se) == (0.0, 0.0, 0.0, 0.0)
    assert result.verdict == NOT_RESOLVED and result.detectable == 0.0 and result.scale_to_resolve is None


def test_a_clear_win_holds_and_its_sign_flip_does_not():
    ours, theirs = table([1, 1, 1], [1, 1, 1]), table([0, 0, 0], [0, 0, 0])  # +1 on every (seed, record)
    win = paired_verdict(ours, theirs)
    assert (win.diff, win.low, win.high, win.verdict) == (1.0, 1.0, 1.0, HELD)
    assert (win.seeds, win.records) == (2, 6)
    flip = paired_verdict(theirs, ours)
    assert (flip.diff, flip.low, flip.high, flip.verdict) == (-1.0, -1.0, -1.0, NOT_HELD)
    assert flip.cell() == "-1.000 [-1.000, -1.000]"


def test_one_seed_counts_the_records_spread():
    """Differences [1, 1, 1, 0]: a resample's mean is (ones drawn)/4, ones ~ Binomial(4, 3/4).  P(0) = 1/256 = 0.004
    and P(<= 1/4) = 1/256 + 12/256 = 0.051, so the 2.5th percentile is 0.25; P(1) = 81/256 = 0.32 puts the 97.5th at
    1.  The interval [0.25, 1] excludes 0: HELD, for this seed."""
    result = paired_verdict(table([1, 1, 1, 1]), table([0, 0, 0, 1]))
    assert (result.diff, result.low, result.high, result.verdict) == (0.75, 0.25, 1.0, HELD)
    assert result.detectable == 0.375
    # differences [1, 0]: means 0, 1/2, 1 with chances 1/4, 1/2, 1/4 -> the interval [0, 1] holds 0
    two = paired_verdict(table([1, 1]), table([0, 1]))
    assert (two.diff, two.low, two.high, two.verdict) == (0.5, 0.0, 1.0, NOT_RESOLVED)
    assert two.scale_to_resolve == 1.0  # (half-width 0.5 / difference 0.5)^2


def test_seeds_that_disagree_are_not_resolved_though_each_is_certain():
    """Seed 0: +1 on both records, seed 1: -1 on both.  Records alone would be certain within each seed; resampling
    the seeds gives means +1, 0, -1 with chances 1/4, 1/2, 1/4: the interval is [-1, 1]."""
    result = paired_verdict(table([1, 1], [0, 0]), table([0, 0], [1, 1]))
    assert (result.diff, result.low, result.high, result.verdict) == (0.0, -1.0, 1.0, NOT_RESOLVED)
    assert result.se == pytest.approx(np.sqrt(0.5), abs=0.01)  # the variance of the three means: 1/4 + 1/4


def test_a_steady_small_lead_resolves_paired_and_not_unpaired():
    """3 seeds x 50 records; GRPO solves 15, 17.5 (rounded: 17), 20 -> seed means 0.30, 0.34, 0.40; GDPO solves the
    same records and 2 more in every seed (+0.04 each).  Unpaired: 2 SE of the difference = 2 sqrt(2) x 0.029 = 0.082
    > 0.04, NOT RESOLVED.  Paired: the resampled difference is (ones drawn of 150)/150 with ones ~ Binomial(150,
    0.04): P(0) = 0.002, P(<= 1) = 0.016, P(<= 2) = 0.058, so its 2.5th percentile is 2/150 > 0: HELD."""
    solved = (15, 17, 20)
    theirs = table(*[[1.0] * n + [0.0] * (50 - n) for n in solved])
    ours = table(*[[1.0] * (n + 2) + [0.0] * (48 - n) for n in solved])
    means = [[sum(t.values()) / 50 for t in arm.values()] for arm in (ours, theirs)]
    assert two_se_verdict(*means) == NOT_RESOLVED
    result = paired_verdict(ours, theirs)
    assert result.diff == pytest.approx(0.04) and result.low == pytest.approx(2 / 150)
    assert result.verdict == HELD


def test_the_interval_is_seeded_and_deterministic():
    ours, theirs = table([1, 0, 1, 1, 0], [1, 1, 0, 1, 1]), table([0, 0, 1, 1, 0], [1, 0, 0, 1, 0])
    assert paired_verdict(ours, theirs) == paired_verdict(ours, theirs)
    assert paired_verdict(ours, theirs, seed=1) != paired_verdict(ours, theirs, seed=2)


def test_bootstrap_draws_each_slot_of_a_seed_its_own_records():
    """Two seeds, one always 0 and one with differences [0, 1]: a resample holding seed 1 twice draws its records
    twice, so means of 1/4 and 3/4 occur (one shared draw per seed would give only 0, 1/2, 1 and 1/4 via seed 0)."""
    means = bootstrap_means([np.zeros(2), np.array([0.0, 1.0])], 4000, np.random.default_rng(0))
    assert set(np.round(means, 3)) == {0.0, 0.25, 0.5, 0.75, 1.0}


def test_unmatched_arms_are_refused_by_name():
    with pytest.raises(ValueError, match=r"the same seeds"):
        differences(table([1]), table([1], [0]))
    with pytest.raises(ValueError, match=r"seed 0: .* \(unmatched: \['r1'\]\)"):
        differences(table([1, 0]), table([1]))


ROWS = [{"id": "a", "sample": "greedy", "correctness": 1.0, "format": 1.0},
        {"id": "a", "sample": 0, "correctness": 0.0, "format": 1.0},
        {"id": "a", "sample": 1, "correctness": 1.0, "format": None},
        {"id": "b", "sample": "greedy", "correctness": 0.0, "format": None},
        {"id": "b", "sample": 0, "correctness": 0.0, "format": 0.0},
        {"id": "b", "sample": 1, "correctness": 1.0, "format": 0.0}]


def test_record_outcomes_greedy_and_mean_at_k():
    assert record_outcomes(ROWS, "correctness", sampled=False) == {"a": 1.0, "b": 0.0}
    assert record_outcomes(ROWS, "correctness", sampled=True) == {"a": 0.5, "b": 0.5}
    assert record_outcomes(ROWS, "format", sampled=True) == {"a": 1.0, "b": 0.0}  # None left out
    assert record_outcomes(ROWS, "format", sampled=False) == {"a": 1.0}  # b abstained: dropped


def test_arm_outcomes_read_each_runs_last_evaluation(tmp_path):
    runs = []
    for arm, seed, last in (("gdpo", 0, 1.0), ("grpo", 0, 0.0)):
        held = tmp_path / f"{arm}{seed}" / "held_out"
        held.mkdir(parents=True)
        for step, value in ((3, 0.5), (12, last)):  # step 12 is the last: ordered by number, not by text
            rows = [{"id": "a", "sample": "greedy", "correctness": value}]
            (held / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(SimpleNamespace(path=held.parent, arm=arm,
                                    config=SimpleNamespace(trainer=SimpleNamespace(seed=seed))))
    assert last_outcomes(tmp_path / "missing") == []
    assert arm_outcomes(runs, lambda r: r.arm, "gdpo", "correctness", False) == {0: {"a": 1.0}}
    assert arm_outcomes(runs, lambda r: r.arm, "grpo", "correctness", False) == {0: {"a": 0.0}}
