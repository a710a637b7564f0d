"""`mrl train rollout.engine=vllm` end to end: the engine keeps up with weights the optimizer moves, under ZeRO-3 too.

Its own module: each run here builds and closes its own vLLM, and closing one tears down vLLM's process-wide
parallel state, which would leave test_vllm_engine.py's shared engine (a module fixture) without its groups.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from test_vllm_engine import FP32, SMOLLM2, needs_vllm

from mrl.generation import rollout
from mrl.runs.tracking import METRICS_FILE, read_metrics


@needs_vllm
def test_three_steps_keep_the_engine_on_policy_under_zero3(tmp_path, monkeypatch):
    """rollout.engine=vllm with deepspeed=zero3 in one process, 3 GRPO steps at lr 1e-4 (48 tokens: room for the calc
    call and the answer, so rewards differ and the weights move): vLLM is built and synced with the partitioned
    weights gathered (mrl.train.loop.build_engine, sync_engine), and the trainer's log-probs of every step's rollouts
    are the sampler's within 1e-3 in fp32 (without the gather vLLM cannot load the partitions at all).  The same run
    without DeepSpeed and with the sync turned off (a stale engine) shows a gap over 1e-2 by step 3: the test can
    tell."""
    from mrl.train.loop import train

    run = ["rollout.engine=vllm", "model=smollm2_local", f"model.name_or_path={SMOLLM2}", "rewards=calc_agent",
           "algo=grpo", "trainer.max_steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4",
           "trainer.micro_batch_size=8", "trainer.max_new_tokens=48", "trainer.lr=1e-4", "trainer.save_every=1000",
           "trainer.eval_every=0", "logger=none", *FP32]
    train(compose_config(*run, "deepspeed=zero3", shrink=False), tmp_path / "synced")
    # DeepSpeed's default group, which vLLM built on, outlives vLLM's shutdown: DeepSpeed's cached groups stay valid
    # for a later DeepSpeed run in this process (destroyed, its next initialize fails: "Group ... is not registered")
    assert torch.distributed.is_initialized()
    synced = read_metrics(tmp_path / "synced" / METRICS_FILE)
    assert [m["step"] for m in synced] == [1, 2, 3]
    assert synced[0]["adv/std"] > 0 and synced[1]["adv/std"] > 0  # the rewards differ: the updates move the weights
    assert all(m["rollout/logprob_gap_max"] < 1e-3 for m in synced), [m["rollout/logprob_gap_max"] for m in synced]
    assert synced[-1]["rollout/importance_weight"] == pytest.approx(1.0, abs=1e-3)
    monkeypatch.setattr(rollout.VllmEngine, "sync_weights", lambda self, policy: None)
    train(compose_config(*run, shrink=False), tmp_path / "stale")
    stale = read_metrics(tmp_path / "stale" / METRICS_FILE)
    assert stale[0]["rollout/logprob_gap_max"] < 1e-3  # step 1: nothing to sync yet
    assert stale[-1]["rollout/logprob_gap_max"] > 1e-2, [m["rollout/logprob_gap_max"] for m in stale]
