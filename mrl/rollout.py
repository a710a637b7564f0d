"""Prompts -> G sampled completions each -> token tensors and Episodes; and the policy's per-token log-probs.

Layout of a batch of N = B*G rollouts, grouped by prompt (rows g*G .. g*G+G-1 are prompt g's group):
prompt tokens left-padded to P, completion tokens right-padded to T, so that row n's sequence is
prompt_ids[n] ++ completion_ids[n] and completion token t sits at position P + t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mrl.episode import Episode, Prompt


@dataclass
class Rollouts:
    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded
    completion_mask: Tensor  # [N, T] 1 on generated tokens (end-of-sequence included): what the losses train on
    completion_attention: Tensor  # [N, T] 1 on every transcript token (generated and observed), 0 on padding
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
    def attention_mask(self) -> Tensor:  # [N, P+T]: the model reads observations as it did while generating
        return torch.cat([self.prompt_mask, self.completion_attention], dim=1)

    def take(self, rows: Tensor) -> "Rollouts":
        """The rollouts at `rows` [M] (a micro-batch, or whole groups)."""
        rows = rows.to(self.prompt_ids.device)
        cpu_rows = rows.cpu()
        return Rollouts(
            self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows], self.completion_mask[rows],
            self.completion_attention[rows], [self.episodes[r] for r in rows.tolist()], self.group_size,
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
            torch.cat([right(p.completion_attention, 0) for p in parts]),
            [e for p in parts for e in p.episodes],
            parts[0].group_size,
            torch.cat([p.rewards for p in parts]) if parts[0].rewards is not None else None,
            torch.cat([p.failed for p in parts]) if parts[0].failed is not None else None,
        )


def end_token_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def single_token_ids(tokenizer, words, what: str) -> dict[int, str]:
    """{token id: word} for words that must each be one token of the vocabulary (tool names, answer words)."""
    ids = {}
    for word in words:
        pieces = tokenizer(word, add_special_tokens=False).input_ids
        if pieces == [tokenizer.unk_token_id] and tokenizer.unk_token_id is not None:
            raise ValueError(f"{what} {word!r} is not in this tokenizer's vocabulary")
        if len(pieces) != 1:
            raise ValueError(f"{what} {word!r} is {len(pieces)} tokens in this tokenizer; it must be one token")
        ids[pieces[0]] = word
    return ids


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _right_pad(rows: list[list[int]], value: int, device: torch.device) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=device)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], group_size: int, max_new_tokens: int, temperature: float,
             use_chat_template: bool, device: torch.device, tools: dict[str, Callable[[Prompt], str]] | None = None,
             max_turns: int = 1, answer_words: tuple[str, ...] = (), greedy: bool = False) -> Rollouts:
    """Sample `group_size` episodes per prompt with HF `generate` (sampling, KV cache), turn by turn.

    A turn ends at an end-of-sequence token, at the policy's budget (`max_new_tokens` generated tokens per
    episode, all turns together), at an answer word, or at a tool call: the tool's name as a token.  The tool's
    observation is then appended (mask 0: never trained on) and the episode goes on, up to `max_turns` turns,
    unless the transcript now holds an answer word.  Without tools every episode is one turn.  `greedy` decodes
    the most likely token instead of sampling (evaluation).
    """
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0,
                                                    "top_p": 1.0}
    texts = [p.text for p in prompts]
    if use_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    encoded = tokenizer(texts, add_special_tokens=not use_chat_template).input_ids
    prompt_rows = [encoded[n // group_size] for n in range(len(prompts) * group_size)]
    tools = tools or {}
    tool_ids = single_token_ids(tokenizer, tools, "tool name")
    answer_ids = set(single_token_ids(tokenizer, answer_words, "answer word"))
    end_ids = end_token_ids(model, tokenizer)
    stop_ids = set(end_ids) | set(tool_ids) | answer_ids
    completions: list[list[int]] = [[] for _ in prompt_rows]  # policy and observation tokens
    masks: list[list[int]] = [[] for _ in prompt_rows]  # 1 where the policy generated the token
    turns: list[list[str]] = [[] for _ in prompt_rows]
    calls: list[list[dict]] = [[] for _ in prompt_rows]
    ended = [False] * len(prompt_rows)
    active = list(range(len(prompt_rows)))
    while active:
        input_ids, attention_mask = _left_pad([prompt_rows[n] + completions[n] for n in active],
                                              tokenizer.pad_token_id, device)
        budget = max(max_new_tokens - sum(masks[n]) for n in active)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, **sampling, max_new_tokens=budget,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(stop_ids), use_cache=True,
        )
        still_active = []
        for row, n in enumerate(active):
            new = output[row, input_ids.shape[1]:].tolist()[: max_new_tokens - sum(masks[n])]
            stop = next((t for t, token in enumerate(new) if token in stop_ids), None)
            new = new if stop is None else new[: stop + 1]
            completions[n] += new
            masks[n] += [1] * len(new)
            turns[n].append(tokenizer.decode([t for t in new if t not in tool_ids and t not in end_ids],
                                             skip_special_tokens=True))
            last = new[-1] if new else None
            if last in tool_ids:
                name = tool_ids[last]
                observation = tools[name](prompts[n // group_size])
                observed = tokenizer(observation, add_special_tokens=False).input_ids
                completions[n] += observed
                masks[n] += [0] * len(observed)
                calls[n].append({"name": name, "observation": observation})
                ended[n] = bool(answer_ids.intersection(observed))  # the tool's result answered
                if not ended[n] and sum(masks[n]) < max_new_tokens and len(turns[n]) < max_turns:
                    still_active.append(n)
            else:
                ended[n] = last in end_ids or last in answer_ids
        active = still_active

    prompt_ids, prompt_mask = _left_pad(prompt_rows, tokenizer.pad_token_id, device)  # [N, P]
    episodes = []
    for n, completion in enumerate(completions):
        body = [t for t in completion if t not in end_ids]
        episodes.append(Episode(
            prompt=prompts[n // group_size],
            completion=tokenizer.decode(body, skip_special_tokens=True),
            completion_ids=body,
            num_tokens=sum(masks[n]),
            truncated=not ended[n],
            max_new_tokens=max_new_tokens,
            tool_calls=calls[n],
            turns=turns[n],
            observation_tokens=len(masks[n]) - sum(masks[n]),
        ))
    completion_ids = _right_pad(completions, tokenizer.pad_token_id, device)  # [N, T]
    completion_mask = _right_pad(masks, 0, device)  # [N, T]: observations and padding are 0
    completion_attention = _right_pad([[1] * len(c) for c in completions], 0, device)  # [N, T]: padding is 0
    return Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, completion_attention, episodes,
                    group_size)


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
