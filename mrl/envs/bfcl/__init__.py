"""bfcl: BFCL v4 single-turn function calling (the Berkeley Function Calling Leaderboard), read from the installed
`bfcl-eval` package (`make bfcl`, files.py) and graded as BFCL's own AST checker grades (grader.py: `grade`).
This module: the task and its channels.

An episode is one BFCL record: its own functions are the only tools declared (JSON schemas, through the chat
template's `tools=` or mrl's system prompt), its own messages are the conversation, and the calls the model writes in
its chat format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several for the parallel categories)
are the answer: nothing runs, and the episode ends with the model's turn.

The held-out split is fixed by record id (crc32 of the id, so the same records whatever the seed, the categories
chosen or the package's record order): about `eval_percent`% of each category is never trained on.

Channels: format (well-formed calls of declared functions), correctness (BFCL's own verdict), right_functions
(shaping) and, on irrelevance records, a constraint against calling anything (no_call); not in the preset,
GradedCorrectness (ToolRL's graded correctness, the GDPO paper's tool-calling reward: repro-paper adds it).
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any

from mrl.core.config import UserError
from mrl.core.data import SplitPrompts
from mrl.core.episode import Demonstration, Episode, Prompt, Reply
from mrl.envs.bfcl import grader
from mrl.envs.bfcl.files import tool_schemas
from mrl.envs.task import TaskBase

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


def split_by_id(records: list[dict], eval_percent: float) -> tuple[list[dict], list[dict]]:
    """(train, held out) of `records`, in their order, by `held_out` of each one's id."""
    return ([r for r in records if not held_out(r["id"], eval_percent)],
            [r for r in records if held_out(r["id"], eval_percent)])


class BfclTask(TaskBase):
    """BFCL v4 records of `categories` as prompts; `prompt(index)` walks the train split (reshuffled each epoch,
    mrl.core.data.SplitPrompts), `eval_prompts()` the held-out one.

    format_hint: a sentence added to the last user turn saying how to answer (a lever for small models; BFCL's own
      prompts leave it to the model's tool format).
    fewshot: solved examples before the question: other train records of the same categories (fixed per record
      by the seed), each its user turn and an assistant turn with its gold call; their functions are declared after
      the record's own (a lever for small models, which learn the call format from them).
    fewshot_shared: the same `fewshot` examples before every record: the accepted train records with the shortest
      question and declarations, each of another function, their functions declared before the record's own.  Every
      prompt then starts with the same preamble, declarations and nothing else of its own, a prefix generation
      computes once (mrl.generation.rollout.shared_prefix_length): a held-out evaluation with shots costs about what it
      costs without (docs/evaluation.md).  A train record that is one of them gets the next one instead.
    answer_prefix: the text every answer starts with, written into the prompt (e.g. `<tool_call>{"name": "`: a lever
      for small models, which then only fill in the call; never for the irrelevance categories, where it would
      force a call).
    eval_per_category: the first this many held-out records of each category (0: all of them), so that a held-out
      evaluation a CPU can afford still covers every category.
    """

    parallel_calls = True  # BFCL's parallel categories answer with several calls in one turn

    def __init__(self, categories: list[str] | str = ("simple_python",), seed: int = 0, eval_percent: float = 20.0,
                 format_hint: bool = False, fewshot: int = 0, answer_prefix: str = "", eval_per_category: int = 0,
                 fewshot_shared: bool = False):
        categories = [categories] if isinstance(categories, str) else list(categories)
        if not categories:
            raise UserError(f"rewards.task.categories is empty; choose some of {list(grader.CATEGORIES)}")
        if not 0 <= eval_percent < 100:
            raise UserError(f"rewards.task.eval_percent={eval_percent} must be in [0, 100), e.g. 20")
        if answer_prefix and any(c in IRRELEVANCE for c in categories):
            raise UserError(f"rewards.task.answer_prefix={answer_prefix!r} would force a call on the irrelevance "
                            "categories, where the right answer is none; drop one or the other")
        self.seed, self.format_hint, self.fewshot, self.answer_prefix = seed, format_hint, fewshot, answer_prefix
        self.fewshot_shared = fewshot_shared
        records = [entry for category in categories for entry in grader.load_entries(category)]
        train, held = split_by_id(records, eval_percent)
        if eval_per_category:
            held = [kept for category in categories
                    for kept in [e for e in held if e["category"] == category][:eval_per_category]]
        if not train:
            raise UserError(f"BFCL categories {categories} leave no train records at eval_percent={eval_percent}")
        self.split = SplitPrompts(train, held, f"bfcl/{seed}", self.to_prompt)
        self.shared_shots = self._shared_shots() if fewshot and fewshot_shared else []

    def prompt(self, index: int) -> Prompt:
        return self.split.prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        """The held-out records, in the package's order."""
        return self.split.eval_prompts()

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """Every solved train record: a fixed set, which `count` (a generator's) does not cut."""
        return self.split.demonstrations(split, "rewards=bfcl", self._demonstration)

    def _demonstration(self, entry: dict[str, Any]) -> Demonstration | None:
        """A train record answered with its gold calls (an allowed value per argument, optional ones omitted; a
        parallel record's calls in one turn), where BFCL accepts them; an irrelevance record with a sentence and no
        call."""
        if entry["category"] in IRRELEVANCE:
            reply = Reply(NO_FUNCTION_FITS)
        elif grader.grade(entry, grader.gold_calls(entry)):
            reply = Reply("", tuple(grader.gold_calls(entry)))
        else:
            return None
        return Demonstration(self.to_prompt(entry), (reply,), entry["id"])

    def to_prompt(self, entry: dict[str, Any]) -> Prompt:
        messages = grader.messages(entry)
        if self.format_hint:
            last = messages[-1]
            messages = messages[:-1] + [{**last, "content": f"{last['content']}\n\n{FORMAT_HINT}"}]
        shots = self._shots(entry)
        solved = [m for shot in shots for m in _solved(shot)]
        system = [m for m in messages if m["role"] == "system"]
        messages = system + solved + [m for m in messages if m["role"] != "system"]
        # The record's functions first, the examples' after; shared examples' first, so the prompts share them too.
        tools = []
        for source in [*shots, entry] if self.fewshot_shared else [entry, *shots]:
            declared = {t["function"]["name"] for t in tools}
            tools += [t for t in tool_schemas(source) if t["function"]["name"] not in declared]
        meta = {key: entry[key] for key in ("id", "category", "ground_truth", "function")}
        return Prompt(text=messages[-1]["content"], meta=meta, messages=messages, tools=tools,
                      answer_prefix=self.answer_prefix)

    def _shots(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """`fewshot` train records other than `entry`, whose gold calls BFCL accepts, the same for the same seed."""
        if not self.fewshot:
            return []
        if self.fewshot_shared:
            return [shot for shot in self.shared_shots if shot["id"] != entry["id"]][:self.fewshot]
        rng = random.Random(f"bfcl-shots/{self.seed}/{entry['id']}")
        shots = []
        train = self.split.train
        for candidate in rng.sample(train, min(len(train), 4 * self.fewshot + 1)):
            if candidate["id"] != entry["id"] and grader.grade(candidate, grader.gold_calls(candidate)) \
                    and candidate["category"] not in IRRELEVANCE:
                shots.append(candidate)
            if len(shots) == self.fewshot:
                break
        return shots

    def _shared_shots(self) -> list[dict[str, Any]]:
        """`fewshot` + 1 accepted train records with the shortest question and declarations, each calling another
        function (one spare, for a train record that is itself one of them)."""
        def size(entry: dict[str, Any]) -> tuple[int, str]:
            return len(json.dumps([entry["question"], entry["function"]])), entry["id"]

        shots, functions = [], set()
        for candidate in sorted(self.split.train, key=size):
            names = {name for name, _ in grader.gold_calls(candidate)}
            if candidate["category"] not in IRRELEVANCE and not names & functions \
                    and grader.grade(candidate, grader.gold_calls(candidate)):
                shots.append(candidate)
                functions |= names
            if len(shots) == self.fewshot + 1:
                break
        return shots


def _solved(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's user turn and an assistant turn making its gold call(s), for a few-shot example."""
    calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}
             for name, arguments in grader.gold_calls(entry)]
    question = [m for m in grader.messages(entry) if m["role"] != "system"]
    return question + [{"role": "assistant", "content": "", "tool_calls": calls}]


# -------------------------------------------------------------------------------------------------------- the channels

def episode_calls(episode: Episode) -> list[tuple[str, Any]]:
    """The calls an episode made, as BFCL's checker reads a decoded answer: (name, arguments) of every call the
    model wrote as a JSON object with a name; an unparseable block is no call (BFCL: a failed decode)."""
    return [(c.name, c.arguments) for c in episode.tool_calls if c.name]


def _irrelevant(episode: Episode) -> bool:
    return episode.prompt.meta["category"] in IRRELEVANCE


class Format:
    """1.0 when the episode makes at least one call and every call is valid (parseable JSON, a declared function,
    its required arguments present) and calls one of the record's own functions, else 0.0.  Abstains (None) on
    irrelevance records, where no call is right.

    The record's own: few-shot examples declare their functions too, and a policy paid for any valid call learned to
    copy the example's call word for word (format 0.03 -> 0.8 while held-out accuracy fell back to 0).
    """

    def __call__(self, episode: Episode) -> float | None:
        if _irrelevant(episode):
            return None
        own = {doc["name"] for doc in episode.prompt.meta["function"]}
        calls = episode.tool_calls
        return float(bool(calls) and all(c.valid and c.name in own for c in calls))


class Correctness:
    """BFCL's verdict, 1.0 or 0.0 (grader.grade): the right function(s) with allowed values of the
    right types, parallel calls in any order; on irrelevance records, 1.0 for no call at all."""

    def __call__(self, episode: Episode) -> float:
        calls = episode_calls(episode)
        if any(not isinstance(arguments, dict) for _, arguments in calls):
            return 0.0
        return float(grader.grade(episode.prompt.meta, calls))


class NoCall:
    """A constraint of irrelevance records: -1.0 when the episode calls any function (none of the declared ones
    fits the request), 0.0 when it does not.  Abstains on the other records."""

    def __call__(self, episode: Episode) -> float | None:
        if not _irrelevant(episode):
            return None
        return -1.0 if episode_calls(episode) else 0.0


class RightFunctions:
    """Partial credit BFCL does not give: 1.0 when the episode calls exactly the functions the ground truth calls
    (as a multiset, any order), whatever their arguments, else 0.0.  A denser signal than correctness for a model
    that rarely gets every argument right at first.  Abstains on irrelevance records (no_call grades those).

    Ground truth [get_weather, get_time]: calls get_time + get_weather -> 1.0; get_weather alone -> 0.0.
    """

    def __call__(self, episode: Episode) -> float | None:
        if _irrelevant(episode):
            return None
        wanted = sorted(name for answer in episode.prompt.meta["ground_truth"] for name in answer)
        return float(sorted(name for name, _ in episode_calls(episode)) == wanted)


class GradedCorrectness:
    """ToolRL's correctness reward, in [-3, 3] (grader.toolrl_score): credit for the right functions, the right
    parameter names and each value BFCL accepts, where `correctness` pays only a whole right answer.  The reward the
    GDPO paper's tool-calling setting trains on beside a 1/0 format reward, so its scale is six times format's: the
    setting where GRPO's summed normalization and GDPO's per-channel one differ.  Abstains on irrelevance records.

    Ground truth spotify.play(artist="Taylor Swift", duration=20): that call -> 3.0; no call -> -3.0; the right
    function with the duration wrong -> 1.5 (6 * 3/4 - 3).
    """

    def __call__(self, episode: Episode) -> float | None:
        if _irrelevant(episode):
            return None
        return grader.toolrl_score(episode.prompt.meta, episode_calls(episode))
