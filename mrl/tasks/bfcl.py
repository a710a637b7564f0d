"""bfcl: BFCL v4 single-turn function calling (the Berkeley Function Calling Leaderboard), read from the installed
`bfcl-eval` package (`make bfcl`) and graded as BFCL's own AST checker grades (mrl.benchmarks.bfcl.grade).

An episode is one BFCL record: its own functions are the only tools declared (JSON schemas, through the chat
template's `tools=` or mrl's system prompt), its own messages are the conversation, and the calls the model writes in
its chat format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several for the parallel categories)
are the answer: nothing runs, and the episode ends with the model's turn.

The held-out split is fixed by record id (crc32 of the id, so the same records whatever the seed, the categories
chosen or the package's record order): about `eval_percent`% of each category is never trained on.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from mrl.benchmarks import bfcl
from mrl.benchmarks.bfcl_data import tool_schemas
from mrl.config import UserError
from mrl.data import EpochStream
from mrl.episode import Demonstration, Prompt, Reply, train_split_only

IRRELEVANCE = ("irrelevance", "live_irrelevance")
NO_FUNCTION_FITS = "None of the functions given can answer this request."
FORMAT_HINT = ("Answer with the function call(s) only, each as <tool_call>{\"name\": ..., \"arguments\": {...}}"
               "</tool_call>, or with a short sentence if no function fits.")


def held_out(record_id: str, eval_percent: float) -> bool:
    """Whether a record is in the fixed held-out split: crc32(id) mod 100 below `eval_percent`.

    >>> held_out("simple_python_0", 20), held_out("simple_python_0", 0)
    (False, False)
    """
    return zlib.crc32(record_id.encode()) % 100 < eval_percent


class BfclTask:
    """BFCL v4 records of `categories` as prompts; `prompt(index)` walks the train split (reshuffled each epoch, as
    mrl.data.DatasetTask), `eval_prompts()` the held-out one.

    format_hint: a sentence added to the last user turn saying how to answer (a lever for small models; BFCL's own
      prompts leave it to the model's tool format).
    fewshot: solved examples before the question: other train records of the same categories (fixed per record
      by the seed), each its user turn and an assistant turn with its gold call; their functions are declared after
      the record's own (a lever for small models, which learn the call format from them).
    answer_prefix: the text every answer starts with, written into the prompt (e.g. `<tool_call>{"name": "`: a lever
      for small models, which then only fill in the call; never for the irrelevance categories, where it would
      force a call).
    eval_per_category: the first this many held-out records of each category (0: all of them), so that a held-out
      evaluation a CPU can afford still covers every category.
    """

    parallel_calls = True  # BFCL's parallel categories answer with several calls in one turn

    def __init__(self, categories: list[str] | str = ("simple_python",), seed: int = 0, eval_percent: float = 20.0,
                 format_hint: bool = False, fewshot: int = 0, answer_prefix: str = "", eval_per_category: int = 0):
        categories = [categories] if isinstance(categories, str) else list(categories)
        if not categories:
            raise UserError(f"rewards.task.categories is empty; choose some of {list(bfcl.CATEGORIES)}")
        if not 0 <= eval_percent < 100:
            raise UserError(f"rewards.task.eval_percent={eval_percent} must be in [0, 100), e.g. 20")
        if answer_prefix and any(c in IRRELEVANCE for c in categories):
            raise UserError(f"rewards.task.answer_prefix={answer_prefix!r} would force a call on the irrelevance "
                            "categories, where the right answer is none; drop one or the other")
        self.seed, self.format_hint, self.fewshot, self.answer_prefix = seed, format_hint, fewshot, answer_prefix
        records = [entry for category in categories for entry in bfcl.load_entries(category)]
        self.train = [e for e in records if not held_out(e["id"], eval_percent)]
        self.eval = [e for e in records if held_out(e["id"], eval_percent)]
        if eval_per_category:
            self.eval = [kept for category in categories
                         for kept in [e for e in self.eval if e["category"] == category][:eval_per_category]]
        if not self.train:
            raise UserError(f"BFCL categories {categories} leave no train records at eval_percent={eval_percent}")
        self._stream = EpochStream(self.train, f"bfcl/{seed}")

    def __len__(self) -> int:
        return len(self.train)

    def prompt(self, index: int) -> Prompt:
        """Train record number `index` of the stream: the same index always gives the same prompt."""
        return self.to_prompt(self._stream[index])

    def eval_prompts(self) -> list[Prompt]:
        """The held-out records, in the package's order (never served by `prompt()`)."""
        return [self.to_prompt(e) for e in self.eval]

    def demonstrations(self, split: str = "train") -> list[Demonstration]:
        """Each train record answered with its gold calls (an allowed value per argument, optional ones omitted;
        a parallel record's calls in one turn), where BFCL accepts them; an irrelevance record with a sentence and
        no call."""
        train_split_only(split, "rewards=bfcl")
        demos = []
        for entry in self.train:
            if entry["category"] in IRRELEVANCE:
                reply = Reply(NO_FUNCTION_FITS)
            elif bfcl.grade(entry, bfcl.gold_calls(entry)):
                reply = Reply("", tuple(bfcl.gold_calls(entry)))
            else:
                continue
            demos.append(Demonstration(self.to_prompt(entry), (reply,), entry["id"]))
        return demos

    def to_prompt(self, entry: dict[str, Any]) -> Prompt:
        messages = bfcl.messages(entry)
        if self.format_hint:
            last = messages[-1]
            messages = messages[:-1] + [{**last, "content": f"{last['content']}\n\n{FORMAT_HINT}"}]
        shots = self._shots(entry)
        solved = [m for shot in shots for m in _solved(shot)]
        system = [m for m in messages if m["role"] == "system"]
        messages = system + solved + [m for m in messages if m["role"] != "system"]
        tools = tool_schemas(entry)
        for shot in shots:  # the examples' functions after the record's own, each declared once
            declared = {t["function"]["name"] for t in tools}
            tools += [t for t in tool_schemas(shot) if t["function"]["name"] not in declared]
        meta = {key: entry[key] for key in ("id", "category", "ground_truth", "function")}
        return Prompt(text=messages[-1]["content"], meta=meta, messages=messages, tools=tools,
                      answer_prefix=self.answer_prefix)

    def _shots(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """`fewshot` train records other than `entry`, whose gold calls BFCL accepts, the same for the same seed."""
        if not self.fewshot:
            return []
        rng = random.Random(f"bfcl-shots/{self.seed}/{entry['id']}")
        shots = []
        for candidate in rng.sample(self.train, min(len(self.train), 4 * self.fewshot + 1)):
            if candidate["id"] != entry["id"] and bfcl.grade(candidate, bfcl.gold_calls(candidate)) \
                    and candidate["category"] not in IRRELEVANCE:
                shots.append(candidate)
            if len(shots) == self.fewshot:
                break
        return shots


def _solved(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's user turn and an assistant turn making its gold call(s), for a few-shot example."""
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}
             for name, arguments in bfcl.gold_calls(entry)]
    question = [m for m in bfcl.messages(entry) if m["role"] != "system"]
    return question + [{"role": "assistant", "content": "", "tool_calls": calls}]
