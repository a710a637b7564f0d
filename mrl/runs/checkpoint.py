"""Checkpoints: written atomically, found again for `trainer.resume`.

Layout of run_dir/checkpoints/step_000050/:
  policy/             the policy as an ordinary model directory (model.safetensors, config, tokenizer), weights in
                      model.dtype: what `mrl eval` and users load.  With LoRA (model.lora.r > 0): a peft adapter
                      dir (adapter_model.safetensors, adapter_config.json) and the tokenizer, no base weights; the
                      optimizer's state below then covers the adapters alone (mrl/modeling/lora.py)
  value_head.safetensors | critic/ + critic_head.safetensors   (PPO; critic/ in model.dtype too)
  optimizer.pt (plain PyTorch: AdamW's state, and the float32 masters when model.dtype rounds policy/ and critic/)
  or deepspeed/ (DeepSpeed's own checkpoint: optimizer partitions with their float32 masters)
A resume loads policy/ (and critic/), then the optimizer's state, whose masters replace the rounded weights: it
continues exactly whatever model.dtype is (mrl/modeling/precision.py).
  rng.json            Python, NumPy and torch (CPU and CUDA) generator states, as JSON (one per rank).  mrl
                      unpickles nothing: optimizer.pt is read with torch.load(weights_only=True) (tensors and plain
                      containers only), and so are deepspeed/'s files for eval, export and init_from
                      (mrl.runs.restore.deepspeed_weights); a resume's DeepSpeed reads them with full pickle, so resume
                      only from runs you trust (the checksums catch damage, not a forged manifest)
  state.json          step, data position, the prices (lambda) of the constraints with a budget, pid prices' memory
  manifest.json       every file's size and sha256, and the run's algorithm, reward set and number of ranks
                      (mrl/runs/rundir.py)
A checkpoint is written to a temporary directory, fsynced with its manifest, and renamed into place; `latest` is
replaced the same way afterwards.  A crash or SIGKILL mid-save leaves the previous checkpoint and the `latest` pointer
intact; a write that fails (a full disk) removes its temp dir and raises CheckpointError in one line.  A resume
verifies the checksums and falls back to the previous intact checkpoint (mrl.runs.rundir.resolve_resume).

Several ranks (mrl/core/distributed.py): every rank calls save_checkpoint; each writes its DeepSpeed partitions into
rank 0's temporary directory (DeepSpeed's checkpoint calls are collective), rank 0 writes the rest, seals and renames.
A failure on any rank fails the save on every rank, with rank 0's message.  The run dir must be on a filesystem
every rank sees (multi-node: a shared one).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save_file

from mrl.core import distributed as dist
from mrl.modeling.lora import is_peft, save_adapter, trained_state
from mrl.modeling.precision import save_model_dir
from mrl.runs.rundir import (
    CHECKPOINTS,
    LATEST,
    STATE_FILE,
    atomic_write_text,
    fsync_dir,
    latest_checkpoint,
    seal_checkpoint,
)

RNG_FILE = "rng.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); the previous one is intact."""


def rng_state() -> dict[str, Any]:
    """Every generator's state as plain JSON data."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(keys), gauss], "numpy": [name, np_keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def load_rng_state(checkpoint: Path, rank: int = 0) -> None:
    saved = json.loads((checkpoint / RNG_FILE).read_text())
    set_rng_state(saved["ranks"][rank] if "ranks" in saved else saved)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], actor, tokenizer, critic=None,
                    identity: dict[str, Any] | None = None) -> Path:
    """Write checkpoint `step` for the Trainables `actor` (an Actor) and `critic` (a ValueModel or None); `identity`
    (mrl.runs.rundir.run_identity) goes into its manifest.  Raises CheckpointError, the previous checkpoint intact, when
    the write fails."""
    root = run_dir / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".{final.name}.tmp{dist.broadcast(os.getpid())}"  # rank 0's: every rank writes into it
    aside = root / f".{final.name}.old{os.getpid()}"
    main = dist.is_main()
    failure: Exception | None = None
    try:
        if main:
            root.mkdir(parents=True, exist_ok=True)
            for partial in root.glob(".step_*"):  # left by a process killed mid-save (the lock: none writes now)
                shutil.rmtree(partial, ignore_errors=True)
            tmp.mkdir()
    except Exception as err:
        failure = err
    if dist.all_agree(failure is None):
        try:
            write_checkpoint_files(tmp, state, actor, tokenizer, critic)  # every rank: its part
        except Exception as err:
            failure = err
    reasons = [r for r in dist.gather_objects(None if failure is None else _reason(failure)) if r is not None]
    if not reasons and main:
        try:
            seal_checkpoint(tmp, identity or {})
            if final.exists():  # re-saving a step after a resume from an earlier one: keep it until the new one is in
                os.replace(final, aside)
            os.replace(tmp, final)
            fsync_dir(root)
            atomic_write_text(root / LATEST, final.name)
        except Exception as err:
            failure = err
            reasons = [_reason(err)]
    message = None
    if reasons and main:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not final.exists():
            os.replace(aside, final)
        previous = latest_checkpoint(run_dir)
        free = shutil.disk_usage(root if root.exists() else run_dir).free
        # torch.save reports a full disk as "unexpected pos ...": the free space tells
        full = getattr(failure, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < 2**26 \
            or any(os.strerror(errno.ENOSPC) in r for r in reasons)
        message = (f"could not write checkpoint {final.name} in {root} ({reasons[0]}; {free / 2**20:.0f} MiB free "
                   "there); " + (f"{previous.name} is intact: {'free space' if full else 'fix the cause'}, then "
                                  "continue with trainer.resume=true" if previous is not None
                                  else "no earlier checkpoint exists"))
    message = dist.broadcast(message)
    if message is not None:
        raise CheckpointError(message) from failure
    if main:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def _reason(err: Exception) -> str:
    return (err.strerror if isinstance(err, OSError) and err.strerror else
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")


def write_checkpoint_files(directory: Path, state: dict[str, Any], actor, tokenizer, critic) -> None:
    """Every rank calls it: the ZeRO-3 weight gather and DeepSpeed's save are collective; rank 0 writes the model
    directories, the heads, the RNG states of all ranks and state.json.

    A write that fails (a full disk) must not make its rank skip the collectives after it, or the other ranks would
    wait in them for ever: after a failure a rank writes nothing more of its own, still takes part in every
    collective, and raises its first error at the end (the caller then fails the save on every rank)."""
    main = dist.is_main()
    failed: list[Exception] = []

    def attempt(write: Callable[[], None], collective: bool = False) -> None:
        """Rank 0's own write (skipped after a failure), or a collective step every rank must run."""
        if collective or (main and not failed):
            try:
                write()
            except Exception as err:
                failed.append(err)

    lora = is_peft(actor.module.policy)
    weights = trained_state(actor) if lora else actor.full_state_dict()

    def write_policy() -> None:
        if lora:  # the adapters alone; the base stays at model.name_or_path (mrl/modeling/lora.py)
            save_adapter(actor, directory / "policy", weights)
        else:
            policy_weights = {k.removeprefix("policy."): v for k, v in weights.items() if k.startswith("policy.")}
            save_model_dir(actor.module.policy, directory / "policy", policy_weights, actor.precision.export)
        tokenizer.save_pretrained(directory / "policy")
        head = {k: v.contiguous() for k, v in weights.items() if k.startswith("value_head.")}
        if head:
            save_file(head, directory / "value_head.safetensors")

    attempt(write_policy)
    attempt(lambda: actor.save_optimizer(directory), collective=True)
    if critic is not None:
        critic_weights = critic.full_state_dict()

        def write_critic() -> None:
            backbone = {k.removeprefix("backbone."): v for k, v in critic_weights.items()
                        if k.startswith("backbone.")}
            save_model_dir(critic.module.backbone, directory / "critic", backbone, critic.precision.export)
            save_file({k: v.contiguous() for k, v in critic_weights.items() if k.startswith("value_head.")},
                      directory / "critic_head.safetensors")

        attempt(write_critic)
        dist.barrier()  # critic/ exists before the ranks write DeepSpeed's files into it
        attempt(lambda: critic.save_optimizer(directory / "critic"), collective=True)
    rngs = dist.gather_objects(rng_state())

    def write_state() -> None:
        (directory / RNG_FILE).write_text(json.dumps(rngs[0] if len(rngs) == 1 else {"ranks": rngs}))
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2))

    attempt(write_state)
    if failed:
        raise failed[0]
