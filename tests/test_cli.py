"""The `mrl` command end to end, in subprocesses: Hydra gets the arguments unchanged; bad input gets a short error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.runs.tracking import METRICS_FILE, read_metrics

MRL = [sys.executable, "-m", "mrl.cli"]
TINY_RUN = ["trainer.prompts_per_step=2", "trainer.group_size=4", "logger=none"]


def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


def test_train_writes_metrics_and_checkpoint_in_the_hydra_run_dir(tmp_path):
    run = tmp_path / "run"
    result = mrl("train", "trainer.max_steps=2", *TINY_RUN, f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1, 2]
    assert (run / ".hydra" / "config.yaml").exists() and (run / "checkpoints" / "latest").exists()


def test_wandb_offline_logs_without_login(tmp_path):
    run = tmp_path / "run"
    result = mrl("train", "trainer.max_steps=1", *TINY_RUN[:2], "logger=wandb", f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run in the run dir"


def test_multirun_gives_one_run_dir_per_algorithm(tmp_path):
    sweep = tmp_path / "sweep"
    result = mrl("train", "-m", "algo=ppo,grpo,dapo,gdpo", "trainer.max_steps=2", *TINY_RUN,
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    runs = sorted(p.parent.name for p in sweep.glob(f"*/{METRICS_FILE}"))
    assert runs == ["0_ppo_seed0", "1_grpo_seed0", "2_dapo_seed0", "3_gdpo_seed0"]

    report = mrl("report", str(sweep), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert (sweep / "report.png").stat().st_size > 0
    table = (sweep / "report.md").read_text()
    for label in ["ppo/seed0", "grpo/seed0", "dapo/seed0", "gdpo/seed0"]:
        assert label in table
    assert "| correctness | efficiency | safety |" in table


def test_cfg_job_prints_the_composed_config(tmp_path):
    result = mrl("train", "--cfg", "job", "algo=dapo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "name: dapo" in result.stdout and "dynamic_sampling: true" in result.stdout
    assert not list(tmp_path.glob("outputs")), "--cfg must not start a run"


def test_help_goes_to_hydra(tmp_path):
    result = mrl("train", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "== mrl train ==" in result.stdout
    assert "corrgrpo, dapo, gd2po, gd2po_snr, gdpo, gdpo_conditioned, gdpo_dapo, grpo, grpo_weighted, ppo" in \
        result.stdout  # Hydra's groups


@pytest.mark.parametrize("override, expected", [
    ("algo=foo", "algo=foo: there is no algo/foo.yaml; choose one of corrgrpo, dapo, gd2po, gd2po_snr, gdpo,"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("trainer.max_stepz=3", "max_stepz"),
    ("algo.loss_agg=tokenmean", "choose one of seq_mean, token_mean"),
    ("algo.weights={correctness:1}", "give one weight per channel"),
    ("model.name_or_path=/no/such/model", "'/no/such/model': no such directory"),
    ("trainer.group_size=1", "group_size >= 2"),
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("trainer.resume=/no/such/run", "neither a checkpoint nor a run dir"),
])
def test_bad_input_gets_a_short_error_and_nonzero_exit(override, expected, tmp_path):
    result = mrl("train", override, "logger=none", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode != 0
    assert expected in result.stderr + result.stdout
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) < 25


def test_report_on_a_missing_dir_fails_cleanly(tmp_path):
    result = mrl("report", str(tmp_path / "nothing"), cwd=tmp_path)
    assert result.returncode == 2 and "no such directory" in result.stderr
