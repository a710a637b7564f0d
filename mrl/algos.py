"""The registry of advantage estimators: the one place where the trainers differ in how they turn rewards into
advantages.  Everything else that distinguishes the presets in conf/algo/ (dynamic sampling, clip-higher, loss
aggregation, overlong shaping, KL, conditions and constraints) is a config switch that combines with any estimator,
so the training loop never asks which algorithm it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from mrl.advantages import (
    GroupSignal,
    batch_contributions,
    gae_advantages,
    gae_token_rewards,
    gdpo_advantages,
    gdpo_contributions,
    gdpo_signal,
    grpo_advantages,
    grpo_contributions,
    grpo_signal,
    masked_whiten,
)
from mrl.config import Bound, Registry, UserError
from mrl.losses import AGGREGATIONS

# (rewards [B, G, K] NaN = abstained, weights [K], completion mask [N, T], values [N, T] or None,
#  per-token KL penalty [N, T] (already times kl_coef, >= 0) or None, algo config)
#   -> (advantages [N, T], returns [N, T] or None)
TokenAdvantageFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None", "Tensor | None", object],
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
    # (mrl.advantages.live_groups: DAPO's dynamic sampling, groups/dead_frac*)
    group_signal: GroupSignal


def _broadcast(sequence_advantages: Tensor, mask: Tensor) -> Tensor:
    """[B, G] sequence advantages -> [N, T]: every generated token of a rollout shares its rollout's advantage."""
    return sequence_advantages.reshape(-1, 1).to(mask.dtype) * mask


def _grpo(rewards, weights, mask, values, kl_penalty, cfg):
    return _broadcast(grpo_advantages(rewards, weights, cfg.adv_eps), mask), None


def _gdpo(rewards, weights, mask, values, kl_penalty, cfg):
    return _broadcast(gdpo_advantages(rewards, weights, cfg.adv_eps, cfg.gdpo_batch_norm), mask), None


def _gae(rewards, weights, mask, values, kl_penalty, cfg):
    """PPO: the weighted channel sum is the reward of the last generated token, minus the KL penalty on every
    generated token (the standard per-token RLHF reward); GAE over the critic's values."""
    token_rewards = gae_token_rewards(rewards, weights, mask, kl_penalty).to(values.dtype)  # [N, T]
    advantages, returns = gae_advantages(token_rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


ESTIMATORS = Registry("algo.advantage", "mrl/algos.py ESTIMATORS", {
    "grpo": Estimator(_grpo, grpo_contributions, group_relative=True, needs_critic=False, reward_kl=False,
                      group_signal=grpo_signal),
    "gdpo": Estimator(_gdpo, gdpo_contributions, group_relative=True, needs_critic=False, reward_kl=False,
                      group_signal=gdpo_signal),
    "gae": Estimator(_gae, lambda r, w, eps: batch_contributions(r, w), group_relative=False, needs_critic=True,
                     reward_kl=True, group_signal=grpo_signal),
})


def check(cfg) -> None:
    """The algorithm against its estimator and the trainer: group size, critic, where the KL goes, overlong shaping."""
    t, a = cfg.trainer, cfg.algo
    estimator = ESTIMATORS.choose(a.advantage)
    AGGREGATIONS.choose(a.loss_agg)
    if estimator.group_relative and t.group_size < 2:
        raise UserError(f"trainer.group_size={t.group_size}: algo={a.name} normalizes within groups of rollouts, "
                        "so it needs group_size >= 2 (try 8)")
    if a.critic is None and estimator.needs_critic:
        raise UserError(f"algo.advantage={a.advantage} needs a critic: set algo.critic=model or head")
    if a.critic is not None and not estimator.needs_critic:
        raise UserError(f"algo.critic={a.critic.value}: algo.advantage={a.advantage} takes its baseline from the "
                        "group of rollouts and trains no critic; drop algo.critic (critic=null) or use advantage=gae")
    if a.critic is not None:
        Bound("algo.critic_lr", 0, strict=True,
              fix="the critic's learning rate (the model preset's model.critic_lr by default)").check(a.critic_lr)
    if a.kl_coef > 0 and a.kl_mode == "reward" and not estimator.reward_kl:
        raise UserError(f"algo.kl_mode=reward with algo.advantage={a.advantage}: a group-relative estimator "
                        "normalizes a per-rollout penalty away; use algo.kl_mode=loss (the KL term in the loss)")
    if a.overlong_buffer >= t.max_new_tokens:
        raise UserError(f"algo.overlong_buffer={a.overlong_buffer} must be < trainer.max_new_tokens="
                        f"{t.max_new_tokens}: the penalty rises over the last overlong_buffer tokens of the budget")
