"""code (GDPO paper, coding): write code that passes unit tests, without bugs, briefly.

Built-in generator, sized for the tiny model: prompt `x + 3 =` asks for the body of `f(x)`, i.e. the expression
`x + 3` (or `x * 3`), checked by tests such as `f(4) == 7`.  Real data (`data.path=...`): each record has
`prompt` and `tests` (Python expressions that must be true, e.g. `"f(2) == 4"`, or `assert` statements, or
`{"stdin": ..., "stdout": ...}` runs), and optionally `wrap`, a template turning the completion into a program
(`"def f(x):\\n    return {completion}"`); without it the completion, minus any Markdown code fence, is the program.
Code only ever runs in mrl.sandbox (bubblewrap by default); the tests are graded in the trainer.
"""

from __future__ import annotations

import random
import re

from mrl.episode import Episode, Prompt

TINY_WRAP = "def f(x):\n    return {completion}\n"
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


class CodeTask:
    OPS = {"+": lambda x, k: x + k, "*": lambda x, k: x * k}

    def __init__(self, seed: int = 0, num_tests: int = 3):
        self.seed, self.num_tests = seed, num_tests

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"code/{self.seed}/{index}")
        op, k = rng.choice(sorted(self.OPS)), rng.randint(0, 9)
        inputs = rng.sample(range(10), self.num_tests)
        tests = [f"f({x}) == {self.OPS[op](x, k)}" for x in inputs]
        return Prompt(text=f"x {op} {k} =", meta={"tests": tests, "wrap": TINY_WRAP})


def program(episode: Episode) -> str:
    """The program a completion stands for: the record's `wrap` filled in, or the (un-fenced) completion."""
    wrap = episode.prompt.meta.get("wrap")
    if wrap:
        return wrap.format(completion=episode.completion.strip())
    fenced = FENCE.search(episode.completion)
    return fenced.group(1) if fenced else episode.completion


def is_empty(episode: Episode) -> bool:
    """True when the completion holds no code: nothing but whitespace, or an empty Markdown fence."""
    fenced = FENCE.search(episode.completion)
    return not (fenced.group(1) if fenced else episode.completion).strip()
