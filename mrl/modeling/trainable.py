"""A module with its optimizer, behind one small interface: plain PyTorch, or a DeepSpeed ZeRO engine.

The loop calls `accumulate(loss, last)` once per micro-batch; the optimizer steps after the last one.  Losses are
already divided by the mini-batch's size (see mrl/algo/losses.py), so neither path rescales them by the number of
micro-batches, and that number may change from step to step (DAPO trains on however many live groups it found).
Whatever `model.dtype` says, the optimizer updates float32 masters (mrl/modeling/precision.py): the module itself on the
plain path, DeepSpeed's partitions in its bf16/fp16 mode.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from mrl.core import distributed
from mrl.core.config import DeepSpeedConfig, UserError
from mrl.modeling.precision import MASTER, Precision, deepspeed_modes, grad_scaler, precision_for

DS_TAG = "deepspeed"
OPTIMIZER_FILE = "optimizer.pt"


def init_single_process_group(device: torch.device) -> None:
    """Without a launcher, give DeepSpeed a one-process group (gloo on CPU, nccl on GPU); under one, the launcher's
    group (mrl.core.distributed.init)."""
    import deepspeed
    import torch.distributed as dist

    distributed.init()
    if dist.is_initialized():
        return
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def skip_shm_comm_op() -> None:
    """Start DeepSpeed's communication without its CPU shared-memory all-reduce op (deepspeed_shm_comm).  The op
    serves only `inference_all_reduce`, the all-reduce of DeepSpeed-Inference's tensor-parallel layers (AutoTP),
    which mrl never calls (and which falls back to torch's all_reduce without it); ZeRO's collectives are torch's.
    Yet every rank loaded it at every start, after probing every op's build (gcc runs on a test program, logged
    through Hydra's logger as `gcc ... test.c -laio`: the async_io op's libaio check)."""
    import importlib

    # (not `deepspeed.comm.torch`: that attribute is the torch package, which deepspeed.comm re-exports)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def torch_extensions_dir() -> Path:
    """Where DeepSpeed's compiled C++ ops are cached: one dir per Python environment.  Two venvs sharing one dir
    rebuild the op in turn (its build flags name the venv's include paths): minutes per DeepSpeed start on a
    loaded 2-core machine."""
    import hashlib

    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    return Path.home() / ".cache" / "mrl" / "torch_extensions" / key


def load_plain(path: Path, allowed: tuple[type, ...] = ()) -> Any:
    """A `.pt` file of tensors and plain containers (torch.load(weights_only=True): nothing is unpickled that could
    run code), and instances of the plain data classes `allowed`; anything else is one line naming the file, not
    torch's page-long traceback."""
    import pickle

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError, TypeError) as err:
        lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        first = next((line for line in lines if "GLOBAL" in line or "Unpickler" in line), lines[0])  # what it refused
        raise UserError(f"{path} is not a file of plain tensors that mrl loads ({first.strip()[:160]}); it was not "
                        "written by mrl train, or was changed since: use another checkpoint") from None


def clear_stale_build_locks(root: Path, recheck_s: float = 1.0) -> list[Path]:
    """Remove the build locks a killed op build left under `root` (the dirs of TORCH_EXTENSIONS_DIR); return them.

    torch guards a build with `<op>/lock`, created with O_EXCL and held open by the builder until it removes it.  A
    build killed midway (a timeout's SIGKILL, Ctrl-C during the first DeepSpeed start) leaves the file, and every
    later start then waits on it forever, polling.  A lock that no process holds open, still there and still
    unheld `recheck_s` later (a builder that just closed it removes it at once), is such a leftover."""
    locks = {str(p): p.stat().st_ino for p in root.glob("*/lock") if p.is_file()}
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    unheld = set(locks) - _held_open(set(locks))
    if not unheld:
        return []
    time.sleep(recheck_s)
    removed = []
    for path in sorted(unheld - _held_open(unheld)):
        try:
            if os.stat(path).st_ino == locks[path]:
                os.unlink(path)
                removed.append(Path(path))
        except FileNotFoundError:  # its builder, or another process clearing it, got there first
            pass
    return removed


def _held_open(paths: set[str]) -> set[str]:
    """Those of `paths` that some process (of those this one may inspect) has open, from /proc/<pid>/fd."""
    held = set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            entries = list(fds.iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in entries:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own fd among them)
                continue
            if target in paths:
                held.add(target)
    return held


def free_port() -> int:
    """A TCP port nobody listens on now, so that runs on one machine do not collide."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_config(cfg: DeepSpeedConfig, precision: Precision, micro_batch_size: int, lr: float,
                     weight_decay: float) -> dict[str, Any]:
    """The dict `deepspeed.initialize` takes, from the `deepspeed/` config group and the precision policy."""
    zero: dict[str, Any] = {"stage": cfg.stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        # Accumulation boundaries are set by the loop (set_gradient_accumulation_boundary), not counted.
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.gradient_clipping,
        "zero_optimization": zero,
        **deepspeed_modes(precision),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.offload_optimizer:  # offloaded states need DeepSpeed's CPU Adam, named here rather than passed in
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
    return config


def param_groups(module: nn.Module, lr: float, lr_by_prefix: dict[str, float]) -> list[dict[str, Any]]:
    """One AdamW group per distinct learning rate, by parameter-name prefix; the rest at `lr`."""
    groups: dict[float, list[nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            group_lr = next((v for prefix, v in lr_by_prefix.items() if name.startswith(prefix)), lr)
            groups.setdefault(group_lr, []).append(param)
    return [{"params": ps, "lr": group_lr} for group_lr, ps in groups.items()]


class Trainable:
    """`module` (float32, as mrl.modeling.models loads it) trained by AdamW, optionally inside a DeepSpeed engine.

    `lr_by_prefix` gives parameters whose name starts with a prefix their own learning rate (PPO's value head).
    `module_dtype` is the dtype of the module's weights as its forward sees them: float32, or bf16/fp16 inside
    DeepSpeed's bf16/fp16 mode (the masters then live in the engine's optimizer).
    """

    def __init__(self, module: nn.Module, lr: float, weight_decay: float, grad_clip: float,
                 ds: DeepSpeedConfig, micro_batch_size: int, device: torch.device,
                 lr_by_prefix: dict[str, float] | None = None):
        self.grad_clip = grad_clip
        # Weights that never train (a LoRA policy's base) stay out of checkpoints: they are where the model came from.
        self.frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self.precision = precision_for(ds.model_dtype, device, getattr(ds, "compute_dtype", None) or "auto")
        params = param_groups(module, lr, lr_by_prefix or {})
        if ds.enabled:
            # DeepSpeed compiles a C++ op on first use: cache it across runs (~30 s saved per run), and clear
            # what a build killed there left, which would hang this start.
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
            for lock in clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"])):
                print(f"mrl: removed {lock}, left by a DeepSpeed op build that was killed", file=sys.stderr)
            import deepspeed

            skip_shm_comm_op()
            init_single_process_group(device)
            config = deepspeed_config(ds, self.precision, micro_batch_size, lr, weight_decay)
            optimizer = None if "optimizer" in config else torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, model_parameters=params, config=config
            )
            self.module = self.engine.module
            self.zero_stage = ds.stage
            self.module_dtype = self.precision.compute or MASTER
        else:
            self.engine = None
            self.module = module
            # fused: one kernel over every parameter; on a CPU ~3x faster than the per-tensor default (SmolLM2-135M:
            # 0.43 s a step instead of 1.2 s, scripts/bench.py), the same update up to float rounding.
            self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
            self.scaler = grad_scaler(self.precision, device)
            self.zero_stage = None
            self.module_dtype = MASTER

    def __call__(self, *args, **kwargs):
        return (self.engine or self.module)(*args, **kwargs)

    def whole(self):
        """A context in which the module holds all its weights and runs without collectives: under ZeRO-3, each
        rank gathers every parameter once (one all-gather per parameter) and lifts DeepSpeed's hooks, which would
        otherwise gather each layer's weights again at every forward call, i.e. at every generated token, and make
        the ranks' forward calls wait for each other.  Costs the whole model's weights (in the compute dtype) on
        each rank for the context's span; a no-op under ZeRO-0/1/2 and plain PyTorch (weights already whole)."""
        return _gathered_zero3(self.engine) if self.zero_stage == 3 else nullcontext()

    def accumulate(self, loss: torch.Tensor, last: bool) -> float | None:
        """Backward one micro-batch's loss; after the last, clip and step.  Returns the grad norm when it steps."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
            norm = self.engine.get_global_grad_norm() if last else None
            return float(norm) if norm is not None else None
        self.scaler.scale(loss).backward()
        if not last:
            return None
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)  # skipped when float16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole module's weights on CPU, gathered from ZeRO-3 partitions when needed (on rank 0 only)."""
        if self.zero_stage == 3:  # collective: every rank calls it, rank 0 gets the weights (others: {})
            state = self.engine._zero3_consolidated_16bit_state_dict() or {}
        else:
            state = self.module.state_dict()
        return {k: v.detach().cpu() for k, v in state.items()}

    def save_optimizer(self, directory: Path) -> None:
        """What the optimizer needs to go on exactly: its moments, the loss scale, and the float32 masters when the
        checkpoint's model directories round them to model.dtype (DeepSpeed's checkpoint holds all of it); frozen
        weights are left out."""
        if self.engine is not None:
            self.engine.save_checkpoint(str(directory), tag=DS_TAG, exclude_frozen_parameters=bool(self.frozen))
            return
        rounded = self.precision.export != MASTER
        masters = {k: v for k, v in self.module.state_dict().items() if k not in self.frozen} if rounded else None
        torch.save({"optimizer": self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict(),
                    "masters": masters}, directory / OPTIMIZER_FILE)

    def load_optimizer(self, directory: Path) -> None:
        """Restore what `save_optimizer` wrote; the masters replace the rounded weights the module was loaded with."""
        if self.engine is not None:
            self.engine.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=not self.frozen)
            return
        state = load_plain(directory / OPTIMIZER_FILE)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["grad_scaler"])
        if state["masters"] is not None:
            missing = set(self.module.load_state_dict(state["masters"], strict=not self.frozen).missing_keys)
            if missing - self.frozen:
                raise UserError(f"{directory / OPTIMIZER_FILE} lacks trained weights "
                                f"{sorted(missing - self.frozen)[:3]}: it belongs to another model or LoRA setting")


@contextmanager
def _gathered_zero3(engine) -> Iterator[None]:
    """ZeRO-3: all parameters gathered, DeepSpeed's module hooks removed for the span and put back after (as TRL's
    `unwrap_model_for_generation`)."""
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for param in engine.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = getattr(offload, "param_coordinator", None)
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # the forward calls seen inside are not the training step's
            offload._register_deepspeed_module(offload.module)


def check(cfg) -> None:
    """Where the run trains: `trainer.device`, and the ranks under a launcher."""
    check_device(cfg.trainer.device)
    _check_ranks(cfg)


def check_device(name: str) -> None:
    """`trainer.device` names a device torch knows, and a CUDA one only where CUDA is visible."""
    try:
        device = torch.device(name) if name != "auto" else None
    except (RuntimeError, ValueError):
        raise UserError(f"trainer.device={name!r} is not a device: use auto (cuda if present, else cpu), cpu, cuda "
                        "or cuda:N") from None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name!r} but no CUDA device is visible; use trainer.device=auto or cpu")


def _check_ranks(cfg) -> None:
    """Under a launcher (WORLD_SIZE > 1): the global batch splits into whole groups per rank, and DeepSpeed is the
    one path that averages gradients over ranks (mrl/core/distributed.py)."""
    world = distributed.world_size()
    if world == 1:
        return
    if not cfg.deepspeed.enabled:
        raise UserError(f"deepspeed=none under a launcher (WORLD_SIZE={world}): the plain PyTorch path trains one "
                        "process and would let the ranks' weights drift apart; use "
                        "deepspeed=zero2 (or zero1, zero3), or run on one process")
    if cfg.trainer.prompts_per_step % world:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} does not split over {world} ranks: "
                        "it is the global batch, and each rank generates whole groups for an equal share; use a "
                        f"multiple of {world} (e.g. {world * max(1, cfg.trainer.prompts_per_step // world)})")


def pick_device(name: str) -> torch.device:
    """`trainer.device` as the device this rank trains (or evaluates) on: auto is cuda where visible, else cpu; under
    a launcher, one GPU per rank on its node."""
    check_device(name)  # `mrl eval` of a GPU run on a machine without one: the same one line as train's
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.world_size() > 1:
        name = f"cuda:{distributed.local_rank()}"
    return torch.device(name)
