"""code (GDPO paper, coding): write code that passes unit tests, without bugs, briefly.

Built-in generator, sized for the tiny model: prompt `x + 3 =` asks for the body of `f(x)`, i.e. the expression
`x + 3` (or `x * 3`), checked by tests such as `f(4) == 7`.  Real data (`data.path=...`): each record has
`prompt` and `tests` (Python expressions that must be true, e.g. `"f(2) == 4"`, or `assert` statements, or
`{"stdin": ..., "stdout": ...}` runs), and optionally either
  * `wrap`, a template turning the completion into a program (`"def f(x):\\n    return {completion}"`): the literal
    `{completion}` is replaced and nothing else in it is read, so other braces are kept as written; or
  * `prefix` and `entry_point`: the code the completion continues (imports, helpers, the signature and docstring of
    the function, as HumanEval's prompts) and the function's name; see mrl.sandbox.programs.complete_function.
Without either, the completion, minus any Markdown code fence, is the program.
Code only ever runs in mrl.sandbox (bubblewrap by default); the tests are graded in the trainer.
"""

from __future__ import annotations

import random

from mrl.config import UserError
from mrl.episode import Episode, Prompt
from mrl.sandbox.programs import complete_function, unfence

TINY_WRAP = "def f(x):\n    return {completion}\n"
PLACEHOLDER = "{completion}"


class CodeTask:
    record_fields = ("tests",)  # what its channels read from a dataset record (mrl.tasks.check)
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
    """The program a completion stands for: the record's `prefix` completed, its `wrap` filled in, or the
    (un-fenced) completion."""
    meta = episode.prompt.meta
    if meta.get("prefix") is not None:
        if not meta.get("entry_point"):
            raise UserError(f"a code record with a prefix needs its entry_point (the function's name); it has "
                            f"fields {sorted(meta)}: add entry_point to the record")
        return complete_function(meta["prefix"], meta["entry_point"], episode.completion)
    wrap = meta.get("wrap")
    if wrap:
        if PLACEHOLDER not in wrap:
            raise UserError(f"a code record's wrap {wrap!r:.80} has no {PLACEHOLDER} placeholder; put it where the "
                            "completion goes, e.g. 'def f(x):\\n    return {completion}'")
        return wrap.replace(PLACEHOLDER, episode.completion.strip())
    return unfence(episode.completion)


def is_empty(episode: Episode) -> bool:
    """True when the completion holds no code: nothing but whitespace and comments, or an empty Markdown fence (a
    comment-only body runs as `return` alone, bug-free: it must not earn the bug ratio that an honest program does)."""
    code = unfence(episode.completion)
    return not any(line.strip() and not line.strip().startswith("#") for line in code.splitlines())
