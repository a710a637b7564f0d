"""Channels of calc_agent: the final answer (the task) and a well-formed call (the format)."""

from __future__ import annotations

from mrl.episode import Episode
from mrl.tasks.calc_agent import CALC, final_answer


class Correctness:
    """1.0 when the agent called calc and the last integer of its final message is the sum: for 37 + 48, a call then
    `The answer is 85.` -> 1.0; `84` -> 0.0; `85` without a call -> 0.0 (the task is to use the tool)."""

    def __call__(self, episode: Episode) -> float:
        called = any(c.valid and c.name == CALC for c in episode.tool_calls)
        return float(called and final_answer(episode) == episode.prompt.meta["target"])


class Format:
    """1.0 when the agent called calc with the prompt's two numbers and made no invalid call, else 0.0."""

    def __call__(self, episode: Episode) -> float:
        wanted = {"a": episode.prompt.meta["a"], "b": episode.prompt.meta["b"]}
        calls = episode.tool_calls
        right = any(c.valid and c.name == CALC and _as_ints(c.arguments) == wanted for c in calls)
        return float(right and all(c.valid for c in calls))


def _as_ints(arguments) -> dict | None:
    try:
        return {k: int(v) for k, v in arguments.items()}
    except (AttributeError, TypeError, ValueError):
        return None
