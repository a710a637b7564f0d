"""tool_call (GDPO paper, tool calling): emit the right tool call with the right arguments.

Built-in generator, sized for the tiny model: prompt `add 3 7 =` asks for the call `calc 3 7` (add -> calc,
max -> lookup).  Real data (`data.path=...`): each record has `prompt` and `call` = {"name": ..., "arguments":
{...} or [...]}, and optionally `tools`: the record's tool declarations (mrl/core/data.py), or {tool name: [parameter
names]} (default: the called tool alone).  A dataset's episodes see the record's tools only, never calc and lookup.

The tools are declared (JSON schemas) but never run: the call itself is graded.  The tiny model writes it out as
words (`calc 3 7`); a chat model is asked in words ("What is 3 + 7? Answer by calling the right tool.") and calls
in its own format, `<tool_call>{"name": "calc", "arguments": {"a": 3, "b": 7}}</tool_call>`, which ends the episode.

Channels: format (a well-formed call) and correctness (name and arguments, with partial credit).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from mrl.chat.protocols import Tool, read_call
from mrl.core.episode import Demonstration, Episode, Prompt, Reply, train_split_only
from mrl.envs.task import TaskBase

OP_TO_TOOL = {"add": "calc", "max": "lookup"}
TOOL_PARAMS = {"calc": ["a", "b"], "lookup": ["a", "b"]}
QUESTIONS = {"add": "What is {} + {}?", "max": "Which is larger, {} or {}?"}
INTEGERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}


class ToolCallTask(TaskBase):
    record_fields = ("call",)  # what its channels read from a dataset record (mrl.envs.task.check)

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.tools = {"calc": Tool("calc", "Adds two integers.", INTEGERS),
                      "lookup": Tool("lookup", "Returns the larger of two integers.", INTEGERS)}

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"tool_call/{self.seed}/{index}")
        op = rng.choice(sorted(OP_TO_TOOL))
        args = [str(rng.randint(0, 9)) for _ in range(2)]
        question = f"{QUESTIONS[op].format(*args)} Answer by calling the right tool."
        return Prompt(text=f"{op} {' '.join(args)} =",
                      meta={"call": {"name": OP_TO_TOOL[op], "arguments": args}, "tools": TOOL_PARAMS},
                      messages=[{"role": "user", "content": question}])


    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """The first `count` train prompts (a generator's train prompts are its indices 0, 1, ...; held-out ones
        negative), each with its solved episode: the right tool called with the two numbers (`calc 3 7` in words)."""
        train_split_only(split, "rewards=tool_call")
        demos = []
        for i in range(count):
            prompt = self.prompt(i)
            call = prompt.meta["call"]
            arguments = dict(zip(TOOL_PARAMS[call["name"]], map(int, call["arguments"])))
            demos.append(Demonstration(prompt, (Reply("", ((call["name"], arguments),)),), f"prompt {i}"))
        return demos

    def dataset_prompt(self, prompt: Prompt) -> Prompt:
        """A dataset record without `tools` declares the tool it should call, alone (parameters from its arguments;
        positional arguments are named a0, a1, ...)."""
        if prompt.tools or "call" not in prompt.meta:
            return prompt
        call = prompt.meta["call"]
        names = list(call["arguments"]) if isinstance(call["arguments"], dict) else \
            [f"a{i}" for i in range(len(call["arguments"]))]
        parameters = {"type": "object", "properties": {n: {} for n in names}, "required": names}
        return replace(prompt, tools=[Tool(call["name"], "", parameters).schema])


def episode_call(episode: Episode) -> tuple[str, Any] | None:
    """The call an episode made: the first one the chat protocol read, else its completion parsed (the words form
    `calc 3 7`, or a bare JSON object)."""
    if episode.tool_calls:
        return episode.tool_calls[0].name, episode.tool_calls[0].arguments
    return parse_call(episode.completion)


def parse_call(text: str) -> tuple[str, Any] | None:
    """(name, arguments) from a JSON object or from words, or None when it is not a call at all.

    >>> parse_call('{"name": "calc", "arguments": {"a": 3}}'), parse_call("calc 3 7"), parse_call("")
    (('calc', {'a': 3}), ('calc', ['3', '7']), None)
    """
    text = text.strip()
    if text.startswith("{"):
        name, arguments, error = read_call(text)  # bounded: any text is a call or None, never an exception
        return (name, arguments) if error is None and isinstance(arguments, (dict, list)) else None
    words = text.split()
    return (words[0], words[1:]) if words else None


# -------------------------------------------------------------------------------------------------------- the channels

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
