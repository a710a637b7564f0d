"""Channels of bfcl: format (well-formed calls of declared functions), correctness (BFCL's own verdict) and, on
irrelevance records, a constraint against calling anything."""

from __future__ import annotations

from typing import Any

from mrl.benchmarks.bfcl import grade
from mrl.episode import Episode
from mrl.tasks.bfcl import IRRELEVANCE


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
    """BFCL's verdict, 1.0 or 0.0 (mrl.benchmarks.bfcl.grade): the right function(s) with allowed values of the
    right types, parallel calls in any order; on irrelevance records, 1.0 for no call at all."""

    def __call__(self, episode: Episode) -> float:
        calls = episode_calls(episode)
        if any(not isinstance(arguments, dict) for _, arguments in calls):
            return 0.0
        return float(grade(episode.prompt.meta, calls))


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
