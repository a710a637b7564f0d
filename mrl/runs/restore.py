"""Restore a trained policy from a checkpoint, for inference: `mrl eval`, `mrl export` and the GPU check.

Training resumes through mrl.runs.checkpoint (the optimizer's state, the ranks' partitions); what is read here is the
actor's weights alone, at full precision (`trained_weights`), and the policy as a plain transformers model
(`merged_policy`: LoRA adapters merged into their base; `load_for_inference`: on a device, in model.dtype).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mrl.core import safe_json
from mrl.core.config import ModelConfig, UserError
from mrl.modeling.lora import adapter_weights, is_adapter_dir
from mrl.modeling.models import load_causal_lm, resolve_model_path
from mrl.modeling.precision import MASTER, compute_in, model_precision
from mrl.modeling.trainable import DS_TAG, OPTIMIZER_FILE, load_plain
from mrl.runs.rundir import LINEAGE_FILE, MANIFEST, checkpoint_problem, foreign_files_problem, weights_problem


def trained_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's weights in `checkpoint` at full precision, keyed as in mrl.modeling.models.Actor (`policy.*`):
    DeepSpeed's float32 masters, the masters in optimizer.pt, or policy/ itself when model.dtype did not round it.  A
    LoRA checkpoint holds the trained weights alone: the adapters (and a value head), without the base."""
    if (checkpoint / DS_TAG).is_dir():
        return deepspeed_weights(checkpoint)
    masters = load_plain(checkpoint / OPTIMIZER_FILE)["masters"]
    if masters is not None:
        return masters
    if is_adapter_dir(checkpoint / "policy"):
        return {f"policy.{k}": v for k, v in adapter_weights(checkpoint / "policy").items()}
    from safetensors.torch import load_file

    return {f"policy.{k}": v for k, v in load_file(checkpoint / "policy" / "model.safetensors").items()}


INIT_DIR = "init_policy"  # RUN_DIR/init_policy: the merged model a warm start writes (mrl/runs/warm_start.py)
# What DeepSpeed's checkpoint files hold besides tensors and containers: plain data classes, rebuilt from their fields.
DS_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
              "deepspeed.utils.tensor_fragment.fragment_address")


def deepspeed_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's float32 masters in `checkpoint`, gathered by its own zero_to_fp32, each of its files read as
    mrl reads optimizer.pt (mrl.modeling.trainable.load_plain: tensors, containers and DS_GLOBALS, never code):
    DeepSpeed itself unpickles them whole, so a forged `*_optim_states.pt` of a foreign run dir ran code in `mrl eval`,
    `mrl export --merge` and trainer.init_from (issue 44).  A resume still loads through DeepSpeed (trusted: the
    run's own dir)."""
    import importlib
    from unittest import mock

    from deepspeed.utils import zero_to_fp32

    allowed = tuple(getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
                    for name in DS_GLOBALS)

    class Torch:  # torch, as zero_to_fp32 sees it, but for its load
        def __getattr__(self, name: str):
            return getattr(torch, name)

        @staticmethod
        def load(file, *args, **kwargs):
            return load_plain(Path(file), allowed)

    with mock.patch.object(zero_to_fp32, "torch", Torch()):
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)


def adapter_base(checkpoint: Path, cfg: ModelConfig) -> str:
    """The model dir the adapters of `checkpoint` were trained on: the run's model.name_or_path, or the warm start
    its run dir records (lineage.json's model_dir: trainer.init_from's model), which must pass a checkpoint's
    checks.  adapter_config.json names it; a directory it names that is neither is refused in one line (a foreign
    run dir named any directory, whose weights were then loaded outside the manifest's checks); a name that is no
    directory means model.name_or_path."""
    policy = checkpoint / "policy"
    base = json.loads((policy / "adapter_config.json").read_text()).get("base_model_name_or_path")
    recorded = resolve_model_path(cfg)
    if not (isinstance(base, str) and Path(base).is_dir()) or Path(base).resolve() == Path(recorded).resolve():
        return recorded
    run_dir = checkpoint.parent.parent
    warm = warm_start_dir(run_dir)
    if warm is None or Path(base).resolve() != warm.resolve():
        problem = f"is {base}, neither model.name_or_path ({cfg.name_or_path}) nor the run's warm start (lineage.json)"
    elif (warm.parent / MANIFEST).exists():  # a source checkpoint's policy/, used in place
        problem = checkpoint_problem(warm.parent)
    elif warm.resolve() == (run_dir / INIT_DIR).resolve():  # the merged model the warm start wrote
        problem = foreign_files_problem(warm) or weights_problem(warm)
    else:
        problem = f"is {base}, which lineage.json names, neither a checkpoint's policy/ nor this run's {INIT_DIR}/"
    if problem:
        raise UserError(f"{policy / 'adapter_config.json'}: the adapters' base {problem}; mrl loads a base only from "
                        "those: use the run's own checkpoint, or set base_model_name_or_path to its model")
    return str(warm)


def warm_start_dir(run_dir: Path) -> Path | None:
    """The model dir `run_dir` started from (its lineage.json's model_dir), or None."""
    try:
        recorded = safe_json.loads((run_dir / LINEAGE_FILE).read_text(encoding="utf-8"), 1 << 20)
    except (OSError, UnicodeDecodeError, safe_json.Unreadable):
        return None
    model_dir = recorded.get("model_dir") if isinstance(recorded, dict) else None
    return Path(model_dir) if isinstance(model_dir, str) else None


def merged_policy(checkpoint: Path, cfg: ModelConfig) -> nn.Module:
    """A LoRA checkpoint's policy as a plain transformers model, float32, on CPU: the base at model.name_or_path with
    the adapters merged in at full precision (their float32 masters where model.dtype rounded policy/, with or
    without DeepSpeed: `trained_weights`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base(checkpoint, cfg), dtype=MASTER)
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
    return compute_in(merged_policy(checkpoint, cfg).to(device), model_precision(cfg, device), device)
