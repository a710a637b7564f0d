"""The optimizer wrapper and the dict handed to deepspeed.initialize."""

from __future__ import annotations

import os

import torch
from conftest import compose_config
from torch import nn

from mrl.modeling.precision import Precision
from mrl.modeling.trainable import clear_stale_build_locks, deepspeed_config, param_groups, skip_shm_comm_op

FP32 = Precision(compute=None, export=torch.float32)


class WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.value_head = nn.Linear(2, 1)


def test_value_head_gets_its_own_learning_rate():
    groups = param_groups(WithHead(), lr=1e-3, lr_by_prefix={"value_head.": 5e-2})
    by_lr = {g["lr"]: sum(p.numel() for p in g["params"]) for g in groups}
    assert by_lr == {1e-3: 6, 5e-2: 3}


def test_no_prefix_gives_one_group():
    assert len(param_groups(WithHead(), lr=1e-3, lr_by_prefix={})) == 1


def test_deepspeed_presets_become_deepspeed_dicts():
    for stage in (1, 2, 3):
        cfg = compose_config(f"deepspeed=zero{stage}").deepspeed
        ds = deepspeed_config(cfg, FP32, micro_batch_size=4, lr=1e-3, weight_decay=0.0)
        assert ds["zero_optimization"] == {"stage": stage}
        assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_clipping"] == 1.0
        assert ds["bf16"] == ds["fp16"] == {"enabled": False} and "optimizer" not in ds


def test_offload_switches_set_cpu_offload_and_deepspeed_adam():
    cfg = compose_config("deepspeed=zero3", "deepspeed.offload_optimizer=true", "deepspeed.offload_param=true"
                         ).deepspeed
    ds = deepspeed_config(cfg, FP32, micro_batch_size=2, lr=3e-4, weight_decay=0.1)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}


def test_every_combination_composes():
    from conftest import ALGOS, DEEPSPEED, MODELS, REWARDS

    for algo in ALGOS:
        for rewards in REWARDS:
            for deepspeed in DEEPSPEED:
                cfg = compose_config(f"algo={algo}", f"rewards={rewards}", f"deepspeed={deepspeed}")
                assert cfg.algo.name == algo and cfg.deepspeed.enabled == (deepspeed != "none")
    for model in MODELS:
        assert compose_config(f"model={model}").model.name_or_path


def test_a_build_lock_nobody_holds_is_cleared_and_a_held_one_is_kept(tmp_path):
    # A DeepSpeed op build killed midway leaves <op>/lock, and every later start would wait on it forever.
    (tmp_path / "killed_op").mkdir()
    (tmp_path / "killed_op" / "lock").touch()
    (tmp_path / "building_op").mkdir()
    held = os.open(tmp_path / "building_op" / "lock", os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it
    try:
        assert clear_stale_build_locks(tmp_path, recheck_s=0) == [tmp_path / "killed_op" / "lock"]
        assert (tmp_path / "building_op" / "lock").exists() and not (tmp_path / "killed_op" / "lock").exists()
        assert clear_stale_build_locks(tmp_path, recheck_s=0) == []
    finally:
        os.close(held)


def test_deepspeed_communication_starts_without_its_shm_op_and_torch_is_left_alone(monkeypatch):
    """No op probe (gcc runs) and no op load per rank per start; `deepspeed.comm.torch` the attribute is torch."""
    import importlib

    comm = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(comm, "build_shm_op", comm.build_shm_op)  # put back after the test
    skip_shm_comm_op()
    assert comm.build_shm_op() is None
    assert not hasattr(torch, "build_shm_op")
