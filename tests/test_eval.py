"""`mrl eval RUN_DIR` end to end, in subprocesses: a table and eval.json for a trained run; a short error otherwise."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MRL = [sys.executable, "-m", "mrl.cli"]
CHANNELS = ["correctness", "efficiency", "safety"]  # the default run: rewards=agent_triple


def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A 3-step run of the default config (2 prompts x 4 rollouts), checkpointed at every step, trained once for this
    module."""
    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    result = mrl("train", "trainer.max_steps=3", "trainer.save_every=1", "trainer.prompts_per_step=2",
                 "trainer.group_size=4", "logger=none", f"hydra.run.dir={run}", cwd=root)
    assert result.returncode == 0, result.stderr
    assert (run / "checkpoints" / "latest").exists()
    return run


def test_eval_prints_a_table_and_writes_eval_json(trained_run):
    result = mrl("eval", str(trained_run), "--prompts", "8", "--samples", "2", cwd=trained_run.parent)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Held-out prompts: 8 (step_000003)" in out
    assert "| decoding | correctness | efficiency | safety |" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"greedy", "sampled"} <= set(rows)
    for mode in ("greedy", "sampled"):
        cells = [c.strip() for c in rows[mode].strip().strip("|").split("|")][1:]
        assert len(cells) == len(CHANNELS)
        assert all(c == "-" or math.isfinite(float(c)) for c in cells)
    assert f"json: {trained_run / 'eval.json'}" in out

    report = json.loads((trained_run / "eval.json").read_text())
    assert {"greedy", "sampled", "prompts", "checkpoint"} <= set(report)
    assert report["prompts"] == 8 and report["checkpoint"] == "step_000003"
    for mode in ("greedy", "sampled"):
        assert list(report[mode]) == CHANNELS
        for name, value in report[mode].items():
            assert isinstance(value, float) and math.isfinite(value), (mode, name, value)
        assert 0.0 <= report[mode]["correctness"] <= 1.0
        assert -1.0 <= report[mode]["safety"] <= 0.0
        assert report[mode]["efficiency"] < 0  # every episode costs at least one token


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mrl: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_eval_of_a_dir_that_is_not_a_run(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    line = one_line_error(mrl("eval", str(tmp_path / "not_a_run"), cwd=tmp_path))
    assert "not a run dir" in line


def test_eval_of_a_run_without_checkpoints(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("checkpoints", "eval.json"))
    assert (run / ".hydra" / "overrides.yaml").exists() and not (run / "checkpoints").exists()
    line = one_line_error(mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path))
    assert "no checkpoint" in line
    assert not (run / "eval.json").exists()


def test_eval_skips_a_damaged_checkpoint_for_the_newest_intact_one(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval.json"))
    weights = next((run / "checkpoints" / "step_000003").rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-64])  # cut short, as by a crash mid-copy
    result = mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Held-out prompts: 2 (step_000002)" in result.stdout
    assert "skipped step_000003" in result.stderr and "using step_000002" in result.stderr
    assert json.loads((run / "eval.json").read_text())["checkpoint"] == "step_000002"


def test_eval_with_every_checkpoint_damaged(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval.json"))
    for weights in (run / "checkpoints").rglob("*.safetensors"):
        weights.write_bytes(b"")
    line = one_line_error(mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path))
    assert "no intact checkpoint to evaluate" in line and "step_000003" in line
    assert not (run / "eval.json").exists()
