"""GDPO's 2026 successors (mrl/algo/advantages.py: gd2po, gd2po_snr, corrgrpo) and the diagnostics that tell which
one a run needs.  Every expected value is worked out by hand in the comments (float64 inputs, eps in the formulas)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from mrl.algo.advantages import (
    ESTIMATORS,
    channel_correlations,
    conflict_frac,
    corrgrpo_advantages,
    dead_sum_live_channel,
    gd2po_advantages,
    gdpo_advantages,
    grpo_advantages,
    live_groups,
)

EPS = 1e-6
TOL = dict(rtol=1e-9, atol=1e-9)
F64 = torch.float64

# ------------------------------------------------------------------------------------------------------ CorrGRPO

# CorrGRPO's own example (their README's Figure 2 and the demo in their app.js): 4 rollouts x 3 channels; r1 and r2
# correlate 40/41 = 0.9756, r3 correlates 9/82 = 0.1098 with each, its std ~9x theirs.
FIG2 = torch.tensor([[[0.10, 0.18, 0.80], [0.18, 0.10, 7.28], [0.82, 0.90, 8.00], [0.90, 0.82, 1.52]]], dtype=F64)


def test_corrgrpo_figure2_multipliers():
    # Sums [1.08, 7.56, 9.72, 3.24], mean 5.4, centered c = [-4.32, 2.16, 4.32, -2.16].
    # GRPO: unbiased var of the sum (2 * 4.32^2 + 2 * 2.16^2) / 3 = 15.552, A = c / (3.9436 + eps): multiplier 0.2536.
    # CorrGRPO: sum rho = 3 + 2 * 40/41 + 4 * 9/82 = 442/82, A = c / sqrt(442/82 + eps): multiplier 0.4307.
    centered = torch.tensor([[-4.32, 2.16, 4.32, -2.16]], dtype=F64)
    assert_close(corrgrpo_advantages(FIG2), centered / math.sqrt(442 / 82 + EPS), **TOL)
    assert_close(grpo_advantages(FIG2), centered / (math.sqrt(15.552) + EPS), **TOL)
    assert round(1 / math.sqrt(442 / 82), 4) == 0.4307 and round(1 / math.sqrt(15.552), 4) == 0.2536  # their numbers
    corr = channel_correlations(FIG2)
    assert corr[(0, 1)] == pytest.approx(40 / 41, abs=1e-12)
    assert corr[(0, 2)] == pytest.approx(9 / 82, abs=1e-12) and corr[(1, 2)] == pytest.approx(9 / 82, abs=1e-12)


def test_corrgrpo_counts_redundant_channels_once_and_ignores_scale():
    # Group of 4, channel 0 = [0, 1, 2, 3], channel 1 = 10 x channel 0 (redundant, 10x louder), channel 2 = [1, 0, 0, 1]
    # (independent: its correlation with [0, 1, 2, 3] is 0: dev [-1.5, -.5, .5, 1.5] . [.5, -.5, -.5, .5] = 0).
    # sum rho = 1 + 1 + 1 + 2 * 1 (0~1) + 0 + 0 = 5.  Sums [1, 11, 22, 34], mean 17, centered [-16, -6, 5, 17].
    rewards = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 10.0, 0.0], [2.0, 20.0, 0.0], [3.0, 30.0, 1.0]]], dtype=F64)
    centered = torch.tensor([[-16.0, -6.0, 5.0, 17.0]], dtype=F64)
    assert_close(corrgrpo_advantages(rewards), centered / math.sqrt(5 + EPS), **TOL)
    # Rescaling any channel moves the numerator, never the denominator: channel 1 at weight 0.1 (= channel 0), so the
    # sums are [1, 2, 4, 7], centered [-2.5, -1.5, 0.5, 3.5], still over sqrt(5).
    assert_close(corrgrpo_advantages(rewards, [1.0, 0.1, 1.0]),
                 torch.tensor([[-2.5, -1.5, 0.5, 3.5]], dtype=F64) / math.sqrt(5 + EPS), **TOL)


def test_corrgrpo_a_constant_channel_has_a_zero_row_and_column():
    # Group [[0, 5], [1, 5]]: channel 1 does not vary, so its diagonal is 0 too: sum rho = 1, A = +-0.5 / sqrt(1 + eps)
    # (GRPO: sums [5, 6], +-0.5 / (0.7071 + eps) = +-0.7071).  A group where nothing varies: exactly 0.
    rewards = torch.tensor([[[0.0, 5.0], [1.0, 5.0]], [[2.0, 3.0], [2.0, 3.0]]], dtype=F64)
    out = corrgrpo_advantages(rewards)
    assert_close(out[0], torch.tensor([-0.5, 0.5], dtype=F64) / math.sqrt(1 + EPS), **TOL)
    assert torch.equal(out[1], torch.zeros(2, dtype=F64))
    # Decided by exact equality, not var > 0: in float32 a group of eight 0.1s centers to ~7e-9, not 0, which would
    # give the still channel a row and column of correlations (its diagonal 1).  Channel 0 = 0..7:
    # A = dev / sqrt(1 + eps).
    still = torch.cat([torch.arange(8.0).view(1, 8, 1), torch.full((1, 8, 1), 0.1)], -1)  # float32
    assert_close(corrgrpo_advantages(still), (torch.arange(8.0) - 3.5).view(1, 8) / math.sqrt(1 + EPS))


def test_corrgrpo_at_g2_two_opposed_channels_blow_up_as_published():
    # G = 2: any two varying channels correlate +-1.  [[0, 0], [1, -0.5]]: rho_01 = -1, sum rho = 1 + 1 - 2 = 0, so the
    # denominator is sqrt(0 + eps) = 1e-3, and the centered sums +-0.25 become +-250: the published formula, kept
    # (docs/design.md says so); a channel pair that cancels exactly ([[1, 0], [0, 1]]) gives exactly 0.
    out = corrgrpo_advantages(torch.tensor([[[0.0, 0.0], [1.0, -0.5]], [[1.0, 0.0], [0.0, 1.0]]], dtype=F64))
    assert_close(out[0], torch.tensor([-0.25, 0.25], dtype=F64) / math.sqrt(EPS), **TOL)
    assert torch.equal(out[1], torch.zeros(2, dtype=F64))


# --------------------------------------------------------------------------------- NVlabs/GDPO issue #3: G = 2

def test_gdpo_figure2_values_are_before_batch_normalization():
    # Two binary channels, G = 2.  Group A: (0, 0) vs (1, 1), totals [0, 2]; group B: (0, 0) vs (1, 0), totals [0, 1].
    # Per channel in a group of two, z = +-(1/sqrt(2)) / (1/sqrt(2) ... ): dev +-0.5, unbiased std 0.7071, z = +-0.5 /
    # (0.7071 + eps).  Before batch norm: A sums two z's (+-1.4142), B one (+-0.7071): the paper's Figure 2.  Each group
    # as its own batch, batch-normalized: summed / (std over the 2 entries + eps) = +-0.7071 for both (issue #3).
    a = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]], dtype=F64)
    b = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]], dtype=F64)
    z = 0.5 / (math.sqrt(0.5) + EPS)
    assert_close(gdpo_advantages(a, batch_norm=False), torch.tensor([[-2 * z, 2 * z]], dtype=F64), **TOL)
    assert_close(gdpo_advantages(b, batch_norm=False), torch.tensor([[-z, z]], dtype=F64), **TOL)
    for group in (a, b):  # std of [-s, s] is s * sqrt(2): s / (s sqrt(2) + eps)
        s = gdpo_advantages(group, batch_norm=False)[0, 1].item()
        assert_close(gdpo_advantages(group), torch.tensor([[-s, s]], dtype=F64) / (s * math.sqrt(2) + EPS), **TOL)
        assert gdpo_advantages(group)[0, 1].item() == pytest.approx(0.70711, abs=1e-5)
    # In one batch they stay apart: summed [-2z, 2z, -z, z], unbiased std z * sqrt(10/3).
    both = gdpo_advantages(torch.cat([a, b]))
    assert_close(both, torch.tensor([[-2 * z, 2 * z], [-z, z]], dtype=F64) / (z * math.sqrt(10 / 3) + EPS), **TOL)
    # GD²PO whitens the same way (no conflict here: both channels move together or one is still): +-0.7071 alone.
    for group in (a, b):
        advantages, keep = gd2po_advantages(group)
        assert keep.all()
        assert advantages[0, 1].item() == pytest.approx(0.70711, abs=1e-5)


# -------------------------------------------------------------------------------------------------------- GD²PO

# G = 4, K = 2.  channel 0 = [3, 1, 0, 0]: mean 1, dev [2, 0, -1, -1], unbiased var 6/3 = 2, s = sqrt(2) + eps
#                channel 1 = [0, 1, 0, 3]: mean 1, dev [-1, 0, -1, 2], the same s.
# z0 = [2, 0, -1, -1] / s, z1 = [-1, 0, -1, 2] / s.
# rollout 0: (+2, -1)/s in conflict, rho = 1/3;  rollout 1: (0, 0) no sign;  rollout 2: (-1, -1)/s agree;
# rollout 3: (-1, +2)/s in conflict, rho = 1/3.
CONFLICT = torch.tensor([[[3.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 3.0]]], dtype=F64)
S = math.sqrt(2) + EPS


def test_gd2po_hard_drops_the_conflicts_scales_by_the_kept_share_and_whitens_the_kept():
    # Hard: keep [F, T, T, F], q = 1/2.  S' on the kept: rollout 1: 0, rollout 2: -2/s * 1/2 = -1/s.
    # Whitened over the two: mean -1/(2s), unbiased var 2 (1/(2s))^2 / 1 = 1/(2 s^2): A = +-(1/(2s)) / sqrt(1/(2s^2) +
    # 1e-8) = +-0.7071 on rollouts 1 and 2, 0 on the dropped.
    advantages, keep = gd2po_advantages(CONFLICT)
    assert keep.tolist() == [[False, True, True, False]]
    half = 1 / (2 * S) / math.sqrt(1 / (2 * S**2) + 1e-8)
    assert_close(advantages, torch.tensor([[0.0, half, -half, 0.0]], dtype=F64), **TOL)
    assert conflict_frac(CONFLICT) == 0.5


def test_gd2po_kept_share_weighs_groups_against_each_other():
    # Whitening is blind to one group's scale, not to the groups' relative scales: CONFLICT (q = 1/2, kept S' = 0 and
    # -2/s * 1/2 = -1/s) beside a group without conflict, both channels [1, 0, 1, 0]: dev +-1/2, unbiased std
    # sqrt(1/3), z = +-1/2 / (sqrt(1/3) + eps) per channel, S = +-a with a = 1 / (sqrt(1/3) + eps), q = 1.
    # Kept: [0, -1/s, a, -a, a, -a]; mean m = -1/(6s); unbiased var v = sum (x - m)^2 / 5; A = (x - m) / sqrt(v + 1e-8).
    # Without q rollout 2 would enter at -2/s and end at -0.71 instead of -0.37.
    both = torch.cat([CONFLICT, torch.tensor([[[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]], dtype=F64)])
    a = 1 / (math.sqrt(1 / 3) + EPS)
    kept = torch.tensor([0.0, -1 / S, a, -a, a, -a], dtype=F64)
    m = kept.mean()
    v = ((kept - m) ** 2).sum() / 5
    whitened = (kept - m) / torch.sqrt(v + 1e-8)
    expected = torch.tensor([[0.0, whitened[0], whitened[1], 0.0], whitened[2:].tolist()], dtype=F64)
    advantages, keep = gd2po_advantages(both)
    assert keep.tolist() == [[False, True, True, False], [True] * 4]
    assert_close(advantages, expected, **TOL)
    assert advantages[0, 2].item() == pytest.approx(-0.3739, abs=1e-4)


def test_gd2po_whitens_over_tokens():
    # The same kept pair with 3 and 1 tokens: mean (3 * 0 + 1 * (-1/s)) / 4 = -1/(4s), unbiased var over the 4 tokens
    # (3 (1/(4s))^2 + (3/(4s))^2) / 3 = 1/(4 s^2): A = [1/(4s), -3/(4s)] / sqrt(1/(4s^2) + 1e-8) = [0.5, -1.5].
    lengths = torch.tensor([[5.0, 3.0, 1.0, 7.0]], dtype=F64)
    advantages, _ = gd2po_advantages(CONFLICT, lengths=lengths)
    scale = 1 / math.sqrt(1 / (4 * S**2) + 1e-8)
    assert_close(advantages, torch.tensor([[0.0, scale / (4 * S), -3 * scale / (4 * S), 0.0]], dtype=F64), **TOL)
    assert advantages[0, 1].item() == pytest.approx(0.5, abs=1e-6)


def test_gd2po_snr_keeps_a_conflict_whose_channels_mostly_agree():
    # |rho| = 1/3.  tau 0.8 (their scripts): 1/3 < 0.8, dropped as in hard.  tau 0.2 (their code's default): kept, so
    # nothing is dropped: q = 1, S = [1, 0, -2, 1]/s, mean 0, unbiased var (1 + 0 + 4 + 1) / 3 / s^2 = 2/s^2:
    # A = S / sqrt(2/s^2 + 1e-8) ~ [0.7071, 0, -1.4142, 0.7071], which is GDPO's here.
    hard, _ = gd2po_advantages(CONFLICT)
    strict, keep = gd2po_advantages(CONFLICT, tau=0.8)
    assert torch.equal(strict, hard) and keep.tolist() == [[False, True, True, False]]
    loose, keep = gd2po_advantages(CONFLICT, tau=0.2)
    assert keep.all()
    expected = torch.tensor([[1.0, 0.0, -2.0, 1.0]], dtype=F64) / S / math.sqrt(2 / S**2 + 1e-8)
    assert_close(loose, expected, **TOL)
    assert_close(loose, gdpo_advantages(CONFLICT), rtol=0, atol=1e-5)  # GDPO: std + 1e-6; here: rsqrt(var + 1e-8)
    for tau, kept in ((1.5, 2), (-1.0, 4)):  # clamped to [0, 1]: 1 drops every conflict, 0 none
        assert int(gd2po_advantages(CONFLICT, tau=tau)[1].sum()) == kept


def test_gd2po_nothing_kept_gives_zeros_and_a_group_of_one_uses_mean_0_std_1():
    every = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=F64)  # both rollouts in conflict
    advantages, keep = gd2po_advantages(every)
    assert not keep.any() and torch.equal(advantages, torch.zeros(1, 2, dtype=F64))
    # G = 1 (their convention): z = r / (1 + eps).  Rollouts (2, 3) and (1, -1): the second in conflict.  Kept: the
    # first alone, q = 1, S = 5/(1 + eps); one entry: its mean is itself, so A = 0.
    single = torch.tensor([[[2.0, 3.0]], [[1.0, -1.0]]], dtype=F64)
    advantages, keep = gd2po_advantages(single)
    assert keep.tolist() == [[True], [False]] and torch.equal(advantages, torch.zeros(2, 1, dtype=F64))


def test_the_weights_enter_the_conflict_test_and_a_weight_0_channel_never_conflicts():
    # CONFLICT with channel 1 at weight 0 (an enforced constraint): no rollout has two signs.
    _, keep = gd2po_advantages(CONFLICT, [1.0, 0.0])
    assert keep.all() and conflict_frac(CONFLICT, [1.0, 0.0]) == 0.0
    # A negative weight flips a channel's direction: channel 1 at -1 makes rollouts 0 and 3 agree, 2 conflict.
    _, keep = gd2po_advantages(CONFLICT, [1.0, -1.0])
    assert keep.tolist() == [[True, True, False, True]]


def test_live_groups_follow_each_successor():
    # G = 2, weights [1, 0.5]: [[1, 0], [0, 1]] -- GDPO: parts (+0.707, -0.354) and (-0.707, +0.354), sums +-0.354:
    # live.  GD²PO: both rollouts in conflict, nothing kept: dead.  GRPO: sums [1, 0.5]: live.  CorrGRPO: live.
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=F64)
    live = {name: live_groups(rewards, [1.0, 0.5], ESTIMATORS[name].group_signal).item()
            for name in ("grpo", "gdpo", "gd2po", "gd2po_snr", "corrgrpo")}
    assert live == {"grpo": True, "gdpo": True, "gd2po": False, "gd2po_snr": False, "corrgrpo": True}
    # SNR's tau is the run's (Estimator.bound): rho = 0.354 / 1.061 = 1/3 >= 0.2 keeps both.
    snr = ESTIMATORS["gd2po_snr"].bound(SimpleNamespace(gd2po_tau=0.2))
    assert live_groups(rewards, [1.0, 0.5], snr.group_signal).item()


def test_the_estimators_token_advantages_and_kept_rows():
    settings = SimpleNamespace(adv_eps=EPS, gd2po_tau=0.8)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=F64)  # lengths 2, 3, 1, 3
    weights = torch.ones(2, dtype=F64)
    advantages, returns = ESTIMATORS["gd2po"].token_advantages(CONFLICT, weights, mask, None, None, settings)
    sequence, _ = gd2po_advantages(CONFLICT, lengths=mask.sum(-1).reshape(1, 4))
    assert returns is None and torch.equal(advantages, sequence.reshape(-1, 1) * mask)
    assert ESTIMATORS["gd2po"].kept(CONFLICT, weights, settings).tolist() == [[False, True, True, False]]
    assert ESTIMATORS["gd2po_snr"].kept(CONFLICT, weights, SimpleNamespace(adv_eps=EPS, gd2po_tau=0.2)).all()
    assert ESTIMATORS["corrgrpo"].kept is None and ESTIMATORS["gdpo"].kept is None
    advantages, _ = ESTIMATORS["corrgrpo"].token_advantages(FIG2, torch.ones(3, dtype=F64), mask, None, None,
                                                            settings)
    assert torch.equal(advantages, corrgrpo_advantages(FIG2).reshape(-1, 1) * mask)


def test_contributions_sum_to_each_advantage():
    rewards = torch.cat([CONFLICT, torch.tensor([[[0.0, 2.0], [1.0, 1.0], [4.0, 1.0], [2.0, 0.0]]], dtype=F64)])
    w = torch.tensor([1.0, 0.5], dtype=F64)
    corr = ESTIMATORS["corrgrpo"].contributions(rewards, w, EPS).sum(-1)
    assert_close(corr, corrgrpo_advantages(rewards, w), **TOL)
    # GD²PO: S' before whitening.  CONFLICT at weights [1, 0.5]: rollouts 0 and 3 still conflict; rollout 2's parts
    # (-1, -0.5)/s sum to -1.5/s, times the kept share 1/2.
    parts = ESTIMATORS["gd2po"].contributions(rewards, w, EPS).sum(-1)
    assert_close(parts[0], torch.tensor([0.0, 0.0, -0.75 / S, 0.0], dtype=F64), **TOL)


# ----------------------------------------------------------------------------------------------------- diagnostics

def test_dead_sum_live_channel_counts_the_groups_a_sum_filter_drops():
    # group 0: (1, 0), (0, 1): sums 1, 1 -- dead on the sum, both channels vary: counted.
    # group 1: (1, 1), (1, 1): nothing varies: dead either way, not counted.
    # group 2: (1, 0), (0, 0): the sum varies: live, not counted.
    # group 3: (2, 0), (1, 2) at weights [1, 0.5]: sums 2, 2 -- counted; at weights [1, 0] channel 1 cannot count and
    #          the sums 2, 1 vary: not counted.
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [0.0, 0.0]],
                            [[2.0, 0.0], [1.0, 2.0]]], dtype=F64)
    assert dead_sum_live_channel(rewards, [1.0, 0.5]) == 0.25  # group 0 only: group 0's sums are 1, 0.5 here
    assert dead_sum_live_channel(rewards, [1.0, 1.0]) == 0.25  # group 0; group 3's sums 2, 3 vary
    assert dead_sum_live_channel(rewards[3:], [1.0, 0.5]) == 1.0
    assert dead_sum_live_channel(rewards[3:], [1.0, 0.0]) == 0.0


def test_channel_correlations_skip_groups_where_a_channel_is_still_and_abstentions():
    # group 0: x = [0, 1, 2], y = [2, 1, 0]: -1.  group 1: y constant: left out.  group 2: x = [0, 1, NaN],
    # y = [0, 3, 5]: the pair scored twice, (0, 0) and (1, 3): +1.  Mean over groups 0 and 2: 0.
    nan = float("nan")
    rewards = torch.tensor([[[0.0, 2.0], [1.0, 1.0], [2.0, 0.0]], [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]],
                            [[0.0, 0.0], [1.0, 3.0], [nan, 5.0]]], dtype=F64)
    assert channel_correlations(rewards)[(0, 1)] == pytest.approx(0.0, abs=1e-12)
    assert channel_correlations(rewards[1:2])[(0, 1)] is None


# ----------------------------------------------------------------------------------------------------- in the loop

def test_a_dropped_rollout_contributes_zero_gradient(make_cfg):
    """GD²PO drops rollouts 0 and 3 of the hand batch of tests/test_algos.py (their channels conflict): with their
    loss mask 0, one update equals the update on rollouts 1 and 2 alone, even with an entropy bonus (which would still
    pull on a zero-advantage row left in the mask)."""
    from conftest import algo_settings
    from test_algos import hand_batch

    from mrl.train.batch import StepBatch
    from mrl.train.loop import build_models
    from mrl.train.update import update

    cfg = make_cfg("algo=gd2po", "algo.entropy_coef=0.05", "trainer.micro_batch_size=8")
    estimator = ESTIMATORS["gd2po"]
    rewards, ones = CONFLICT.float(), torch.ones(2)
    settings = algo_settings(cfg)
    assert estimator.kept(rewards, ones, settings).tolist() == [[False, True, True, False]]

    def one_update(rows: list[int] | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        tokenizer, actor, _, _ = build_models(cfg, estimator, torch.device("cpu"))
        batch = hand_batch(tokenizer)
        mask = batch.completion_mask.float()  # [4, T]
        advantages, _ = estimator.token_advantages(rewards, ones, mask, None, None, settings)
        keep = estimator.kept(rewards, ones, settings).reshape(-1, 1).float()  # [4, 1]
        full = StepBatch(batch, loss_mask=mask * keep, advantages=advantages)
        update(settings, actor, None, full if rows is None else full.take(torch.tensor(rows)))
        return {k: v.detach().clone() for k, v in actor.module.state_dict().items()}

    masked, alone = one_update(None), one_update([1, 2])
    torch.manual_seed(0)
    start = build_models(cfg, estimator, torch.device("cpu"))[1].module.state_dict()
    assert any(not torch.equal(masked[k], start[k]) for k in masked)  # the update moved something
    for key in masked:
        assert_close(masked[key], alone[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["gd2po", pytest.param("gd2po_snr", marks=pytest.mark.slow), "corrgrpo"])
def test_each_successor_trains_with_dynamic_sampling_conditions_and_a_veto_and_logs_its_diagnostics(
        estimator, make_cfg, tmp_path):
    """gdpo_conditioned's shaping (efficiency conditioned on correctness, the shortcut vetoed) with the successor's
    estimator and DAPO's dynamic sampling: finite, and the diagnostics logged."""
    from mrl.runs.tracking import METRICS_FILE, read_metrics
    from mrl.train.loop import train

    cfg = make_cfg("algo=gdpo_conditioned", f"algo.advantage={estimator}", "algo.dynamic_sampling=true",
                   "algo.max_gen_batches=2", "trainer.max_steps=2")
    final = train(cfg, tmp_path)
    for key in ("loss/policy", "adv/std", "adv/conflict_frac", "groups/dead_sum_live_channel"):
        assert final[key] is not None and math.isfinite(final[key]), key
    assert 0.0 <= final["adv/conflict_frac"] <= 1.0
    records = read_metrics(tmp_path / METRICS_FILE)
    assert any("adv/corr/correctness~efficiency" in r for r in records)


@pytest.mark.parametrize("estimator", ["gd2po", pytest.param("gd2po_snr", marks=pytest.mark.slow)])
def test_the_loop_leaves_the_rollouts_gd2po_drops_out_of_the_loss_mask(estimator, make_cfg, tmp_path, monkeypatch):
    """On agent_triple's own channels (correctness and efficiency conflict in most groups: calc is right and long),
    with dynamic sampling and the shortcut vetoed: the update's loss mask is 0 exactly on the rollouts the estimator
    drops (and on none it keeps), recomputed here from the batch it trained on; and some were dropped."""
    import mrl.train.loop as loop

    seen = []
    real = loop.update_policy

    def spy(run, batch):
        seen.append((run, batch))
        return real(run, batch)

    monkeypatch.setattr(loop, "update_policy", spy)
    loop.train(make_cfg(f"algo={estimator}", "algo.dynamic_sampling=true", "algo.max_gen_batches=2",
                        "rewards.channels.safety.enforce=veto", "trainer.max_steps=1", "trainer.prompts_per_step=4",
                        "trainer.group_size=8", "trainer.micro_batch_size=8"), tmp_path)
    run, batch = seen[-1]
    shaped, keep, _ = run.reward_set.shape(batch_rewards(run, batch))
    kept = run.estimator.kept(shaped, run.reward_set.weights, run.algo)  # [B', G]
    assert (~kept).any(), "no rollout was in conflict: the check below would not see a dropped one"
    trained = (batch.loss_mask.sum(-1) > 0).reshape(keep.shape)  # [B', G]
    assert torch.equal(trained, keep & kept)


def batch_rewards(run, batch):
    """The trained batch's rewards as scored, [B', G, K], from its episodes."""
    rewards, _ = run.reward_set.score(batch.rollouts.episodes)
    return rewards.view(-1, batch.rollouts.group_size, len(run.reward_set.names))


# ---------------------------------------------------------------------------------------------- repro-successors

@pytest.mark.parametrize("setting", ["conflict", "correlated", "skewed"])
def test_each_repro_setting_composes_with_every_arm(setting):
    """`make repro-successors`' sweeps: every arm on every setting passes validation, and the settings are what the plan
    says (equal weights in conflict, a judge repeating correctness in correlated, the shortcut vetoed everywhere)."""
    from conftest import compose_config

    from mrl.repro.successors import ARMS, SETTINGS
    from mrl.rewards.channels import build_reward_set
    from mrl.train.validation import validate

    for arm in ARMS:
        cfg = compose_config(f"algo={arm}", *SETTINGS[setting])
        validate(cfg)
        reward_set = build_reward_set(cfg.rewards, cfg.algo)
        weights = dict(zip(reward_set.names, reward_set.weights.tolist()))
        assert weights["safety"] == 0.0 and reward_set.specs[reward_set.names.index("safety")].enforce == "veto"
        assert weights["efficiency"] == {"conflict": 1.0, "correlated": 0.25, "skewed": 0.25}[setting]
        assert ("judge" in weights) == (setting == "correlated")


def test_the_bfcl_setting_is_repro_papers_plan_with_the_successors_arms(monkeypatch):
    """SETTINGS=bfcl (built, not run here): repro-paper's warm start and arm settings, one sweep per successor arm."""
    from mrl.repro import paper_bfcl
    from mrl.repro.successors import BFCL_ARMS, bfcl_plan, settings

    monkeypatch.setenv("SCALE", "cpu")
    plan, paper = bfcl_plan(), paper_bfcl.plan()
    assert plan.sft == paper.sft and plan.train == paper.train
    assert [s.overrides[0] for s in plan.sweeps] == [f"algo={arm}" for arm in BFCL_ARMS]
    assert str(plan.root).endswith("reports/successors/bfcl/runs")
    monkeypatch.setenv("SETTINGS", "bfcl,skewed")
    with pytest.raises(SystemExit, match="bfcl alone"):
        settings()
