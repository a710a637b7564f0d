"""A warm start: `mrl train trainer.init_from=RUN_DIR` starts RL from another run's newest intact checkpoint (an `mrl
sft` run's, or an RL run's), as the model every part of the run starts from: the policy, the KL reference, the
critic's backbone.

The checkpoint's policy is taken whole and at full precision (mrl.runs.restore.trained_weights: DeepSpeed's or
optimizer.pt's float32 masters where model.dtype rounded policy/): a full fine-tune's policy/ is used in place when it
is already exact; otherwise, and for LoRA, whose adapters are **merged** into their base, the weights are written
once to RUN_DIR/init_policy/.  LoRA in the new run (model.lora.r > 0) then trains new adapters on that merged model:
continuing the old adapters would tie the run to the old base and rank.

The run records where it came from in RUN_DIR/lineage.json (source run, checkpoint, step, stage, the policy
weights' sha256 from the checkpoint's manifest), which `mrl report` reads to draw the stages as one held-out curve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mrl.core import distributed as dist
from mrl.core.config import UserError
from mrl.modeling.lora import is_adapter_dir
from mrl.modeling.precision import MASTER
from mrl.modeling.trainable import DS_TAG, OPTIMIZER_FILE
from mrl.runs.restore import INIT_DIR, merged_policy, trained_weights
from mrl.runs.rundir import CHECKPOINTS, LINEAGE_FILE, MANIFEST, atomic_write_text, intact_checkpoint, step_of

WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")


def lineage(checkpoint: Path) -> dict[str, Any]:
    """Where a warm start comes from: the source run dir, the checkpoint, its step and stage, and the sha256 of its
    policy weights as its manifest recorded them."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = manifest["files"]
    weights = next((f"policy/{name}" for name in WEIGHT_FILES if f"policy/{name}" in files), None)
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint.parent
    return {"source_run": str(run_dir.resolve()), "checkpoint": str(checkpoint.resolve()), "step": step_of(checkpoint),
            "stage": (manifest.get("run") or {}).get("stage", "rl"),
            "policy_sha256": files[weights]["sha256"] if weights else None}


def exact_in_place(checkpoint: Path) -> bool:
    """Whether checkpoint/policy/ already holds the trained weights whole at full precision."""
    if (checkpoint / DS_TAG).is_dir() or is_adapter_dir(checkpoint / "policy"):
        return False
    import torch

    # mmap: only the "masters" entry is looked at, not the optimizer's moments read in
    return torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True, mmap=True)["masters"] is None


def materialize(checkpoint: Path, model_cfg, out: Path) -> None:
    """Write `checkpoint`'s policy as a plain model dir in float32 at `out` (LoRA merged), with its tokenizer."""
    if is_adapter_dir(checkpoint / "policy"):
        policy = merged_policy(checkpoint, model_cfg)
    else:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(str(checkpoint / "policy"), dtype=MASTER)
        weights = {k.removeprefix("policy."): v.float() for k, v in trained_weights(checkpoint).items()
                   if k.startswith("policy.")}
        missing = policy.load_state_dict(weights, strict=False).missing_keys
        tied = set(getattr(policy, "_tied_weights_keys", None) or ())
        if set(missing) - tied:
            raise UserError(f"trainer.init_from: {checkpoint} lacks weights {sorted(set(missing) - tied)[:3]}")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.is_symlink():  # planted to send the weights elsewhere: the link goes, its target is not touched
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(str(tmp), safe_serialization=True)
    for name in (p.name for p in (checkpoint / "policy").iterdir() if "token" in p.name or p.suffix == ".jinja"):
        shutil.copy2(checkpoint / "policy" / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def warm_start(init_from: str, model_cfg, run_dir: Path) -> str:
    """The model dir this run starts from (rank 0 writes what is needed, once; the other ranks wait in
    mrl.core.distributed.main_first around it) and its lineage, written to run_dir/lineage.json."""
    checkpoint = intact_checkpoint(Path(init_from), f"trainer.init_from={init_from}")
    source = lineage(checkpoint)
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    if exact_in_place(checkpoint):
        path = checkpoint / "policy"
    else:
        path = run_dir / INIT_DIR
        recorded = run_dir / LINEAGE_FILE
        same = recorded.exists() and json.loads(recorded.read_text()).get("policy_sha256") == source["policy_sha256"]
        if dist.is_main() and not (same and path.is_dir()):
            materialize(checkpoint, model_cfg, path)
    if dist.is_main():
        atomic_write_text(run_dir / LINEAGE_FILE, json.dumps({**source, "model_dir": str(path.resolve())}, indent=1))
    return str(path)


def check(cfg) -> None:
    """trainer.init_from names an intact checkpoint, or a run dir with one, before the run dir exists."""
    init_from = cfg.trainer.get("init_from")
    if init_from:
        intact_checkpoint(Path(init_from), f"trainer.init_from={init_from}")
