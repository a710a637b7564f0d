"""Restore a trained policy from a checkpoint, for inference: `mrl eval`, `mrl export` and the GPU check.

Training resumes through mrl.checkpoint (the optimizer's state, the ranks' partitions); what is read here is the
actor's weights alone, at full precision (`trained_weights`), and the policy as a plain transformers model
(`merged_policy`: LoRA adapters merged into their base; `load_for_inference`: on a device, in model.dtype).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mrl.config import ModelConfig
from mrl.lora import adapter_weights, is_adapter_dir
from mrl.models import load_causal_lm, resolve_model_path
from mrl.precision import MASTER, compute_in, precision_for
from mrl.trainable import DS_TAG, OPTIMIZER_FILE, load_plain


def trained_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's weights in `checkpoint` at full precision, keyed as in mrl.models.Actor (`policy.*`): DeepSpeed's
    float32 masters, the masters in optimizer.pt, or policy/ itself when model.dtype did not round it.  A LoRA
    checkpoint holds the trained weights alone: the adapters (and a value head), without the base."""
    if (checkpoint / DS_TAG).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    masters = load_plain(checkpoint / OPTIMIZER_FILE)["masters"]
    if masters is not None:
        return masters
    if is_adapter_dir(checkpoint / "policy"):
        return {f"policy.{k}": v for k, v in adapter_weights(checkpoint / "policy").items()}
    from safetensors.torch import load_file

    return {f"policy.{k}": v for k, v in load_file(checkpoint / "policy" / "model.safetensors").items()}


def adapter_base(policy_dir: Path) -> str | None:
    """The model dir the adapters were trained on, when adapter_config.json names a directory that exists (a warm
    start's merged model, trainer.init_from); else None: model.name_or_path."""
    import json

    base = json.loads((policy_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return base if isinstance(base, str) and Path(base).is_dir() else None


def merged_policy(checkpoint: Path, cfg: ModelConfig) -> nn.Module:
    """A LoRA checkpoint's policy as a plain transformers model, float32, on CPU: the base at model.name_or_path with
    the adapters merged in at full precision (their float32 masters where model.dtype rounded policy/, with or
    without DeepSpeed: `trained_weights`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base(checkpoint / "policy") or resolve_model_path(cfg),
                                                dtype=MASTER)
    policy = PeftModel.from_pretrained(base, str(checkpoint / "policy"), torch_device="cpu")
    adapters = {k.removeprefix("policy."): v.float() for k, v in trained_weights(checkpoint).items()
                if k.startswith("policy.")}
    unexpected = policy.load_state_dict(adapters, strict=False).unexpected_keys
    assert not unexpected, f"trained weights in {checkpoint} that the adapters lack: {unexpected[:3]}"
    return policy.merge_and_unload()


def load_for_inference(checkpoint: Path, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """A checkpoint's policy to sample from (`mrl eval`): policy/ itself, or the base with the adapters merged."""
    if not is_adapter_dir(checkpoint / "policy"):
        return load_causal_lm(str(checkpoint / "policy"), cfg, device)
    return compute_in(merged_policy(checkpoint, cfg).to(device), precision_for(cfg.dtype, device), device)
