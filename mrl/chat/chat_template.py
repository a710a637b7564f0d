"""Chat-template inspection: what a tokenizer's chat template does with tools, measured once on dummy conversations.

A chat result's tokens are the template's suffix for a `tool` message, rendered from a fixed dummy conversation, never
from the sampled history: templates such as Qwen3's render earlier assistant turns differently (they drop <think>
blocks), so re-rendering the history would change tokens the policy already saw.  `inspect_template` checks once per
tokenizer that this suffix is well defined (it does not depend on the conversation before it, and tokenizes the same
alone as in context).

A template is a Jinja program that came with the tokenizer (a checkpoint from elsewhere chose it): every render goes
through `render_template`, which stops one that runs longer than RENDER_SECONDS or writes more than RENDER_CHARS
(two nested `range(100000)` loops rendered for minutes).
"""

from __future__ import annotations

import ctypes
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterator

from jinja2.exceptions import TemplateError

from mrl.core.config import UserError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_LAYOUTS = 64  # tool names whose rendered layout ChatTemplate.suffix keeps (least recently used dropped)


def call_text(name: str, arguments: Any) -> str:
    """A call as mrl asks templates without tool support to write it."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


RENDER_SECONDS = 5.0  # SmolLM2's and Qwen3's templates render a conversation in about a millisecond
RENDER_CHARS = 1 << 22  # 4 Mi characters: ~1M tokens, far beyond any context mrl trains


class _Overran(BaseException):
    """Raised in the rendering thread when the render overran RENDER_SECONDS.  Not an Exception: no template code
    and no library `except Exception` catches it on its way out."""


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise `_Overran` in this thread once `seconds` pass inside the block.  A timer thread sets an asynchronous
    exception (CPython's PyThreadState_SetAsyncExc), raised at the next bytecode: a render is Python code (Jinja
    compiles templates to it), so it stops within a bytecode of the bound, in any thread (SIGALRM: the main one)."""
    target, lock, state = threading.get_ident(), threading.Lock(), {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(_Overran))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            if state["fired"]:  # raised already, or pending: a pending one is cleared here
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
        timer.cancel()
    if state["fired"]:  # fired as the block ended: still an overrun
        raise _Overran


def render_template(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)` within RENDER_SECONDS and RENDER_CHARS,
    or a one-line UserError naming the tokenizer and the fix."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    fix = "use a tokenizer whose template you trust, or model.use_chat_template=false and model.tool_format=words"
    try:
        with time_bound(RENDER_SECONDS):
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except _Overran:
        raise UserError(f"the chat template of {name} rendered one conversation for more than {RENDER_SECONDS:g} s "
                        f"(a template loops for ever or for hours): {fix}") from None
    except MemoryError:
        raise UserError(f"the chat template of {name} ran out of memory rendering one conversation: {fix}") from None
    if len(text) > RENDER_CHARS:
        raise UserError(f"the chat template of {name} wrote {len(text)} characters for one conversation, more than "
                        f"{RENDER_CHARS}: {fix}")
    return text


PROBE = "mrl_probe"  # a name, message or tool result the dummy conversations are measured with
PROBE_TOOL = {"type": "function", "function": {"name": PROBE, "description": "A probe.",
                                              "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ChatTemplate:
    """What a tokenizer's chat template does with tools, measured once on dummy conversations (`inspect_template`).

    renders_tools / renders_tool_calls / tool_role / system_role: whether `tools=`, an assistant message's
      `tool_calls`, `tool` messages and a system message reach the text; where not, mrl declares tools in a system
      prompt (or the first user message), writes calls as `<tool_call>` text, and sends results as user messages
      `<tool_response>...</tool_response>`.
    end_of_turn: the token that ends an assistant turn (`<|im_end|>`).
    prefix_preserving: appending a tool message leaves the rendered conversation before it unchanged (TRL's
      is_chat_template_prefix_preserving).  Not required: Qwen3's template is not (it drops the <think> block of
      an assistant turn once a tool message follows it), and mrl never re-renders the history.
    problems: why tool results cannot be appended token-in/token-out with this template (empty when they can): the
      text after the assistant's end of turn depends on the conversation before it, or tokenizes differently alone.
    """

    tokenizer: Any = field(repr=False)
    kwargs: str = "{}"  # chat_template_kwargs as sorted JSON
    renders_tools: bool = False
    renders_tool_calls: bool = False
    tool_role: bool = False
    system_role: bool = False
    end_of_turn: str = ""
    end_id: int = -1
    prefix_preserving: bool = True
    problems: tuple[str, ...] = ()
    _layouts: dict[str, tuple[str, int, str]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               generation_prompt: bool = False) -> str:
        return render_template(self.tokenizer, messages, tools=tools, add_generation_prompt=generation_prompt,
                               **json.loads(self.kwargs))

    def assistant_call(self, name: str, arguments: Any, content: str = "", reasoning: str | None = None) -> dict:
        calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}]
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return self.normalize([message])[0]

    def tool_message(self, name: str, content: str) -> dict:
        return self.normalize([{"role": "tool", "name": name, "content": content}])[0]

    def normalize(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` in forms this template renders: calls as `<tool_call>` text, results as user messages, where
        it has no tool support."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls") and not self.renders_tool_calls:
                calls = "".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
                m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": (m.get("content") or "") + calls}
            elif m["role"] == "tool" and not self.tool_role:
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        return out

    def with_system(self, messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
        """`text` put first in the system message (in the first user message, for templates without a system
        role)."""
        role = "system" if self.system_role else "user"
        if messages and messages[0]["role"] == role:
            return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}] + messages[1:]
        if role == "system":
            return [{"role": "system", "content": text}] + messages
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        return messages[:first] + [{**messages[first], "content": f"{text}\n\n{messages[first]['content']}"}] \
            + messages[first + 1:]

    def suffix(self, result: str, name: str, after_stop: bool, then_user: str | None = None) -> str:
        """The text a tool `result` adds after the assistant's turn, through the next generation prompt (with
        `then_user`: a user message after the result, the user's next turn).

        Rendered from a dummy conversation (a user message, an assistant call to `name`, the `tool` message), never
        from the sampled history, and cut after the assistant's end-of-turn token.  after_stop: the turn ended at
        `</tool_call>`, before the template's end of turn, which the suffix then starts with.
        """
        prefix, cut, closing = self._layouts.pop(name, None) or _layout(self, _dummy(self, name), name)
        self._layouts[name] = prefix, cut, closing  # the most recently used last: a dict keeps insertion order
        if len(self._layouts) > MAX_LAYOUTS:  # a tool name the policy invented costs ~40 KB: keep the recent ones
            del self._layouts[next(iter(self._layouts))]
        user = [{"role": "user", "content": then_user}] if then_user is not None else []
        text = self.render(_dummy(self, name) + [self.tool_message(name, result)] + user, generation_prompt=True)
        if text[:cut] != prefix:
            raise UserError(f"this chat template renders the conversation before a tool result differently for the "
                            f"result {result[:80]!r}; mrl cannot append tool results with it (model.tool_format=words)")
        return (closing if after_stop else "") + text[cut:]

    def reply_suffix(self, message: str) -> str:
        """The text a user `message` adds after an assistant's final message (which ended at its end-of-turn
        token), through the next generation prompt: rendered from a dummy conversation, cut after the assistant's
        end of turn, as `suffix`."""
        history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
        plain = self.render(history)
        cut = plain.find(self.end_of_turn, plain.rfind(PROBE)) + len(self.end_of_turn)
        text = self.render(history + [{"role": "user", "content": message}], generation_prompt=True)
        if cut < len(self.end_of_turn) or text[:cut] != plain[:cut]:
            raise UserError("this chat template renders an assistant message differently when a user message follows "
                            "it; mrl cannot append the user's next turn with it")
        return text[cut:]


def _dummy(template: ChatTemplate, name: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Hi"}, template.assistant_call(name, {})]


def _layout(template: ChatTemplate, history: list[dict[str, Any]], name: str) -> tuple[str, int, str]:
    """(the text before the cut, the cut, the closing text) of `history` followed by a tool message: the cut is
    where the assistant's end-of-turn token ends; the closing text is what the template writes after the call's
    `</tool_call>` up to the cut (`<|im_end|>`), or the end-of-turn token alone."""
    text = template.render(history + [template.tool_message(name, PROBE)], generation_prompt=True)
    eot = template.end_of_turn
    at = text.rfind(eot, 0, text.rfind(PROBE))
    if at < 0:
        raise UserError(f"this chat template writes no end-of-turn token {eot!r} between an assistant's tool call and "
                        "the tool's result, so mrl cannot tell where the turn ends; use model.tool_format=words")
    cut = at + len(eot)
    close = text.rfind(CALL_CLOSE, 0, at)
    closing = text[close + len(CALL_CLOSE): cut] if close > text.rfind(eot, 0, at) else eot
    return text[:cut], cut, closing


@lru_cache(maxsize=16)
def inspect_template(tokenizer, chat_template_kwargs: str = "{}") -> ChatTemplate:
    """Measure `tokenizer`'s chat template (with `chat_template_kwargs`, sorted JSON) on dummy conversations, once:
    which tool features it renders, its end-of-turn token, whether it is prefix-preserving, and whether a tool
    result's suffix is well defined (`problems` says why not)."""
    bare = ChatTemplate(tokenizer, chat_template_kwargs)

    def shows(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> bool:
        try:
            return PROBE in bare.render(messages, tools)
        except TemplateError:
            return False

    user = {"role": "user", "content": "Hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": PROBE, "arguments": {}}}]}
    template = ChatTemplate(
        tokenizer, chat_template_kwargs,
        renders_tools=shows([user], [PROBE_TOOL]),
        renders_tool_calls=shows([user, call]),
        system_role=shows([{"role": "system", "content": PROBE}, user]),
    )
    template = replace(template, tool_role=shows(_dummy(template, "calc") + [{"role": "tool", "name": "calc",
                                                                                 "content": PROBE}]))
    end_of_turn = _end_of_turn(template)
    template = replace(template, end_of_turn=end_of_turn, end_id=tokenizer.convert_tokens_to_ids(end_of_turn))

    # The suffix after the assistant's end of turn must not depend on what came before: compare a plain dummy with
    # a longer conversation (system message, other question, thinking and text before the call).
    prefix, cut, closing = _layout(template, _dummy(template, "calc"), "calc")
    rich = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? Use calc."},
            template.assistant_call("calc", {"a": 2, "b": 2}, "Let me check.", reasoning="Easy: calc.")]
    rich_prefix, rich_cut, rich_closing = _layout(template, rich, "calc")
    full = template.render(_dummy(template, "calc") + [template.tool_message("calc", PROBE)], generation_prompt=True)
    rich_full = template.render(rich + [template.tool_message("calc", PROBE)], generation_prompt=True)
    problems = []
    if (full[cut:], closing) != (rich_full[rich_cut:], rich_closing):
        problems.append(f"a tool message renders as {full[cut:]!r} after one conversation and as "
                        f"{rich_full[rich_cut:]!r} after another")

    # Tokenized alone, the suffix (and the closing text before it) must give the tokens it has in context.
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    seams = [cut] + ([cut - len(closing)] if closing != end_of_turn else [])
    for seam in seams:
        if encode(full[:seam]) + encode(full[seam:]) != encode(full):
            problems.append(f"the text {full[seam:seam + 40]!r} tokenizes differently alone than after "
                            f"{full[max(seam - 40, 0):seam]!r}")

    # Informational (TRL's prefix-preservation): does appending the tool message keep the rendered dummy?
    alone = template.render(_dummy(template, "calc"))
    alone = alone[: alone.rfind(end_of_turn) + len(end_of_turn)]
    return replace(template, prefix_preserving=full.startswith(alone), problems=tuple(problems))


def _end_of_turn(template: ChatTemplate) -> str:
    """The special token the template writes right after an assistant message's content (`<|im_end|>`)."""
    text = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}])
    after = text[text.rfind(PROBE) + len(PROBE):]
    specials = {t.content for t in template.tokenizer.added_tokens_decoder.values()}
    found = [(after.find(s), s) for s in specials if s and s in after]
    if not found:
        raise UserError("this chat template ends an assistant message with no special token (after the content "
                        f"comes {after[:40]!r}), so mrl cannot tell where a turn ends; use model.tool_format=words")
    return min(found, key=lambda f: (f[0], -len(f[1])))[1]  # the first, the longest of those starting there
