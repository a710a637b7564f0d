"""How an agent's turn ends: an end-of-turn token, or the turn's text spelling a stop string (a tool call, an answer
word).  Generation stops on the same test (mrl.generation.rollout.StopStrings) that reads the turn afterwards
(`first_stop`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

END_OF_TURN = "<end of turn>"  # first_stop's reason for a turn ended by an end-of-turn token


@dataclass(frozen=True)
class Stops:
    """How a turn ends: an end-of-turn token, or its text spelling one of `strings`.

    words: a stop string counts only as a whole word (the words protocol: `w1` does not spell the answer word `1`).
    by_id: a word-level vocabulary spells each word with its own token and no other way, so stop strings are matched
      by token id, as fast as end-of-turn tokens; None: any vocabulary able to spell a string across several tokens,
      whose decoded text is checked.
    """

    end_ids: frozenset[int]
    strings: tuple[str, ...] = ()
    words: bool = False
    by_id: dict[int, str] | None = None

    @property
    def window(self) -> int:
        """Tokens to decode to see a stop string that ends at the newest token (every token spells at least one
        character), plus one for the word boundary before it."""
        return max(map(len, self.strings)) + 1

    @property
    def by_text(self) -> bool:
        return bool(self.strings) and self.by_id is None


def spelled_stop(window: str, from_turn_start: bool, stops: Stops) -> str | None:
    """The stop string that the decoded `window` (the turn's last tokens) spells, or None.

    >>> s = Stops(frozenset(), ("calc", "1"), words=True)
    >>> spelled_stop("w2 calc", False, s), spelled_stop("w1", True, s), spelled_stop("1", True, s)
    ('calc', None, '1')
    """
    if not from_turn_start:
        window = "\x00" + window  # the window's first character is no word boundary: it continues earlier text
    for s in stops.strings:
        if re.search(rf"(?:^|\s){re.escape(s)}(?=\s|$)", window) if stops.words else s in window:
            return s
    return None


def first_stop(tokenizer, ids: list[int], stops: Stops) -> tuple[int, str] | None:
    """(index, reason) of the token that ended a turn of sampled `ids` — reason END_OF_TURN or the stop string —
    or None when nothing did (the budget ran out).  The same test generation stops on (rollout.StopStrings)."""
    by_text = stops.by_text and any(s in tokenizer.decode(ids, skip_special_tokens=False) for s in stops.strings)
    for t, token in enumerate(ids):
        if token in stops.end_ids:
            return t, END_OF_TURN
        if stops.by_id and token in stops.by_id:
            return t, stops.by_id[token]
        if by_text:
            start = max(0, t + 1 - stops.window)
            hit = spelled_stop(tokenizer.decode(ids[start:t + 1], skip_special_tokens=False), start == 0, stops)
            if hit is not None:
                return t, hit
    return None


def word_level(tokenizer) -> bool:
    """Whether every token is a whole word (the built-in tiny model's WordLevel vocabulary)."""
    from tokenizers.models import WordLevel

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.model, WordLevel)

