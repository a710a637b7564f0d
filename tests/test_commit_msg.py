"""The commit-msg hook (scripts/commit_msg.py, .githooks/commit-msg): the messages it lets through and those it
refuses, and `make hooks` installing it where, and only where, the directory is a git checkout."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("commit_msg", ROOT / "scripts" / "commit_msg.py")
commit_msg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(commit_msg)

GOOD = [
    "Fix the KL term's sign in token_mean",
    "train/update.py: drop the second score() and name the batch's rows",
    "docs: keep the current tables in measured.md",
    "Speed up the decoder's prompt cache",  # an exception to "-ed"
    "Use bf16 on SmolLM2 where the CPU has it",  # digits inside names are not numbers
    "Re-stamp the reports' preset fingerprints\n\nconf/train.yaml names modules at their homes: 14 reports.",
    "Process groups in lockstep",  # "Process" ends in "s" but is not a third-person verb
    "binding repro: pid arms at the pilot's gains",  # an area of two words
    "integrate: tests and design.md follow the presets",  # "tests", a noun as often as a verb
    "Merge branch 'house-docs' into main with a subject that is much longer than seventy-two characters",
    "fixup! Added it",
    "Add the hook\n\n# Please enter the commit message for your changes.\n# 1234",
    "Add the hook\n" + commit_msg.SCISSORS + "\ndiff --git a/x b/x\n+Added 12 lines",
]
BAD = [
    ("x" * 73, "73 characters"),
    ("Added the hook", "imperative"),
    ("Adding the hook", "imperative"),
    ("Fixes the hook", "imperative"),
    ("train: updated the loop", "imperative"),
    ("Applies the fix", "imperative"),
    ("Make bench-step 1.35x faster on bf16 CPUs", "no body"),
    ("Cut the step's walk to 9 files\n\n", "no body"),
    ("Cut the walk to 9 files\nbecause it read as a list", "blank line"),
]


@pytest.mark.parametrize("message", GOOD)
def test_a_good_message_passes(message):
    assert commit_msg.problems(message) == []


@pytest.mark.parametrize("message,why", BAD)
def test_a_bad_message_is_refused_saying_why(message, why):
    found = commit_msg.problems(message)
    assert len(found) == 1 and why in found[0], found


def test_the_hook_runs_the_checker_and_exits_1_on_a_bad_message(tmp_path):
    """As git runs it: from the working tree's root, with the message file as its argument."""
    message = tmp_path / "COMMIT_EDITMSG"
    hook = str(ROOT / ".githooks" / "commit-msg")
    message.write_text("Added 3 things\n")
    done = subprocess.run([hook, str(message)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "imperative" in done.stderr and "no body" in done.stderr, done.stderr
    message.write_text("Add 3 things\n\nThree, because two were not enough.\n")
    done = subprocess.run([hook, str(message)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(not shutil.which("git") or not shutil.which("make"), reason="needs git and make")
def test_make_hooks_installs_in_a_checkout_and_is_harmless_outside_one(tmp_path):
    """Twice in a fresh repository (idempotent), then a commit with a bad message is refused; in a plain folder it
    says so and exits 0 (a tarball, or CI's copy without .git)."""
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    for folder in (repo, plain):
        (folder / "scripts").mkdir(parents=True)
        shutil.copy(ROOT / "Makefile", folder)
        shutil.copy(ROOT / "scripts" / "commit_msg.py", folder / "scripts")
        shutil.copytree(ROOT / ".githooks", folder / ".githooks")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    for _ in range(2):
        done = subprocess.run(["make", "-s", "hooks"], cwd=repo, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "checked" in done.stdout, done.stderr
    assert subprocess.run(["git", "config", "core.hooksPath"], cwd=repo, capture_output=True, text=True).stdout \
        == ".githooks\n"
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    refused = subprocess.run([*git, "commit", "-q", "-m", "Added the hook"], cwd=repo, capture_output=True, text=True)
    assert refused.returncode != 0 and "imperative" in refused.stderr
    kept = subprocess.run([*git, "commit", "-q", "-m", "Add the hook"], cwd=repo, capture_output=True, text=True)
    assert kept.returncode == 0, kept.stderr
    done = subprocess.run(["make", "-s", "hooks"], cwd=plain, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert done.returncode == 0 and "not a git checkout" in done.stdout, done.stderr
