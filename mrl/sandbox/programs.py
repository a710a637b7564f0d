"""From a completion to the program it stands for: its Markdown fence removed, or the function it completes.

Shared by the code task (mrl/envs/code.py) and HumanEval (mrl/envs/humaneval.py); the program then runs in
the sandbox (mrl.sandbox.run_tests).  Pure string work: nothing here runs code.
"""

from __future__ import annotations

import ast
import re

FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
INDENT = "    "


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
