"""What happens to the per-channel rewards before an estimator sees them: pure tensor functions, no config, no
device moves.  `mrl.rewards.channels.RewardSet.shape` calls them with its channels' settings as [K] tensors.

Shapes: B prompts, G rollouts per prompt, K reward channels.  Every rule acts rollout by rollout, never on a batch
statistic, so a rollout's shaped rewards do not depend on which other groups share its batch (dynamic sampling
relies on it).

- Conditioned rewards (GDPO, Liu et al., 2026, arXiv 2601.05242, Eq. 8): a channel is paid only where the channel it
  is conditioned on reaches a threshold, and a fixed `gated` value elsewhere (0 in the paper).
- Vetoes (an enforced constraint): a rollout that violates the constraint pays every other channel's gated value;
  the constraint keeps its own value, which shows the violation.
- Drops: a rollout that violates the constraint is left out of the losses (it still counts in its group's baseline:
  it was sampled from the policy like the others).
A constraint priced by a budget is no rule here: its price is its weight (mrl.algo.advantages.dual_step).
"""

from __future__ import annotations

import torch
from torch import Tensor


def condition(rewards: Tensor, on: Tensor, threshold: Tensor, gated: Tensor) -> tuple[Tensor, Tensor]:
    """GDPO Eq. 8: channel k pays r_k where r_{on[k]} >= threshold[k], and gated[k] elsewhere.

    rewards: [B, G, K], NaN = abstained; on: [K] long, the channel each is conditioned on (-1: unconditioned);
    threshold, gated: [K] -> (shaped [B, G, K], passed [B, G, K] bool: the gate open; always True on an
    unconditioned channel).  An abstention (NaN) on the conditioning channel closes the gate.  The conditions read
    the rewards as scored, so a chain of conditions does not compound.

    >>> condition(torch.tensor([[[1., 1.], [0., 1.], [1., 1.], [0., 1.]]]), torch.tensor([-1, 0]),
    ...           torch.tensor([1., 1.]), torch.tensor([0., 0.]))[0][0, :, 1]  # the paper's case
    tensor([1., 0., 1., 0.])
    """
    conditioned = on >= 0  # [K]
    source = rewards[..., on.clamp(min=0)]  # [B, G, K] the value each channel's gate reads
    passed = (source >= threshold) | ~conditioned  # [B, G, K]
    return torch.where(passed, rewards, gated.to(rewards.dtype)), passed


def violations(rewards: Tensor, below: Tensor) -> Tensor:
    """rewards: [B, G, K]; below: [K] -> [B, G, K] bool: r_k < below[k].  An abstention (NaN) is no violation."""
    return rewards < below


def veto(shaped: Tensor, violated: Tensor, vetoes: Tensor, gated: Tensor) -> Tensor:
    """Every vetoing constraint k, in channel order: a rollout that violates it pays every other channel's gated
    value, and channel k keeps the value it had.

    shaped: [B, G, K] (after `condition`); violated: [B, G, K] bool (`violations`); vetoes: [K] bool, the channels
    that veto; gated: [K] -> [B, G, K].
    """
    gated = gated.to(shaped.dtype)
    for k in vetoes.nonzero().flatten().tolist():
        vetoed = torch.where(violated[..., k, None], gated, shaped)  # [B, G, K] every gate closed for a violator
        vetoed[..., k] = shaped[..., k]  # the constraint keeps the value that shows the violation
        shaped = vetoed
    return shaped


def drop(violated: Tensor, drops: Tensor) -> Tensor:
    """violated: [B, G, K] bool (`violations`); drops: [K] bool, the channels whose violators are dropped -> keep
    [B, G] bool: the rollouts that violate none of them, the ones that enter the losses."""
    return ~(violated & drops).any(-1)
