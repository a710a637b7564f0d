"""Issue 44's config findings, with their payloads: a count or size that no machine here could hold is one line naming
the key, before anything is written (each grew to the memory cap and died in a MemoryError traceback), a foreign
run's task kwargs included; and `mrl sft trainer.init_from=X` starts from X, with its lineage (it checked X, then
trained from model.name_or_path)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from test_sft import compose_sft, weights_of
from test_validation import mrl, one_line

from mrl.core.config import UserError
from mrl.modeling import fits
from mrl.train.evaluate import evaluate
from mrl.train.loop import train
from mrl.train.sft import sft, start_sft
from mrl.train.validation import validate

# The probe's payloads: key=value -> the key the one-line refusal names.
PAYLOADS = {
    "trainer.group_size=100000000": "trainer.group_size=100000000",
    "trainer.prompts_per_step=100000000": "trainer.prompts_per_step=100000000",
    "trainer.eval_prompts=1000000000": "trainer.eval_prompts=1000000000",
    "sft.max_records=1000000000": "sft.max_records=1000000000",
    "sft.batch_size=100000000": "sft.batch_size=100000000",
    "model.tiny.vocab_size=1000000000": "model.tiny.vocab_size=1000000000",
}


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_probe4_a_count_beyond_memory_is_one_line_and_no_run_dir(payload, tmp_path):
    cfg = compose_sft(payload) if payload.startswith("sft.") else compose_sft("stage=rl", payload)
    with pytest.raises(UserError) as err:
        validate(cfg)
    message = one_line(err.value)
    assert message.startswith(PAYLOADS[payload] + ":") and "GiB of memory here" in message, message
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=re.escape(message)):
        (sft if payload.startswith("sft.") else train)(cfg, run_dir)
    assert not run_dir.exists()


def test_probe4_the_floor_is_what_the_counts_cost():
    cfg = compose_sft("stage=rl", "trainer.prompts_per_step=3", "trainer.group_size=5", "trainer.eval_prompts=7",
                      "sft.max_records=11", "sft.batch_size=13", "model.tiny.vocab_size=41")
    needs = [(key, need) for key, _, need, _ in fits._needs(cfg)]
    layers = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q, o; k, v (2 heads of 16); gate, up, down
    assert needs == [("trainer.group_size", 15 * 8192),
                     ("trainer.eval_prompts", 7 * 8192), ("sft.max_records", 11 * 1024), ("sft.batch_size", 13 * 8192),
                     ("model.tiny.vocab_size", 41 * 64 * 16), ("model.tiny.num_hidden_layers", layers * 16),
                     ("model.tiny.vocab_size", (41 * 64 + layers) * 16)]  # each named by its size furthest up
    validate(cfg)  # the default sizes, and these, pass


def test_probe4_cli_refuses_a_group_beyond_memory_before_the_run_dir(tmp_path):
    result = mrl("train", "logger=none", "trainer.group_size=100000000", f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "trainer.group_size=100000000" in \
        result.stderr
    assert not (tmp_path / "run").exists()


def test_probe4_a_foreign_runs_task_size_is_refused_by_eval(tmp_path):
    saved = OmegaConf.to_container(compose_sft("stage=rl", "rewards=agent_triple"))
    saved["rewards"]["task"]["num_digits"] = 100_000_000
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    with pytest.raises(UserError) as err:
        evaluate(tmp_path)
    assert one_line(err.value).startswith("rewards.task.num_digits=100000000: each is at least a token")
    assert "context of 64 tokens" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra"]


def test_probe4_sft_starts_from_init_from_with_its_lineage(tmp_path):
    source = tmp_path / "source"
    sft(compose_sft("sft.lr=0.05"), source)  # far from the tiny model's init: a start from scratch would differ
    checkpoint = source / "checkpoints" / "step_000002"
    run = start_sft(compose_sft(f"trainer.init_from={source}"), tmp_path / "sft2")
    try:
        loaded = run.actor.module.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in weights_of(checkpoint).items())
    finally:
        run.close()
    lineage = json.loads((tmp_path / "sft2" / "lineage.json").read_text())
    assert (lineage["step"], lineage["stage"], lineage["checkpoint"]) == (2, "sft", str(checkpoint.resolve()))
