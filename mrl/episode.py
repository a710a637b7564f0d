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

    completion: the generated text up to (not including) the end-of-sequence token.
    num_tokens: generated tokens, the end-of-sequence token included.
    truncated: True when generation hit max_new_tokens before ending.
    """

    prompt: Prompt
    completion: str
    completion_ids: list[int]
    num_tokens: int
    truncated: bool
    max_new_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def words(self) -> list[str]:
        return self.completion.split()
