"""math_length (GDPO paper, math with a length constraint): answer correctly within a token limit.

Built-in generator, sized for the tiny model: `max 3 7 =` or `min 3 7 =`, answer one digit.  Real data
(`data.path=...`): each record has `prompt` and `answer` (the final number as a string); the answer read from a
completion is its last number (`\\boxed{12}` or `... so 12.` both give 12).  A chat model is asked in words
("What is the larger of 3 and 7? Reply with the number alone.").
"""

from __future__ import annotations

import random
import re

from mrl.episode import Prompt

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class MathLengthTask:
    record_fields = ("answer",)  # what its channels read from a dataset record (mrl.tasks.check)
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
