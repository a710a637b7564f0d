"""code (GDPO paper, coding): write code that passes unit tests, without bugs, briefly.

Built-in generator, sized for the tiny model: prompt `x + 3 =` asks for the body of `f(x)`, i.e. the expression
`x + 3` (or `x * 3`), checked by tests such as `f(4) == 7`.  Real data (`data.path=...`): each record has
`prompt` and `tests` (Python expressions that must be true, e.g. `"f(2) == 4"`, or `assert` statements, or
`{"stdin": ..., "stdout": ...}` runs), and optionally either
  * `wrap`, a template turning the completion into a program (`"def f(x):\\n    return {completion}"`): the literal
    `{completion}` is replaced and nothing else in it is read, so other braces are kept as written; or
  * `prefix` and `entry_point`: the code the completion continues (imports, helpers, the signature and docstring of
    the function, as HumanEval's prompts) and the function's name; see `complete_function`.
Without either, the completion, minus any Markdown code fence, is the program.
Code only ever runs in mrl.sandbox (bubblewrap by default); the tests are graded in the trainer.
"""

from __future__ import annotations

import ast
import random
import re

from mrl.config import UserError
from mrl.episode import Episode, Prompt

TINY_WRAP = "def f(x):\n    return {completion}\n"
PLACEHOLDER = "{completion}"
FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
INDENT = "    "


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


def unfence(completion: str, entry_point: str | None = None) -> str:
    """The code of a completion: its fenced block (the first that defines `entry_point` if one does, else the
    first), or the whole completion when it has no fence."""
    blocks = FENCE.findall(completion)
    if not blocks:
        return completion
    defining = [b for b in blocks if entry_point and _defines(b, entry_point)]
    return (defining or blocks)[0]


def _defines(code: str, entry_point: str) -> re.Match | None:
    """Where `code` defines `entry_point` at column 0 (a whole function, not a body)."""
    return re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", code, re.MULTILINE)


def complete_function(prefix: str, entry_point: str, completion: str) -> str:
    """The program of a completion that continues `prefix` (imports, helpers, and the signature and docstring of
    `entry_point`), built by concatenation, never `str.format`: prompts hold braces.

    A completion that defines `entry_point` at column 0 (fenced or not) is the whole function: the program is the
    prefix without its stub of that function (its imports and helpers stay: the model may call them), then the
    completion.  Otherwise the completion is the body: kept as written when its first line is indented, indented by
    four spaces when it starts at column 0, and appended to the prefix.
        complete_function('def f(x):\\n    "Twice x."\\n', "f", "return 2 * x")
        -> 'def f(x):\\n    "Twice x."\\n    return 2 * x\\n'
    """
    code = unfence(completion, entry_point)
    if _defines(code, entry_point):
        return _without_stub(prefix, entry_point) + "\n\n" + code.rstrip() + "\n"
    lines = code.rstrip().splitlines()
    first = next((line for line in lines if line.strip()), "")
    if first and not first[0].isspace():  # a body written from column 0: it belongs under the signature
        lines = [INDENT + line if line.strip() else line for line in lines]
    body = "\n".join(lines)
    return prefix + ("" if prefix.endswith("\n") else "\n") + (body + "\n" if body.strip() else "")


def _without_stub(prefix: str, entry_point: str) -> str:
    """`prefix` without its top-level definition of `entry_point` (decorators included), so that the model's whole
    function is the only one."""
    try:
        tree = ast.parse(prefix)
    except (SyntaxError, ValueError):  # a prefix that stops inside the function: keep what comes before it
        found = _defines(prefix, entry_point)
        return prefix[:found.start()].rstrip() if found else prefix.rstrip()
    lines = prefix.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            return "".join(lines[:start] + lines[node.end_lineno:]).rstrip()
    return prefix.rstrip()


def is_empty(episode: Episode) -> bool:
    """True when the completion holds no code: nothing but whitespace and comments, or an empty Markdown fence (a
    comment-only body runs as `return` alone, bug-free: it must not earn the bug ratio that an honest program does)."""
    code = unfence(episode.completion)
    return not any(line.strip() and not line.strip().startswith("#") for line in code.splitlines())
