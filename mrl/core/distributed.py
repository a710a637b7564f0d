"""Data parallel: who this process is, the few collectives the loop calls at named places, and rank 0's sinks.

`torchrun --nproc_per_node=N -m mrl train ...` and `deepspeed --num_gpus N --module mrl train ...` start N processes
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; `mrl train` starts the one process group of the
run (`init`) before Hydra runs, so that rank 0 can tell the others its run dir (mrl.cli).  Without a launcher every
function here is the identity on one process: single-process code pays nothing and reads the same.

What is global and what is per rank:
- `trainer.prompts_per_step` (B) is the global batch: rank r generates whole groups for prompts
  [position + r*B/N, position + (r+1)*B/N) (`shard`), and the data position advances by B, as on one process;
- every batch-level statistic (GDPO's batch normalization, PPO's whitening, dead-group fractions, logged means) is
  computed on rows gathered from every rank (`gather_rows`), as TRL gathers rewards before normalizing;
- losses are divided by the *global* count of their mini-batch divided by N (`per_rank_denominator`): DeepSpeed
  averages gradients over ranks, so the result is the gradient of the global mini-batch on one process.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, NoReturn, TypeVar

T = TypeVar("T")


# ---- who am I (environment only: cheap, no torch import) ---------------------------------------------------------

def world_size() -> int:
    """Processes in the run: WORLD_SIZE as the launcher set it, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def shard(num_prompts: int, world: int | None = None, at: int | None = None) -> tuple[int, int]:
    """(offset, count) of this rank's prompts among a round's `num_prompts` (the global B): contiguous, equal shares,
    so that the ranks' shards, in rank order, are the prompts one process would draw.

    >>> shard(8, world=2, at=1)
    (4, 4)
    """
    world = world_size() if world is None else world
    at = rank() if at is None else at
    if num_prompts % world:
        raise ValueError(f"{num_prompts} prompts do not split over {world} ranks")
    count = num_prompts // world
    return at * count, count


# ---- the process group -----------------------------------------------------------------------------------------

def init() -> None:
    """Under a launcher (WORLD_SIZE > 1): start the default process group, gloo for CPU tensors and NCCL for CUDA
    tensors when a GPU is visible.  DeepSpeed finds it initialized and uses it."""
    if world_size() == 1:
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=timedelta(minutes=30))


def finish(exit_code: int) -> None:
    """End this rank's part of a run whose exit code is `exit_code`.  Under a launcher, never by the interpreter's
    finalization: gloo groups outlive `destroy_process_group` (DeepSpeed holds them), and a worker of theirs that
    releases a collective's Python tensors late takes the GIL while the interpreter finalizes; CPython ends it with
    pthread_exit, whose unwinding through gloo's noexcept destructor aborts the rank ("terminate called without an
    active exception", 2 two-rank runs in 40 under load: reports/journal/testing.md).

    - 0 (every rank finished the run: each has made the same collectives): meet in a barrier, destroy the group,
      then `leave(0)`.  A rank that failed after the last collective never reaches the barrier; the launcher stops
      this one when that rank exits.
    - anything else: the peers may be inside a collective this rank will never join, so destroying the group (a
      collective) could wait for ever: `leave(exit_code)` at once; the launcher sees it and stops the other ranks.
    A rank that never started a group (`mrl eval` on ranks > 0) leaves the same way."""
    if world_size() == 1:
        return
    if exit_code == 0 and _active():
        import torch.distributed as dist

        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001  a peer left mid-way: the run did not end alike on every rank
            print(f"mrl: error: [rank {rank()}] another rank stopped before the end of the run ({err})",
                  file=sys.stderr)
            exit_code = 1
    leave(exit_code)


def leave(exit_code: int) -> NoReturn:
    """Exit with `exit_code` without the C++ runtime's static teardown (os._exit), every sink closed first: the
    run's own (metrics file, progress bar, W&B run) are closed by its loop; here W&B's service, the logging
    handlers (Hydra's log file) and stdout/stderr."""
    import logging

    if "wandb" in sys.modules:  # atexit would have torn its service down
        sys.modules["wandb"].teardown(exit_code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_code)


def peer_lost(err: BaseException) -> bool:
    """`err` is a collective failing because another rank's process is gone (it stopped on an error of its own,
    said above by that rank): gloo reports the connection to it reset or closed."""
    return _active() and isinstance(err, RuntimeError) and any(
        sign in str(err) for sign in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


@contextmanager
def process_group(start: bool = True) -> Iterator[None]:
    """The process group of one command (`mrl train`, `mrl sft`): started on entry under a launcher, ended by
    `finish` with the command's exit code, whatever the way out (return, SystemExit, an exception).  `start=False`
    (`mrl eval`, whose rank 0 works alone): no group, only the way out."""
    if start:
        init()
    code = 1
    try:
        yield
        code = 0
    except SystemExit as err:
        code = exit_code_of(err)
        raise
    except BaseException:
        if world_size() > 1:  # finish leaves by os._exit: the interpreter would never print it
            traceback.print_exc()
        raise
    finally:
        finish(code)


def exit_code_of(err: SystemExit) -> int:
    """The process exit code a SystemExit gives (None: 0; a message: 1).

    >>> exit_code_of(SystemExit()), exit_code_of(SystemExit(3)), exit_code_of(SystemExit("bye"))
    (0, 3, 1)
    """
    return 0 if err.code is None else err.code if isinstance(err.code, int) else 1


def _active() -> bool:
    if world_size() == 1:
        return False
    import torch.distributed as dist

    return dist.is_initialized()


def barrier() -> None:
    if _active():
        import torch.distributed as dist

        dist.barrier()


def broadcast(obj: T) -> T:
    """Rank 0's `obj` on every rank (any picklable object)."""
    if not _active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: T) -> list[T]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def main_decides(decide: Callable[[], T]) -> T:
    """Rank 0 runs `decide()` (reads the run dir, say), the others receive its result; an exception there is raised
    on every rank as the same type and message, so that no rank waits for a rank that stopped."""
    outcome: tuple[Any, BaseException | None] = (None, None)
    if is_main():
        try:
            outcome = (decide(), None)
        except Exception as err:  # noqa: BLE001  re-raised below, on every rank
            outcome = (None, err)
    value, err = broadcast(outcome)
    if err is not None:
        raise err
    return value


@contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (builds a cache, writes a file), the others after it: no two build one thing."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def all_agree(ok: bool) -> bool:
    """True when `ok` holds on every rank."""
    return min(gather_objects(bool(ok)))


# ---- one run dir for every rank (mrl.cli, mrl.runs.rundir.RunDirGuard) ----------------------------------------------

_announced = False


def announce_run_dir(run_dir: str) -> None:
    """Rank 0, once its run dir is resolved, locked and checked: tell the other ranks (waiting in `await_run_dir`)."""
    global _announced
    if _active() and is_main() and not _announced:
        _announced = True
        broadcast((run_dir, None))


def abandon_run_dir(exit_code: int) -> None:
    """Rank 0 stops without having announced a run dir: the other ranks exit with `exit_code`."""
    global _announced
    if _active() and is_main() and not _announced:
        _announced = True
        broadcast((None, exit_code))


def await_run_dir() -> tuple[str | None, int | None]:
    """Ranks > 0, before Hydra: (rank 0's run dir, None), or (None, rank 0's exit code) when it stopped first."""
    return broadcast(None)


# ---- numbers and tensors over ranks ----------------------------------------------------------------------------

def _reduce(value: float, op: str) -> float:
    if not _active():
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor.item()


def sum_over_ranks(value: float) -> float:
    return _reduce(value, "sum")


def max_over_ranks(value: float) -> float:
    return _reduce(value, "max")


def per_rank_denominator(count: float) -> float:
    """What a rank divides its part of a loss by: the global count (sequences or tokens of the mini-batch, summed over
    ranks) / the number of ranks.  DeepSpeed averages the ranks' gradients, so sum_r (sum of rank r's terms) / count
    — the one-process gradient of the global mini-batch, whatever each rank's share of its rows."""
    return max(sum_over_ranks(count), 1.0) / world_size()


def mean_over_ranks(values: dict[str, float], weight: float = 1.0) -> dict[str, float]:
    """The `weight`-weighted mean of each value over ranks (every rank passes the same keys; a rank of weight 0, whose
    values may be NaN, means of nothing, is left out)."""
    parts = [(v, w) for v, w in gather_objects((values, float(weight))) if w]
    total = sum(w for _, w in parts)
    if len(parts) <= 1 or total == 0:
        return dict(parts[0][0] if parts else values)
    return {k: sum(v[k] * w for v, w in parts) / total for k in values}


def pad_to(x, shape: tuple[int, ...], value: float = 0):
    """`x` padded at the end of every dim to `shape` (>= x.shape) with `value`.

    >>> import torch
    >>> pad_to(torch.tensor([[1, 2]]), (2, 3)).tolist()
    [[1, 2, 0], [0, 0, 0]]
    """
    import torch.nn.functional as F

    widths = []
    for have, want in reversed(list(zip(x.shape, shape))):
        widths += [0, want - have]
    return F.pad(x, widths, value=value) if any(widths) else x


def join_rows(parts: list, sizes: list[int]):
    """Parts padded to one shape ([max rows, ...]) -> their first `sizes[r]` rows each, concatenated (rank order)."""
    import torch

    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def gather_rows(x):
    """Every rank's rows of `x` [n_r, ...], concatenated in rank order -> [sum n_r, ...]; trailing dims are padded
    with 0 to the largest rank's (a completion mask's padding is 0: nothing).  None stays None."""
    if x is None or not _active():
        return x
    import torch
    import torch.distributed as dist

    shapes = gather_objects(tuple(x.shape))
    shape = tuple(max(s[d] for s in shapes) for d in range(x.dim()))
    as_bool = x.dtype == torch.bool
    padded = pad_to(x.to(torch.uint8) if as_bool else x, shape).contiguous()
    parts = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(parts, padded)
    out = join_rows(parts, [s[0] for s in shapes])
    return out.bool() if as_bool else out


def local_rows(x, like):
    """This rank's rows of `x` (a result over `gather_rows(like)`), cut back to `like`'s trailing shape."""
    if x is None or not _active():
        return x
    sizes = [s[0] for s in gather_objects(tuple(like.shape))]
    start = sum(sizes[:rank()])
    return x[(slice(start, start + like.shape[0]), *(slice(0, n) for n in like.shape[1:]))]


def choose_over_ranks(choose: Callable[[Any], Any], flags) -> tuple[Any, int]:
    """A choice that must see the whole batch in its global order (dynamic sampling's first live groups): `choose`
    ([n] bool -> [n] bool) on every rank's `flags`, in rank order -> (this rank's part of the choice, how many were
    chosen over all ranks).  One process: (choose(flags), its count)."""
    chosen = choose(gather_rows(flags))
    return local_rows(chosen, flags), int(chosen.sum())


# ---- rank 0's sinks --------------------------------------------------------------------------------------------

def warn(message: str) -> None:
    """Print `mrl: warning: <message>` (one line) on this rank: what the user should know, not worth stopping for."""
    print(f"mrl: warning: {message}", file=sys.stderr, flush=True)


def exit_with_error(message: str, code: int = 2, every_rank: bool = False) -> NoReturn:
    """Print `mrl: error: <message>` (one line) and exit with `code`.  Under a launcher only rank 0 prints an error
    that every rank meets alike (a config error, an agreed stop); `every_rank` for one that a rank may meet alone (a
    reward channel failing on its rows), prefixed with the rank."""
    if is_main():
        print(f"mrl: error: {message}", file=sys.stderr)
    elif every_rank:
        print(f"mrl: error: [rank {rank()}] {message}", file=sys.stderr)
    raise SystemExit(code)


class Nothing:
    """What ranks > 0 hold instead of a sink (metrics file, progress bar): every method call does nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def on_main(make: Callable[[], T]) -> T | Nothing:
    """`make()` on rank 0 (a sink: it writes files or the terminal); `Nothing` elsewhere."""
    return make() if is_main() else Nothing()
