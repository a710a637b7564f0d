"""scripts/gpu_check.py runs on GPU machines only; what it does before and after `mrl train` is checked here, on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import compose_config

from mrl.core.config import TinyModelSpec
from mrl.modeling.models import resolve_model_path, tiny_model_dir
from mrl.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.parametrize("arch", sorted(gpu_check.PRESETS))
def test_its_mrl_train_overrides_compose(arch, tmp_path):
    overrides = gpu_check.train_overrides(arch, tmp_path / "model", tmp_path / "run", 3, chat=True)
    cfg = compose_config(*[o for o in overrides if not o.startswith("hydra.")], shrink=False)
    assert (cfg.model.dtype, cfg.deepspeed.model_dtype, cfg.deepspeed.stage) == ("bfloat16", "bfloat16", 2)
    assert cfg.model.name_or_path == str(tmp_path / "model") and cfg.trainer.device == "cuda"
    assert cfg.algo.kl_coef > 0 and cfg.trainer.max_steps == cfg.trainer.save_every == 3


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        gpu_check.main()


def test_tokenizer_falls_back_to_the_tiny_one(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "TOKENIZERS", [tmp_path / "none"])
    directory, chat = gpu_check.tokenizer_dir()
    assert (directory / "tokenizer.json").exists() and not chat


def test_check_run_reads_the_masters_of_a_bf16_run(make_cfg, tmp_path):
    cfg = make_cfg("model.dtype=bfloat16", "algo=grpo", "trainer.lr=1e-5", "algo.entropy_coef=0.001",
                   "trainer.max_steps=1")
    train(cfg, tmp_path)
    assert gpu_check.check_run(tmp_path, Path(resolve_model_path(cfg.model))) == []


def test_its_decoder_comparison_finds_every_row_equal_on_cpu(capsys):
    """What the GPU check reports of mrl's native decoder against HF generate: on CPU (float32) every row is equal."""
    assert gpu_check.compare_decoders(tiny_model_dir(TinyModelSpec()), torch.device("cpu"), "float32", rows=16,
                                      tokens=8) == []
    printed = capsys.readouterr().out
    assert printed.count("100% of rows equal") == 2 and "greedy" in printed and "sampled" in printed
    assert printed.count("with its own draw") == 1  # the sampled line times the draw training uses
