"""Model directories built without the hub: SmolLM2 from PyPI's GGUF, random-init GPU architectures."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import compose_config

import mrl.modeling.local_models
from mrl.core.config import UserError
from mrl.modeling.local_models import ARCHITECTURES, SMOLLM2_DIR, build_random_init, is_built, smollm2_gguf
from mrl.modeling.models import ModelLoadError, load_causal_lm, resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
# A shrunken architecture: the test builds, saves and loads the real classes in a second.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=64)


@pytest.mark.parametrize("arch, total, non_embedding", [
    ("qwen3_0_6b", 596_049_920, 440_467_456),  # published: 0.6B, 0.44B without embeddings
    ("qwen2_5_1_5b_instruct", 1_543_714_304, 1_310_340_608),  # published: 1.54B, 1.31B
])
def test_architectures_have_the_published_sizes(arch, total, non_embedding):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no time
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ARCHITECTURES[arch]))
    n = sum(p.numel() for p in model.parameters())
    assert (n, n - model.get_input_embeddings().weight.numel()) == (total, non_embedding)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_random_init_builds_a_model_directory_mrl_loads(arch, tmp_path):
    tiny = compose_config()
    out = build_random_init(arch, Path(resolve_model_path(tiny.model)), tmp_path / arch, **SMALL)
    assert is_built(out)
    model_cfg = compose_config(f"model.name_or_path={out}", "model.dtype=bfloat16").model
    model = load_causal_lm(resolve_model_path(model_cfg), model_cfg, torch.device("cpu"))
    assert model.config.model_type == ARCHITECTURES[arch]["model_type"]
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (1, 64)  # the overrides
    assert model.config.pad_token_id == 0  # the tokenizer's
    assert torch.isfinite(model(input_ids=torch.tensor([[14, 7, 11, 17]])).logits).all()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build_random_init(arch, Path(resolve_model_path(tiny.model)), out, **SMALL)  # built: skipped
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_random_init_refuses_an_unknown_architecture(tmp_path):
    with pytest.raises(UserError, match="'llama_7b'.*qwen3_0_6b"):
        build_random_init("llama_7b", tmp_path, tmp_path / "out")


def test_missing_package_says_make_smollm2(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(mrl.modeling.local_models.metadata, "distribution", not_installed)
    with pytest.raises(UserError, match="make smollm2"):
        smollm2_gguf()


def test_unbuilt_smollm2_dir_says_make_smollm2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_cfg = compose_config("model=smollm2_local").model
    with pytest.raises(ModelLoadError, match="make smollm2"):
        resolve_model_path(model_cfg)


@pytest.mark.slow
@pytest.mark.skipif(not is_built(ROOT / SMOLLM2_DIR), reason="models/smollm2-135m-instruct is not built (make smollm2)")
def test_smollm2_chats(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(ROOT)
    path = resolve_model_path(compose_config("model=smollm2_local").model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    reply = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(reply[0, ids.shape[1]:], skip_special_tokens=True)
