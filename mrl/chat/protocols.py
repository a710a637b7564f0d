"""Tool protocols: how an agent's turn ends, how its tool call is read, and which tokens a tool's result adds.

One seam (`ToolProtocol`), two implementations:
- `WordsProtocol`, the built-in tiny model's: a call is a tool's name written as a word, the result's raw text
  follows it; an answer word also ends the episode.
- `ChatProtocol`, the model's own chat format (Qwen/Hermes style): tools are declared as JSON schemas through the chat
  template's `tools=` argument (or a system prompt, for templates without tools), a call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and its result comes back as a `tool` message.

Token-in/token-out, as in verl's agent loop and TRL's tool loop: the rollout keeps the ids it sampled and appends
the environment's tokens after them; nothing sampled is decoded and tokenized again for training.  How a turn
ends is mrl.chat.stops; what a chat template renders (and the suffix a tool result adds) is mrl.chat.chat_template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from mrl.chat.chat_template import CALL_CLOSE, CALL_OPEN, call_text, inspect_template, render_template
from mrl.chat.stops import Stops, word_level
from mrl.core import safe_json
from mrl.core.config import Registry, UserError
from mrl.core.episode import Prompt, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_CALL_CHARS = 100_000  # characters of one `<tool_call>` body
# A token is seldom longer than this many characters: a tool's result is cut to budget * this before it is tokenized,
# so that a result of megabytes costs no more to cut than one at the budget.
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Tool:
    """A tool an agent may call: a name, a description and JSON-schema parameters (what the model is shown), and
    `fn(prompt, arguments) -> result text` (what runs).  `fn=None` declares a tool that is never run: a call to it
    is the episode's final action (tool_call: the call itself is what gets graded)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    fn: Callable[[Prompt, dict[str, Any]], str] | None = None

    def __call__(self, prompt: Prompt, arguments: dict[str, Any] | None = None) -> str:
        return self.fn(prompt, arguments or {})

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=[...]`, OpenAI style)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def argument_error(self, arguments: Any) -> str | None:
        """What is wrong with `arguments` for this tool, said to the policy, or None."""
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, not {json.dumps(arguments)}"
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"{self.name} needs the argument(s) {', '.join(missing)}"
        if self.parameters.get("additionalProperties") is False:
            unknown = sorted(set(arguments) - set(self.parameters.get("properties", {})))
            if unknown:
                return f"{self.name} takes no argument(s) {', '.join(unknown)}"
        return None


# --------------------------------------------------------------------------------------------- the seam


@dataclass
class Turn:
    """What the environment makes of one policy turn."""

    text: str  # the policy's own words (Episode.turns): no call markup, no <think> block
    calls: list[ToolCall]  # the calls it made, in order, already answered; [] without a call
    observation: list[int]  # token ids the environment appends after the turn (mask 0: never trained on)
    ended: bool  # the episode is over: an answer, a final message, or a final-action call


class Environment(Protocol):
    """One episode's stateful world (a task's `environment(prompt)`, one per rollout): tools that act on state kept
    between calls, and a user who speaks several times (BFCL multi-turn: mrl.envs.bfcl_agent).  The chat protocol
    asks it which functions are available, hands it every call to run, and, when the policy answers without a call
    or spends its calls for the turn, asks for the user's next message; the episode ends when there is none."""

    user_turn: int  # the user turn under way, from 0
    calls_this_turn: int  # calls made in it so far (0: the policy's next reply is its first of the turn)

    def available(self) -> set[str]:
        """The functions that may be called in this user turn."""
        ...

    def call(self, name: str, arguments: Any) -> str | None:
        """Run `name` -> its result text (an error text when it fails), or None when it is not available in this
        turn (not run; "" for a call that could not be read).  Every call counts toward the turn's limit."""
        ...

    def turn_over(self) -> bool:
        """Whether this user turn's calls are spent (its call limit)."""
        ...

    def next_message(self) -> str | None:
        """The user's next message (and the next turn begins), or None: the conversation is over."""
        ...


class ToolProtocol(Protocol):
    """How episodes run in one tool format: the prompt's tokens, how a turn ends, what follows it."""

    stops: Stops
    max_turns: int

    def prompt_ids(self, prompt: Prompt) -> list[int]: ...

    def environment(self, prompt: Prompt) -> Environment | None:
        """A new world for one episode of `prompt`, or None for a stateless task."""
        ...

    def turn(self, prompt: Prompt, text: str, reason: str | None, env: Environment | None = None) -> Turn:
        """Read a finished turn: its decoded `text` and why it ended (mrl.chat.stops.END_OF_TURN, a stop string, or None
        when the budget ran out); run the tool it calls (on `env`, the episode's world, when the task has one)."""
        ...


def _cut_to(tokenizer, text: str, limit: int, wrap: Callable[[str], str]) -> tuple[list[int], str, bool]:
    """(ids of wrap(text), the text kept, whether it was cut): `text` cut at a token boundary so that wrap(text)
    is at most `limit` tokens."""

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False).input_ids

    text = text.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate is no text a tokenizer takes
    cut = len(text) > limit * CHARS_PER_TOKEN  # a result may be megabytes: cut it before anything is tokenized
    text = text[: limit * CHARS_PER_TOKEN]
    ids = encode(wrap(text))
    if len(ids) <= limit:
        return ids, text, cut
    pieces = encode(text)
    keep = max(len(pieces) - (len(ids) - limit), 0)
    while True:
        kept = tokenizer.decode(pieces[:keep])
        ids = encode(wrap(kept))
        if len(ids) <= limit or keep == 0:
            return ids, kept, True
        keep -= 1


class WordsProtocol:
    """The built-in tiny model's protocol.  A turn ends at an end-of-turn token, at a tool's name written as a word
    (the call: the tool runs on the prompt and its raw result text follows, cut to `max_tool_tokens`), or at an
    answer word; the episode ends at an answer word, in the policy's text or in a tool's result.  A tool without a
    function is not a stop: the policy writes its call out (`calc 3 7`) and the task's channels read it."""

    def __init__(self, tokenizer, tools: dict[str, Tool] | None = None, answer_words: tuple[str, ...] = (),
                 max_turns: int = 1, max_tool_tokens: int = 256, use_chat_template: bool = False,
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.max_turns, self.max_tool_tokens = tokenizer, max_turns, max_tool_tokens
        self.use_chat_template, self.chat_template_kwargs = use_chat_template, dict(chat_template_kwargs or {})
        self.tools = {name: tool for name, tool in (tools or {}).items() if tool.fn is not None}
        self.answer_words = tuple(answer_words)
        strings = tuple(self.tools) + self.answer_words
        by_id = _single_token_ids(tokenizer, [("tool name", self.tools), ("answer word", self.answer_words)]) \
            if word_level(tokenizer) else None
        self.stops = Stops(frozenset(), strings, words=True, by_id=by_id)

    def environment(self, prompt: Prompt) -> None:
        return None

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if not self.use_chat_template:
            return self.tokenizer(prompt.text).input_ids
        text = render_template(self.tokenizer, [{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                               **self.chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def turn(self, prompt: Prompt, text: str, reason: str | None, env: None = None) -> Turn:
        if reason in self.tools:
            result = self.tools[reason](prompt)
            ids, result, cut = _cut_to(self.tokenizer, result, self.max_tool_tokens, lambda s: s)
            answered = any(word in self.answer_words for word in result.split())
            return Turn(text[: text.rfind(reason)].rstrip(), [ToolCall(reason, {}, result, cut=cut)], ids, answered)
        return Turn(text, [], [], reason is not None)  # an answer word or end of turn ends it; None: out of budget


def _single_token_ids(tokenizer, groups: list[tuple[str, Any]]) -> dict[int, str]:
    """{token id: word} for a word-level vocabulary, where each stop word must be one word of the vocabulary."""
    ids = {}
    for what, words in groups:
        for word in words:
            pieces = tokenizer(word, add_special_tokens=False).input_ids
            if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in pieces:
                raise ValueError(f"{what} {word!r} is not in this tokenizer's word-level vocabulary; add it to the "
                                 "vocabulary (mrl.modeling.models.TASK_WORDS for the built-in model)")
            if len(pieces) != 1:
                raise ValueError(f"{what} {word!r} is {len(pieces)} words; in a word-level vocabulary it must be "
                                 "one word")
            ids[pieces[0]] = word
    return ids


class ChatProtocol:
    """The model's own chat format.  A turn ends at the template's end-of-turn token or at `</tool_call>`; the call
    is the JSON between `<tool_call>` and `</tool_call>`, parsed from text (any number of tokens).  A valid call to a
    tool with a function runs it, and its result comes back as the template's `tool` message (cut to
    `max_tool_tokens`); an unparseable call, an unknown tool or missing arguments come back as an error message the
    same way, and count as invalid.  A final message (end of turn, no call) ends the episode.

    The tools an episode may call are its prompt's own (`Prompt.tools`, a dataset record's declarations) when it
    has any, else the task's: a record's tools replace the task's, never add to them.
    parallel_calls: the turn ends only at the end of turn, and every `<tool_call>` block in it is read (BFCL's
      parallel calls).  For tasks whose calls are the answer (declared tools, never run): nothing has to come back
      between two calls, so the turn need not stop at the first.
    A prompt's `answer_prefix` (the text its answer starts with) is written after the generation prompt, as part of
    the prompt (never trained on), and read as the start of the turn; only with parallel_calls, whose episodes are
    one turn.
    """

    def __init__(self, tokenizer, tools: dict[str, Tool] | None = None, max_turns: int = 1,
                 max_tool_tokens: int = 256, chat_template_kwargs: dict[str, Any] | None = None,
                 parallel_calls: bool = False, environment: Callable[[Prompt], Environment] | None = None):
        self.tokenizer, self.max_turns, self.max_tool_tokens = tokenizer, max_turns, max_tool_tokens
        self.tools, self.parallel_calls, self.environments = dict(tools or {}), parallel_calls, environment
        if parallel_calls and any(t.fn is not None for t in self.tools.values()):
            raise UserError("parallel tool calls are read only for tools that never run (the calls are the answer); "
                            f"these tools run: {', '.join(t.name for t in self.tools.values() if t.fn)}")
        self.template = inspect_template(tokenizer, json.dumps(chat_template_kwargs or {}, sort_keys=True))
        if self.template.problems:
            raise UserError("model.tool_format=chat cannot append tool results with this chat template: "
                            + "; ".join(self.template.problems)
                            + ".  Use model.tool_format=words, or give the model a chat template that renders "
                              "`tool` messages the same after any conversation.")
        self.stops = Stops(frozenset({self.template.end_id}), () if parallel_calls else (CALL_CLOSE,))
        longest = max(list(self.tools) + ["tool"], key=len)
        wrapping = len(tokenizer(self.template.suffix("", longest, True), add_special_tokens=False).input_ids)
        if wrapping > max_tool_tokens:
            raise UserError(f"trainer.max_tool_tokens={max_tool_tokens} is below the {wrapping} tokens this chat "
                            "template wraps every tool result in; raise it (e.g. 256)")

    def tools_of(self, prompt: Prompt) -> dict[str, Tool]:
        """The tools `prompt`'s episodes may call: its own declarations (never run), else the task's."""
        if not prompt.tools:
            return self.tools
        return {d["function"]["name"]: Tool(d["function"]["name"], d["function"].get("description", ""),
                                            d["function"].get("parameters") or {"type": "object", "properties": {}})
                for d in prompt.tools}

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        tools = [t.schema for t in self.tools_of(prompt).values()]
        messages = self.template.normalize(prompt.chat())
        if tools and not self.template.renders_tools:
            messages = self.template.with_system(messages, tools_prompt(tools))
        text = self.template.render(messages, tools=tools if tools and self.template.renders_tools else None,
                                    generation_prompt=True)
        if prompt.answer_prefix and not (self.parallel_calls or self.environments):
            raise UserError("an answer prefix is written before the first turn only, so it needs a one-turn task "
                            "whose calls are the answer (parallel_calls) or a stateful environment (it then starts "
                            "the first reply of every user turn)")
        return self.tokenizer(text + prompt.answer_prefix, add_special_tokens=False).input_ids

    def environment(self, prompt: Prompt) -> Environment | None:
        return self.environments(prompt) if self.environments is not None else None

    def turn(self, prompt: Prompt, text: str, reason: str | None, env: Environment | None = None) -> Turn:
        if self.parallel_calls:
            return self._final_calls(prompt, text, reason)
        if env is not None:
            return self._world_turn(env, text, reason, prompt.answer_prefix)
        visible, body = split_turn(text, reason == CALL_CLOSE)
        if reason is None or body is None:  # out of budget, or a final message
            return Turn(visible, [], [], reason is not None)
        tools = self.tools_of(prompt)
        name, arguments, error = check_call(body, tools)
        if error is None and tools[name].fn is None:  # a final action: the call is the answer
            return Turn(visible, [ToolCall(name, arguments)], [], True)
        result = f"error: {error}" if error else tools[name](prompt, arguments)
        ids, result, cut = _cut_to(self.tokenizer, result, self.max_tool_tokens,
                                   lambda s: self.template.suffix(s, name or "tool", reason == CALL_CLOSE))
        return Turn(visible, [ToolCall(name, arguments, result, valid=error is None, cut=cut)], ids, False)

    def _world_turn(self, env: Environment, text: str, reason: str | None, prefix: str) -> Turn:
        """A turn of a stateful episode: a call runs on `env` and its result comes back; a turn without a call (or
        one that spends the turn's calls) is followed by the user's next message, in the same tokens a chat
        template gives a new user message; the episode ends when the user has nothing more to say.  `prefix` (the
        prompt's answer_prefix) starts the first reply of every user turn: written after the generation prompt,
        as part of the observation (never trained on)."""
        if env.calls_this_turn == 0:
            text = prefix + text
        visible, body = split_turn(text, reason == CALL_CLOSE)
        if reason is None:  # out of budget
            return Turn(visible, [], [], False)
        if body is None:
            message = env.next_message()
            if message is None:
                return Turn(visible, [], [], True)
            return Turn(visible, [], self._encode(self.template.reply_suffix(message) + prefix), False)
        name, arguments, error = read_call(body)
        turn = env.user_turn
        result = env.call(name, arguments)
        if error is None and result is None:
            offered = ", ".join(sorted(env.available()))
            error = f"there is no function {name!r} in this turn; the functions are: {offered}"
        if error:
            result = f"error: {error}"
        spent = env.turn_over()  # the turn's calls are spent: the user's next message follows the result
        message = env.next_message() if spent else None
        if spent and message is None:  # ... and that was the last user turn: the episode is over
            return Turn(visible, [ToolCall(name, arguments, result, valid=error is None, user_turn=turn)], [], True)
        after = prefix if spent else ""  # the user's next message opens a turn: its first reply starts with prefix
        ids, result, cut = _cut_to(self.tokenizer, result, self.max_tool_tokens,
                                   lambda s: self.template.suffix(s, name or "tool", reason == CALL_CLOSE, message)
                                   + after)
        return Turn(visible, [ToolCall(name, arguments, result, valid=error is None, cut=cut, user_turn=turn)], ids,
                    False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _final_calls(self, prompt: Prompt, text: str, reason: str | None) -> Turn:
        """Every call of a turn that ended at its end of turn (None: out of budget, its calls unfinished); the
        calls are the answer, so nothing comes back and the episode ends."""
        visible, bodies = split_calls(prompt.answer_prefix + text)
        if reason is None:
            return Turn(visible, [], [], False)
        tools = self.tools_of(prompt)
        calls = []
        for body in bodies:
            name, arguments, error = check_call(body, tools)
            calls.append(ToolCall(name, arguments, "" if error is None else f"error: {error}", valid=error is None))
        return Turn(visible, calls, [], True)


def check_call(body: str, tools: dict[str, Tool]) -> tuple[str, Any, str | None]:
    """(name, arguments, error) of a `<tool_call>` body checked against `tools`: unparseable, unknown tool or bad
    arguments give the error said to the policy; None when the call is valid."""
    name, arguments, error = read_call(body)
    if error is None and name not in tools:
        error = f"there is no tool {name!r}; the tools are: {', '.join(tools) or 'none'}"
    if error is None:
        error = tools[name].argument_error(arguments)
    return name, arguments, error


def split_calls(text: str) -> tuple[str, list[str]]:
    """(the visible text, the body of every `<tool_call>` block) of a turn that may hold several calls; an opened
    block left unclosed is a call too (its body runs to the end).  One pass: linear in the text's length, however
    many blocks or unclosed tags the policy writes.

    >>> split_calls('Both.<tool_call>{"name": "a"}</tool_call>\\n<tool_call>{"name": "b"}</tool_call>')
    ('Both.', ['{"name": "a"}', '{"name": "b"}'])
    """
    text = strip_thinking(text)
    visible, bodies, pos = None, [], 0
    while True:
        start, end = text.find(CALL_OPEN, pos), text.find(CALL_CLOSE, pos)
        if start < 0 and end < 0:
            return text.strip() if visible is None else visible, bodies
        if visible is None:
            visible = text[:start].strip() if start >= 0 else ""
        bodies.append(text[start + len(CALL_OPEN) if start >= 0 else pos: end if end >= 0 else len(text)])
        if end < 0:
            return visible, bodies
        pos = end + len(CALL_CLOSE)
        if text.find(CALL_OPEN, pos) < 0:
            return visible, bodies


def strip_thinking(text: str) -> str:
    """`text` without its `<think>...</think>` blocks, and without everything from a `<think>` never closed, in one
    pass (a lazy regex rescans the rest of the text from every unclosed opener: quadratic in 32k of them).

    >>> strip_thinking("a<think>b</think>c<think>d"), strip_thinking("<think>" * 3 + "x")
    ('ac', '')
    """
    kept, pos = [], 0
    while (start := text.find(THINK_OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:  # thinking that never finished
            return "".join(kept)
        pos = end + len(THINK_CLOSE)
    return "".join(kept) + text[pos:]


def split_turn(text: str, closed: bool) -> tuple[str, str | None]:
    """(the policy's visible text, the body of its tool call or None) of one chat turn; `closed`: the turn ended at
    `</tool_call>`, so it is a call even if its opening tag is missing.

    >>> split_turn('<think>7?</think>Let me check.<tool_call>{"name": "calc"}', False)
    ('Let me check.', '{"name": "calc"}')
    >>> split_turn("<think>\\n\\n</think>\\n\\n7", False), split_turn("<think>unfinished", False)
    (('7', None), ('', None))
    """
    text = strip_thinking(text)
    start, end = text.find(CALL_OPEN), text.find(CALL_CLOSE)
    if start < 0 and end < 0 and not closed:
        return text.strip(), None
    visible = text[:start] if start >= 0 else ""
    body = text[start + len(CALL_OPEN) if start >= 0 else 0: end if end >= 0 else len(text)]
    return visible.strip(), body


def read_call(body: str) -> tuple[str, Any, str | None]:
    """(name, arguments, error) of the JSON in a `<tool_call>` block; the error, said to the policy, or None.

    >>> read_call('{"name": "calc", "arguments": {"a": 3}}'), read_call('{"name": "calc"}')[:2]
    (('calc', {'a': 3}, None), ('calc', {}))

    Total: any text gives a call or an error (its size, nesting and numbers bounded by mrl.core.safe_json), never an
    exception: a policy cannot stop the trainer by what it writes.

    >>> read_call('{"name": "calc", "arguments": ' + '[' * 1000)[2][:45]
    'the tool call is nested deeper than 32 levels'
    """
    example = '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'
    try:
        call = safe_json.loads(body.strip(), MAX_CALL_CHARS)
    except safe_json.Unreadable as err:
        return "", {}, f"the tool call {err}; write {example}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "", {}, f"the tool call needs a \"name\"; write {example}"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = safe_json.loads(arguments, MAX_CALL_CHARS)
        except safe_json.Unreadable:
            pass
    return call["name"], arguments, None


def tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """The system prompt that declares tools to a chat template that does not render `tools=` (e.g. SmolLM2's)."""
    lines = ["You can call tools. To call one, write", call_text("<tool name>", {"<argument>": "<value>"}),
             "and end your message there; the result comes back in the next message. The tools:"]
    return "\n".join(lines + [json.dumps(s["function"]) for s in schemas])


@dataclass(frozen=True)
class ProtocolSettings:
    """What the task and the config ask of a tool protocol.  environment: the task's `environment(prompt)`, for
    stateful episodes (chat only)."""

    use_chat_template: bool
    chat_template_kwargs: dict[str, Any]
    tools: dict[str, Tool]
    max_turns: int
    answer_words: tuple[str, ...]
    max_tool_tokens: int
    parallel_calls: bool = False
    environment: Callable[[Prompt], Environment] | None = None


def words_protocol(tokenizer, s: ProtocolSettings) -> WordsProtocol:
    if s.environment is not None:
        raise UserError("this task's episodes run in a stateful environment with a user who speaks several times, "
                        "which only the chat protocol runs; use a chat model (model.tool_format=chat or auto)")
    return WordsProtocol(tokenizer, s.tools, s.answer_words, s.max_turns, s.max_tool_tokens, s.use_chat_template,
                         s.chat_template_kwargs)


def chat_protocol(tokenizer, s: ProtocolSettings) -> ChatProtocol:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("model.tool_format=chat needs a chat template, and this tokenizer has none; use "
                        "model.tool_format=words (or auto)")
    return ChatProtocol(tokenizer, s.tools, s.max_turns, s.max_tool_tokens, s.chat_template_kwargs, s.parallel_calls,
                        s.environment)


def auto_protocol(tokenizer, s: ProtocolSettings) -> ToolProtocol:
    """Chat for a model used with its chat template (one it has), else words."""
    chat = s.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    return (chat_protocol if chat else words_protocol)(tokenizer, s)


# model.tool_format -> (tokenizer, ProtocolSettings) -> ToolProtocol
PROTOCOLS = Registry("model.tool_format", "mrl/chat/protocols.py PROTOCOLS",
                     {"auto": auto_protocol, "words": words_protocol, "chat": chat_protocol})


def make_protocol(tokenizer, tool_format: str, settings: ProtocolSettings) -> ToolProtocol:
    """The protocol `model.tool_format` names (PROTOCOLS), for `settings`."""
    return PROTOCOLS.choose(tool_format)(tokenizer, settings)


def check(cfg) -> None:
    """`model.tool_format` names a registered protocol."""
    PROTOCOLS.choose(cfg.model.tool_format)
