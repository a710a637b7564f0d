"""Bounded JSON: text from outside (a policy's tool call, a dataset's record) read with its size, its nesting and its
numbers bounded, in one place, so that reading it and every recursive walk after it (json.dumps, deepcopy, a gym's
checks, a tokenizer) ends in bounded time and memory, and nothing but `Unreadable` comes out (one line, "is ..." or
"has ...", naming the bound).

The C decoder raises RecursionError past ~1,000 levels and ValueError past 4,300 digits: both are the caller's crash,
not a parse error, unless caught here.  A parsed value nested 600 deep still crashes a recursive walk after it, so
the nesting is bounded well below Python's recursion limit.

>>> loads('{"a": [1, 2.5, "x"]}', max_chars=100)
{'a': [1, 2.5, 'x']}
>>> loads("[" * 40 + "]" * 40, max_chars=100)
Traceback (most recent call last):
...
mrl.core.safe_json.Unreadable: is nested deeper than 32 levels
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 32  # levels of arrays and objects
MAX_DIGITS = 40  # characters of a number literal (sign, digits, point, exponent)


class Unreadable(ValueError):
    """Text that is not JSON within the bounds; its message says why, in words for a policy or a user."""


class _Number(Exception):
    pass


def _number(convert, max_digits: int):
    def parse(text: str):
        if len(text) > max_digits:
            raise _Number(f"a number of {len(text)} characters ({text[:12]}...), over the {max_digits} allowed")
        return convert(text)

    return parse


def loads(text: str, max_chars: int, max_depth: int = MAX_DEPTH, max_digits: int = MAX_DIGITS) -> Any:
    """The JSON value of `text` -> a value nested at most `max_depth` deep, every number literal at most
    `max_digits` characters, every string valid Unicode (no lone surrogate); else Unreadable."""
    if len(text) > max_chars:
        raise Unreadable(f"is {len(text)} characters, over the {max_chars} allowed")
    try:
        value = json.loads(text, parse_int=_number(int, max_digits), parse_float=_number(float, max_digits))
    except RecursionError:
        raise Unreadable(f"is nested deeper than {max_depth} levels") from None
    except _Number as err:
        raise Unreadable(f"has {err}") from None
    except json.JSONDecodeError as err:
        raise Unreadable(f"is not valid JSON ({err.msg} at character {err.pos})") from None
    problem = check(value, max_depth)
    if problem:
        raise Unreadable(problem)
    return value


def check(value: Any, max_depth: int = MAX_DEPTH, max_int: int | None = None) -> str | None:
    """What makes a parsed value unsafe to walk, or None: nesting deeper than `max_depth`, a string that is not
    valid Unicode, an integer beyond `max_int` (when given).  Iterative: any depth is safe to check."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= max_depth:
                return f"is nested deeper than {max_depth} levels"
            children = list(item.items()) if isinstance(item, dict) else [(None, v) for v in item]
            for key, child in children:
                if isinstance(key, str) and not _unicode(key):
                    return "has a key that is not valid Unicode (a lone surrogate)"
                stack.append((child, depth + 1))
        elif isinstance(item, str) and not _unicode(item):
            return "has a string that is not valid Unicode (a lone surrogate)"
        elif max_int is not None and isinstance(item, int) and not isinstance(item, bool) and abs(item) > max_int:
            return f"has an integer beyond {max_int}"
    return None


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
