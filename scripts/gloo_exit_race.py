"""The abort at exit of issue 43, in a few lines (docs/testing.md): a gloo group that outlives
`destroy_process_group` (another owner holds it, as DeepSpeed's engine holds its groups), its workers still
releasing all-reduces of Python tensors when the interpreter finalizes.

    python -m torch.distributed.run --standalone --nproc_per_node=2 scripts/gloo_exit_race.py exit   # aborts at times
    python -m torch.distributed.run --standalone --nproc_per_node=2 scripts/gloo_exit_race.py leave  # never
"""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
group = dist.new_group([0, 1])
tensors = [torch.ones(4096) for _ in range(200)]
works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
dist.destroy_process_group()
del works, tensors
if sys.argv[1:] == ["leave"]:
    from mrl.core.distributed import leave

    leave(0)
