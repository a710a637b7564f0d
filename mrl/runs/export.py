"""`mrl export RUN_DIR [--merge] [--out DIR]`: a checkpoint's policy as a model directory to hand on.

A full fine-tune's policy/ is already an ordinary HF model directory in model.dtype: it is copied as it is.  A LoRA
run's policy/ holds adapters only: `--merge` writes the base with the adapters merged in (float32 masters merged,
then saved in model.dtype) and the tokenizer, which `AutoModelForCausalLM.from_pretrained` loads with no peft;
without `--merge` the adapter directory is copied (load it with peft's `PeftModel.from_pretrained(base, DIR)`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mrl.core.config import UserError
from mrl.modeling.lora import is_adapter_dir
from mrl.modeling.models import load_tokenizer, quiet_transformers
from mrl.modeling.precision import DTYPES, save_model_dir
from mrl.runs.restore import merged_policy
from mrl.runs.rundir import intact_checkpoint
from mrl.runs.trust import run_config


def export(source: Path, out: Path | None = None, merge: bool = False,
           trust_config: bool = False) -> tuple[Path, str]:
    """Write `source`'s policy to `out` (default RUN_DIR/export).  Returns (out, what was written).  `source` is a
    checkpoint dir, which must match its checksums, or a run dir: its newest intact checkpoint, as a resume picks."""
    checkpoint = intact_checkpoint(source, f"mrl export {source}")
    run_dir = checkpoint.parent.parent
    out = out if out is not None else run_dir / "export"
    if out.is_symlink():
        raise UserError(f"--out {out} is a symlink: give a real directory (or a new path) to write the model to")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: give another --out or remove it")
    policy = checkpoint / "policy"
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    if is_adapter_dir(policy) and merge:
        cfg = run_config(run_dir, trust_config, renders=False).model  # export renders no conversation
        quiet_transformers()
        model = merged_policy(checkpoint, cfg)
        save_model_dir(model, tmp, model.state_dict(), DTYPES[cfg.dtype])
        load_tokenizer(str(policy)).save_pretrained(tmp)
        what = f"the base model with {checkpoint.name}'s LoRA adapters merged, in {cfg.dtype}"
    else:
        shutil.copytree(policy, tmp)
        what = (f"{checkpoint.name}'s LoRA adapters (peft; --merge for a plain model)" if is_adapter_dir(policy)
                else f"{checkpoint.name}'s policy")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(tmp, out)
    return out, what
