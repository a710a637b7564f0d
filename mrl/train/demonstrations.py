"""Demonstrations as token rows: a task's solved episodes (mrl.core.episode.Demonstration) played through the episode's
own protocol, so that SFT trains on exactly the ids a rollout that wrote those turns would hold.

`play` is a rollout whose policy is a script: each reply is written out as the policy would write it (the chat
template's own rendering of an assistant message, cut where a rollout's turn stops: after `</tool_call>` where a
result comes back, at the end-of-turn token otherwise; the words protocol's tool names and answer words), tokenized,
and handed to `protocol.turn` with the stop a sampler would have met; the environment answers as in a rollout (a
tool's result, the user's next message: mask 0).  Its Episode is what the reward channels score, which is how the
round-trip tests prove a demonstration is right (full correctness, no violation).

A user's own conversations (`conversations(path)`: TRL's conversational format, `messages` with `tool_calls` and
`tool` turns, plus `tools`; or TRL's prompt-completion format, `prompt` and `completion` as strings or turns) play
the same way against a `Transcript`, an environment that answers with the recorded tool results and user turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mrl.chat.chat_template import CALL_CLOSE
from mrl.chat.protocols import ChatProtocol, ToolProtocol, WordsProtocol
from mrl.chat.stops import END_OF_TURN
from mrl.core.config import UserError
from mrl.core.data import conversation_messages, load_records, record_tools
from mrl.core.distributed import world_size
from mrl.core.episode import Demonstration, Episode, Prompt, Reply
from mrl.generation.rollout import EpisodeState


@dataclass
class Played:
    """One demonstration as token rows: the prompt's ids, then the transcript's ids with mask 1 on what the policy
    writes (its turns, end-of-turn tokens included) and 0 on what the environment writes (results, user turns)."""

    source: str
    prompt_ids: list[int]
    ids: list[int]  # [T] the transcript after the prompt
    mask: list[int]  # [T] 1: the policy's token (trained on); 0: the environment's
    episode: Episode

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def labels_mask(self) -> list[int]:
        """[P + T]: the loss mask over the whole sequence (the prompt is never trained on)."""
        return [0] * len(self.prompt_ids) + self.mask


def reply_turns(protocol: ToolProtocol, reply: Reply) -> list[tuple[str, str]]:
    """(text, stop reason) of each policy turn that writes `reply`, as a sampler would end them."""
    if isinstance(protocol, WordsProtocol):
        if not reply.calls:
            word = reply.content.strip()
            return [(reply.content, word if word in protocol.answer_words else END_OF_TURN)]
        turns = []
        for name, arguments in reply.calls:  # a tool that runs stops the turn at its name; a declared one is text
            words = [name, *map(str, arguments.values() if isinstance(arguments, dict) else arguments or ())]
            turns.append((name, name) if name in protocol.tools else (" ".join(words), END_OF_TURN))
        return turns
    if not reply.calls or protocol.parallel_calls:  # a message; or calls that are the answer, all in one turn
        return [(assistant_text(protocol, reply), END_OF_TURN)]
    return [(assistant_text(protocol, Reply("", (call,)), until=CALL_CLOSE), CALL_CLOSE) for call in reply.calls]


def assistant_text(protocol: ChatProtocol, reply: Reply, until: str | None = None) -> str:
    """What the chat template renders for `reply` as an assistant message, without its end of turn (or cut right
    after `until`): the text the model writes for it."""
    template = protocol.template
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in reply.calls]
    message = {"role": "assistant", "content": reply.content, **({"tool_calls": calls} if calls else {})}
    asked = [{"role": "user", "content": "mrl_probe"}]
    tools = [{"type": "function", "function": {"name": n, "description": "", "parameters": {"type": "object"}}}
             for n, _ in reply.calls] or None
    tools = tools if template.renders_tools else None
    before = template.render(template.normalize(asked), tools=tools, generation_prompt=True)
    whole = template.render(template.normalize(asked + [message]), tools=tools)
    if not whole.startswith(before):
        raise UserError("this chat template renders an assistant turn differently from its generation prompt; "
                        "demonstrations need a template whose generation prompt is the assistant turn's start")
    text = whole[len(before):]
    if until is not None and until in text:
        return text[: text.index(until) + len(until)]
    end = text.find(template.end_of_turn) if template.end_of_turn else -1
    return text[:end] if end >= 0 else text.rstrip()


def play(protocol: ToolProtocol, tokenizer, demo: Demonstration, end_ids: list[int]) -> Played:
    """`demo`'s replies written turn by turn through `protocol`, as `mrl.generation.rollout.generate` runs a sampled
    episode; stops where the protocol ends the episode.  `end_ids`: the model's end-of-turn ids (the first is
    written)."""
    prompt = demo.prompt
    world = protocol.environment(prompt)
    state = EpisodeState(prompt, 0, world, max_new_tokens=1 << 30)
    end_id = (sorted(protocol.stops.end_ids) or end_ids)[0]
    for text, reason in (turn for reply in demo.replies for turn in reply_turns(protocol, reply)):
        if state.ended:
            break
        new = tokenizer(text, add_special_tokens=False).input_ids + ([end_id] if reason == END_OF_TURN else [])
        state.extend(new, protocol.turn(prompt, text, reason, world))
    ends = set(end_ids) | set(protocol.stops.end_ids)
    body = [t for t in state.ids if t not in ends]
    episode = state.episode(body, tokenizer.decode(body, skip_special_tokens=True), "")
    episode.truncated = not state.ended
    return Played(demo.source, protocol.prompt_ids(prompt), state.ids, state.mask, episode)


# ---- a user's own conversations (TRL's conversational format) -------------------------------------------------

class Transcript:
    """An environment (mrl.chat.protocols.Environment) that answers with a recorded conversation: each call with the
    next recorded `tool` message, each turn's end with the next recorded user message."""

    def __init__(self, answers: list[list[str]], users: list[str]):
        self.answers, self.users = answers, users  # per user turn: the tool results, in order; later user turns
        self.user_turn, self.calls_this_turn = 0, 0

    def available(self) -> set[str]:
        return set()

    def call(self, name: str, arguments: Any) -> str | None:
        results = self.answers[self.user_turn] if self.user_turn < len(self.answers) else []
        self.calls_this_turn += 1
        return results[self.calls_this_turn - 1] if self.calls_this_turn <= len(results) else ""

    def turn_over(self) -> bool:
        return False

    def next_message(self) -> str | None:
        if self.user_turn >= len(self.users):
            return None
        self.user_turn += 1
        self.calls_this_turn = 0
        return self.users[self.user_turn - 1]


def conversation(record: dict[str, Any], where: str) -> tuple[Demonstration, Transcript]:
    """A TRL conversational record -> (its demonstration, the environment that replays it).  The prompt is every
    message before the first assistant turn; each assistant turn is a reply (its `tool_calls` one call a turn),
    the `tool` messages its results, a later user message the next user turn."""
    messages = conversation_messages(record, where)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: a conversation needs `messages`: a list of {{role, content}} turns (TRL's "
                        "conversational format)")
    first = next((k for k, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise UserError(f"{where}: no assistant turn after a user turn: nothing to learn from; give each record the "
                        "user's turn(s) then the assistant's")
    replies: list[Reply] = []
    answers: list[list[str]] = [[]]
    users: list[str] = []
    for k, message in enumerate(messages[first:], start=first):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            replies += _replies(message, f"{where}: messages[{k}]")
        elif role == "tool":
            answers[-1].append(str(message.get("content") or ""))
        elif role == "user":
            users.append(str(message.get("content") or ""))
            answers.append([])
        else:
            raise UserError(f"{where}: messages[{k}] has role {role!r}; after the first assistant turn the roles are "
                            "assistant, tool and user")
    tools = record_tools(record["tools"], where) if record.get("tools") else []
    asked = messages[:first]
    prompt = Prompt(text=str(asked[-1].get("content") or ""), meta={"source": where}, messages=list(asked),
                    tools=tools)
    return Demonstration(prompt, tuple(replies), where), Transcript(answers, users)


def _replies(message: dict[str, Any], where: str) -> list[Reply]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise UserError(f"{where}: `tool_calls` must be a list of {{\"function\": {{\"name\", \"arguments\"}}}}, got "
                        f"{json.dumps(calls)[:60]}")
    parsed = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise UserError(f"{where}: a tool call must be {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}, "
                            f"got {json.dumps(call)[:60]}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):  # OpenAI's wire form: arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise UserError(f"{where}: the arguments of {function['name']!r} are not JSON: {arguments[:60]!r}")
        parsed.append((function["name"], arguments))
    content = str(message.get("content") or "")
    replies = [Reply(content)] if content and not parsed else []
    return replies + [Reply("", (call,)) for call in parsed]


def check(cfg) -> None:
    """`mrl sft`, before the run dir exists: a batch that splits over the ranks, and with data.path=FILE every record
    a conversation (`conversation`'s one-line errors, naming the record)."""
    if cfg.get("stage", "rl") != "sft":
        return
    world = world_size()
    if cfg.sft.batch_size % world:
        raise UserError(f"sft.batch_size={cfg.sft.batch_size} does not split over {world} ranks: give a multiple of "
                        f"{world} (each rank takes an equal share of a step's demonstrations)")
    if not cfg.data.path:
        return
    records = load_records(cfg.data.path)
    if not records:
        raise UserError(f"data.path={cfg.data.path}: no records; give a JSONL file of conversations")
    for i, record in enumerate(records):
        conversation(record, f"{cfg.data.path} record {i}")


def play_conversation(tokenizer, protocol_for, record: dict[str, Any], where: str, end_ids: list[int]) -> Played:
    """A conversation record played against its own Transcript; `protocol_for(environment)` builds the chat
    protocol whose episodes run in that environment."""
    demo, transcript = conversation(record, where)
    protocol = protocol_for(lambda prompt: transcript)
    return play(protocol, tokenizer, demo, end_ids)
