"""Precision is a policy, not a dtype flag.

`model.dtype` says how the user wants the model: the dtype it computes in where the device has fast kernels for it,
and the dtype of the model directories a checkpoint exports.  It is never the dtype of the weights being trained:

- Masters: trained weights and AdamW's moments are float32.  bf16 keeps 8 significant bits, so a weight of 0.02 can
  only move in steps of ~1e-4; an Adam update of lr=1e-6 rounds away, and one step on bf16 weights moves ~1% of
  them.  Loading in fp32 costs 2 more bytes per parameter than bf16 weights (next to the 12 of grads and moments).
- Compute, plain PyTorch: on CUDA, forward passes (training, scoring and `generate`) run under `torch.autocast` in
  model.dtype (matmuls in bf16, softmax, norms and losses in fp32); float16 adds a gradient scaler, since its small
  range underflows gradients.  bfloat16 on a GPU without bf16 (pre-Ampere) computes in fp32.
- Compute, DeepSpeed: its own bf16 (fp16) mode, which casts the module to bf16 and keeps the fp32 masters and the
  optimizer states inside the (ZeRO) optimizer, partitioned with them.
- CPU: float32 throughout, whatever model.dtype says.  bf16 matmuls on CPUs without AMX run ~27x slower than fp32
  (a 512x576 @ 576x1536 matmul on this repo's 2-core AMD EPYC: 26 ms fp32, 692 ms bf16), and CPU runs are small.
- Export: a checkpoint's policy/ and critic/ hold model.dtype weights, as the model came.  When that rounds them
  (model.dtype != float32, plain PyTorch), the Trainable's optimizer.pt also keeps the fp32 masters, so a resume
  continues exactly; DeepSpeed's checkpoint keeps its own masters.
- The frozen reference computes exactly as the policy did at step 0, so the KL starts at 0 rather than at a
  precision floor: it loads like the policy (float32 weights, the same autocast) on the plain path.  A bf16
  reference would save 2 bytes per parameter but differ from the autocast policy (its residual stream, embeddings
  and norms run in bf16).  Inside DeepSpeed's bf16 mode the policy computes on bf16 weights, so the reference
  should too: `load_causal_lm(..., weights=actor.module_dtype)`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mrl.core.config import UserError

MASTER = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype | None  # autocast dtype of every forward pass; None: float32
    export: torch.dtype  # model.dtype: the weights of the model directories a checkpoint writes


def precision_for(dtype: str, device: torch.device) -> Precision:
    """The policy for `model.dtype=dtype` on `device` (see the module docstring)."""
    if dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype!r}: choose one of {sorted(DTYPES)}; trained weights are float32 "
                        "whatever it says, it sets the compute dtype on GPUs and the exported weights")
    wanted = DTYPES[dtype]
    half = device.type == "cuda" and wanted != MASTER
    if wanted == torch.bfloat16 and half and not torch.cuda.is_bf16_supported():
        half = False  # pre-Ampere GPUs emulate bf16 slowly: compute in fp32, still export bf16
    return Precision(compute=wanted if half else None, export=wanted)


def compute_in(model: nn.Module, precision: Precision, device: torch.device) -> nn.Module:
    """Make every forward of `model` run under autocast in `precision.compute` (no-op without one).

    Wrapping `forward` itself (as accelerate does) covers every caller alike: a Trainable, a DeepSpeed engine, HF
    `generate` and the frozen reference, so sampling, scoring and training see the same numerics.
    """
    if precision.compute is None:
        return model
    forward = model.forward
    autocast = functools.partial(torch.autocast, device.type, dtype=precision.compute)

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with autocast():
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    model.compute_autocast = autocast  # for callers of its parts (mrl.modeling.models.Actor: decoder, output layer)
    return model


def autocast_of(model: nn.Module):
    """The autocast context `compute_in` gave `model` (a null context without one)."""
    make = getattr(model, "compute_autocast", None)
    return make() if make is not None else contextlib.nullcontext()


def deepspeed_modes(precision: Precision) -> dict[str, dict[str, bool]]:
    """DeepSpeed's bf16 / fp16 sections: on when the device computes in that dtype."""
    return {"bf16": {"enabled": precision.compute == torch.bfloat16},
            "fp16": {"enabled": precision.compute == torch.float16}}


def grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for float16 compute on the plain path; a pass-through otherwise."""
    return torch.amp.GradScaler(device.type, enabled=precision.compute == torch.float16)


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype`; tensors shared under several names (tied embeddings) stay shared."""
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        key = (value.data_ptr(), value.shape, value.stride())
        out[name] = cast.setdefault(key, value.to(dtype))
    return out


def save_model_dir(model, directory: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """`model`'s architecture with weights `state` as an HF model directory, its weights (and config) in `dtype`."""
    model.save_pretrained(directory, state_dict=cast_state(state, dtype))
    # save_pretrained records the dtype of the live (fp32) module, not of the weights written.
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(directory)
