"""scripts/gpu_check.py's engine measurement (tokens/s of HF generate, native and captured decoding as fractions of
the bandwidth bound, and the 90% equal-rows gate), run on CPU: `--dry-run` on a tiny layout, the gate on a decoder
made to differ, and the LoRA run's overrides."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import compose_config

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
CPU = torch.device("cpu")


def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0


def test_the_dry_run_measures_every_engine_on_a_tiny_layout(capsys):
    assert gpu_check.dry_run(["qwen3_0_6b"]) == 0
    out = capsys.readouterr().out
    assert "gpu_check --dry-run: OK" in out
    assert all(f"| qwen3_0_6b | 2 | {engine} |" in out for engine in ("hf", "native", "captured"))
    assert "| 100% |" in out  # the captured decoder's greedy rows are HF generate's


def test_fractions_of_the_bound_and_the_equal_rows_gate(monkeypatch):
    """The bound is rows x bandwidth / weight bytes: 3 rows at 1e9 B/s over the model's bytes; a captured decoder
    whose tokens differ from HF generate's fails the check, naming the share."""
    import mrl.generation.rollout

    model = gpu_check.layout_model("qwen2_5_1_5b_instruct", CPU, **gpu_check.DRY_LAYOUT)
    weights = sum(p.numel() * 4 for p in model.parameters())
    results, problems = gpu_check.measure_engines(model, CPU, (3,), tokens=2, prompt=8, bandwidth=1e9)
    assert problems == [] and [r["engine"] for r in results] == ["hf", "native", "captured"]
    for r in results:
        assert r["bound_fraction"] == pytest.approx(r["tokens_per_s"] / (3 * 1e9 / weights))
        assert r["tokens_per_s"] == pytest.approx(3 * 2 / r["seconds"])
    assert results[2]["greedy_equal"] == 1.0

    def shifted(model, request, sampling, **kwargs):  # one token off in every row
        out = mrl.generation.rollout.hf_decode(model, request, sampling)
        out[:, -1] = (out[:, -1] + 1) % model.config.vocab_size
        return out

    monkeypatch.setattr(mrl.generation.rollout, "captured_decode", shifted)
    _, problems = gpu_check.measure_engines(model, CPU, (3,), tokens=2, prompt=8, bandwidth=1e9)
    assert problems == ["captured decoder, 3 rows greedy: only 0% of rows equal HF generate's (want >= 90%)"]


@pytest.mark.parametrize("arch", sorted(gpu_check.PRESETS))
def test_the_lora_run_decodes_with_the_captured_engine_kl_on(arch, tmp_path):
    overrides = gpu_check.train_overrides(arch, tmp_path / "model", tmp_path / "run", 3, chat=True, lora_rank=16)
    cfg = compose_config(*[o for o in overrides if not o.startswith("hydra.")], shrink=False)
    assert (cfg.model.lora.r, cfg.rollout.engine, cfg.deepspeed.stage) == (16, "captured", 2)
    assert cfg.algo.kl_coef > 0 and cfg.model.dtype == "bfloat16"


SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def test_the_vllm_arm_says_why_it_is_not_measured(monkeypatch, capsys):
    import mrl.generation.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "missing", lambda: "vLLM is not installed")
    assert gpu_check.measure_vllm(None, SMOLLM2, CPU) == []
    assert capsys.readouterr().out == "  vllm: not measured (vLLM is not installed: make install-vllm)\n"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not (SMOLLM2 / "config.json").exists(),
                    reason="needs vLLM (make install-vllm) and SmolLM2 (make smollm2)")
def test_the_vllm_arm_measures_every_row_decoding_its_tokens():
    """On CPU, SmolLM2 (vLLM's CPU build cannot serve the dry run's tiny layout): 2 and 3 rows x 8 tokens, every row
    decoding all 8 (no stop), tokens/s and the bound fraction from the timed call."""
    from mrl.modeling.models import load_causal_lm

    cfg = compose_config("model=smollm2_local", f"model.name_or_path={SMOLLM2}", "model.compute_dtype=float32",
                         shrink=False)
    model = load_causal_lm(str(SMOLLM2), cfg.model, CPU).eval()
    results = gpu_check.measure_vllm(model, SMOLLM2, CPU, (2, 3), tokens=8, prompt=16, bandwidth=1e9)
    assert [(r["rows"], r["engine"], r["generated"]) for r in results] == [(2, "vllm", 16), (3, "vllm", 24)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for r in results:
        assert r["tokens_per_s"] == pytest.approx(r["generated"] / r["seconds"])
        assert r["bound_fraction"] == pytest.approx(r["tokens_per_s"] / (r["rows"] * 1e9 / weights))
