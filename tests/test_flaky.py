"""scripts/flaky.py (`make flaky`): its junit reading by hand, and every test it hunts still exists."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("flaky", ROOT / "scripts" / "flaky.py")
flaky = importlib.util.module_from_spec(spec)
sys.modules["flaky"] = flaky
spec.loader.exec_module(flaky)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="0.1" />
<testcase classname="tests.test_a" name="test_bad[x-1]" time="0.1"><failure message="assert 1 == 2">long
traceback
E   assert 1 == 2</failure></testcase>
<testcase classname="tests.test_b" name="test_broken_fixture" time="0.1"><error message="fixture failed">boom</error>
</testcase>
<testcase classname="tests.test_b" name="test_no_bwrap" time="0.0"><skipped message="no bwrap" /></testcase>
</testsuite></testsuites>"""


def test_outcomes_of_a_junit_file_by_hand(tmp_path):
    (tmp_path / "run.xml").write_text(JUNIT)
    got = flaky.outcomes(tmp_path / "run.xml")
    assert {node: state for node, (state, _) in got.items()} == {
        "tests/test_a.py::test_ok": "passed", "tests/test_a.py::test_bad[x-1]": "failed",
        "tests/test_b.py::test_broken_fixture": "failed", "tests/test_b.py::test_no_bwrap": "skipped"}
    assert got["tests/test_a.py::test_bad[x-1]"][1].endswith("E   assert 1 == 2")  # the failure's last lines


def test_every_target_of_the_hunt_exists():
    for group in flaky.GROUPS:
        for target in group.targets:
            file, _, name = target.partition("::")
            assert (ROOT / file).is_file(), f"{group.name}: no {file}"
            if name:
                assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.MULTILINE), f"{group.name}: {target}"
