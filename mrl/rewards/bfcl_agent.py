"""Channels of bfcl_agent (BFCL multi-turn): correctness, the share of turns passed, efficiency, and safety as a
constraint.  Each replays the episode's calls on fresh worlds beside the ground truth (mrl.benchmarks.bfcl_agent
.replay), once per episode whatever the number of channels."""

from __future__ import annotations

import json
from functools import lru_cache

from mrl.benchmarks import bfcl_agent as gym
from mrl.episode import Episode


@lru_cache(maxsize=None)
def _entries(category: str) -> dict[str, dict]:
    return {e["id"]: e for e in gym.load_entries(category)}


def calls_per_turn(episode: Episode) -> list[list[gym.Call]]:
    """The episode's calls as BFCL reads them, per user turn: every call with a name (an unparseable block is no
    call); a call to an unavailable function is kept (the checks refuse to run it and count it against safety)."""
    turns: list[list[gym.Call]] = [[] for _ in range(episode.prompt.meta["user_turns"])]
    for call in episode.tool_calls:
        if call.name:
            turns[call.user_turn].append((call.name, call.arguments))
    return turns


@lru_cache(maxsize=4096)
def _scores(category: str, entry_id: str, calls: str, gold_only: bool) -> dict[str, float]:
    return gym.replay(_entries(category)[entry_id], json.loads(calls), gold_only)


def scores(episode: Episode) -> dict[str, float]:
    """replay's channels for `episode`: {correctness, turns, efficiency, safety}."""
    meta = episode.prompt.meta
    return _scores(meta["category"], meta["id"], json.dumps(calls_per_turn(episode), sort_keys=True),
                   meta.get("gold_only", False))


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
