"""calc_agent: a two-turn tool task a small pretrained chat model can learn on CPU (`make train-real`).

"What is 37 + 48? Use the calc tool." — the agent calls `calc` with the two numbers in its chat format
(`<tool_call>{"name": "calc", "arguments": {"a": 37, "b": 48}}</tool_call>`), reads the sum as a `tool` message,
and answers with it.  Only an answer after a call counts: a 135M model that sums in its head is mostly wrong, and
rewarding its lucky guesses taught it to skip the tool (measured: right answers fell 0.38 -> 0.06 in 10 steps).

Why this task for a 135M model (measured with SmolLM2-135M-Instruct, temperature 1.0, 32 samples each): with the
tool only described in the system prompt it wrote no call at all; one solved example given as *earlier turns* of
the conversation (user asks, assistant calls, tool answers, assistant answers) gives a learnable start — 44%
well-formed calls, 38% with the right arguments, 31% right final answers — with room to rise (two examples: 100%,
nothing left to learn).  `fewshot` sets the number of those examples.

For chat models: the tiny model's word vocabulary cannot spell two-digit numbers.

Channels: correctness (the final answer, after a call) and format (a well-formed call with the prompt's numbers).
"""

from __future__ import annotations

import random
import re
from typing import Any

from mrl.chat.protocols import Tool
from mrl.core.episode import Demonstration, Episode, Prompt, Reply, train_split_only
from mrl.envs.task import TaskBase
from mrl.envs.tool_call import INTEGERS  # the same two-integer parameters as tool_call's calc

CALC = "calc"
INTEGER = re.compile(r"-?\d+")
MAX_DIGITS = 40  # characters of an answer read as a number


class CalcAgent(TaskBase):
    record_fields = ("target", "a", "b")  # what its channels read from a dataset record (mrl.envs.task.check)

    def __init__(self, seed: int = 0, low: int = 10, high: int = 99, fewshot: int = 1, max_turns: int = 2):
        if not low <= high:
            raise ValueError(f"calc_agent needs low <= high, got low={low} high={high}")
        self.seed, self.low, self.high, self.fewshot, self.max_turns = seed, low, high, fewshot, max_turns
        self.tools = {CALC: Tool(CALC, "Adds two integers a and b and returns their sum.", INTEGERS, fn=self.calc)}

    def prompt(self, index: int) -> Prompt:
        """Prompt number `index` of the stream, after `fewshot` solved examples of other numbers."""
        problem = self._problem(random.Random(f"calc_agent/{self.seed}/{index}"))
        shots = [self._problem(random.Random(f"calc_agent/{self.seed}/{index}/shot{i}")) for i in range(self.fewshot)]
        messages = [m for shot in shots for m in self._solved(shot)] + [self._ask(problem)]
        return Prompt(text=problem.text, meta=problem.meta, messages=messages)

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """The first `count` train prompts (a generator's train prompts are its indices 0, 1, ...; held-out ones
        negative), each with its solved episode: a call to calc with the two numbers, then the answer in a sentence."""
        train_split_only(split, "rewards=calc_agent")
        demos = []
        for i in range(count):
            prompt = self.prompt(i)
            call = (CALC, {"a": prompt.meta["a"], "b": prompt.meta["b"]})
            demos.append(Demonstration(prompt, (Reply("", (call,)), Reply(answer_sentence(prompt))), f"prompt {i}"))
        return demos

    def _problem(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return Prompt(text=f"add {a} {b} =", meta={"a": a, "b": b, "target": a + b})

    @staticmethod
    def _ask(problem: Prompt) -> dict[str, Any]:
        return {"role": "user", "content": f"What is {problem.meta['a']} + {problem.meta['b']}? Use the calc tool."}

    def _solved(self, problem: Prompt) -> list[dict[str, Any]]:
        arguments = {"a": problem.meta["a"], "b": problem.meta["b"]}
        call = {"type": "function", "function": {"name": CALC, "arguments": arguments}}
        return [self._ask(problem), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": CALC, "content": self.calc(problem, arguments)},
                {"role": "assistant", "content": answer_sentence(problem)}]

    @staticmethod
    def calc(prompt: Prompt, arguments: dict[str, Any] | None = None) -> str:
        """The sum of the call's arguments `a` and `b` (the protocol has checked both are there)."""
        try:
            return str(int(arguments["a"]) + int(arguments["b"]))
        except (TypeError, ValueError, KeyError):
            return "error: a and b must be integers"


def answer_sentence(problem: Prompt) -> str:
    return f"The answer is {problem.meta['target']}."


def final_answer(episode: Episode) -> int | None:
    """The last integer of the policy's last turn, or None: `The answer is 85.` -> 85; a call alone -> None; one of
    more than MAX_DIGITS characters -> None (no sum is that long, and int() refuses 4,301 digits by raising)."""
    found = INTEGER.findall(episode.turns[-1]) if episode.turns else []
    return int(found[-1]) if found and len(found[-1]) <= MAX_DIGITS else None


# -------------------------------------------------------------------------------------------------------- the channels

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
