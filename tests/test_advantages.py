"""Unit tests for mrl/algo/advantages.py.  Every expected value is worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from mrl.algo.advantages import (
    ESTIMATORS,
    check_finite,
    gae_advantages,
    gae_token_rewards,
    gdpo_advantages,
    gdpo_signal,
    grpo_advantages,
    grpo_signal,
    live_groups,
    masked_whiten,
)
from mrl.core.config import UserError

EPS = 1e-6
TOL = dict(rtol=1e-9, atol=1e-9)  # float64 inputs, eps written into the hand formulas


def hand_rewards() -> torch.Tensor:
    """[B=2, G=3, K=2], float64.

    group 0: channel 0 = [0, 1, 2] (mean 1, dev [-1, 0, 1], unbiased std sqrt(2/2) = 1)
             channel 1 = [4, 2, 0] (mean 2, dev [2, 0, -2], unbiased std sqrt(8/2) = 2)
    group 1: channel 0 = [1, 1, 1] (constant)
             channel 1 = [0, 3, 0] (mean 1, dev [-1, 2, -1], unbiased std sqrt(6/2) = sqrt(3))
    """
    return torch.tensor(
        [
            [[0.0, 4.0], [1.0, 2.0], [2.0, 0.0]],
            [[1.0, 0.0], [1.0, 3.0], [1.0, 0.0]],
        ],
        dtype=torch.float64,
    )


WEIGHTS = [1.0, 0.5]


# ---------------------------------------------------------------------------------------------- GRPO


def test_grpo_hand_example():
    # weighted sums (w = [1, 0.5]):
    #   group 0: [0 + 2, 1 + 1, 2 + 0] = [2, 2, 2]  -> constant -> exactly 0
    #   group 1: [1 + 0, 1 + 1.5, 1 + 0] = [1, 2.5, 1], mean 1.5, dev [-0.5, 1, -0.5],
    #            unbiased var (0.25 + 1 + 0.25) / 2 = 0.75, std sqrt(0.75) ~ 0.8660
    #            -> [-0.5, 1, -0.5] / (0.8660 + eps) ~ [-0.5774, 1.1547, -0.5774]
    s = math.sqrt(0.75) + EPS
    expected = torch.tensor([[0.0, 0.0, 0.0], [-0.5 / s, 1.0 / s, -0.5 / s]], dtype=torch.float64)
    out = grpo_advantages(hand_rewards(), WEIGHTS, eps=EPS)
    assert out.shape == (2, 3)
    assert_close(out, expected, **TOL)
    assert torch.equal(out[0], torch.zeros(3, dtype=torch.float64))  # constant group: exactly 0, not 0/eps
    # Loose sanity on the rounded numbers in the comment.
    assert_close(out[1], torch.tensor([-0.5774, 1.1547, -0.5774], dtype=torch.float64), rtol=0, atol=1e-4)


def test_grpo_weights_matter():
    # With unit weights, group 0 sums to [0+4, 1+2, 2+0] = [4, 3, 2]: mean 3, dev [1, 0, -1], std 1
    #   -> [1, 0, -1] / (1 + eps): no longer zero (so the weights really enter the sum).
    out = grpo_advantages(hand_rewards(), [1.0, 1.0], eps=EPS)
    assert_close(out[0], torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64) / (1 + EPS), **TOL)


# ---------------------------------------------------------------------------------------------- GDPO


def _gdpo_hand_summed() -> torch.Tensor:
    # Per channel, per group (dev / (std + eps)):
    #   group 0 ch0: [-1, 0, 1] / (1 + eps);  ch1: [2, 0, -2] / (2 + eps)
    #   group 1 ch0: constant -> exactly 0;   ch1: [-1, 2, -1] / (sqrt(3) + eps)
    # Weighted sum with w = [1, 0.5]:
    #   group 0: [-1/(1+eps) + 1/(2+eps), 0, 1/(1+eps) - 1/(2+eps)] ~ [-0.5, 0, 0.5]
    #   group 1: 0.5 * [-1, 2, -1] / (sqrt(3)+eps) ~ [-0.2887, 0.5774, -0.2887]
    a = 1 / (1 + EPS) - 1 / (2 + EPS)
    b = 0.5 / (math.sqrt(3) + EPS)
    return torch.tensor([[-a, 0.0, a], [-b, 2 * b, -b]], dtype=torch.float64)


def test_gdpo_hand_example_no_batch_norm():
    expected = _gdpo_hand_summed()
    out = gdpo_advantages(hand_rewards(), WEIGHTS, eps=EPS, batch_norm=False)
    assert_close(out, expected, **TOL)
    assert_close(out, torch.tensor([[-0.5, 0.0, 0.5], [-0.2887, 0.5774, -0.2887]], dtype=torch.float64),
                 rtol=0, atol=1e-4)
    # GRPO gave group 0 all zeros (weighted sum constant); GDPO keeps the per-channel signal.
    assert out[0].abs().max() > 0.4


def test_gdpo_constant_channel_contributes_exactly_zero():
    # Group 1's channel 0 is constant: with its weight changed to anything, group 1 is bit-for-bit unchanged.
    r = hand_rewards()
    a = gdpo_advantages(r, [1.0, 0.5], eps=EPS, batch_norm=False)
    b = gdpo_advantages(r, [123.0, 0.5], eps=EPS, batch_norm=False)
    assert torch.equal(a[1], b[1])
    assert not torch.equal(a[0], b[0])  # group 0's channel 0 varies, so there it matters


def test_gdpo_hand_example_batch_norm():
    # Flatten summed: [-a, 0, a, -b, 2b, -b]; mean exactly 0 (each group sums to 0).
    # Sum of squares 2a^2 + 6b^2 (~ 0.5 + 6/12 = 1.0), unbiased var / (6 - 1) ~ 0.2, std ~ 0.4472
    #   -> ~ [-1.1180, 0, 1.1180, -0.6455, 1.2910, -0.6455]
    summed = _gdpo_hand_summed()
    a = summed[0, 2].item()
    b = summed[1, 0].abs().item()
    std = math.sqrt((2 * a * a + 6 * b * b) / 5)
    expected = summed / (std + EPS)
    out = gdpo_advantages(hand_rewards(), WEIGHTS, eps=EPS, batch_norm=True)
    assert_close(out, expected, **TOL)
    assert_close(
        out,
        torch.tensor([[-1.1180, 0.0, 1.1180], [-0.6455, 1.2910, -0.6455]], dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
    # Batch-normalized: mean 0 and unbiased std ~1 over all B*G entries.
    assert abs(out.mean().item()) < 1e-12
    assert abs(out.std().item() - 1.0) < 1e-5


def test_gdpo_batch_norm_constant_batch_is_zero():
    # Every group constant in every channel -> summed all 0 -> std 0 -> zeros, not NaN.
    r = torch.ones(3, 4, 2)
    out = gdpo_advantages(r, batch_norm=True)
    assert torch.equal(out, torch.zeros(3, 4))


# ----------------------------------------------------------------------------------------- properties


def _random_rewards(seed: int, b: int = 4, g: int = 5, k: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(b, g, k, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constant_group_exactly_zero(seed):
    r = _random_rewards(seed)
    r[2] = r[2, :1].expand_as(r[2]).clone()  # every rollout of prompt 2 gets rollout 0's rewards
    w = [1.0, 0.3, 2.0]
    zeros = torch.zeros(r.shape[1], dtype=r.dtype)
    assert torch.equal(grpo_advantages(r, w)[2], zeros)
    assert torch.equal(gdpo_advantages(r, w, batch_norm=False)[2], zeros)
    # The other groups are not all zero (the test could fail).
    assert grpo_advantages(r, w)[0].abs().sum() > 0


@pytest.mark.parametrize("batch_norm", [True, False])
def test_gdpo_invariant_to_channel_scale_grpo_is_not(batch_norm):
    r = _random_rewards(3)
    w = [1.0, 0.5, 2.0]
    scaled = r.clone()
    scaled[..., 1] *= 7.3
    # GDPO: (c x - c m) / (c s + eps) = (x - m) / (s + eps/c): equal up to an eps-sized term.
    assert_close(
        gdpo_advantages(scaled, w, batch_norm=batch_norm),
        gdpo_advantages(r, w, batch_norm=batch_norm),
        rtol=1e-4,
        atol=1e-4,
    )
    # GRPO: the scaled channel dominates the sum, so the advantages move by far more than eps.
    diff = (grpo_advantages(scaled, w) - grpo_advantages(r, w)).abs().max()
    assert diff > 0.05


@pytest.mark.parametrize("seed", [4, 5])
def test_gdpo_without_batch_norm_equals_grpo_for_one_channel(seed):
    r = _random_rewards(seed, k=1)
    r[1] = 0.25  # include a constant group
    assert_close(gdpo_advantages(r, batch_norm=False), grpo_advantages(r), rtol=1e-12, atol=1e-12)
    # ...but with batch norm it differs (per-group stds are not 1 over the whole batch).
    assert not torch.allclose(gdpo_advantages(r, batch_norm=True), grpo_advantages(r), atol=1e-3)


# ---------------------------------------------------------------------------------------- live_groups


def dead(rewards, weights=None, estimator="gdpo"):
    """The groups that are dead for the estimator of that name, by its registered group signal."""
    return (~live_groups(rewards, weights, ESTIMATORS[estimator].group_signal)).tolist()


def test_live_groups():
    r = torch.tensor(
        [
            [[1.0, 0.0], [0.0, 1.0]],  # both channels vary, sum constant (1, 1)
            [[0.5, 2.0], [0.5, 2.0]],  # nothing varies: dead
            [[1.0, 1.0], [1.0, 2.0]],  # only channel 1 varies: alive
            [[0.0, 0.0], [0.0, 0.0]],  # all zero: dead
        ]
    )
    # Group 0 under GDPO: ch0 -> [0.7071, -0.7071], ch1 -> [-0.7071, 0.7071]: they cancel exactly, advantage 0.
    assert dead(r, estimator="gdpo") == [True, True, False, True]
    assert dead(r, estimator="grpo") == [True, True, False, True]
    assert dead(r, estimator="gae") == [True, True, False, True]
    assert torch.equal(gdpo_advantages(r, batch_norm=False)[0], torch.zeros(2))
    assert torch.equal(grpo_advantages(r)[0], torch.zeros(2))
    assert live_groups(r, None, gdpo_signal).dtype == torch.bool


def test_a_group_where_only_a_weight_0_constraint_varies_is_dead():
    # Issue 21's first case: every rollout wrong, two of four used the shortcut.  Channels (correctness,
    # efficiency, safety) at weights (1, 0.25, 0): safety is an enforced constraint (weight 0).
    r = torch.tensor([[[0.0, -6.0, -1.0], [0.0, -6.0, 0.0], [0.0, -6.0, -1.0], [0.0, -6.0, 0.0]]])
    w = [1.0, 0.25, 0.0]
    for estimator in ("gdpo", "grpo", "gae"):
        assert dead(r, w, estimator) == [True], estimator
    assert torch.equal(gdpo_advantages(r, w, batch_norm=False), torch.zeros(1, 4))
    # At weight 1 the constraint's variation is signal.
    assert dead(r, [1.0, 0.25, 1.0], "gdpo") == [False]


def test_grpo_weighted_sums_that_tie_are_dead_but_gdpo_is_live():
    # Issue 21's second case: (1, -8) and (0, -4) at weights 1 and 0.25: sums 1 - 2 = -1 and 0 - 1 = -1.
    r = torch.tensor([[[1.0, -8.0], [0.0, -4.0]]])
    w = [1.0, 0.25]
    assert dead(r, w, "grpo") == [True]
    assert dead(r, w, "gae") == [True]
    assert torch.equal(grpo_advantages(r, w), torch.zeros(1, 2))
    # GDPO: ch0 [1, 0] -> [0.7071, -0.7071]; ch1 [-8, -4] -> [-0.7071, 0.7071], times 0.25:
    # rollout 0: 0.7071 - 0.1768 = 0.5303, rollout 1: -0.5303.
    assert dead(r, w, "gdpo") == [False]
    assert_close(gdpo_advantages(r, w, batch_norm=False), torch.tensor([[0.5303, -0.5303]]), rtol=0, atol=1e-4)


def test_an_unknown_estimator_names_the_choices_and_the_registry():
    with pytest.raises(UserError, match=r"^algo.advantage='reinforce': choose one of grpo, gdpo, gae, gd2po, "
                                        r"gd2po_snr, corrgrpo \(registered in "
                                        r"mrl/algo/advantages.py ESTIMATORS, with @estimator\)$"):
        ESTIMATORS.choose("reinforce")


def test_constant_sum_group_is_dead_for_grpo_and_live_for_gdpo():
    # K=3, rollouts (2,0,0) and (0,1,1): sums 2 and 2 -> GRPO exactly 0, but every channel varies.
    # GDPO (no batch norm, unit weights), G=2 so unbiased std = |gap| / sqrt(2):
    #   ch0 [2, 0]: dev [1, -1],      std sqrt(2)   -> [1, -1] / (sqrt(2) + eps)
    #   ch1 [0, 1]: dev [-0.5, 0.5],  std 1/sqrt(2) -> [-0.5, 0.5] / (1/sqrt(2) + eps); ch2 the same
    #   sum rollout 0: 0.7071 - 2 * 0.7071 = -0.7071; rollout 1: +0.7071
    r = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]], dtype=torch.float64)
    assert dead(r, estimator="gdpo") == [False]
    assert dead(r, estimator="grpo") == [True]
    assert torch.equal(grpo_advantages(r, eps=EPS), torch.zeros(1, 2, dtype=torch.float64))
    v = 1 / (math.sqrt(2) + EPS) - 2 * 0.5 / (1 / math.sqrt(2) + EPS)
    out = gdpo_advantages(r, eps=EPS, batch_norm=False)
    assert_close(out, torch.tensor([[v, -v]], dtype=torch.float64), **TOL)
    assert_close(out, torch.tensor([[-0.7071, 0.7071]], dtype=torch.float64), rtol=0, atol=1e-4)


def test_live_groups_difference_not_in_first_rollout():
    # G=3: rollouts 0 and 1 agree, rollout 2 differs in channel 0 -> alive.
    r = torch.tensor([[[1.0, 3.0], [1.0, 3.0], [2.0, 3.0]], [[7.0, 3.0], [7.0, 3.0], [7.0, 3.0]]])
    assert dead(r) == [False, True]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dead_groups_get_exact_zeros_after_gdpo_batch_normalization(seed):
    # Issue 21: the batch mean's rounding (~7e-9) moved a dead group's zeros off 0; the mean is 0 by construction and
    # is not subtracted.  float32, random live groups beside a constant one and a weight-0-only one.
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(6, 5, 3, generator=gen)
    r[1] = r[1, :1].clone()  # constant
    r[4, :, :2] = r[4, :1, :2].clone()  # only channel 2 varies, at weight 0
    w = [1.0, 0.3, 0.0]
    out = gdpo_advantages(r, w)  # batch_norm=True
    assert live_groups(r, w, gdpo_signal).tolist() == [True, False, True, True, False, True]
    assert torch.equal(out[1], torch.zeros(5)) and torch.equal(out[4], torch.zeros(5))
    # The live groups: (summed - mean) / (std + eps), the textbook batch normalization, to float rounding.
    summed = gdpo_advantages(r, w, batch_norm=False)
    assert_close(out, (summed - summed.mean()) / (summed.std() + EPS), rtol=0, atol=1e-6)
    assert abs(out.std().item() - 1.0) < 1e-4


# ------------------------------------------------------------------------------ GDPO paper, G=2 example


def test_gdpo_paper_two_rollout_example():
    # Two binary channels, G=2 rollouts, summed rewards per group: {0,1}, {0,2}, {1,2}.
    r = torch.tensor(
        [
            [[0.0, 0.0], [1.0, 0.0]],  # sums 0, 1
            [[0.0, 0.0], [1.0, 1.0]],  # sums 0, 2
            [[1.0, 0.0], [1.0, 1.0]],  # sums 1, 2
        ],
        dtype=torch.float64,
    )
    # GRPO: two distinct values x < y in a group of 2: dev -+(y-x)/2, unbiased std = (y-x)/sqrt(2)
    #   -> -+ 1/sqrt(2) = -+0.7071 whatever the gap; with eps: (d/2) / (d/sqrt(2) + eps).
    grpo = grpo_advantages(r, eps=EPS)
    for d, row in zip([1.0, 2.0, 1.0], grpo):
        v = (d / 2) / (d / math.sqrt(2) + EPS)
        assert_close(row, torch.tensor([-v, v], dtype=torch.float64), **TOL)
    assert_close(grpo, torch.tensor([[-0.7071, 0.7071]] * 3, dtype=torch.float64), rtol=0, atol=1e-4)

    # GDPO (no batch norm): each binary channel that varies in a group of 2 gives -+ 0.5/(1/sqrt(2) + eps)
    #   group 0: ch0 varies, ch1 constant -> -+0.7071
    #   group 1: both vary              -> -+1.4142
    #   group 2: ch0 constant, ch1 varies -> -+0.7071
    u = 0.5 / (1 / math.sqrt(2) + EPS)
    gdpo = gdpo_advantages(r, eps=EPS, batch_norm=False)
    expected = torch.tensor([[-u, u], [-2 * u, 2 * u], [-u, u]], dtype=torch.float64)
    assert_close(gdpo, expected, **TOL)
    assert gdpo[1, 1] > gdpo[0, 1] + 0.5  # (0,0) vs (1,1) is separated from (0,0) vs (1,0)

    # With batch norm: flat [-u, u, -2u, 2u, -u, u], mean 0, sum sq 12u^2, var 12u^2/5, std u*sqrt(2.4)
    #   -> [-1, 1, -2, 2, -1, 1] / sqrt(2.4) (up to eps) ~ [-0.6455, 0.6455, -1.2910, 1.2910, ...]
    gdpo_bn = gdpo_advantages(r, eps=EPS, batch_norm=True)
    std = u * math.sqrt(2.4)
    assert_close(gdpo_bn, expected / (std + EPS), **TOL)
    assert_close(gdpo_bn[1], torch.tensor([-1.2910, 1.2910], dtype=torch.float64), rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------- input validation


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
@pytest.mark.parametrize("fn", [grpo_advantages, gdpo_advantages])
def test_infinite_rewards_raise(fn, bad):
    r = _random_rewards(6, k=2)
    r[1, 2, 1] = bad
    with pytest.raises(ValueError, match="inf"):
        fn(r)


def test_check_finite_names_the_channel():
    r = torch.zeros(2, 3, 2)
    r[1, 1, 0] = float("nan")  # an abstention: no error
    check_finite(r, ["accuracy", "efficiency"])
    r[1, 0, 1] = float("inf")
    with pytest.raises(ValueError, match="efficiency"):
        check_finite(r, ["accuracy", "efficiency"])
    with pytest.raises(ValueError, match="#1"):
        check_finite(r)
    r2 = torch.zeros(2, 3, 2)
    r2[0, 2, 0] = float("-inf")
    with pytest.raises(ValueError, match="accuracy") as info:
        check_finite(r2, ["accuracy", "efficiency"])
    assert "efficiency" not in str(info.value)


@pytest.mark.parametrize("batch_norm", [True, False])
def test_weights_none_equals_ones(batch_norm):
    r = _random_rewards(7, k=3)
    ones = torch.ones(3, dtype=torch.float64)
    assert torch.equal(grpo_advantages(r, None), grpo_advantages(r, ones))
    assert torch.equal(grpo_advantages(r), grpo_advantages(r, [1.0, 1.0, 1.0]))
    assert torch.equal(gdpo_advantages(r, None, batch_norm=batch_norm), gdpo_advantages(r, ones, batch_norm=batch_norm))


@pytest.mark.parametrize("weights", [[1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [[1.0, 2.0, 3.0]]])
@pytest.mark.parametrize("fn", [grpo_advantages, gdpo_advantages])
def test_wrong_weights_shape_raises(fn, weights):
    r = _random_rewards(8, k=3)
    with pytest.raises(ValueError):
        fn(r, weights)


# ------------------------------------------------------------------------------------------------ GAE


def test_gae_hand_example():
    # T=3, gamma=1, lam=0.5, reward only on the last token, V = [0.5, 0.2, 0.7]; value after the end is 0.
    #   t=2: delta = 1 + 0 - 0.7 = 0.3;           A2 = 0.3
    #   t=1: delta = 0 + 0.7 - 0.2 = 0.5;         A1 = 0.5 + 0.5 * 0.3 = 0.65
    #   t=0: delta = 0 + 0.2 - 0.5 = -0.3;        A0 = -0.3 + 0.5 * 0.65 = 0.025
    # returns = A + V = [0.525, 0.85, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.7]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    assert_close(adv, torch.tensor([[0.025, 0.65, 0.3]], dtype=torch.float64), **TOL)
    assert_close(ret, torch.tensor([[0.525, 0.85, 1.0]], dtype=torch.float64), **TOL)


def test_gae_hand_example_discounted():
    # Same data, gamma=0.9, lam=0.5 (gamma*lam = 0.45):
    #   t=2: delta = 1 - 0.7 = 0.3;               A2 = 0.3
    #   t=1: delta = 0.9*0.7 - 0.2 = 0.43;        A1 = 0.43 + 0.45*0.3 = 0.565
    #   t=0: delta = 0.9*0.2 - 0.5 = -0.32;       A0 = -0.32 + 0.45*0.565 = -0.06575
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.7]], dtype=torch.float64)
    adv, _ = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.5)
    assert_close(adv, torch.tensor([[-0.06575, 0.565, 0.3]], dtype=torch.float64), **TOL)


def test_gae_skips_masked_observation():
    # mask [1, 0, 1]: position 1 is a tool observation; its value (9.0) must not enter the recursion.
    # Equivalent 2-token sequence (positions 0 and 2): r = [0, 1], V = [0.5, 0.7], gamma=1, lam=0.5
    #   t=2: delta = 1 - 0.7 = 0.3;          A2 = 0.3
    #   t=0: delta = 0 + 0.7 - 0.5 = 0.2;    A0 = 0.2 + 0.5 * 0.3 = 0.35
    # returns: [0.35 + 0.5, 0, 0.3 + 0.7] = [0.85, 0, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.7]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    assert_close(adv, torch.tensor([[0.35, 0.0, 0.3]], dtype=torch.float64), **TOL)
    assert_close(ret, torch.tensor([[0.85, 0.0, 1.0]], dtype=torch.float64), **TOL)
    assert adv[0, 1].item() == 0.0 and ret[0, 1].item() == 0.0

    # Same as the function on the 2-token sequence itself.
    adv2, ret2 = gae_advantages(rewards[:, [0, 2]], values[:, [0, 2]], torch.ones(1, 2), gamma=1.0, lam=0.5)
    assert_close(adv[:, [0, 2]], adv2, **TOL)
    assert_close(ret[:, [0, 2]], ret2, **TOL)


def test_gae_padded_tail_and_batch_rows_independent():
    # Row 0 = the full example above; row 1: mask [1, 1, 0], reward on the last real token, pad value 5.0.
    #   row 1, t=2 padded: skipped, next value stays the terminal 0
    #   t=1: delta = 1 + 0 - 0.2 = 0.8;      A1 = 0.8
    #   t=0: delta = 0 + 0.2 - 0.5 = -0.3;   A0 = -0.3 + 0.5 * 0.8 = 0.1
    #   returns [0.6, 1.0, 0]
    # Row 2 = the masked-observation example.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.7], [0.5, 0.2, 5.0], [0.5, 9.0, 0.7]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    expected_adv = torch.tensor([[0.025, 0.65, 0.3], [0.1, 0.8, 0.0], [0.35, 0.0, 0.3]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.525, 0.85, 1.0], [0.6, 1.0, 0.0], [0.85, 0.0, 1.0]], dtype=torch.float64)
    assert_close(adv, expected_adv, **TOL)
    assert_close(ret, expected_ret, **TOL)
    assert adv[1, 2].item() == 0.0 and ret[1, 2].item() == 0.0


# -------------------------------------------------------------------------------------- masked_whiten


def test_masked_whiten_hand_example():
    # masked-in [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]; the 100 is masked out -> 0.
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = masked_whiten(values, mask)
    assert_close(out, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64), rtol=0, atol=1e-7)


def test_masked_whiten_random():
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 3.0 + 5.0
    mask = torch.rand(4, 6, generator=gen) > 0.35
    mask[0, 0] = True
    mask[0, 1] = False
    values[~mask] = 1e6  # junk in masked-out entries must not leak into the statistics
    out = masked_whiten(values, mask)
    inside = out[mask]
    assert abs(inside.mean().item()) < 1e-10
    assert abs(inside.std().item() - 1.0) < 1e-6  # unbiased, like the function
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))


def trl_normalize_then_sum(rewards: torch.Tensor, weights: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """TRL's documented GRPOConfig(multi_objective_aggregation="normalize_then_sum"), written from its definition:
    per reward function, (r - group mean) / (unbiased group std + eps); weighted sum; then
    (A - batch mean) / (unbiased batch std + eps).  rewards [B, G, K] -> [B, G]."""
    mean_k = rewards.mean(dim=1, keepdim=True)
    std_k = rewards.std(dim=1, keepdim=True)
    summed = ((rewards - mean_k) / (std_k + eps) * weights).sum(-1)
    return (summed - summed.mean()) / (summed.std() + eps)


@pytest.mark.parametrize("seed", range(5))
def test_gdpo_matches_trl_normalize_then_sum(seed):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (6, 4, 3), generator=generator).double()  # ties: constant channels and groups
    rewards[:, :, 2] *= 25.0  # a loud channel
    rewards[0] = 1.0  # a fully constant group
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(gdpo_advantages(rewards, weights, eps=1e-4), trl_normalize_then_sum(rewards, weights))


# ------------------------------------------------------------------------------------------ abstentions


def reference_with_abstentions(rewards, weights, eps, estimator):
    """An independent, loop-by-loop reference written from the definitions (TRL's nan-aware statistics).

    gdpo: per group and channel, mean and unbiased std over the entries that scored; an abstention gets 0 on that
      channel, and so does every entry of a group whose scored entries are all equal (or fewer than two); weighted
      sum; then (A - batch mean) / (unbiased batch std + eps), or 0 if the batch is constant.
    grpo: weighted sum with an abstention counting 0 (nansum); then the same normalization within each group.
    """
    num_groups, group_size, num_channels = rewards.shape
    values = rewards.tolist()

    def normalize(xs):
        scored = [x for x in xs if not math.isnan(x)]
        if len(scored) < 2 or len(set(scored)) == 1:
            return [0.0] * len(xs)
        mean = sum(scored) / len(scored)
        std = math.sqrt(sum((x - mean) ** 2 for x in scored) / (len(scored) - 1))
        return [0.0 if math.isnan(x) else (x - mean) / (std + eps) for x in xs]

    if estimator == "grpo":
        sums = [[sum(0.0 if math.isnan(v) else v * w for v, w in zip(values[b][g], weights))
                 for g in range(group_size)] for b in range(num_groups)]
        return torch.tensor([normalize(row) for row in sums], dtype=torch.float64)
    summed = [[0.0] * group_size for _ in range(num_groups)]
    for b in range(num_groups):
        for k in range(num_channels):
            for g, z in enumerate(normalize([values[b][g][k] for g in range(group_size)])):
                summed[b][g] += weights[k] * z
    flat = normalize([x for row in summed for x in row])
    return torch.tensor(flat, dtype=torch.float64).reshape(num_groups, group_size)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("estimator", ["grpo", "gdpo"])
def test_abstentions_match_an_independent_reference(seed, estimator):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (5, 4, 3), generator=gen).double()  # ties: constant channels
    rewards[..., 1] *= 10.0
    rewards[torch.rand(rewards.shape, generator=gen) < 0.3] = float("nan")  # ~30% abstentions
    rewards[0, :, 2] = float("nan")  # a whole group abstains on a channel
    rewards[1, 1:, 0] = float("nan")  # a single scored entry: does not vary
    weights = [1.0, 0.5, 2.0]
    expected = reference_with_abstentions(rewards, weights, EPS, estimator)
    got = grpo_advantages(rewards, weights, EPS) if estimator == "grpo" else gdpo_advantages(rewards, weights, EPS)
    assert not torch.isnan(got).any()
    assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_an_abstention_does_not_inflate_the_others():
    # GDPO, one channel: [1, 0, 1] and [1, 0, 1, abstained] have the same mean (2/3) and unbiased std (0.5774), so
    # the scored rollouts' normalized values are equal: +0.5774, -1.1547, +0.5774.  Imputing the group mean for the
    # abstention (the old behaviour) shrank the std to 0.4714 and inflated them to +0.7071, -1.4142.
    nan = float("nan")
    three = gdpo_advantages(torch.tensor([[[1.0], [0.0], [1.0]]]), batch_norm=False)
    four = gdpo_advantages(torch.tensor([[[1.0], [0.0], [1.0], [nan]]]), batch_norm=False)
    assert_close(four[0, :3], three[0], rtol=0, atol=1e-6)
    assert_close(three[0], torch.tensor([0.5774, -1.1547, 0.5774]), rtol=0, atol=1e-4)
    assert four[0, 3] == 0.0


def test_live_groups_ignore_abstentions():
    nan = float("nan")
    r = torch.tensor([[[1.0], [nan], [1.0]],  # scored entries equal: dead
                      [[1.0], [nan], [0.0]],  # they differ: live
                      [[nan], [nan], [2.0]]])  # one scored entry: dead
    assert dead(r) == [True, False, True]
    # GRPO counts an abstention 0 in the sum (TRL's nansum): [1, 0, 1], [1, 0, 0], [0, 0, 2] all vary.
    assert dead(r, estimator="grpo") == [False, False, False]


# ------------------------------------------------------------------------------------ exact dead groups


@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7])
@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 2, 3), (4, 8, 2), (3, 5, 4)])
def test_a_constant_group_gets_exactly_zero_in_float32(value, shape):
    # float32 gives a constant group of 0.1 a std of ~1e-8, not 0: a `std > 0` test then produced ~0.03 of the
    # same sign for the whole group.  Deadness is decided by exact equality.
    rewards = torch.full(shape, value, dtype=torch.float32)
    zeros = torch.zeros(shape[:2])
    assert torch.equal(grpo_advantages(rewards), zeros)
    assert torch.equal(gdpo_advantages(rewards, batch_norm=False), zeros)
    assert torch.equal(gdpo_advantages(rewards), zeros)
    assert not live_groups(rewards, None, gdpo_signal).any()
    assert not live_groups(rewards, None, grpo_signal).any()
    # Next to a live group, the constant one still gets exactly 0 and the live one does not.
    mixed = torch.cat([rewards, torch.rand(shape, generator=torch.Generator().manual_seed(0))])
    assert torch.equal(grpo_advantages(mixed)[: shape[0]], zeros)
    assert torch.equal(gdpo_advantages(mixed, batch_norm=False)[: shape[0]], zeros)
    assert grpo_advantages(mixed)[shape[0]:].abs().sum() > 0


# ------------------------------------------------------------------------------ PPO's per-token reward


def test_gae_token_rewards_put_the_sum_last_and_kl_on_every_generated_token():
    # 2 rollouts (B=1, G=2), K=2 with weights [1, 2]; rollout 0's channel 1 abstains (counts 0).
    # mask row 0: [1, 0, 1, 0] (observation at t=1, padding at t=3) -> last generated token t=2
    # mask row 1: [1, 1, 0, 0] -> last generated token t=1
    rewards = torch.tensor([[[1.0, float("nan")], [0.5, 1.0]]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.9, 0.2, 0.9], [0.3, 0.4, 0.9, 0.9]])  # masked entries must not count
    got = gae_token_rewards(rewards, torch.tensor([1.0, 2.0]), mask, kl)
    expected = torch.tensor([[-0.1, 0.0, 1.0 - 0.2, 0.0], [-0.3, 0.5 + 2.0 - 0.4, 0.0, 0.0]])
    assert_close(got, expected)
