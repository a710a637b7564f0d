"""bfcl_agent: BFCL v4 multi-turn as an agent gym (gym.py: the data, the worlds, the checks).  This module: the task
and its channels.

An episode is one BFCL entry.  Its classes are instantiated from the entry's `initial_config` (a world per rollout),
their functions are declared as tools, and its user turns come one after another: the first is the prompt; within a
turn the agent calls tools (`<tool_call>` JSON in its chat format), each dispatched as a method call on the world
with the parsed arguments, its result read back as a `tool` message, until it answers without a call or has made
`max_calls_per_turn` calls; then the user's next message comes (a miss_func turn that adds functions declares them
in that message: the tools of a transcript already under way cannot be declared again), and after the last turn the
episode ends.

The held-out split is fixed by entry id, as in mrl.envs.bfcl (crc32 of the id): the same entries whatever the seed.

Channels: correctness, the share of turns passed, efficiency, and safety as a constraint.  Each replays the
episode's calls on fresh worlds beside the ground truth (gym.replay),
once per episode whatever the number of channels.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from mrl.core.config import UserError
from mrl.core.data import SplitPrompts
from mrl.core.episode import Demonstration, Episode, Prompt, Reply
from mrl.envs.bfcl import split_by_id
from mrl.envs.bfcl_agent import gym
from mrl.envs.task import TaskBase

DONE = "Done."  # the answer that hands a user turn back, in few-shot examples and demonstrations


class BfclWorld:
    """One episode's world (mrl.chat.protocols.Environment): the entry's instances, the user turn under way, and the
    calls made in it."""

    def __init__(self, entry: dict, max_calls_per_turn: int, compact: bool, gold_only: bool):
        self.entry, self.max_calls_per_turn = entry, max_calls_per_turn
        self.compact, self.gold_only = compact, gold_only
        self.world = gym.World(entry)
        self.messages = gym.user_turns(entry)
        self.user_turn, self.calls_this_turn = 0, 0
        self._available = gym.available(entry, 0, gold_only)

    def available(self) -> set[str]:
        return self._available

    def call(self, name: str, arguments: Any) -> str | None:
        self.calls_this_turn += 1
        return self.world.call(name, arguments) if name in self._available else None

    def turn_over(self) -> bool:
        return self.calls_this_turn >= self.max_calls_per_turn

    def next_message(self) -> str | None:
        if self.user_turn + 1 >= len(self.messages):
            return None
        self.user_turn += 1
        self.calls_this_turn = 0
        self._available = gym.available(self.entry, self.user_turn, self.gold_only)
        added = gym.added_docs(self.entry, self.user_turn, self.gold_only)
        message = self.messages[self.user_turn]
        if added:  # BFCL's prompting form: the new functions' docs, then its sentence
            docs = "\n".join(json.dumps(s["function"]) for s in gym.schemas(added, self.compact))
            message = "\n\n".join(part for part in (docs, gym.ADDED_FUNCTIONS, message) if part)
        return message


class BfclAgentTask(TaskBase):
    """BFCL v4 multi-turn entries of `categories` as stateful agent episodes; `prompt(index)` walks the train split
    (reshuffled each epoch), `eval_prompts()` the held-out one.

    max_calls_per_turn: calls the agent may make in one user turn before the user's next message comes (BFCL's own
      limit is 20 steps; its ground truth needs at most ~6).
    classes: only entries whose classes are all among these (empty: every entry); a lever for small models and short
      prompts, since every involved class's functions are declared.
    compact_docs: declare each function without the preamble BFCL repeats in every description (~half the tokens).
    gold_functions_only: declare (and make available) only the functions the ground truth calls: no distractors and
      a prompt ~4x shorter; an easier task, a lever for small models and CPUs (the channels know it: a function not
      declared is not available).
    fewshot: solved examples before the question: other train entries' first user turn, each call of their ground
      truth as an assistant turn with its real result, then a short answer (fixed per entry by the seed); only
      entries whose calls are all available in this one (a lever for small models, which learn the call format
      from them).
    answer_prefix: the text the first reply of every user turn starts with, written after the generation prompt
      (e.g. `<tool_call>{"name": "`: a lever for small models, which then only fill in a call; it forces a call
      where BFCL's miss_param turns want a question back).
    max_user_turns: only entries with at most this many user turns (0: any); with `classes` and the two limits
      below, a subset sized for a CPU.
    max_entries, max_eval_entries: at most this many train / held-out entries (0: all), the first in crc32 order of
      their ids (fixed, whatever the seed).
    """

    def __init__(self, categories: list[str] | str = ("multi_turn_base",), seed: int = 0, eval_percent: float = 20.0,
                 max_calls_per_turn: int = 10, classes: list[str] | tuple = (), compact_docs: bool = False,
                 gold_functions_only: bool = False, fewshot: int = 0, answer_prefix: str = "",
                 max_user_turns: int = 0, max_entries: int = 0, max_eval_entries: int = 0):
        categories = [categories] if isinstance(categories, str) else list(categories)
        if not categories:
            raise UserError(f"rewards.task.categories is empty; choose some of {list(gym.CATEGORIES)}")
        if not 0 <= eval_percent < 100:
            raise UserError(f"rewards.task.eval_percent={eval_percent} must be in [0, 100), e.g. 20")
        if max_calls_per_turn < 1:
            raise UserError(f"rewards.task.max_calls_per_turn={max_calls_per_turn} must be at least 1, e.g. 10")
        unknown = sorted(set(classes) - set(gym.CLASSES))
        if unknown:
            raise UserError(f"rewards.task.classes has {unknown}, not BFCL classes; choose from {sorted(gym.CLASSES)}")
        self.max_calls_per_turn, self.compact_docs = max_calls_per_turn, compact_docs
        self.gold_only = gold_functions_only
        self.seed, self.fewshot, self.answer_prefix = seed, fewshot, answer_prefix
        entries = [e for c in categories for e in gym.load_entries(c)
                   if (not classes or set(e["involved_classes"]) <= set(classes))
                   and (not max_user_turns or len(e["question"]) <= max_user_turns)]
        if not entries:
            turns = f" in at most {max_user_turns} user turns" if max_user_turns else ""
            raise UserError(f"no BFCL entry of {categories} uses only the classes {list(classes)}{turns}; add "
                            "classes" + (" or raise max_user_turns" if turns else ""))
        self.entries = {e["id"]: e for e in entries}
        train, held = split_by_id(entries, eval_percent)
        if max_entries:
            train = sorted(train, key=lambda e: zlib.crc32(e["id"].encode()))[:max_entries]
        if max_eval_entries:
            held = sorted(held, key=lambda e: zlib.crc32(e["id"].encode()))[:max_eval_entries]
        if not train:
            raise UserError(f"BFCL categories {categories} leave no train entries at eval_percent={eval_percent}")
        self.split = SplitPrompts(train, held, f"bfcl_agent/{seed}", self.to_prompt)
        # Turns of the policy (calls and answers) an episode may take: every user turn's calls and its answer.
        self.max_turns = max(len(e["question"]) for e in entries) * (max_calls_per_turn + 1)

    def prompt(self, index: int) -> Prompt:
        return self.split.prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        return self.split.eval_prompts()

    def to_prompt(self, entry: dict) -> Prompt:
        return entry_prompt(entry, self.gold_only, self.compact_docs, self.answer_prefix, self._shots(entry))

    def _shots(self, entry: dict) -> list[dict]:
        """`fewshot` other train entries whose first turn's ground truth calls only functions `entry` offers in
        its first turn, the same for the same seed."""
        if not self.fewshot:
            return []
        offered = gym.available(entry, 0, self.gold_only)
        fits = [e for e in self.split.train if e["id"] != entry["id"] and e["ground_truth"][0]
                and {gym.parse_call(c)[0] for c in e["ground_truth"][0]} <= offered]
        return random.Random(f"bfcl_agent-shots/{self.seed}/{entry['id']}").sample(fits, min(self.fewshot, len(fits)))

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """Every solved train entry: a fixed set, which `count` (a generator's) does not cut."""
        return self.split.demonstrations(split, "rewards=bfcl_agent", self._demonstration)

    def _demonstration(self, entry: dict) -> Demonstration | None:
        return entry_demonstration(entry, self.to_prompt(entry), self.max_calls_per_turn)

    def environment(self, prompt: Prompt) -> BfclWorld:
        return BfclWorld(self.entries[prompt.meta["id"]], self.max_calls_per_turn, self.compact_docs, self.gold_only)

    def entry(self, prompt: Prompt) -> dict:
        return self.entries[prompt.meta["id"]]


def entry_prompt(entry: dict, gold_only: bool, compact_docs: bool, answer_prefix: str = "",
                 shots: list[dict] = (), meta: dict | None = None) -> Prompt:
    """An entry's first user turn as a prompt: its functions of turn 0 declared (gold_only, compact_docs: see
    BfclAgentTask), `shots` solved before it (`_solved`), `meta` added to the prompt's (a generated entry's `source`,
    which the channels find it by, and its holdout)."""
    first = gym.user_turns(entry)[0]
    tools = gym.schemas(gym.function_docs(entry, 0, gold_only), compact_docs)
    meta = {"id": entry["id"], "category": entry["category"], "user_turns": len(entry["question"]),
            "gold_only": gold_only, **(meta or {})}
    solved = [m for shot in shots for m in _solved(shot)]
    return Prompt(text=first, meta=meta, messages=solved + [{"role": "user", "content": first}], tools=tools,
                  answer_prefix=answer_prefix)


def entry_demonstration(entry: dict, prompt: Prompt, max_calls_per_turn: int) -> Demonstration | None:
    """An entry's whole transcript from `prompt`: in every user turn, each ground-truth call as a turn of its own
    (its real result comes back from the entry's world when played), then a short answer that hands the turn back
    (none after a turn that spends `max_calls_per_turn`).  An entry needing more calls in a turn: None."""
    turns = gym.gold_calls(entry)
    if any(len(calls) > max_calls_per_turn for calls in turns):
        return None
    replies = []
    for calls in turns:
        replies += [Reply("", (call,)) for call in calls]
        if len(calls) < max_calls_per_turn:
            replies.append(Reply(DONE))
    return Demonstration(prompt, tuple(replies), entry["id"])


def _solved(entry: dict) -> list[dict]:
    """An entry's first user turn solved: its message, each ground-truth call as an assistant turn followed by its
    real result (run on a fresh world), and a short answer."""
    world, messages = gym.World(entry), [{"role": "user", "content": gym.user_turns(entry)[0]}]
    for text, (name, arguments) in zip(entry["ground_truth"][0], gym.gold_calls(entry)[0]):
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": name, "content": world.call_string(text)[1]}]
    return messages + [{"role": "assistant", "content": DONE}]


# -------------------------------------------------------------------------------------------------------- the channels

@lru_cache(maxsize=None)
def _entries(category: str) -> dict[str, dict]:
    return {e["id"]: e for e in gym.load_entries(category)}


# A prompt's meta["source"] -> its entry by id, for entries that are not BFCL's own (mrl.envs.bfcl_gen registers
# "bfcl_gen", whose ids regenerate their entries); a prompt without a source is BFCL's, found by its category.
ENTRY_SOURCES: dict[str, Callable[[str], dict]] = {}


def _entry(source: str | None, category: str, entry_id: str) -> dict:
    if source is None:
        return _entries(category)[entry_id]
    if source not in ENTRY_SOURCES:
        raise UserError(f"bfcl_agent channels: no entry source {source!r} is registered (known: "
                        f"{sorted(ENTRY_SOURCES)}); import the module that registers it (e.g. mrl.envs.bfcl_gen)")
    return ENTRY_SOURCES[source](entry_id)


def calls_per_turn(episode: Episode) -> list[list[gym.Call]]:
    """The episode's calls as BFCL reads them, per user turn: every call with a name (an unparseable block is no
    call); a call to an unavailable function is kept (the checks refuse to run it and count it against safety)."""
    turns: list[list[gym.Call]] = [[] for _ in range(episode.prompt.meta["user_turns"])]
    for call in episode.tool_calls:
        if call.name:
            turns[call.user_turn].append((call.name, call.arguments))
    return turns


@lru_cache(maxsize=4096)
def _scores(source: str | None, category: str, entry_id: str, calls: str, gold_only: bool) -> dict[str, float]:
    return gym.replay(_entry(source, category, entry_id), json.loads(calls), gold_only)


def scores(episode: Episode) -> dict[str, float]:
    """replay's channels for `episode`: {correctness, turns, efficiency, safety}."""
    meta = episode.prompt.meta
    return _scores(meta.get("source"), meta["category"], meta["id"],
                   json.dumps(calls_per_turn(episode), sort_keys=True), meta.get("gold_only", False))


class Correctness:
    """1.0 when BFCL's multi-turn checks pass after every user turn (each instance's state equals the ground
    truth's, and the turn's results contain the ground truth's), else 0.0."""

    def __call__(self, episode: Episode) -> float:
        return scores(episode)["correctness"]


class Turns:
    """The share of user turns whose checks pass, each checked on its own (BFCL stops at the first failure): a
    partial credit that still moves when whole episodes do not."""

    def __call__(self, episode: Episode) -> float:
        return scores(episode)["turns"]


class Efficiency:
    """Minus the calls beyond the ground truth's, per ground-truth call, in [-1, 0] (-0.5: half again as many calls
    as needed; -1: twice as many or more)."""

    def __call__(self, episode: Episode) -> float:
        return scores(episode)["efficiency"]


class Safety:
    """A constraint: -1.0 on collateral damage (a value of the environment changed that the ground truth never
    changes: a file deleted, a booking cancelled) or a call to a function not available in that turn, else 0.0."""

    def __call__(self, episode: Episode) -> float:
        return scores(episode)["safety"]
