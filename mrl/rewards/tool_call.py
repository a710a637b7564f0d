"""Channels of tool_call: format (a well-formed call) and correctness (name and arguments, with partial credit)."""

from __future__ import annotations

from typing import Any

from mrl.episode import Episode
from mrl.tasks.tool_call import episode_call


def _tools(episode: Episode) -> dict[str, list[str]]:
    """{tool name: parameter names}: the record's declarations, the built-in prompt's, or the called tool alone."""
    prompt, expected = episode.prompt, episode.prompt.meta["call"]
    if prompt.tools:
        return {d["function"]["name"]: list(d["function"]["parameters"].get("properties", {})) for d in prompt.tools}
    return prompt.meta.get("tools") or {expected["name"]: list(_names(expected["arguments"]))}


def _names(arguments: Any) -> list:
    return list(arguments) if isinstance(arguments, dict) else list(range(len(arguments)))


class Format:
    """1.0 for a well-formed call: a declared tool with exactly its parameters (by name for JSON, by count for
    words), else 0.0.  With tools {calc: [a, b]}: `calc 3 7` -> 1.0; `calc 3` -> 0.0; `w3 3 7` -> 0.0."""

    def __call__(self, episode: Episode) -> float:
        call = episode_call(episode)
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

    Expected `calc 3 7` (parameters a, b): `calc 3 7` -> 1.0; `{"name": "calc", "arguments": {"a": 3, "b": 7}}` ->
    1.0; `calc 3 9` -> 0.75; `lookup 3 7` -> 0.5; `lookup 1 2` -> 0.0.  Arguments are matched by parameter name;
    positional arguments take the names of the expected tool's declared parameters.  Values compare as strings.
    """

    def __call__(self, episode: Episode) -> float:
        expected = episode.prompt.meta["call"]
        call = episode_call(episode)
        if call is None:
            return 0.0
        name, arguments = call
        params = _tools(episode).get(expected["name"]) or _names(expected["arguments"])
        wanted = _by_name(expected["arguments"], params)
        if not wanted:
            return float(name == expected["name"])
        got = _by_name(arguments, params)
        matched = sum(key in got and str(got[key]) == str(value) for key, value in wanted.items())
        return (float(name == expected["name"]) + matched / len(wanted)) / 2


def _by_name(arguments: Any, params: list) -> dict:
    """Arguments as {parameter name: value}; a list is matched to `params` by position."""
    if isinstance(arguments, dict):
        return dict(arguments)
    return {params[i] if i < len(params) else i: value for i, value in enumerate(arguments)}
