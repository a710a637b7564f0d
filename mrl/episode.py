"""The data that flows from a task through the rollout to the reward channels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One task instance: the text shown to the policy and what the reward channels need to score it."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One rollout of a prompt, as the reward channels see it.

    completion: the whole transcript after the prompt — the policy's text and the tools' observations — without
      the end-of-sequence token.
    turns: the policy's own text of each turn (a turn ends at a tool call, whose name is not included).
    tool_calls: one {"name": ..., "observation": ...} per tool call, in order.
    num_tokens: tokens the policy generated, the end-of-sequence token included; observation_tokens: tokens the
      tools appended.
    truncated: True when the episode ran out of budget (max_new_tokens or turns) before ending.
    """

    prompt: Prompt
    completion: str
    completion_ids: list[int]
    num_tokens: int
    truncated: bool
    max_new_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    observation_tokens: int = 0

    @property
    def words(self) -> list[str]:
        """The transcript's words (observations included)."""
        return self.completion.split()
