"""The README's "What mrl computes" table names a test for every formula: each of them exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### What mrl computes", 1)[1].split("\n### ", 1)[0]
    named = set(re.findall(r"`(test_\w+)", section))
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.MULTILINE))
    assert len(named) >= 10
    assert named <= defined, sorted(named - defined)
