"""Channels of math_length: answer correctness and a length constraint."""

from __future__ import annotations

from mrl.episode import Episode
from mrl.tasks.math_length import last_number


class AnswerCorrect:
    """1.0 when the completion's last number equals the record's `answer` (numerically), else 0.0.

    Answer 7: `7` -> 1.0; `3 then 7` -> 1.0; `7 3` -> 0.0; `w3` -> 0.0.
    """

    def __call__(self, episode: Episode) -> float:
        got = last_number(episode.completion)
        if got is None:
            return 0.0
        return float(float(got) == float(episode.prompt.meta["answer"]))


class LengthLimit:
    """A constraint: 0.0 within `max_tokens` generated tokens (end-of-sequence included), -1.0 beyond it.

    max_tokens=2: `7 <eos>` (2 tokens) -> 0.0; `w1 7 <eos>` (3) -> -1.0.  A record's own `max_tokens` wins.
    """

    def __init__(self, max_tokens: int = 2):
        self.max_tokens = max_tokens

    def __call__(self, episode: Episode) -> float:
        limit = episode.prompt.meta.get("max_tokens", self.max_tokens)
        return 0.0 if episode.num_tokens <= limit else -1.0
