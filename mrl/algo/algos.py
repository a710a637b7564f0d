"""An algorithm's settings checked against its estimator (mrl.algo.advantages.ESTIMATORS, where each estimator is
registered) and against the trainer, before a run starts."""

from __future__ import annotations

from mrl.algo.advantages import ESTIMATORS
from mrl.algo.losses import AGGREGATIONS
from mrl.core.config import Bound, UserError


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
