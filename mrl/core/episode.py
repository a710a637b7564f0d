"""The data that flows from a task through the rollout to the reward channels and the logs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mrl.core.config import UserError


@dataclass(frozen=True)
class Prompt:
    """One task instance: what the policy is shown, and what the reward channels need to score it.

    text: the terse form the words protocol shows (the built-in tiny model: `add 3 7 =`).
    messages: the chat form the chat protocol shows, in the model's chat template: optional earlier turns (few-shot
      examples: a user question, an assistant `tool_calls` message, a `tool` result, the assistant's answer) ending
      with the user's request.  Empty: one user message holding `text`.
    tools: the prompt's own tool declarations, OpenAI form (`{"type": "function", "function": {"name",
      "description", "parameters": JSON schema}}`): a dataset record's tools (BFCL's functions).  They replace the
      task's tools for this prompt's episodes and are never run: a call to one is the episode's answer.  Empty: the
      task's tools.
    answer_prefix: the text the answer starts with (chat protocol, one-turn tasks whose calls are the answer): written
      after the chat template's generation prompt, as part of the prompt (never trained on), and read as the start
      of the policy's turn.
    """

    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    answer_prefix: str = ""

    def chat(self) -> list[dict[str, Any]]:
        return self.messages or [{"role": "user", "content": self.text}]


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an episode, as the protocol read it from the policy's text.

    arguments: the parsed JSON arguments (chat protocol); {} for the words protocol, whose call is a name alone.
    observation: the text the environment answered: the tool's result, or an error telling the policy what was wrong
      with the call; "" for a declared tool without a function (a final action, never run).
    valid: False for a call that could not be parsed, names no declared tool, or misses a required argument.
    cut: the result was cut to fit `trainer.max_tool_tokens`.
    user_turn: the user turn it answers (0 but for a stateful environment's episodes, whose user speaks several times:
      mrl.chat.protocols.Environment).
    """

    name: str
    arguments: Any = field(default_factory=dict)
    observation: str = ""
    valid: bool = True
    cut: bool = False
    user_turn: int = 0


@dataclass(frozen=True)
class Reply:
    """One turn of the policy in a demonstration, as it would write it: a message (`content`), or tool calls
    (`calls`: (name, arguments) pairs; one call a turn where results come back, every call of the answer in one
    turn where the calls are the answer).  mrl.train.demonstrations plays it through the episode's own protocol."""

    content: str = ""
    calls: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Demonstration:
    """A solved episode of a train-split prompt: the prompt, and the policy's turns that solve it (the
    environment's answers in between come from playing them: mrl.train.demonstrations.play).  `source` names the record
    (an id, a line of a file) in messages."""

    prompt: Prompt
    replies: tuple[Reply, ...]
    source: str


def train_split_only(split: str, task: str) -> None:
    """Demonstrations come from the train split alone: a held-out prompt is never trained on, by SFT either."""
    if split != "train":
        raise UserError(f"{task}: demonstrations of split {split!r} asked for; only the 'train' split becomes "
                        "demonstrations (the held-out prompts are never trained on)")


@dataclass
class Episode:
    """One rollout of a prompt, as the reward channels see it.

    completion: the whole transcript after the prompt — the policy's text and the tools' observations (the chat
      template's wrapping included, in chat format) — without end-of-turn tokens.
    turns: the policy's own text of each turn: no tool-call markup (a words-protocol tool name, a `<tool_call>` block)
      and no `<think>` block.
    tool_calls: one ToolCall per call, in order.
    num_tokens: tokens the policy generated, end-of-turn tokens included; observation_tokens: tokens the environment
      appended (results, and their chat-template wrapping).
    truncated: True when the episode ran out of budget (max_new_tokens or turns) before ending.
    prompt_text: the prompt as the policy read it (its tokens decoded: the chat template and tool declarations
      included), for people reading samples.
    """

    prompt: Prompt
    completion: str
    completion_ids: list[int]
    num_tokens: int
    truncated: bool
    max_new_tokens: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    observation_tokens: int = 0
    prompt_text: str = ""

    @property
    def words(self) -> list[str]:
        """The transcript's words (observations included)."""
        return self.completion.split()

    @property
    def invalid_calls(self) -> int:
        return sum(not call.valid for call in self.tool_calls)


def agent_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What the agents did, as means per episode: tool calls, turns, and calls the protocol rejected.

    >>> agent_metrics([Episode(Prompt("p"), "", [], 1, False, 8, [ToolCall("calc"), ToolCall("", valid=False)],
    ...                        ["", "", "7"]), Episode(Prompt("p"), "7", [], 1, False, 8, [], ["7"])])
    {'agent/tool_calls': 1.0, 'agent/turns': 2.0, 'agent/invalid_calls': 0.5}
    """
    count = max(len(episodes), 1)
    return {
        "agent/tool_calls": sum(len(e.tool_calls) for e in episodes) / count,
        "agent/turns": sum(len(e.turns) for e in episodes) / count,
        "agent/invalid_calls": sum(e.invalid_calls for e in episodes) / count,
    }


def sample_records(step: int, episodes: list[Episode], rewards: list[list[float]], names: list[str]
                   ) -> list[dict[str, Any]]:
    """Transcripts for people to read (samples.jsonl, a W&B table): prompt, completion with the tools' results,
    the calls, and each channel's reward (None where it abstained)."""
    return [{
        "step": step,
        "prompt": e.prompt_text or e.prompt.text,
        "completion": e.completion,
        "turns": e.turns,
        "tool_calls": [asdict(c) for c in e.tool_calls],
        "num_tokens": e.num_tokens,
        "observation_tokens": e.observation_tokens,
        "truncated": e.truncated,
        "rewards": {name: (None if math.isnan(value) else value) for name, value in zip(names, row)},
    } for e, row in zip(episodes, rewards)]
