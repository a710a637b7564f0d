"""Checkpoints: written atomically, found again for `trainer.resume`.

Layout of run_dir/checkpoints/step_000050/:
  policy/             the policy as an ordinary model directory (model.safetensors, config, tokenizer), weights in
                      model.dtype: what `mrl eval` and users load.  With LoRA (model.lora.r > 0): a peft adapter
                      dir (adapter_model.safetensors, adapter_config.json) and the tokenizer, no base weights; the
                      optimizer's state below then covers the adapters alone (mrl/lora.py)
  value_head.safetensors | critic/ + critic_head.safetensors   (PPO; critic/ in model.dtype too)
  optimizer.pt (plain PyTorch: AdamW's state, and the float32 masters when model.dtype rounds policy/ and critic/)
  or deepspeed/ (DeepSpeed's own checkpoint: optimizer partitions with their float32 masters)
A resume loads policy/ (and critic/), then the optimizer's state, whose masters replace the rounded weights: it
continues exactly whatever model.dtype is (mrl/precision.py).
  rng.pt              Python, NumPy and torch (CPU and CUDA) generator states
  state.json          step and data position
Each checkpoint is written to a temporary directory and renamed into place, and `latest` is rewritten the same way
afterwards, so a crash mid-save leaves the previous checkpoint and the `latest` pointer intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from mrl.config import UserError
from mrl.engine import DS_TAG, OPTIMIZER_FILE
from mrl.lora import is_peft, save_adapter
from mrl.precision import save_model_dir

CHECKPOINTS = "checkpoints"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], actor, tokenizer, critic=None) -> Path:
    """Write checkpoint `step` for the Trainables `actor` (an Actor) and `critic` (a ValueModel or None)."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if is_peft(actor.module.policy):  # LoRA: the adapters alone; the base stays at model.name_or_path (mrl/lora.py)
        weights = save_adapter(actor, tmp / "policy")
    else:
        weights = actor.full_state_dict()
        policy_weights = {k.removeprefix("policy."): v for k, v in weights.items() if k.startswith("policy.")}
        save_model_dir(actor.module.policy, tmp / "policy", policy_weights, actor.precision.export)
    tokenizer.save_pretrained(tmp / "policy")
    head = {k: v.contiguous() for k, v in weights.items() if k.startswith("value_head.")}
    if head:
        save_file(head, tmp / "value_head.safetensors")
    actor.save_optimizer(tmp)
    if critic is not None:
        critic_weights = critic.full_state_dict()
        backbone = {k.removeprefix("backbone."): v for k, v in critic_weights.items() if k.startswith("backbone.")}
        save_model_dir(critic.module.backbone, tmp / "critic", backbone, critic.precision.export)
        save_file({k: v.contiguous() for k, v in critic_weights.items() if k.startswith("value_head.")},
                  tmp / "critic_head.safetensors")
        critic.save_optimizer(tmp / "critic")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    if final.exists():  # re-saving the same step after a resume
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / "latest", final.name)
    return final


def trained_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's weights in `checkpoint` at full precision, keyed as in mrl.models.Actor (`policy.*`): DeepSpeed's
    float32 masters, the masters in optimizer.pt, or policy/ itself when model.dtype did not round it."""
    if (checkpoint / DS_TAG).is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    masters = torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True)["masters"]
    if masters is not None:
        return masters
    from safetensors.torch import load_file

    return {f"policy.{k}": v for k, v in load_file(checkpoint / "policy" / "model.safetensors").items()}


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / CHECKPOINTS / "latest"
    if not pointer.exists():
        return None
    path = run_dir / CHECKPOINTS / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def resolve_resume(resume: Any, run_dir: Path) -> Path | None:
    """`trainer.resume`: false; true (the latest checkpoint in this run dir); a checkpoint dir; or a run dir."""
    if resume in (False, None) or str(resume).lower() in ("false", "no", "0", ""):
        return None
    if resume is True or str(resume).lower() in ("true", "yes", "1", "latest"):
        found = latest_checkpoint(run_dir)
        if found is None:
            raise UserError(
                f"trainer.resume=true but {run_dir}/{CHECKPOINTS} holds no checkpoint; start the run with "
                "hydra.run.dir=<its run dir> or give trainer.resume=<checkpoint or run dir>"
            )
        return found
    path = Path(str(resume)).expanduser()
    if (path / "state.json").exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise UserError(f"trainer.resume={resume!r}: neither a checkpoint nor a run dir with checkpoints")
    return found
