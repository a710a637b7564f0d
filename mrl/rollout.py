"""Prompts -> G sampled completions each -> token tensors and Episodes; and the policy's per-token log-probs.

Layout of a batch of N = B*G rollouts, grouped by prompt (rows g*G .. g*G+G-1 are prompt g's group):
prompt tokens left-padded to P, completion tokens right-padded to T, so that row n's sequence is
prompt_ids[n] ++ completion_ids[n] and completion token t sits at position P + t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mrl.episode import Episode, Prompt


@dataclass
class Rollouts:
    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded
    completion_mask: Tensor  # [N, T] 1 on generated tokens, end-of-sequence included
    episodes: list[Episode]
    group_size: int
    rewards: Tensor | None = None  # [N, K] per channel once scored; NaN where a channel abstained
    failed: Tensor | None = None  # [N] bool: a reward channel failed on the sample (rewards.on_error=drop)

    @property
    def num_groups(self) -> int:
        return len(self.episodes) // self.group_size

    @property
    def input_ids(self) -> Tensor:  # [N, P+T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # [N, P+T]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def take(self, rows: Tensor) -> "Rollouts":
        """The rollouts at `rows` [M] (a micro-batch, or whole groups)."""
        rows = rows.to(self.prompt_ids.device)
        cpu_rows = rows.cpu()
        return Rollouts(
            self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows], self.completion_mask[rows],
            [self.episodes[r] for r in rows.tolist()], self.group_size,
            self.rewards[cpu_rows] if self.rewards is not None else None,
            self.failed[cpu_rows] if self.failed is not None else None,
        )

    def select_groups(self, groups: Tensor) -> "Rollouts":
        """Whole groups, by group index [B'] -> B'*G rollouts."""
        rows = (groups.reshape(-1, 1) * self.group_size + torch.arange(self.group_size)).reshape(-1)
        return self.take(rows)

    @staticmethod
    def concat(parts: list["Rollouts"], pad_id: int) -> "Rollouts":
        """Stack rollouts from several generation rounds, re-padding prompts on the left, completions on the right."""
        if len(parts) == 1:
            return parts[0]
        prompt_len = max(p.prompt_ids.shape[1] for p in parts)
        completion_len = max(p.completion_ids.shape[1] for p in parts)

        def left(x: Tensor, value: int) -> Tensor:
            return F.pad(x, (prompt_len - x.shape[1], 0), value=value)

        def right(x: Tensor, value: int) -> Tensor:
            return F.pad(x, (0, completion_len - x.shape[1]), value=value)

        return Rollouts(
            torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            torch.cat([left(p.prompt_mask, 0) for p in parts]),
            torch.cat([right(p.completion_ids, pad_id) for p in parts]),
            torch.cat([right(p.completion_mask, 0) for p in parts]),
            [e for p in parts for e in p.episodes],
            parts[0].group_size,
            torch.cat([p.rewards for p in parts]) if parts[0].rewards is not None else None,
            torch.cat([p.failed for p in parts]) if parts[0].failed is not None else None,
        )


def end_token_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], group_size: int, max_new_tokens: int, temperature: float,
             use_chat_template: bool, device: torch.device) -> Rollouts:
    """Sample `group_size` completions per prompt with HF `generate` (sampling, KV cache)."""
    texts = [p.text for p in prompts]
    if use_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not use_chat_template)
    prompt_ids = encoded.input_ids.repeat_interleave(group_size, dim=0).to(device)  # [N, P]
    prompt_mask = encoded.attention_mask.repeat_interleave(group_size, dim=0).to(device)  # [N, P]
    end_ids = end_token_ids(model, tokenizer)
    output = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=temperature, top_k=0,
        top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=end_ids,
        use_cache=True,
    )
    completion_ids = output[:, prompt_ids.shape[1]:]  # [N, T]
    is_end = torch.isin(completion_ids, torch.tensor(end_ids, device=completion_ids.device))
    # 1 up to and including the first end token: cumsum of ends *before* each position is 0.
    ends_before = torch.cumsum(is_end.long(), dim=1) - is_end.long()
    completion_mask = (ends_before == 0).long()  # [N, T]
    lengths = completion_mask.sum(1).tolist()
    ended = is_end.any(1).tolist()
    episodes = []
    for n in range(completion_ids.shape[0]):
        body = completion_ids[n, : lengths[n] - int(ended[n])].tolist()
        episodes.append(Episode(
            prompt=prompts[n // group_size],
            completion=tokenizer.decode(body, skip_special_tokens=True),
            completion_ids=body,
            num_tokens=lengths[n],
            truncated=not ended[n],
            max_new_tokens=max_new_tokens,
        ))
    return Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, episodes, group_size)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as HF generate computes them.  [N, L] -> [N, L]."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def policy_forward(actor, batch: Rollouts) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-token log-probs of the completion under `actor` (an mrl.models.Actor, maybe inside an engine).

    Returns (logprobs [N, T], logits [N, T, V], values [N, T] from the actor's value head, or None), where
    position t scores completion token t from the state before it.
    """
    attention_mask = batch.attention_mask
    logits, values = actor(batch.input_ids, attention_mask, position_ids(attention_mask))
    start = batch.prompt_ids.shape[1] - 1
    logits = logits[:, start:-1].float()  # [N, T, V]
    logprobs = torch.gather(torch.log_softmax(logits, -1), 2, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    values = values[:, start:-1].float() if values is not None else None
    return logprobs, logits, values


def value_forward(critic, batch: Rollouts) -> Tensor:
    """Values of the state before each completion token, from a separate critic (mrl.models.ValueModel).  -> [N, T]"""
    attention_mask = batch.attention_mask
    values = critic(batch.input_ids, attention_mask, position_ids(attention_mask))
    return values[:, batch.prompt_ids.shape[1] - 1:-1].float()
