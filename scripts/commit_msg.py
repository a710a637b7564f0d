"""The commit-msg hook (`.githooks/commit-msg`, installed by `make install` as git's core.hooksPath): refuses a commit
whose message breaks the project's habits, in one line each, before the commit is made:

- the subject (first line) is at most 72 characters;
- the subject is imperative ("Fix", "Add", "train: drop ...", not "Fixed", "Adding", "Fixes"): its first word, after
  an optional `area: ` prefix of up to three words, ends neither in "ed" nor in "ing" (words of five letters or
  more, less the ordinary ones in EXCEPTIONS), nor is it a verb of VERBS with an "s": a heuristic that lets some
  through rather than refuse a good subject;
- a message whose subject carries a number (a digit not inside a name such as bf16 or SmolLM2: 13/13, 1.35x,
  issue 65) has a body: a blank line, then at least one line saying what the number is and why.

Lines starting with '#' (git's template) and everything below git's scissors line are not the message.  Merge,
fixup! and squash! subjects are not checked.  Standard library only (git runs it with any python3):

    python3 scripts/commit_msg.py MESSAGE_FILE     # exit 1 with the reasons on stderr
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MAX_SUBJECT = 72
SCISSORS = "# ------------------------ >8 ------------------------"
# Verbs whose third person ("Fixes", "Adds", "Applies") opens a subject that describes instead of commanding.  Verbs
# as often plural nouns ("tests", "runs", "reports") are left out: a subject let through costs less than one refused.
VERBS = frozenset("""
    add adjust allow apply avoid bump carry catch clean compute copy correct drop enable ensure explain expose extend
    fix gather give guard handle implement improve introduce keep let make modify move pass pin raise reduce refactor
    remove rename replace require restore return reuse revert say simplify skip speed split stop support switch take
    unify update use verify wrap write
""".split())
# Ordinary words the endings would refuse ("Speed up ...", "Embed ...").
EXCEPTIONS = frozenset({"bed", "bring", "embed", "feed", "need", "ping", "ring", "seed", "shed", "speed", "string"})
AREA = re.compile(r"^[\w./*,{}=-]+(?: [\w./*,{}=-]+){0,2}: ")  # "train/update.py: ", "docs, tests: ", "binding repro: "
NUMBER = re.compile(r"(?<![\w.])\d")  # 13/13, 1.35x, issue 65; not bf16, SmolLM2, H100


def message_lines(text: str) -> list[str]:
    """The message as git will record it: above the scissors line, without '#' lines, trailing blanks dropped."""
    lines = [line.rstrip() for line in text.split(SCISSORS)[0].splitlines() if not line.startswith("#")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def not_imperative(word: str) -> bool:
    """Whether a subject's first word reads as past, progressive or third person ("Added", "Adding", "Adds")."""
    word = word.lower().strip("`'\"")
    if not word.isalpha() or word in EXCEPTIONS:
        return False
    if word.endswith("ed") or word.endswith("ing"):
        return len(word) > 4
    stems = {word[:-1], word[:-2] if word.endswith("es") else "", word[:-3] + "y" if word.endswith("ies") else ""}
    return word.endswith("s") and bool(stems & VERBS)


def problems(text: str) -> list[str]:
    """What is wrong with a commit message, one sentence each with the fix; [] when it may be committed."""
    lines = message_lines(text)
    if not lines:
        return []  # git refuses an empty message itself
    subject = lines[0]
    if subject.startswith(("Merge ", "fixup! ", "squash! ", "amend! ")):
        return []
    found = []
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject is {len(subject)} characters (at most {MAX_SUBJECT}): say what changed, and move "
                     "the numbers and the why to the body")
    words = AREA.sub("", subject).split()
    if words and not_imperative(words[0]):
        found.append(f"the subject starts with {words[0]!r}: write it in the imperative (\"Fix ...\", not "
                     "\"Fixed ...\", \"Fixing ...\" or \"Fixes ...\")")
    body = [line for line in lines[1:] if line.strip()]
    if NUMBER.search(subject) and not body:
        found.append("the subject carries a number but the message has no body: add a blank line and a body that "
                     "says what was measured and why")
    elif body and lines[1].strip():
        found.append("the body must be separated from the subject by a blank line")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = problems(Path(argv[1]).read_text(encoding="utf-8", errors="replace"))
    for problem in found:
        print(f"commit-msg: {problem}", file=sys.stderr)
    if found:
        print(f"commit-msg: the message is kept in {argv[1]}; `git commit -e -F {argv[1]}` edits it again",
              file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
