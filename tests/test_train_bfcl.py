"""`make train-bfcl` and `make train-bfcl-agent`: their settings compose (SFT, then RL from its checkpoint), and
(slow, with `make smollm2`) a short version of each pipeline runs SmolLM2-135M-Instruct base -> SFT -> RL with
held-out accuracy at every stage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import compose_config, makefile_overrides
from hydra import compose, initialize_config_dir

from mrl.config import CONF_DIR
from mrl.loop import train
from mrl.sft import sft
from mrl.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
PIPELINES = [("SFT_BFCL", "TRAIN_BFCL"), ("SFT_BFCL_AGENT", "TRAIN_BFCL_AGENT")]


def compose_sft(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("sft", overrides=list(overrides))


@pytest.mark.parametrize("sft_settings, rl_settings", PIPELINES)
def test_the_two_stages_compose_on_the_same_task_and_evaluation(sft_settings, rl_settings):
    first = compose_sft(*makefile_overrides(sft_settings))
    second = compose_config(*makefile_overrides(rl_settings), shrink=False)
    assert first.stage == "sft" and second.stage == "rl" and second.algo.name == "gdpo"
    assert first.rewards.task == second.rewards.task  # SFT's demonstrations and RL's prompts: one task
    for key in ("max_new_tokens", "max_tool_tokens", "eval_prompts"):  # RL's step 0 scores what SFT's end scored
        assert first.trainer[key] == second.trainer[key], key
    assert second.trainer.max_steps % second.trainer.eval_every == 0  # the held-out curve ends on the last step


def test_train_bfcl_scores_every_held_out_record():
    from mrl.tasks import build_task

    cfg = compose_config(*makefile_overrides("TRAIN_BFCL"), shrink=False)
    assert cfg.trainer.eval_prompts == len(build_task(cfg).split.eval) == 78


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` first")
def test_a_short_train_bfcl_pipeline_logs_held_out_accuracy_at_every_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model.name_or_path is relative to the repository
    short = ["trainer.eval_prompts=4"]
    sft(compose_sft(*makefile_overrides("SFT_BFCL"), *short, "sft.steps=2"), tmp_path / "sft")
    rl = ["trainer.max_steps=2", "trainer.eval_every=2", "logger.samples_every=1",
          f"trainer.init_from={tmp_path / 'sft'}"]
    train(compose_config(*makefile_overrides("TRAIN_BFCL"), *short, *rl, shrink=False), tmp_path / "rl")
    sft_evals = {r["step"]: r for r in read_metrics(tmp_path / "sft" / METRICS_FILE) if "eval/accuracy" in r}
    records = read_metrics(tmp_path / "rl" / METRICS_FILE)
    rl_evals = {r["step"]: r for r in records if "eval/accuracy" in r}
    assert sorted(sft_evals) == [0, 2] and sorted(rl_evals) == [0, 2]  # base, after SFT; RL's start and end
    assert rl_evals[0]["eval/accuracy"] == sft_evals[2]["eval/accuracy"]  # RL starts where SFT ended
    for r in [*sft_evals.values(), *rl_evals.values()]:
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/simple_python/accuracy"] == r["eval/accuracy"]
        assert 0 <= r["eval/correctness/mean"] <= r["eval/right_functions/mean"] + 1e-9 <= 1 + 1e-9
    trained = [r for r in records if "reward/correctness/mean" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["reward/total/mean"]) for r in trained)
    sample = json.loads((tmp_path / "rl" / SAMPLES_FILE).read_text().splitlines()[-1])
    assert "You can call tools" in sample["prompt"] and sample["prompt"].count("<|im_start|>user") == 1  # no shots
    assert json.loads((tmp_path / "rl" / "lineage.json").read_text())["step"] == 2
