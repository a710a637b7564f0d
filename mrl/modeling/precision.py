"""Precision is a policy, not a dtype flag.

Two settings say it.  `model.dtype` is how the user wants the model: the dtype checkpoints export (and, on a GPU, the
dtype it computes in).  `model.compute_dtype` (auto | float32 | bfloat16 | float16) is the dtype every forward and
backward runs its matmuls in.  Neither is ever the dtype of the weights being trained:

- Masters: trained weights and AdamW's moments are float32.  bf16 keeps 8 significant bits, so a weight of 0.02 can
  only move in steps of ~1e-4; an Adam update of lr=1e-6 rounds away, and one step on bf16 weights moves ~1% of
  them.  Loading in fp32 costs 2 more bytes per parameter than bf16 weights (next to the 12 of grads and moments).
- Compute, plain PyTorch: forward passes (training, scoring, mrl's decoders and `generate`) run under
  `torch.autocast` in the compute dtype (matmuls in bf16; softmax, log-softmax, norms and losses in fp32, as autocast
  keeps them); float16 adds a gradient scaler, since its small range underflows gradients.
- `auto` picks, on a GPU, model.dtype (bfloat16 on a GPU without bf16, pre-Ampere, computes in fp32); on a CPU,
  bfloat16 where the CPU multiplies bf16 natively, float32 where it does not.  Native: AMX tiles (Intel Xeon 4th gen
  and later: bf16 matmuls 7-8x fp32 on 2 cores, 2x at a decode step's 24 rows) or AVX-512 BF16 dot products (AMD
  EPYC Zen 4: 2.1-2.6x fp32, one thread; docs/measured.md).  Without either (an AMD EPYC Zen 2/3) bf16 matmuls run
  ~27x slower than fp32 (a 512x576 @ 576x1536 matmul 26 ms fp32, 692 ms bf16).  bfloat16 asked for on such a CPU is
  honoured, with a one-line warning of the cost.  The built-in tiny model sets float32 (conf/model/tiny.yaml): its
  64-wide products gain nothing, and its tests compare exact values.
- Compute, DeepSpeed: its own bf16 (fp16) mode where the compute dtype is bf16 (fp16), which casts the module to
  bf16 and keeps the fp32 masters and the optimizer states inside the (ZeRO) optimizer, partitioned with them.
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
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mrl.core import distributed
from mrl.core.config import UserError

MASTER = torch.float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPES = ("auto", *DTYPES)


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype | None  # autocast dtype of every forward pass; None: float32
    export: torch.dtype  # model.dtype: the weights of the model directories a checkpoint writes


@functools.cache
def cpu_bf16() -> str | None:
    """How this CPU multiplies bf16 matrices natively: "AMX" (tiles, Linux's `amx_bf16` flag), "AVX512-BF16"
    (dot products, `avx512_bf16`), or None (emulated: slow)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return None
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None


def precision_for(dtype: str, device: torch.device, compute: str = "auto") -> Precision:
    """The policy for `model.dtype=dtype`, `model.compute_dtype=compute` on `device` (see the module docstring)."""
    if dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype!r}: choose one of {sorted(DTYPES)}; trained weights are float32 "
                        "whatever it says, it sets the exported weights (and the compute dtype on GPUs)")
    if compute not in COMPUTE_DTYPES:
        raise UserError(f"model.compute_dtype={compute!r}: choose one of {', '.join(COMPUTE_DTYPES)} (auto: bf16 "
                        "on a CPU with native bf16 matmuls, model.dtype on a GPU, else float32)")
    export = DTYPES[dtype]
    if device.type == "cuda":
        wanted = export if compute == "auto" else DTYPES[compute]
        if wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            wanted = MASTER  # pre-Ampere GPUs emulate bf16 slowly: compute in fp32, still export bf16
    elif compute == "auto":
        wanted = torch.bfloat16 if device.type == "cpu" and cpu_bf16() else MASTER
    else:
        wanted = DTYPES[compute]
        if wanted == torch.float16 and device.type == "cpu":
            raise UserError("model.compute_dtype=float16 on a CPU: CPUs have no fast float16 matmuls; use bfloat16 "
                            "(fast on a CPU with AMX or AVX-512 BF16) or float32")
    return Precision(compute=None if wanted == MASTER else wanted, export=export)


def model_precision(cfg, device: torch.device) -> Precision:
    """The policy of a `model` config group (ModelConfig); a run dir saved before compute_dtype existed: auto."""
    return precision_for(cfg.dtype, device, getattr(cfg, "compute_dtype", None) or "auto")


def describe(precision: Precision, device: torch.device) -> tuple[str, bool]:
    """(the compute in one line, e.g. `compute: bfloat16 (AMX) on cpu, float32 masters, exported in float32`,
    whether it is a costly choice: bf16 on a CPU without native bf16 matmuls)."""
    costly = device.type == "cpu" and precision.compute == torch.bfloat16 and not cpu_bf16()
    why = ""
    if device.type == "cpu":
        why = f" ({cpu_bf16() or 'no native bf16'})"
    if costly:
        why += ": bf16 matmuls run ~27x slower than fp32 on such CPUs; model.compute_dtype=auto computes in fp32"
    line = (f"compute: {dtype_name(precision.compute or MASTER)}{why} on {device.type}, float32 masters, "
            f"exported in {dtype_name(precision.export)}")
    return line, costly


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def announce(precision: Precision, device: torch.device) -> None:
    """Say `describe`'s line once per process (at its first model's load; rank 0 alone): a warning when costly."""
    line, costly = describe(precision, device)
    if distributed.is_main():
        print(f"mrl: {'warning: ' if costly else ''}{line}", file=sys.stderr, flush=True)


def compute_in(model: nn.Module, precision: Precision, device: torch.device) -> nn.Module:
    """Make every forward of `model` run under autocast in `precision.compute` (no-op without one).

    Wrapping `forward` itself (as accelerate does) covers every caller alike: a Trainable, a DeepSpeed engine, HF
    `generate` and the frozen reference, so sampling, scoring and training see the same numerics.
    """
    announce(precision, device)
    if precision.compute is None:
        return model
    forward = model.forward
    autocast = functools.partial(torch.autocast, device.type, dtype=precision.compute)

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with model.compute_autocast():  # looked up at each call: `in_float32` swaps it
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    model.compute_autocast = autocast  # for callers of its parts (mrl.modeling.models.Actor: decoder, output layer)
    model.compute_dtype = precision.compute  # for those that cast weights themselves (the native decoder's packing)
    return model


@contextlib.contextmanager
def in_float32(model: nn.Module):
    """`model` (given an autocast by `compute_in`) computing in float32 for the duration: to measure what its
    compute dtype changes."""
    base = getattr(model, "get_base_model", None)  # a LoRA policy: the transformers model carries the autocast
    owner = base() if callable(base) else model
    make = vars(owner).get("compute_autocast")
    if make is None:
        yield
        return
    owner.compute_autocast = contextlib.nullcontext
    try:
        yield
    finally:
        owner.compute_autocast = make


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
