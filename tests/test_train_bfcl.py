"""`make train-bfcl`'s settings: they compose, and (slow, with `make smollm2`) a short version of the run trains
SmolLM2-135M-Instruct on BFCL simple_python with held-out accuracy at its first and last step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import compose_config, makefile_overrides

from mrl.loop import train
from mrl.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"


def train_bfcl_overrides() -> list[str]:
    return makefile_overrides("TRAIN_BFCL")


def test_train_bfcl_overrides_compose():
    cfg = compose_config(*train_bfcl_overrides(), shrink=False)
    assert cfg.rewards.name == "bfcl" and list(cfg.rewards.task.categories) == ["simple_python"]
    assert cfg.rewards.pass_channel == "correctness" and cfg.trainer.eval_every > 0
    assert cfg.trainer.max_steps % cfg.trainer.eval_every == 0  # the held-out curve ends on the last step


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` first")
def test_a_short_train_bfcl_run_logs_held_out_accuracy(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model.name_or_path is relative to the repository
    short = ["trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_prompts=4", "logger.samples_every=1"]
    train(compose_config(*train_bfcl_overrides(), *short, shrink=False), tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    evals = {r["step"]: r for r in records if "eval/accuracy" in r}
    assert sorted(evals) == [0, 2]  # the base model, then the trained one
    for r in evals.values():
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/simple_python/accuracy"] == r["eval/accuracy"]
        assert 0 <= r["eval/correctness/mean"] <= r["eval/right_functions/mean"] + 1e-9 <= 1 + 1e-9
    trained = [r for r in records if "reward/correctness/mean" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["reward/total/mean"]) for r in trained)
    sample = json.loads((tmp_path / SAMPLES_FILE).read_text().splitlines()[-1])
    assert "You can call tools" in sample["prompt"] and sample["prompt"].count("<|im_start|>user") == 3  # 2 shots
