"""scripts/same_behaviour.py's comparison by hand: exact by default; with --rtol, fp32 rounding passes and a changed
behaviour (a count, a string, a number moved by more than rtol) still differs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("same_behaviour", ROOT / "scripts" / "same_behaviour.py")
same_behaviour = importlib.util.module_from_spec(spec)
sys.modules["same_behaviour"] = same_behaviour
spec.loader.exec_module(same_behaviour)

BEFORE = [{"step": 1, "grad_norm": 3.0549263954162598, "tokens": 120, "algo": "gdpo", "loss": 0.0}]


def test_rounding_passes_only_with_a_tolerance():
    after = [{**BEFORE[0], "grad_norm": 3.054926872253418}]  # 1.6e-7 relative: a kernel's rounding
    assert same_behaviour.first_difference(BEFORE, after) == \
        "step 1: grad_norm = 3.0549263954162598 before, 3.054926872253418 after"
    assert same_behaviour.first_difference(BEFORE, after, rtol=1e-5) is None
    assert same_behaviour.largest_change(BEFORE, after) == (3.054926872253418 - 3.0549263954162598) / 3.054926872253418


def test_changed_behaviour_differs_within_the_tolerance():
    for key, value in (("grad_norm", 3.0549263954162598 * (1 + 2e-5)), ("tokens", 121), ("algo", "grpo"),
                       ("loss", 2e-5)):  # near 0 the tolerance is absolute: 2e-5 > 1e-5
        after = [{**BEFORE[0], key: value}]
        assert same_behaviour.first_difference(BEFORE, after, rtol=1e-5).startswith(f"step 1: {key} = ")
    assert same_behaviour.first_difference(BEFORE, [{**BEFORE[0], "loss": 5e-6}], rtol=1e-5) is None
    counts = [{"step": 1, "tokens": 200_000}]  # a count one apart is a changed behaviour, however large
    assert same_behaviour.first_difference(counts, [{"step": 1, "tokens": 200_001}], rtol=1e-5) == \
        "step 1: tokens = 200000 before, 200001 after"
    assert same_behaviour.first_difference(BEFORE, [{**BEFORE[0], "extra": 1}], rtol=1e-5) == \
        "step 1: extra = '<absent>' before, 1 after"
    assert same_behaviour.first_difference(BEFORE, BEFORE * 2, rtol=1e-5) == "1 rows before, 2 after"


def test_compare_prints_each_config_and_fails_on_any_difference(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    for run_dir, rows in ((before, {"a": BEFORE, "b": BEFORE, "c": BEFORE}),
                          (after, {"a": BEFORE, "b": [{**BEFORE[0], "grad_norm": 3.054926872253418}]})):
        run_dir.mkdir()
        for name, metrics in rows.items():
            (run_dir / f"{name}.json").write_text(json.dumps(metrics))
    assert same_behaviour.compare(before, after, rtol=1e-5) == 1  # c is missing after
    assert capsys.readouterr().out.splitlines() == [
        "a: same", "b: same within rtol (largest relative change 1.6e-07)", "c: missing after"]
    (after / "c.json").write_text(json.dumps(BEFORE))
    assert same_behaviour.compare(before, after, rtol=1e-5) == 0
    assert same_behaviour.compare(before, after) == 1
    assert "b: DIFFERS: step 1: grad_norm" in capsys.readouterr().out
