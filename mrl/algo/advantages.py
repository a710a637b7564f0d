"""Advantage estimators: pure tensor functions, no config, no device moves.

Shapes: B prompts, G rollouts per prompt, K reward channels, N = B*G sequences, T completion tokens.

How each departs from PPO (Schulman et al., 2017, GAE: Schulman et al., 2016):
- GRPO (Shao et al., 2024, DeepSeekMath): no critic; the baseline is the group of G rollouts of the same prompt.
  Multi-reward GRPO sums the weighted channels first, then normalizes the sum within the group.
- GDPO (Liu et al., 2026, arXiv 2601.05242): normalizes every channel within its group *before* the weighted sum,
  then normalizes the sum over the whole batch, so a loud channel cannot swallow a quiet one and distinct reward
  combinations keep distinct advantages.
  Eq. 8 conditioned rewards are applied before (mrl/algo/shaping.py: `condition`).
- DAPO (Yu et al., 2025) keeps GRPO's estimator; its changes (dynamic sampling of live groups, clip-higher,
  token-mean loss, overlong shaping) live in the rollout stage and the loss, not here.
- GD²PO (arXiv 2606.16771; Qwen-Applications/GD2PO): GDPO's per-channel z, but a rollout whose weighted z's
  disagree in sign (*in conflict*) is dropped from the loss (`gd2po`), or only where they also nearly cancel,
  |sum z| / sum |z| < tau (`gd2po_snr`); each group's sum is scaled by its kept share, then whitened over the kept
  tokens.  Their claim: a rollout good on one channel and bad on another cancels in GDPO's sum.
- CorrGRPO (arXiv 2609.36820, Eq. 2, Listing 1): GRPO's centered weighted sum, divided per group by
  sqrt(sum of the channels' Pearson correlation matrix) instead of the sum's std, so a loud channel cannot set the
  scale and two redundant channels count as less than two.  No batch normalization.
- RDPO (arXiv 2605.13641) is left out: its quantile normalization and Mahalanobis whitening per active reward subspace
  are not published in a form that could be checked against the paper.

Constraints with a budget (Constrained GRPO: Girgis et al., 2026, arXiv 2602.05863): a channel enforced by a budget
enters the weighted sum with its price, a Lagrange multiplier lambda >= 0 learned online (`dual_step`), as its weight.
Its value is minus its cost, so under GDPO the advantage is A = sum_j w_j Z_j - lambda Z_cost with every Z standardized
in its group (the paper's scalarized advantages: lambda stays the price of a violation whatever the channels' scales);
under GRPO and PPO the rewards are summed first, r = sum_j w_j r_j - lambda cost (the paper's scalarized rewards,
whose group normalization reweights the terms by their within-group std).

The estimators a run can choose (`algo.advantage`) are registered at the end, each where it is defined: one function
decorated with `@estimator(name, ...)`, the one place where the trainers differ.

Abstentions: a channel may return None for a rollout (NaN here).  GDPO leaves it out of that channel's group mean
and std and gives it 0 on that channel; GRPO and PPO count it 0 in the weighted sum (TRL's nansum).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Protocol

import torch
from torch import Tensor

from mrl.core.config import Registry


def check_finite(rewards: Tensor, channel_names: list[str] | None = None) -> None:
    """Raise ValueError naming the first channel that holds inf.  rewards: [B, G, K]; NaN means abstained."""
    bad = torch.isinf(rewards)
    if bad.any():
        k = int(bad.reshape(-1, rewards.shape[-1]).any(0).nonzero()[0])
        name = channel_names[k] if channel_names else f"#{k}"
        raise ValueError(f"reward channel {name!r} holds inf: advantages need finite rewards (NaN abstains)")


def _weights(rewards: Tensor, weights: Tensor | list[float] | None) -> Tensor:
    """Weights as a [K] tensor on rewards' device; None means all ones."""
    num_channels = rewards.shape[-1]
    if weights is None:
        return torch.ones(num_channels, dtype=rewards.dtype, device=rewards.device)
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (num_channels,):
        raise ValueError(f"expected {num_channels} channel weights, got shape {tuple(weights.shape)}")
    return weights


def mean_cost(rewards: Tensor) -> Tensor:
    """J-hat, the mean cost per channel: minus the mean value over the rollouts that scored it.  rewards: [M, K], NaN =
    abstained -> [K], NaN where no rollout scored the channel.

    >>> mean_cost(torch.tensor([[-1.0], [0.0], [float("nan")], [0.0]]))  # one violation in 3 scored rollouts
    tensor([0.3333])
    """
    present = ~torch.isnan(rewards)
    scored = present.sum(0)  # [K]
    total = torch.where(present, rewards, torch.zeros_like(rewards)).sum(0)  # [K]
    cost = 0.0 - total / scored.clamp(min=1)  # 0.0 - : a cost of +0.0, not -0.0, where nothing was violated
    return torch.where(scored > 0, cost, torch.full_like(total, float("nan")))


def dual_step(lambdas: Tensor, cost: Tensor, budget: Tensor, lr: Tensor, lambda_max: Tensor) -> Tensor:
    """One step of projected dual ascent on the constraints' prices (Safe RLHF, Dai et al., 2024; Girgis et al., 2026):
    lambda <- min(lambda_max, max(0, lambda + lr * (cost - budget))).  All [C] -> [C].  A NaN cost (no rollout scored
    the channel) leaves its lambda where it was.

    >>> dual_step(torch.tensor([0.5, 0.5, 0.002]), torch.tensor([0.3, 0.05, 0.0]), torch.tensor([0.05] * 3),
    ...           torch.tensor([0.1] * 3), torch.tensor([10.0] * 3))  # above, at, below the budget (clamped at 0)
    tensor([0.5250, 0.5000, 0.0000])
    """
    moved = (lambdas + lr * (cost - budget)).clamp(min=0.0)
    moved = torch.minimum(moved, lambda_max)
    return torch.where(torch.isnan(cost), lambdas, moved)


def varies(scores: Tensor) -> Tensor:
    """scores: [B, G, ...] -> BoolTensor [B, 1, ...]: True where at least two scored entries of the group differ.

    Decided by exact equality, never by a std threshold: float32 gives a constant group of 0.1 a std of ~1e-8.
    Abstentions (NaN) are left out; a group with fewer than two scored entries does not vary.
    """
    present = ~torch.isnan(scores)
    high = torch.where(present, scores, -torch.inf).amax(dim=1, keepdim=True)
    low = torch.where(present, scores, torch.inf).amin(dim=1, keepdim=True)
    return present.any(dim=1, keepdim=True) & (high > low)


def group_normalize(scores: Tensor, eps: float = 1e-6) -> Tensor:
    """(s - group mean) / (group std + eps) along dim 1, std unbiased (as torch.std and TRL), NaN-aware.

    scores: [B, G, ...] -> same shape, never NaN.  Abstentions (NaN) are left out of the group's mean and std and get
    0.  A group that does not vary (exact equality over its scored entries, see `varies`) gets exactly 0.
    """
    present = ~torch.isnan(scores)
    count = present.sum(dim=1, keepdim=True)  # [B, 1, ...]
    values = torch.where(present, scores, torch.zeros_like(scores))
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(present, scores - mean, torch.zeros_like(scores))
    std = ((centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return torch.where(varies(scores), centered / (std + eps), torch.zeros_like(centered))


def weighted_sum(rewards: Tensor, weights: Tensor | list[float] | None = None) -> Tensor:
    """sum_k w_k r_k with an abstention (NaN) counting 0, as TRL's nansum.  rewards: [B, G, K] -> [B, G]."""
    return torch.nan_to_num(rewards * _weights(rewards, weights), nan=0.0).sum(-1)


def grpo_advantages(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """Sum-then-normalize.  rewards: [B, G, K], NaN = abstained (counts 0 in the sum) -> advantages [B, G].

    >>> grpo_advantages(torch.tensor([[[0.], [1.]]]))  # doctest: +ELLIPSIS
    tensor([[-0.7071,  0.7071]])
    """
    check_finite(rewards)
    return group_normalize(weighted_sum(rewards, weights), eps)  # [B, G]


def gdpo_advantages(
    rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6, batch_norm: bool = True
) -> Tensor:
    """Normalize-then-sum (GDPO).  rewards: [B, G, K], NaN = abstained -> advantages [B, G].

    Each channel is normalized within its group over the rollouts that scored it (an abstention contributes 0 on
    that channel; a channel that does not vary there contributes 0), the normalized channels are summed with their
    weights, and, if batch_norm, the sum is normalized over all B*G entries.
    """
    check_finite(rewards)
    summed = (group_normalize(rewards, eps) * _weights(rewards, weights)).sum(-1)  # [B, G]
    if not batch_norm:
        return summed
    return batch_normalize(summed, eps)


def batch_normalize(summed: Tensor, eps: float = 1e-6) -> Tensor:
    """GDPO's batch normalization of the summed group-normalized channels: summed / (batch std + eps), std unbiased
    over all B*G entries.  summed: [B, G] -> [B, G].

    The batch mean is not subtracted: it is 0 by construction (each channel's normalized values sum to 0 within
    their group, abstentions counting 0), so subtracting its float rounding (~1e-9) would only move a dead group's
    exact zeros off 0.  Equal to (summed - mean) / (std + eps) up to that rounding; a batch that does not vary -> 0.
    """
    flat = summed.reshape(-1)  # [B*G] the whole batch as one group
    if flat.numel() < 2 or not bool(varies(flat.reshape(1, -1)).all()):
        return torch.zeros_like(summed)
    return summed / (flat.std() + eps)


# GD²PO (arXiv 2606.16771; Qwen-Applications/GD2PO tool-calling/verl/trainer/ppo/ray_trainer.py): GDPO's z per channel,
# the rollouts whose channels pull in opposite directions dropped, each group's sum scaled by its kept share, then
# whitened over the kept tokens.  Their sum has no weights (all 1); here each z is weighted, as GDPO's.
CONFLICT_EPS = 1e-8  # theirs: a part within 1e-8 of 0 has no sign; also the ratio's denominator guard


def gd2po_parts(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """w_k z_k, z_k = (r_k - group mean_k) / (group std_k + eps), std unbiased.  rewards: [B, G, K], NaN = abstained
    -> [B, G, K].  As `group_normalize` (an abstention, or a channel that does not vary in the group, gets 0); a
    group of one (G = 1) takes mean 0 and std 1, as their code does: z = r / (1 + eps)."""
    check_finite(rewards)
    if rewards.shape[1] == 1:
        z = torch.nan_to_num(rewards, nan=0.0) / (1.0 + eps)
    else:
        z = group_normalize(rewards, eps)
    return z * _weights(rewards, weights)


def in_conflict(parts: Tensor, eps: float = CONFLICT_EPS) -> Tensor:
    """parts: [B, G, K] (`gd2po_parts`) -> BoolTensor [B, G]: one channel's part above eps and another's below -eps.

    >>> in_conflict(torch.tensor([[[1.0, -0.5], [1.0, 0.0]]])).tolist()
    [[True, False]]
    """
    return (parts > eps).any(-1) & (parts < -eps).any(-1)


def conflict_ratio(parts: Tensor, eps: float = CONFLICT_EPS) -> Tensor:
    """GD²PO's rho = sum_k part_k / (sum_k |part_k| + eps): [B, G, K] -> [B, G], in [-1, 1]; near 0 where the channels
    cancel, +-1 where they agree."""
    return parts.sum(-1) / (parts.abs().sum(-1) + eps)


def gd2po_keep(parts: Tensor, tau: float | None = None) -> Tensor:
    """parts: [B, G, K] -> BoolTensor [B, G]: the rollouts GD²PO keeps.  Hard (tau None): those not in conflict.
    SNR: a rollout in conflict is dropped only where |rho| < tau, tau clamped to [0, 1] (0.8 in their scripts)."""
    dropped = in_conflict(parts)
    if tau is not None:
        dropped &= conflict_ratio(parts).abs() < min(max(float(tau), 0.0), 1.0)
    return ~dropped


def gd2po_scaled(parts: Tensor, keep: Tensor) -> Tensor:
    """S' = q * sum_k part_k on the kept rollouts, 0 on the dropped; q = the group's kept share (mean over G of the
    keep mask).  parts: [B, G, K], keep: [B, G] -> [B, G]: the advantage before whitening."""
    share = keep.to(parts.dtype).mean(dim=1, keepdim=True)  # [B, 1] q
    summed = parts.sum(-1) * share  # [B, G]
    return torch.where(keep, summed, torch.zeros_like(summed))


def weighted_whiten(values: Tensor, weight: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) * rsqrt(var + eps) where weight > 0, 0 elsewhere: mean and unbiased variance over the entries counted
    `weight` times each.  With a rollout's kept token count as its weight this is verl's masked_whiten over the
    [N, T] tokens (each token of a rollout holds its value).  values, weight: [B, G] -> [B, G]; nothing counted: 0."""
    weight = weight.to(values.dtype)
    count = weight.sum()
    if not bool(count > 0):
        return torch.zeros_like(values)
    mean = (values * weight).sum() / count
    var = (weight * (values - mean) ** 2).sum() / (count - 1).clamp(min=1)
    return torch.where(weight > 0, (values - mean) * torch.rsqrt(var + eps), torch.zeros_like(values))


def gd2po_advantages(rewards: Tensor, weights: Tensor | list[float] | None = None, tau: float | None = None,
                     eps: float = 1e-6, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """GD²PO, hard (tau None) or SNR.  rewards: [B, G, K], NaN = abstained; lengths: [B, G] tokens per rollout (None:
    one entry each) -> (advantages [B, G], keep [B, G] bool).  The dropped rollouts get 0 and must leave the loss
    (the estimator's `kept`); the kept are whitened over their tokens, so a kept rollout whose S' is 0 moves with
    the batch mean.

    >>> adv, keep = gd2po_advantages(torch.tensor([[[1., 0.], [0., 1.], [1., 1.], [0., 0.]]]))
    >>> keep.tolist()  # rollouts 0 and 1: one channel above its group mean, the other below
    [[False, False, True, True]]
    """
    parts = gd2po_parts(rewards, weights, eps)  # [B, G, K]
    keep = gd2po_keep(parts, tau)  # [B, G]
    counts = keep.to(parts.dtype) * (1.0 if lengths is None else lengths.to(parts.dtype))  # [B, G]
    return weighted_whiten(gd2po_scaled(parts, keep), counts), keep


def corrgrpo_parts(rewards: Tensor, weights: Tensor | list[float] | None = None,
                   eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """CorrGRPO's pieces: (the weighted channels centered in their group [B, G, K], 0 where a channel does not vary
    there; the group's denominator sqrt(max(sum_{l,m} rho_lm, 0) + eps) [B, 1]).  rewards: [B, G, K], NaN = abstained
    (counts 0, as in GRPO's sum)."""
    check_finite(rewards)
    filled = torch.nan_to_num(rewards, nan=0.0) * _weights(rewards, weights)  # [B, G, K]: weights folded in
    moves = varies(filled)  # [B, 1, K]
    centered = torch.where(moves, filled - filled.mean(dim=1, keepdim=True), torch.zeros_like(filled))
    cov = centered.transpose(1, 2) @ centered / max(rewards.shape[1] - 1, 1)  # [B, K, K] divisor G - 1
    var = cov.diagonal(dim1=1, dim2=2)  # [B, K]
    inv_std = torch.where(moves.squeeze(1) & (var > 0), torch.rsqrt(var), torch.zeros_like(var))  # [B, K]
    rho = cov * inv_std.unsqueeze(2) * inv_std.unsqueeze(1)  # [B, K, K]; zero rows and columns where it is 0
    return centered, torch.sqrt(rho.sum(dim=(1, 2)).clamp(min=0) + eps).unsqueeze(1)


def corrgrpo_advantages(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """CorrGRPO (Hu et al., 2026, arXiv 2609.36820, Eq. 2 and Listing 1).  rewards: [B, G, K], NaN = abstained
    (counts 0, as GRPO) -> [B, G]: A = (sum_k w_k r_k - group mean) / sqrt(max(sum_{l,m} rho_lm, 0) + eps), rho the
    Pearson correlations of the weighted channels within the group (covariance with divisor G - 1; a channel that does
    not vary there, by exact equality, has a zero row and column, its diagonal too).  Per group only: no batch
    normalization.  A group whose weighted sum does not vary gets exactly 0 (as `group_normalize`).

    >>> corrgrpo_advantages(torch.tensor([[[0., 0.], [1., 1.]]]))  # two identical channels: sum rho = 4, / 2
    tensor([[-0.5000,  0.5000]])
    """
    centered, denominator = corrgrpo_parts(rewards, weights, eps)  # [B, G, K], [B, 1]
    total = torch.nan_to_num(rewards, nan=0.0) @ _weights(rewards, weights)  # [B, G]
    live = varies(total)  # [B, 1]
    return torch.where(live, centered.sum(-1), torch.zeros_like(total)) / denominator


GroupSignal = Callable[[Tensor, "Tensor | list[float] | None"], Tensor]  # ([B, G, K], [K]) -> [B, G]


def live_groups(rewards: Tensor, weights: Tensor | list[float] | None, signal: GroupSignal) -> Tensor:
    """rewards: [B, G, K], NaN = abstained; weights: [K]; signal: the estimator's group signal (its
    `Estimator.group_signal`: `grpo_signal`, `gdpo_signal`) -> BoolTensor [B]: True where the estimator gives at
    least one rollout of the group a non-zero advantage before batch normalization.  The one definition of a live
    group (DAPO's dynamic sampling, groups/dead_frac*).

    Decided exactly, on the estimator's own arithmetic (its zeros are exact: `group_normalize`): GRPO, a group is
    live when the weighted sum varies; GDPO, when a channel of non-zero weight varies and the normalized channels do
    not cancel in the weighted sum.  A channel of weight 0 (an enforced constraint) never makes a group live.

    >>> live_groups(torch.tensor([[[1., -8.], [0., -4.]]]), [1.0, 0.25], grpo_signal).tolist()  # sums -1, -1
    [False]
    >>> live_groups(torch.tensor([[[1., -8.], [0., -4.]]]), [1.0, 0.25], gdpo_signal).tolist()
    [True]
    """
    return (signal(rewards, weights) != 0).any(dim=1)


def first_live(live: Tensor, needed: int) -> Tensor:
    """live: BoolTensor [B] -> [B]: the first `needed` live groups in order (DAPO fills its batch with them).

    >>> first_live(torch.tensor([False, True, True, False, True]), 2).tolist()
    [False, True, True, False, False]
    """
    return live & (live.cumsum(0) <= needed)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the completion tokens of each sequence.

    rewards: [N, T] per-token rewards; values: [N, T] critic value of the state before each token;
    mask: [N, T] 1 on tokens the policy generated, 0 on padding and tool observations (skipped: the recursion
    jumps from one generated token to the next, so an observation is part of the environment's transition).
    Returns (advantages [N, T], returns [N, T]), both 0 where mask is 0.
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])  # [N] value after the last generated token: terminal, 0
    next_advantage = values.new_zeros(values.shape[0])  # [N]
    for t in reversed(range(values.shape[1])):
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage_t * live
        # Masked positions pass the next generated token's estimates through unchanged.
        next_value = torch.where(live > 0, values[:, t], next_value)
        next_advantage = torch.where(live > 0, advantage_t, next_advantage)
    returns = (advantages + values) * mask
    return advantages, returns


def gae_token_rewards(rewards: Tensor, weights: Tensor, mask: Tensor, kl_penalty: Tensor | None = None) -> Tensor:
    """PPO's per-token reward: the weighted channel sum (abstention = 0) on each rollout's last generated token,
    minus `kl_penalty` (kl_coef * per-token KL, [N, T]) on every generated token.

    rewards: [B, G, K]; weights: [K]; mask: [N, T] with N = B*G -> [N, T], 0 where mask is 0.
    """
    mask = mask.to(torch.float32)
    total = weighted_sum(rewards, weights).reshape(-1)  # [N]
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)  # [N] index of each rollout's last generated token
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(mask.shape[0]), last] = total.to(mask.dtype)
    if kl_penalty is not None:
        token_rewards = token_rewards - kl_penalty.to(mask.dtype)
    return token_rewards * mask


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalize to zero mean, unit variance over the entries where mask is 1.  values, mask: [N, T]."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


# Group signals: the sequence-level advantage an estimator gives a group before batch normalization ([B, G, K], [K]
# -> [B, G]), what `live_groups` tests.  PPO (gae) has no groups and its critic makes no advantage exactly 0; its
# rollouts of one prompt differ in what PPO is paid only when the weighted sum does, so a group is live for it as for
# GRPO (a channel of weight 0, or channels that cancel in the sum, change nothing PPO learns from): grpo_signal.
def grpo_signal(rewards: Tensor, weights: Tensor | list[float] | None) -> Tensor:
    return grpo_advantages(rewards, weights)


def gdpo_signal(rewards: Tensor, weights: Tensor | list[float] | None) -> Tensor:
    return gdpo_advantages(rewards, weights, batch_norm=False)



def gd2po_signal(rewards: Tensor, weights: Tensor | list[float] | None) -> Tensor:
    parts = gd2po_parts(rewards, weights)
    return gd2po_scaled(parts, gd2po_keep(parts))


def gd2po_snr_signal(rewards: Tensor, weights: Tensor | list[float] | None, gd2po_tau: float = 0.8) -> Tensor:
    parts = gd2po_parts(rewards, weights)
    return gd2po_scaled(parts, gd2po_keep(parts, gd2po_tau))


def corrgrpo_signal(rewards: Tensor, weights: Tensor | list[float] | None) -> Tensor:
    return corrgrpo_advantages(rewards, weights)

# Diagnostics: how much each channel drives the advantage.  Each estimator's advantage is (up to one affine map
# over the batch) a sum of per-channel contributions c_k; a channel's share is its covariance with the advantage.


def grpo_contributions(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """[B, G, K] -> [B, G, K] whose sum over K is grpo_advantages: w_k (r_k - group mean_k) / (std of the sum + eps),
    an abstention counting 0 as in the sum."""
    filled = torch.nan_to_num(rewards, nan=0.0) * _weights(rewards, weights)  # [B, G, K]
    total = filled.sum(-1)  # [B, G]
    std = total.std(dim=1, keepdim=True).unsqueeze(-1)  # [B, 1, 1]
    centered = filled - filled.mean(dim=1, keepdim=True)
    return torch.where(varies(total).unsqueeze(-1), centered / (std + eps), torch.zeros_like(centered))


def gdpo_contributions(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """[B, G, K] -> [B, G, K]: w_k * (channel k normalized within its group), summed by GDPO before batch norm."""
    return group_normalize(rewards, eps) * _weights(rewards, weights)


def batch_contributions(rewards: Tensor, weights: Tensor | list[float] | None = None) -> Tensor:
    """[B, G, K] -> [B, G, K]: w_k (r_k - batch mean_k), the parts of PPO's summed reward (no groups)."""
    filled = torch.nan_to_num(rewards, nan=0.0)
    return (filled - filled.mean(dim=(0, 1), keepdim=True)) * _weights(rewards, weights)



def gd2po_contributions(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6,
                        gd2po_tau: float | None = None) -> Tensor:
    """[B, G, K] -> [B, G, K] whose sum over K is GD²PO's S' before whitening: q w_k z_k on kept rollouts, 0 on the
    dropped."""
    parts = gd2po_parts(rewards, weights, eps)
    keep = gd2po_keep(parts, gd2po_tau)
    share = keep.to(parts.dtype).mean(dim=1, keepdim=True).unsqueeze(-1)  # [B, 1, 1]
    return torch.where(keep.unsqueeze(-1), parts * share, torch.zeros_like(parts))


def corrgrpo_contributions(rewards: Tensor, weights: Tensor | list[float] | None = None, eps: float = 1e-6) -> Tensor:
    """[B, G, K] -> [B, G, K] whose sum over K is corrgrpo_advantages: w_k (r_k - group mean_k) over the group's
    denominator, 0 in a group whose weighted sum does not vary."""
    centered, denominator = corrgrpo_parts(rewards, weights, eps)
    live = varies(torch.nan_to_num(rewards, nan=0.0) @ _weights(rewards, weights)).unsqueeze(-1)  # [B, 1, 1]
    return torch.where(live, centered / denominator.unsqueeze(-1), torch.zeros_like(centered))

def advantage_shares(contributions: Tensor, advantages: Tensor) -> Tensor:
    """Share of the advantage's variance due to each channel.  contributions [B, G, K], advantages [B, G] -> [K].

    share_k = cov(c_k, A) / sum_j cov(c_j, A): the shares sum to 1 (a channel working against the others can go
    below 0); all zeros when nothing varies.
    """
    centered = (advantages - advantages.mean()).reshape(-1, 1)  # [B*G, 1]
    parts = contributions.reshape(-1, contributions.shape[-1])  # [B*G, K]
    cov = (parts * centered).sum(0)  # [K]
    total = cov.sum()
    return cov / total if total.abs() > 1e-12 else torch.zeros_like(cov)


def distinct_per_group(advantages: Tensor, decimals: int = 4) -> float:
    """Mean number of distinct advantage values within a group (rounded to 1e-4).  advantages: [B, G]."""
    rounded = torch.round(advantages * 10**decimals)
    return sum(len(torch.unique(group)) for group in rounded) / max(advantages.shape[0], 1)



# Diagnostics that name the failure a successor of GDPO addresses (logged for every estimator): rollouts whose channels
# pull apart (GD²PO), channels that move together (CorrGRPO), groups a filter on the summed reward would drop
# though a channel varies (SkyRL PR #2104, TRL PR #7242: exactly the groups GDPO learns from).


def conflict_frac(rewards: Tensor, weights: Tensor | list[float] | None = None) -> float:
    """Share of the rollouts in conflict (`in_conflict` on `gd2po_parts`): some weighted channel above its group mean,
    another below.  rewards: [B, G, K], NaN = abstained; a channel of weight 0 never conflicts."""
    return in_conflict(gd2po_parts(rewards, weights)).float().mean().item()


def channel_correlations(rewards: Tensor) -> dict[tuple[int, int], float | None]:
    """{(a, b): mean over groups of the within-group Pearson correlation of channels a < b}.  rewards: [B, G, K], NaN =
    abstained: a group counts for a pair where at least two rollouts scored both and both vary there; None where no
    group does.

    >>> channel_correlations(torch.tensor([[[0., 1., 5.], [1., 0., 5.], [2., -1., 7.]]]))[(0, 1)]
    -1.0
    """
    out: dict[tuple[int, int], float | None] = {}
    K = rewards.shape[-1]
    for a in range(K):
        for b in range(a + 1, K):
            x, y = rewards[..., a], rewards[..., b]  # [B, G]
            both = ~torch.isnan(x) & ~torch.isnan(y)
            x, y = torch.where(both, x, torch.nan), torch.where(both, y, torch.nan)
            count = both.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
            dx = torch.where(both, x - torch.nan_to_num(x).sum(1, keepdim=True) / count, torch.zeros_like(x))
            dy = torch.where(both, y - torch.nan_to_num(y).sum(1, keepdim=True) / count, torch.zeros_like(y))
            valid = (varies(x) & varies(y)).squeeze(1)  # [B]
            corr = (dx * dy).sum(1) / ((dx**2).sum(1) * (dy**2).sum(1)).sqrt().clamp(min=1e-30)  # [B]
            out[(a, b)] = corr[valid].mean().item() if bool(valid.any()) else None
    return out


def dead_sum_live_channel(rewards: Tensor, weights: Tensor | list[float] | None = None) -> float:
    """Share of groups whose weighted sum does not vary (dead for GRPO, and for any filter on the summed reward) while
    a channel of non-zero weight does (live for GDPO).  rewards: [B, G, K], NaN = abstained -> a fraction of B.

    >>> dead_sum_live_channel(torch.tensor([[[1., 0.], [0., 1.]], [[1., 1.], [1., 1.]]]))  # group 0: sums 1, 1
    0.5
    """
    w = _weights(rewards, weights)  # [K]
    dead_sum = ~varies(weighted_sum(rewards, w)).squeeze(1)  # [B]
    live_channel = (varies(rewards).squeeze(1) & (w != 0)).any(-1)  # [B]
    return (dead_sum & live_channel).float().mean().item() if rewards.shape[0] else 0.0

# The registry of advantage estimators: the one place where the trainers differ in how they turn rewards into
# advantages.  Everything else that distinguishes the presets in conf/algo/ (dynamic sampling, clip-higher, loss
# aggregation, overlong shaping, KL, conditions and constraints) is a config switch that combines with any estimator,
# so the training loop never asks which algorithm it runs.  An estimator is one function, registered where it is
# defined: (rewards [B, G, K] NaN = abstained, weights [K], completion mask [N, T], values [N, T] or None, per-token
# KL penalty [N, T] (already times kl_coef, >= 0) or None, settings) -> (advantages [N, T], returns [N, T] or None).


class Settings(Protocol):
    """The algo.* values the estimators read (the algo config, or any object with these attributes)."""

    adv_eps: float
    gdpo_batch_norm: bool
    gamma: float
    lam: float
    whiten_advantages: bool
    gd2po_tau: float


TokenAdvantageFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", "Tensor | None", Settings],
                            "tuple[Tensor, Tensor | None]"]


@dataclass(frozen=True)
class Estimator:
    token_advantages: TokenAdvantageFn
    # (rewards [B, G, K], weights [K], eps) -> [B, G, K]: per-channel parts of the advantage, for adv/share/<channel>
    contributions: Callable[[Tensor, Tensor, float], Tensor]
    group_relative: bool  # advantages come from the group of G rollouts: G must be >= 2
    needs_critic: bool  # a value function is trained alongside the policy
    # Takes a per-token KL penalty in the reward (algo.kl_mode=reward).  A group-relative estimator does not: each
    # rollout's penalty would be normalized within its group, so kl_coef would cancel under GDPO (TRL's `beta` and
    # the GDPO reference code put KL in the loss instead).
    reward_kl: bool
    # ([B, G, K], [K]) -> [B, G]: the advantage a group gets before batch normalization, 0 where it gives none
    # (`live_groups`: DAPO's dynamic sampling, groups/dead_frac*)
    group_signal: GroupSignal
    # (rewards [B, G, K], weights [K], settings) -> BoolTensor [B, G]: the rollouts the estimator keeps; the others
    # leave the loss mask (GD²PO's dropped conflicts).  None: it keeps every rollout.
    kept: Callable[[Tensor, Tensor, Settings], Tensor] | None = None
    # Settings the group signal and the contributions read as keywords (GD²PO-SNR's tau), bound by `bound`.
    signal_settings: tuple[str, ...] = ()

    def bound(self, settings: Settings) -> Estimator:
        """This estimator with its group signal and contributions reading the run's settings (`signal_settings`)."""
        if not self.signal_settings:
            return self
        values = {name: getattr(settings, name) for name in self.signal_settings}
        return replace(self, group_signal=partial(self.group_signal, **values),
                       contributions=partial(self.contributions, **values))


ESTIMATORS = Registry("algo.advantage", "mrl/algo/advantages.py ESTIMATORS, with @estimator", {})


def estimator(name: str, *, signal: GroupSignal, contributions: Callable[[Tensor, Tensor, float], Tensor],
              group_relative: bool = True, needs_critic: bool = False, reward_kl: bool = False,
              kept: Callable[[Tensor, Tensor, Settings], Tensor] | None = None,
              signal_settings: tuple[str, ...] = ()) -> Callable[[TokenAdvantageFn], TokenAdvantageFn]:
    """Register the decorated function as the estimator `algo.advantage=name` (the fields: `Estimator`)."""
    def register(fn: TokenAdvantageFn) -> TokenAdvantageFn:
        ESTIMATORS[name] = Estimator(fn, contributions, group_relative, needs_critic, reward_kl, signal, kept,
                                     signal_settings)
        return fn
    return register


def broadcast(sequence_advantages: Tensor, mask: Tensor) -> Tensor:
    """[B, G] sequence advantages -> [N, T]: every generated token of a rollout shares its rollout's advantage."""
    return sequence_advantages.reshape(-1, 1).to(mask.dtype) * mask


@estimator("grpo", signal=grpo_signal, contributions=grpo_contributions)
def grpo(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
         settings: Settings) -> tuple[Tensor, None]:
    """GRPO: `grpo_advantages` (sum, then normalize in the group), one per rollout, on each of its tokens."""
    return broadcast(grpo_advantages(rewards, weights, settings.adv_eps), mask), None


@estimator("gdpo", signal=gdpo_signal, contributions=gdpo_contributions)
def gdpo(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
         settings: Settings) -> tuple[Tensor, None]:
    """GDPO: `gdpo_advantages` (normalize each channel in the group, sum, normalize over the batch), one per rollout,
    on each of its tokens."""
    return broadcast(gdpo_advantages(rewards, weights, settings.adv_eps, settings.gdpo_batch_norm), mask), None


@estimator("gae", signal=grpo_signal, contributions=lambda r, w, eps: batch_contributions(r, w),
           group_relative=False, needs_critic=True, reward_kl=True)
def gae(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
        settings: Settings) -> tuple[Tensor, Tensor]:
    """PPO: the weighted channel sum is the reward of the last generated token, minus the KL penalty on every
    generated token (the standard per-token RLHF reward); GAE over the critic's values."""
    token_rewards = gae_token_rewards(rewards, weights, mask, kl_penalty).to(values.dtype)  # [N, T]
    advantages, returns = gae_advantages(token_rewards, values, mask, settings.gamma, settings.lam)
    if settings.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def gd2po_kept(rewards: Tensor, weights: Tensor, settings: Settings) -> Tensor:
    """GD²PO hard's kept rollouts [B, G]: those not in conflict."""
    return gd2po_keep(gd2po_parts(rewards, weights, settings.adv_eps))


def gd2po_snr_kept(rewards: Tensor, weights: Tensor, settings: Settings) -> Tensor:
    """GD²PO-SNR's kept rollouts [B, G]: those not in conflict, or in conflict with |rho| >= algo.gd2po_tau."""
    return gd2po_keep(gd2po_parts(rewards, weights, settings.adv_eps), settings.gd2po_tau)


def gd2po_tokens(rewards: Tensor, weights: Tensor, mask: Tensor, tau: float | None, eps: float) -> Tensor:
    """`gd2po_advantages` whitened over the kept rollouts' generated tokens (their mask [N, T]), on each token."""
    lengths = mask.sum(-1).reshape(rewards.shape[:2])  # [B, G]
    advantages, _ = gd2po_advantages(rewards, weights, tau, eps, lengths)
    return broadcast(advantages, mask)


@estimator("gd2po", signal=gd2po_signal, contributions=gd2po_contributions, kept=gd2po_kept)
def gd2po(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
          settings: Settings) -> tuple[Tensor, None]:
    """GD²PO hard: rollouts in conflict dropped (0 here, and out of the loss mask: `kept`), each group's sum scaled
    by its kept share, whitened over the kept tokens."""
    return gd2po_tokens(rewards, weights, mask, None, settings.adv_eps), None


@estimator("gd2po_snr", signal=gd2po_snr_signal, signal_settings=("gd2po_tau",),
           contributions=partial(gd2po_contributions, gd2po_tau=0.8), kept=gd2po_snr_kept)
def gd2po_snr(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
              settings: Settings) -> tuple[Tensor, None]:
    """GD²PO-SNR: as gd2po, but a rollout in conflict is dropped only where its channels nearly cancel,
    |rho| < algo.gd2po_tau."""
    return gd2po_tokens(rewards, weights, mask, settings.gd2po_tau, settings.adv_eps), None


@estimator("corrgrpo", signal=corrgrpo_signal, contributions=corrgrpo_contributions)
def corrgrpo(rewards: Tensor, weights: Tensor, mask: Tensor, values: Tensor | None, kl_penalty: Tensor | None,
             settings: Settings) -> tuple[Tensor, None]:
    """CorrGRPO: `corrgrpo_advantages` (the centered weighted sum over sqrt of the summed channel correlations, per
    group), one per rollout, on each of its tokens."""
    return broadcast(corrgrpo_advantages(rewards, weights, settings.adv_eps), mask), None
