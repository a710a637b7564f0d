"""Statistics over seeds, pure and plain: a mean with its standard error, the 2-SE verdict of "ours above theirs",
and a curve's mean and standard error per step over seeds (the band of a trainer in `mrl report`)."""

from __future__ import annotations

import math

HELD, NOT_HELD, NOT_RESOLVED = "HELD", "NOT HELD", "NOT RESOLVED"


def mean_se(values: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) over seeds; the error is NaN below two values (nothing to resolve with).

    >>> mean_se([0.0, 2.0])  # variance (1 + 1) / 1 = 2, SE = sqrt(2 / 2)
    (1.0, 1.0)
    """
    mean = sum(values) / len(values) if values else math.nan
    if len(values) < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def two_se_verdict(ours: list[float], theirs: list[float]) -> str:
    """The claim "ours above theirs", judged on the difference of the means against two standard errors of that
    difference (sqrt(se_ours^2 + se_theirs^2), the arms' seeds independent): HELD above +2 SE, NOT HELD below -2 SE,
    NOT RESOLVED within (the boundary included) or when either arm has fewer than two seeds.

    >>> two_se_verdict([0.5, 0.6, 0.7], [0.1, 0.2, 0.3]), two_se_verdict([0.1, 0.2], [0.2, 0.3])
    ('HELD', 'NOT RESOLVED')
    """
    (a, se_a), (b, se_b) = mean_se(ours), mean_se(theirs)
    se = math.sqrt(se_a ** 2 + se_b ** 2)
    if math.isnan(se) or abs(a - b) <= 2 * se:
        return NOT_RESOLVED
    return HELD if a > b else NOT_HELD


def seed_band(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float], list[int]]:
    """A trainer's curve over its seeds: `curves` holds each seed's (steps, values); returns, for every step any
    seed logged (ascending), the mean over the seeds that logged it, its standard error (NaN where fewer than two
    did) and how many did.

    >>> seed_band([([1, 2], [1.0, 2.0]), ([1, 2, 3], [3.0, 6.0, 5.0])])
    ([1, 2, 3], [2.0, 4.0, 5.0], [1.0, 2.0, nan], [2, 2, 1])
    """
    at: dict[int, list[float]] = {}
    for steps, values in curves:
        for step, value in zip(steps, values):
            at.setdefault(step, []).append(value)
    steps = sorted(at)
    bands = [mean_se(at[s]) for s in steps]
    return steps, [m for m, _ in bands], [se for _, se in bands], [len(at[s]) for s in steps]
