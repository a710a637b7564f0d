"""`StepBatch`: one step's batch, the one record from collect to the optimizer step, and the two places where ranks
meet around it.

Collect (mrl/train/collect.py) fills the rollouts, their per-channel rewards, the shaped rewards and the keep mask;
the update's side (mrl/train/update.py `logprob_pass`, then the loop's advantage phase) completes it with the old
and reference log-probs, the old values, PPO's KL penalty, the advantages, the returns and the loss mask; the update
trains on it, a micro-batch at a time (`take`).  A generation round, and a held-out evaluation's episodes
(mrl/train/evaluate.py), are StepBatches of rollouts and rewards alone.  Rows g*G .. g*G+G-1 are group g's.

Collect, the scoring and the update are single-process code; data parallel (mrl/core/distributed.py) enters the
step at two named calls of the loop, each the identity on one process:
- `lockstep(batch, pad_id)`, before the update's side: every rank grown to as many rows and completion columns as
  the largest (DeepSpeed's collectives need every rank to run the same micro-batches);
- `every_rank(batch)`, after scoring: every rank's own rows of the batch's numbers, gathered in rank order, for the
  batch statistics (the advantages, dynamic sampling's counts, the logged metrics, the prices); `mine` takes this
  rank's rows of a result over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mrl.core import distributed as dist
from mrl.core.episode import Episode
from mrl.generation.rollout import Rollouts
from mrl.rewards.channels import RewardSet


@dataclass
class StepBatch:
    """One step's rollouts and, row for row, what each phase found out about them.  Per completion token [N, T]
    tensors cover every row (lockstep padding too); per-rollout ones [B'*G, ...] this rank's own rows."""

    # collect (mrl/train/collect.py)
    rollouts: Rollouts | None  # N rows: B'*G own, then lockstep padding; None in `every_rank`'s view (no tokens)
    rewards: Tensor | None = None  # [B'*G, K] per channel as scored; NaN where a channel abstained (or failed)
    failed: Tensor | None = None  # [B'*G, K] bool: channel k failed on the rollout (rewards.on_error=drop)
    shaped: Tensor | None = None  # [B', G, K] the rewards after conditions and vetoes (mrl.algo.shaping)
    keep: Tensor | None = None  # [B', G] bool: rollouts that enter the losses (not vetoed, no failed channel)
    shaping_stats: dict[str, float] = field(default_factory=dict)
    live_groups: int = 0  # groups found live (dynamic sampling), or B; over all ranks
    rounds: list[StepBatch] = field(default_factory=list)  # every generation round's rollouts and rewards
    # the update's side (mrl/train/update.py logprob_pass; the loop's advantage phase), [N, T] each or None
    completion_mask: Tensor | None = None  # float, the rollouts'; `every_rank`'s view has no rollouts to ask
    old_logprobs: Tensor | None = None  # the sampling policy's; None: the update's own, detached (single_update)
    ref_logprobs: Tensor | None = None  # the frozen reference's (algo.kl_coef > 0)
    old_values: Tensor | None = None  # the critic's or the value head's (PPO)
    kl_penalty: Tensor | None = None  # PPO's per-token KL penalty in the reward (algo.kl_mode=reward)
    advantages: Tensor | None = None
    returns: Tensor | None = None  # the value loss's targets (PPO)
    loss_mask: Tensor | None = None  # generated tokens of the rows trained on (dropped, lockstep padding: 0)
    own_rows: int | None = None  # rows that are this rank's groups' (B'*G): the rows after them are lockstep padding
    first_own: int = 0  # (`every_rank`'s view) this rank's first row among every rank's rows

    def __post_init__(self) -> None:
        if self.own_rows is None:
            self.own_rows = len(self)
        if self.completion_mask is None and self.rollouts is not None:
            self.completion_mask = self.rollouts.completion_mask.float()

    def __len__(self) -> int:
        """Rows, lockstep padding included."""
        if self.rollouts is not None:
            return len(self.rollouts.episodes)
        return 0 if self.completion_mask is None else self.completion_mask.shape[0]

    @staticmethod
    def scored(rollouts: Rollouts, reward_set: RewardSet, on_error: str) -> StepBatch:
        """Rollouts scored on every reward channel (RewardSet.score)."""
        rewards, failed = reward_set.score(rollouts.episodes, on_error)
        return StepBatch(rollouts, rewards, failed)

    @property
    def group_size(self) -> int:
        return self.rollouts.group_size

    @property
    def episodes(self) -> list[Episode]:
        return self.rollouts.episodes

    @property
    def skip_update(self) -> bool:
        """Dynamic sampling found no live group: no optimizer step (Adam would move the weights on a zero
        gradient)."""
        return self.live_groups == 0

    @property
    def generated(self) -> StepBatch:
        """The rewards and failures of every rollout generated this step (every round, dead groups too): the logs',
        the prices', the failure streaks'.  No tokens."""
        return StepBatch(None, torch.cat([r.rewards for r in self.rounds]), torch.cat([r.failed for r in self.rounds]))

    def select_groups(self, groups: Tensor) -> StepBatch:
        """Whole groups of a scored round, by group index [B'] -> B'*G rows."""
        rows = self.rollouts.group_rows(groups)  # [B'*G]
        return StepBatch(self.rollouts.take(rows), self.rewards[rows], self.failed[rows])

    @staticmethod
    def concat(parts: list[StepBatch], pad_id: int) -> StepBatch:
        """Scored rounds stacked (Rollouts.concat)."""
        if len(parts) == 1:
            return parts[0]
        return StepBatch(Rollouts.concat([p.rollouts for p in parts], pad_id), torch.cat([p.rewards for p in parts]),
                         torch.cat([p.failed for p in parts]))

    def take(self, rows: Tensor) -> StepBatch:
        """The update's micro-batch at `rows` [M], trimmed to its own widths (`Rollouts.trimmed`): the columns its
        rows all pad are never computed, and every per-token tensor keeps the completion's first T' columns."""
        at = rows.to(self.loss_mask.device)
        rollouts = self.rollouts.take(rows).trimmed()
        width = rollouts.completion_ids.shape[1]  # T': the cut columns are padding of every row, loss mask 0
        pick = lambda x: None if x is None else x[at, :width]  # noqa: E731
        return StepBatch(rollouts, loss_mask=pick(self.loss_mask), advantages=pick(self.advantages),
                         returns=pick(self.returns), old_logprobs=pick(self.old_logprobs),
                         ref_logprobs=pick(self.ref_logprobs), old_values=pick(self.old_values))

    def mine(self, x: Tensor | None, like: StepBatch) -> Tensor | None:
        """(`every_rank`'s view) this rank's rows of `x`, a per-token result over every rank's rows [N'', T], in
        `like`'s lockstep shape [N, T]: lockstep padding rows 0."""
        if x is None:
            return None
        own = x[self.first_own:self.first_own + like.own_rows, :like.completion_mask.shape[1]]
        return dist.pad_to(own, tuple(like.completion_mask.shape))


def lockstep(batch: StepBatch, pad_id: int) -> StepBatch:
    """Ranks meet (1 of 2): `batch` grown to the most rows and completion tokens any rank holds; the rows added
    repeat one rollout (of the first round when the batch is empty) and are never trained on (the advantage phase
    zeroes their loss mask).  DeepSpeed needs every rank to run the same micro-batches (a gradient reduction after
    each backward; under ZeRO-3, parameter gathers at each layer's forward, and at each chunk of the output layer,
    whose count grows with N x T).  One process: the batch itself."""
    rollouts = batch.rollouts
    n, width = len(rollouts.episodes), rollouts.completion_ids.shape[1]
    rows, cols = int(dist.max_over_ranks(n)), int(dist.max_over_ranks(width))
    filler = rollouts if n else batch.rounds[0].rollouts
    padding = [filler.take(torch.zeros(rows - n, dtype=torch.long))] if rows > n else []
    grown = Rollouts.concat([rollouts, *padding], pad_id, min_width=cols)
    if grown is rollouts:
        return batch
    return StepBatch(grown, batch.rewards, batch.failed, batch.shaped, batch.keep, batch.shaping_stats,
                     batch.live_groups, batch.rounds, own_rows=n)


def every_rank(batch: StepBatch) -> StepBatch:
    """Ranks meet (2 of 2): every rank's own rows (lockstep padding left out) of the batch's numbers, in rank order,
    with the rollouts generated this step on every rank (`generated`): what the batch statistics are computed on
    (the advantages: GDPO's batch normalization, PPO's whitening; the logged metrics; the prices).  No tokens
    (`rollouts` None).  One process: the batch's own tensors."""
    own = batch.own_rows
    gather = lambda x: None if x is None else dist.gather_rows(x[:own])  # noqa: E731
    generated = batch.generated
    first_own = sum(dist.gather_objects(own)[:dist.rank()])
    return StepBatch(None, gather(batch.rewards), gather(batch.failed), dist.gather_rows(batch.shaped),
                     dist.gather_rows(batch.keep), batch.shaping_stats, batch.live_groups,
                     [StepBatch(None, *(dist.gather_rows(x) for x in (generated.rewards, generated.failed)))],
                     completion_mask=gather(batch.completion_mask), old_values=gather(batch.old_values),
                     kl_penalty=gather(batch.kl_penalty), first_own=first_own)
