"""Phase 1 of a step: prompts -> live groups of scored, shaped rollouts, on which every rank agrees.

`collect` draws B prompts (this rank's shard), has the rollout engine generate G episodes each, scores them per
channel (`Scored`: the rollouts and their rewards side by side, the rollouts untouched) and shapes the rewards
(conditions and vetoes: mrl.algo.shaping).  With dynamic sampling (DAPO), groups to which the estimator gives no
non-zero advantage *after shaping* (what the update trains on; mrl.algo.advantages.live_groups) are dropped and more
prompts are drawn, until B live groups are found or `algo.max_gen_batches` rounds were generated.  It returns a
`Collected`: every round (for the logs), the batch trained on grown to the largest rank's (`lockstep_batch`), its
shaped rewards and keep mask, and `EveryRank`, the rows of every rank that the batch statistics are computed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import Tensor

from mrl.algo.advantages import Estimator, first_live
from mrl.chat.protocols import ToolProtocol
from mrl.core import distributed as dist
from mrl.core.episode import Episode
from mrl.generation.rollout import RolloutEngine, Rollouts, Sampling
from mrl.rewards.channels import RewardSet


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


@dataclass
class Scored:
    """Rollouts and what the reward channels said of them, row for row."""

    rollouts: Rollouts  # N rollouts
    rewards: Tensor  # [N, K] per channel; NaN where a channel abstained (or failed)
    failed: Tensor  # [N, K] bool: channel k failed on the sample (rewards.on_error=drop)

    @staticmethod
    def of(rollouts: Rollouts, reward_set: RewardSet, on_error: str) -> Scored:
        return Scored(rollouts, *reward_set.score(rollouts.episodes, on_error))

    @property
    def episodes(self) -> list[Episode]:
        return self.rollouts.episodes

    def select_groups(self, groups: Tensor) -> Scored:
        """Whole groups, by group index [B'] -> B'*G rows."""
        rows = self.rollouts.group_rows(groups)  # [B'*G]
        return Scored(self.rollouts.take(rows), self.rewards[rows], self.failed[rows])

    @staticmethod
    def concat(parts: list[Scored], pad_id: int) -> Scored:
        if len(parts) == 1:
            return parts[0]
        return Scored(Rollouts.concat([p.rollouts for p in parts], pad_id), torch.cat([p.rewards for p in parts]),
                      torch.cat([p.failed for p in parts]))


@dataclass
class EveryRank:
    """The step's rows on every rank (gathered once; on one process, this rank's), lockstep padding left out: what
    the batch statistics are computed on, the advantages' (GDPO's batch normalization, PPO's whitening) and the
    logged metrics'."""

    rows: int  # this rank's own rows (B'*G); the batch's rows after them are lockstep padding
    shaped: Tensor  # [B'', G, K] the batch's rewards after conditions and vetoes
    rewards: Tensor  # [every rollout generated this step, K] as scored (every round, for the logs and the prices)
    failed: Tensor  # [every rollout generated this step, K] bool: a channel failed on it
    mask: Tensor  # [N'', T] the batch's completion mask
    kl_penalty: Tensor | None = None  # [N'', T] PPO's per-token KL penalty (after scoring: phase 3)

    @staticmethod
    def of(rounds: list[Scored], shaped: Tensor, batch: Rollouts) -> EveryRank:
        """Gathered from every rank: the batch's `shaped` [B', G, K] rewards and completion mask (this rank's own
        B'*G rows of `batch`), and the `rounds`' rewards and failures."""
        rows = shaped.shape[0] * shaped.shape[1]
        rewards, failed = (dist.gather_rows(torch.cat([getattr(r, name) for r in rounds])) for name in ("rewards",
                                                                                                         "failed"))
        return EveryRank(rows, dist.gather_rows(shaped), rewards, failed,
                         dist.gather_rows(batch.completion_mask.float()[:rows]))

    def gather(self, x: Tensor | None) -> Tensor | None:
        """Every rank's own rows of a per-row tensor of the batch (lockstep padding left out)."""
        return None if x is None else dist.gather_rows(x[:self.rows])


@dataclass
class Collected:
    """Phase 1: one step's rollouts, scored per channel and shaped."""

    rounds: list[Scored]  # every generation round: B*G rollouts each, this rank's share
    batch: Rollouts  # the live groups (all groups without dynamic sampling), lockstep padding rows after them
    shaped: Tensor  # [B', G, K] the live groups' rewards after conditions and vetoes, NaN = abstained
    keep: Tensor  # [B', G] bool: rollouts that enter the losses (not dropped by a constraint or a failed channel)
    shaping_stats: dict[str, float]
    num_live: int  # live groups found (dynamic sampling), or B (over all ranks)
    skip_update: bool  # dynamic sampling found no live group: no optimizer step
    every: EveryRank  # the step's rows on every rank, for the batch statistics

    @property
    def rows(self) -> int:
        """Batch rows that are this rank's groups (B'*G); rows after them are lockstep padding."""
        return self.keep.numel()

    @property
    def episodes(self) -> list[Episode]:
        """Every episode generated this step on this rank."""
        return [e for r in self.rounds for e in r.episodes]


def collect(settings: CollectSettings, task, engine: RolloutEngine, whole: Callable[[], ContextManager], tokenizer,
            reward_set: RewardSet, state: dict) -> Collected:
    """Phase 1: B prompts x G samples from the rollout engine, scored per channel and shaped (conditions, vetoes).
    `whole()` is the context in which the policy's weights are whole (Trainable.whole: ZeRO-3 gathers them).

    B is global: this rank generates its shard of each round's prompts (mrl.core.distributed.shard), and the live groups
    kept are the first ones in the global order, as on one process, so every rank agrees on the rounds and on the
    count; the ranks may then hold different numbers of live groups.
    """
    estimator = settings.estimator
    B, G, K = settings.prompts_per_step, settings.group_size, len(reward_set.names)
    offset, local_B = dist.shard(B)
    rounds: list[Scored] = []
    live_parts: list[Scored] = []
    num_live = 0
    while True:
        prompts = [task.prompt(state["prompt_position"] + offset + i) for i in range(local_B)]
        state["prompt_position"] += B
        with whole():  # ZeRO-3: the weights gathered once for the round, not at every token
            rollouts = engine.generate(prompts, G, settings.sampling, settings.protocol)
        scored = Scored.of(rollouts, reward_set, settings.on_error)
        rounds.append(scored)
        if not settings.dynamic_sampling:
            live_parts.append(scored)
            num_live = B
            break
        shaped, _, _ = reward_set.shape(scored.rewards.view(local_B, G, K))
        live = reward_set.live(shaped, estimator)  # [local_B]
        chosen = first_live(dist.gather_rows(live), B - num_live)  # [B] over all ranks, in the global order
        groups = dist.local_rows(chosen, live).nonzero().squeeze(-1)
        if len(groups):
            live_parts.append(scored.select_groups(groups))
        num_live += int(chosen.sum())
        if num_live >= B or len(rounds) >= settings.max_gen_batches:
            break
    # No live group within max_gen_batches: nothing to learn, so no optimizer step (Adam would still move the
    # weights on a zero gradient); the first round stands in for the logs.
    skip_update = num_live == 0
    batch = (Scored.concat(live_parts, tokenizer.pad_token_id) if live_parts
             else rounds[0] if skip_update else rounds[0].select_groups(torch.zeros(0, dtype=torch.long)))
    shaped, keep, shaping_stats = reward_set.shape(batch.rewards.view(-1, G, K))  # [B', G, K], [B', G]
    keep &= ~batch.failed.any(-1).view(keep.shape)  # samples a channel failed on (rewards.on_error=drop)
    padded = lockstep_batch(batch.rollouts, rounds[0].rollouts, tokenizer.pad_token_id)
    return Collected(rounds, padded, shaped, keep, shaping_stats, num_live, skip_update,
                     EveryRank.of(rounds, shaped, padded))


def lockstep_batch(batch: Rollouts, filler: Rollouts, pad_id: int) -> Rollouts:
    """`batch` grown to the most rows and completion tokens any rank holds: the rows added repeat one rollout (of
    `filler` when the batch is empty) and are never trained on (the loop zeroes their loss mask).  DeepSpeed needs
    every rank to run the same micro-batches (a gradient reduction after each backward; under ZeRO-3, parameter
    gathers at each layer's forward, and at each chunk of the output layer, whose count grows with N x T)."""
    n, width = len(batch.episodes), batch.completion_ids.shape[1]
    rows, cols = int(dist.max_over_ranks(n)), int(dist.max_over_ranks(width))
    padding = [(batch if n else filler).take(torch.zeros(rows - n, dtype=torch.long))] if rows > n else []
    return Rollouts.concat([batch, *padding], pad_id, min_width=cols)
