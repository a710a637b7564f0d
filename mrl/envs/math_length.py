"""math_length (GDPO paper, math with a length constraint): answer correctly within a token limit.

Built-in generator, sized for the tiny model: `max 3 7 =` or `min 3 7 =`, answer one digit.  Real data
(`data.path=...`): each record has `prompt` and `answer` (the final number as a string); the answer read from a
completion is its last number (`\\boxed{12}` or `... so 12.` both give 12).  A chat model is asked in words
("What is the larger of 3 and 7? Reply with the number alone.").

Channels: answer correctness, and the length limit as a constraint.
"""

from __future__ import annotations

import random
import re

from mrl.core.episode import Episode, Prompt
from mrl.envs.task import TaskBase

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class MathLengthTask(TaskBase):
    record_fields = ("answer",)  # what its channels read from a dataset record (mrl.envs.task.check)
    OPS = {"max": max, "min": min}
    WORDS = {"max": "larger", "min": "smaller"}

    def __init__(self, seed: int = 0):
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"math_length/{self.seed}/{index}")
        op = rng.choice(sorted(self.OPS))
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = f"What is the {self.WORDS[op]} of {a} and {b}? Reply with the number alone."
        return Prompt(text=f"{op} {a} {b} =", meta={"answer": str(self.OPS[op](a, b))},
                      messages=[{"role": "user", "content": question}])


def last_number(text: str) -> str | None:
    """>>> last_number("so it is 12."), last_number("none")
    ('12', None)"""
    found = NUMBER.findall(text)
    return found[-1] if found else None


# -------------------------------------------------------------------------------------------------------- the channels

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
