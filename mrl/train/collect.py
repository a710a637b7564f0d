"""Phase 1 of a step: prompts -> live groups of scored, shaped rollouts, on which every rank agrees.

`collect` draws B prompts (this rank's shard), has the rollout engine generate G episodes each, scores them per
channel (`StepBatch.scored`: the rollouts and their rewards side by side, the rollouts untouched) and shapes the
rewards (conditions and vetoes: mrl.algo.shaping).  With dynamic sampling (DAPO), groups to which the estimator gives
no non-zero advantage *after shaping* (what the update trains on; mrl.algo.advantages.live_groups) are dropped and
more prompts are drawn, until B live groups are found or `algo.max_gen_batches` rounds were generated.  It returns
the step's `StepBatch` (mrl/train/batch.py): the live groups, their rewards, shaped rewards and keep mask, and every
round (for the logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from mrl.algo.advantages import Estimator, first_live
from mrl.chat.protocols import ToolProtocol
from mrl.core import distributed as dist
from mrl.generation.rollout import RolloutEngine, Sampling
from mrl.rewards.channels import RewardSet
from mrl.train.batch import StepBatch


@dataclass(frozen=True)
class CollectSettings:
    """What phase 1 draws, built once from the config (`of`): B prompts x G episodes a round, sampled per `sampling`
    and run per `protocol`; dynamic sampling's rounds; what a failing reward channel does."""

    prompts_per_step: int  # B, over all ranks (trainer.prompts_per_step)
    group_size: int  # G (trainer.group_size)
    sampling: Sampling  # trainer.max_new_tokens, temperature, top_p, top_k
    protocol: ToolProtocol  # how the task's episodes run with this tokenizer (mrl.envs.task.episode_protocol)
    estimator: Estimator  # algo.advantage's: which groups are live (dynamic sampling)
    dynamic_sampling: bool  # algo.dynamic_sampling
    max_gen_batches: int  # algo.max_gen_batches
    on_error: str  # rewards.on_error

    @staticmethod
    def of(cfg, sampling: Sampling, protocol: ToolProtocol, estimator: Estimator) -> CollectSettings:
        trainer, algo = cfg.trainer, cfg.algo
        return CollectSettings(trainer.prompts_per_step, trainer.group_size, sampling, protocol, estimator,
                               algo.dynamic_sampling, algo.max_gen_batches, cfg.rewards.on_error)


def collect(settings: CollectSettings, task, engine: RolloutEngine, whole: Callable[[], ContextManager], tokenizer,
            reward_set: RewardSet, state: dict) -> StepBatch:
    """Phase 1: B prompts x G samples from the rollout engine, scored per channel and shaped (conditions, vetoes).
    `whole()` is the context in which the policy's weights are whole (Trainable.whole: ZeRO-3 gathers them).

    B is global: this rank generates its shard of each round's prompts (mrl.core.distributed.shard), and the live groups
    kept are the first ones in the global order, as on one process, so every rank agrees on the rounds and on the
    count; the ranks may then hold different numbers of live groups.
    """
    estimator = settings.estimator
    B, G, K = settings.prompts_per_step, settings.group_size, len(reward_set.names)
    offset, local_B = dist.shard(B)  # this rank's prompts of each round: (0, B) on one process
    rounds: list[StepBatch] = []
    live_parts: list[StepBatch] = []
    num_live = 0
    while True:
        prompts = [task.prompt(state["prompt_position"] + offset + i) for i in range(local_B)]
        state["prompt_position"] += B
        with whole():  # ZeRO-3: the weights gathered once for the round, not at every token
            rollouts = engine.generate(prompts, G, settings.sampling, settings.protocol)
        scored = StepBatch.scored(rollouts, reward_set, settings.on_error)
        rounds.append(scored)
        if not settings.dynamic_sampling:
            live_parts.append(scored)
            num_live = B
            break
        shaped, _, _ = reward_set.shape(scored.rewards.view(local_B, G, K))
        live = reward_set.live(shaped, estimator)  # [local_B]
        # the first live groups in the global order, as on one process: every rank agrees on the rounds and count
        chosen, found = dist.choose_over_ranks(lambda every: first_live(every, B - num_live), live)  # [local_B]
        groups = chosen.nonzero().squeeze(-1)
        if len(groups):
            live_parts.append(scored.select_groups(groups))
        num_live += found
        if num_live >= B or len(rounds) >= settings.max_gen_batches:
            break
    # No live group within max_gen_batches: nothing to learn, so no optimizer step (Adam would still move the
    # weights on a zero gradient); the first round stands in for the logs.
    batch = (StepBatch.concat(live_parts, tokenizer.pad_token_id) if live_parts
             else rounds[0] if num_live == 0 else rounds[0].select_groups(torch.zeros(0, dtype=torch.long)))
    shaped, keep, shaping_stats = reward_set.shape(batch.rewards.view(-1, G, K))  # [B', G, K], [B', G]
    keep &= ~batch.failed.any(-1).view(keep.shape)  # samples a channel failed on (rewards.on_error=drop)
    return StepBatch(batch.rollouts, batch.rewards, batch.failed, shaped, keep, shaping_stats, num_live, rounds)
