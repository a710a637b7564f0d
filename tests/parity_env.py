"""An environment added from outside mrl: this module and tests/conf/rewards/parity.yaml, nothing else
(tests/test_envs.py trains two steps on it).  Prompt `add 3 8 =`; the answer is the parity of the sum, `1`."""

from __future__ import annotations

import random

from mrl.core.episode import Episode, Prompt


class ParityTask:
    def __init__(self, seed: int = 0):
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"parity/{self.seed}/{index}")
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Prompt(text=f"add {a} {b} =", meta={"target": (a + b) % 2})


def correct(episode: Episode) -> float:
    """1.0 when the first word is the parity: on `add 3 8 =`, `1` -> 1.0, `0 1` -> 0.0."""
    words = episode.completion.split()
    return float(bool(words) and words[0] == str(episode.prompt.meta["target"]))


def brevity(episode: Episode) -> float:
    """Minus the generated tokens: `1 <eos>` -> -2.0."""
    return -float(episode.num_tokens)
