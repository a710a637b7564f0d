"""LoRA through peft: with `model.lora.r > 0` the policy trains low-rank adapters on top of its frozen weights.

How the rest of mrl sees it:
- Training: `load_policy` wraps the causal LM with peft (`get_peft_model`).  Only the adapters require grad, so the
  optimizer (mrl/modeling/trainable.py `param_groups`) or DeepSpeed keeps states for them (and PPO's value head) alone,
  and the base weights get no gradient buffers.  Where the device computes in half precision (a GPU with
  model.dtype=bf16), the frozen base is loaded in that dtype: only trained weights need float32 masters
  (mrl/modeling/precision.py).
- The KL reference is the policy itself with its adapters switched off (`BaseReference`, peft's `disable_adapter`):
  the base model, computed by the very module that trains (same weights, dtype, autocast and DeepSpeed casting), with
  no second copy in memory.  peft starts B at 0, so the adapted policy equals the base and KL starts at exactly 0.
- Checkpoints (mrl/runs/checkpoint.py): policy/ is a peft adapter directory (adapter_model.safetensors in model.dtype
  and adapter_config.json, whose base_model_name_or_path points at the base model) plus the tokenizer; optimizer.pt
  or deepspeed/ hold the trained parameters' state only (Trainable leaves frozen weights out).  A resume loads the base
  from model.name_or_path again and the adapters from policy/, then the optimizer's state and float32 masters.
- Inference (`mrl eval`) and `mrl export --merge` (mrl/runs/export.py) merge the adapters into the base
  (`mrl.runs.restore.merged_policy`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from mrl.core.config import ModelConfig, UserError
from mrl.modeling.models import Actor, load_causal_lm, resolve_model_path
from mrl.modeling.precision import MASTER, cast_state, model_precision
from mrl.modeling.trainable import Trainable

ADAPTER_CONFIG = "adapter_config.json"


def uses_lora(cfg: ModelConfig) -> bool:
    return cfg.lora.r > 0


def is_adapter_dir(path: Path) -> bool:
    """Whether `path` (a checkpoint's policy/) holds LoRA adapters rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).exists()


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def linear_module_names(cfg: ModelConfig) -> list[str] | None:
    """The full names of the model's linear layers that can take adapters (model.layers.0.self_attn.q_proj, ...;
    not the output layer), from a skeleton built on the meta device: no weights are read.  None where the model's
    config cannot be read (a hub id off-line)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg))
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not output]


def unknown_targets(target: str | list[str], linear: list[str]) -> list[str]:
    """The entries of `target` that match none of the `linear` module names, as peft matches them: a list entry
    is a module's name or its dotted tail (q_proj, self_attn.q_proj); a single string a regular expression over
    whole names."""
    import re

    if isinstance(target, str):
        return [] if any(re.fullmatch(target, name) for name in linear) else [target]
    return [t for t in target if not any(name == t or name.endswith(f".{t}") for name in linear)]


def peft_config(cfg: ModelConfig):
    from peft import LoraConfig

    target = cfg.lora.target_modules
    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=target if isinstance(target, str) else list(target), task_type="CAUSAL_LM")


def load_policy(cfg: ModelConfig, base_path: str, device: torch.device, checkpoint: Path | None = None) -> nn.Module:
    """The policy to train.  Full fine-tuning: the causal LM at `base_path`, or `checkpoint`'s policy/ on resume.
    LoRA: the base at `base_path` with adapters, new ones (B = 0: the base's own function) or `checkpoint`'s."""
    policy_dir = checkpoint / "policy" if checkpoint is not None else None
    if policy_dir is not None:
        check_resume(policy_dir, cfg)
    if not uses_lora(cfg):
        return load_causal_lm(str(policy_dir or base_path), cfg, device)
    from peft import PeftModel, get_peft_model

    # Frozen weights need no float32 masters: they take the dtype the device computes in (float32 on a CPU).
    base = load_causal_lm(base_path, cfg, device, weights=model_precision(cfg, device).compute or MASTER)
    if policy_dir is None:
        policy = get_peft_model(base, peft_config(cfg))
        # adapter_config.json's pointer to the base model: a directory made absolute, so that it holds from anywhere
        policy.peft_config["default"].base_model_name_or_path = (os.path.abspath(base_path) if os.path.isdir(base_path)
                                                                 else base_path)
        return policy
    return PeftModel.from_pretrained(base, str(policy_dir), is_trainable=True)


def check_resume(policy_dir: Path, cfg: ModelConfig) -> None:
    """A resume continues the same kind of run: LoRA with the same rank and alpha, or full fine-tuning."""
    lora = cfg.lora
    if not is_adapter_dir(policy_dir):
        if uses_lora(cfg):
            raise UserError(f"{policy_dir} holds a full model, not LoRA adapters: resume it with model.lora.r=0, or "
                            "start a new LoRA run from a model with model.name_or_path")
        return
    saved = json.loads((policy_dir / ADAPTER_CONFIG).read_text())
    if (saved["r"], float(saved["lora_alpha"])) != (lora.r, float(lora.alpha)):
        raise UserError(f"{policy_dir} holds LoRA adapters of r={saved['r']}, alpha={saved['lora_alpha']} but the "
                        f"config says model.lora.r={lora.r}, model.lora.alpha={lora.alpha}: resume with "
                        f"model.lora.r={saved['r']} model.lora.alpha={saved['lora_alpha']}")


class BaseReference:
    """The KL reference of a LoRA policy: the training module itself with its adapters disabled, without gradients.

    Called like an mrl.modeling.models.Actor (what update.policy_forward calls), through a view that shares the policy's
    modules (no copy) and has no value head.  batch_logprobs calls it while the actor is in eval mode."""

    def __init__(self, actor: Actor):
        self.view = Actor(actor.policy).eval()

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        with self.view.policy.disable_adapter():
            return self.view(*args, **kwargs)


def trained_state(actor: Trainable) -> dict[str, torch.Tensor]:
    """The trained parameters (adapters, value head) on CPU, keyed as in mrl.modeling.models.Actor (`policy.*`)."""
    names = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    if actor.zero_stage == 3:  # partitioned: gather the trained ones alone (collective; rank 0 gets them, others {})
        state = actor.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True) or {}
        return {k: v.detach().cpu() for k, v in state.items() if k in names}
    return {n: p.detach().cpu() for n, p in actor.module.named_parameters() if n in names}


def save_adapter(actor: Trainable, directory: Path, trained: dict[str, torch.Tensor]) -> None:
    """Write the policy's adapters, from its trained weights (`trained_state`), to `directory` as a peft adapter dir,
    in model.dtype."""
    adapters = {k.removeprefix("policy."): v for k, v in trained.items() if k.startswith("policy.")}
    # save_embedding_layers=False: "auto" may look the base up on the hub; embeddings never get adapters here.
    actor.module.policy.save_pretrained(directory, state_dict=cast_state(adapters, actor.precision.export),
                                        save_embedding_layers=False)


def adapter_weights(policy_dir: Path) -> dict[str, torch.Tensor]:
    """A peft adapter dir's weights keyed as the adapted model names its parameters (peft's file leaves out the
    adapter's name: `q_proj.lora_A.weight` is the module's `q_proj.lora_A.default.weight`)."""
    from peft.utils import load_peft_weights

    return {re.sub(r"\.(lora_[AB])\.", r".\1.default.", k): v for k, v in load_peft_weights(str(policy_dir)).items()}


def check(cfg) -> None:
    """model.lora.target_modules: all-linear, or names that are modules of this model (peft would silently skip a
    misspelt one as long as another name matches)."""
    lora = cfg.model.lora
    if lora.r == 0:
        return
    target = lora.target_modules
    names = [target] if isinstance(target, str) else list(target) if OmegaConf.is_list(target) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"model.lora.target_modules={target!r}: give all-linear, or a list of module names such as "
                        "[q_proj,k_proj,v_proj,o_proj]")
    if names == ["all-linear"]:
        return
    linear = linear_module_names(cfg.model)
    if linear is None:  # a hub id whose config this machine cannot read: peft checks when it loads the model
        return
    unknown = unknown_targets(target if isinstance(target, str) else names, linear)
    if unknown:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise UserError(f"model.lora.target_modules: {', '.join(unknown)} matches no linear layer of "
                        f"{cfg.model.name_or_path} (its linear layers: {', '.join(kinds)}; the output layer takes no "
                        "adapters); fix the name, or use all-linear (every linear layer of attention and MLP)")
