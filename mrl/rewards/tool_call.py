"""Channels of tool_call: format (a well-formed call) and correctness (name and arguments, with partial credit)."""

from __future__ import annotations

from typing import Any

from mrl.episode import Episode
from mrl.tasks.tool_call import parse_call


def _tools(episode: Episode) -> dict[str, list[str]]:
    expected = episode.prompt.meta["call"]
    return episode.prompt.meta.get("tools") or {expected["name"]: list(_names(expected["arguments"]))}


def _names(arguments: Any) -> list:
    return list(arguments) if isinstance(arguments, dict) else list(range(len(arguments)))


class Format:
    """1.0 for a well-formed call: a declared tool with exactly its parameters (by name for JSON, by count for
    words), else 0.0.  With tools {calc: [a, b]}: `calc 3 7` -> 1.0; `calc 3` -> 0.0; `w3 3 7` -> 0.0."""

    def __call__(self, episode: Episode) -> float:
        call = parse_call(episode.completion)
        if call is None:
            return 0.0
        name, arguments = call
        params = _tools(episode).get(name)
        if params is None:
            return 0.0
        if isinstance(arguments, dict):
            return float(set(arguments) == set(params))
        return float(len(arguments) == len(params))


class Correctness:
    """ToolRL/BFCL-style partial credit: (name matches + share of expected arguments with the right value) / 2.

    Expected `calc 3 7`: `calc 3 7` -> 1.0; `calc 3 9` -> 0.75; `lookup 3 7` -> 0.5; `lookup 1 2` -> 0.0.
    Arguments are matched by name (dicts) or position (lists), compared as strings.
    """

    def __call__(self, episode: Episode) -> float:
        expected = episode.prompt.meta["call"]
        call = parse_call(episode.completion)
        if call is None:
            return 0.0
        name, arguments = call
        wanted = expected["arguments"]
        keys = _names(wanted)
        if not keys:
            return float(name == expected["name"])
        got = arguments if isinstance(arguments, dict) == isinstance(wanted, dict) else {}
        matched = sum(_get(got, k) is not None and str(_get(got, k)) == str(_get(wanted, k)) for k in keys)
        return (float(name == expected["name"]) + matched / len(keys)) / 2


def _get(arguments: Any, key: Any) -> Any:
    if isinstance(arguments, dict):
        return arguments.get(key)
    return arguments[key] if isinstance(key, int) and key < len(arguments) else None
