"""Config values that size what a run holds in memory, checked against the memory this machine can give it, before
anything is written (issue 44: `trainer.group_size=1e8` grew to the memory cap and died in a MemoryError traceback;
without a cap, the OOM killer picks a process).

Each count is priced at a floor of what one item costs (a rollout's token ids, masks, log-probs and its Episode are
well over ROW_BYTES), so a refused value could never have run, and any value that could is let through: the check
catches absurd counts in one line naming the key, not tight ones (those still meet the machine's own limit).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrl.core.config import UserError
from mrl.modeling.models import BUILTIN_TINY, ModelLoadError, context_length

ROW_BYTES = 8 << 10  # a rollout, a held-out episode, a demonstration in a batch: at least this much
RECORD_BYTES = 1 << 10  # a demonstration drawn from a generator task
PARAMETER_BYTES = 16  # a trained float32 weight, its gradient and AdamW's two moments


def available_bytes() -> int:
    """The memory this process may use: the machine's RAM, within RLIMIT_AS and RLIMIT_DATA and a cgroup's
    memory.max where they are set."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    try:
        cap = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cap.isdigit():
            limits.append(int(cap))
    except OSError:
        pass
    return min(limits)


def _needs(cfg) -> list[tuple[str, Any, int, str]]:
    """(key, its value, the bytes it needs at least, the fix) of every value that sizes memory."""
    trainer, needs = cfg.trainer, []
    if trainer.get("prompts_per_step") is not None and trainer.get("group_size") is not None:
        rollouts = int(trainer.prompts_per_step) * int(trainer.group_size)
        key = max(("prompts_per_step", "group_size"), key=lambda k: int(trainer[k]))  # the one to lower
        needs.append((f"trainer.{key}", trainer[key], rollouts * ROW_BYTES,
                      f"trainer.prompts_per_step x trainer.group_size = {rollouts} rollouts a step"))
    if trainer.get("eval_prompts") is not None:
        needs.append(("trainer.eval_prompts", trainer.eval_prompts, int(trainer.eval_prompts) * ROW_BYTES,
                       "held-out episodes at each evaluation"))
    sft = cfg.get("sft")
    if sft is not None:
        needs.append(("sft.max_records", sft.max_records, int(sft.max_records) * RECORD_BYTES,
                      "demonstrations drawn from the task"))
        needs.append(("sft.batch_size", sft.batch_size, int(sft.batch_size) * ROW_BYTES, "demonstrations a step"))
    tiny = cfg.model.get("tiny")
    if tiny is not None and cfg.model.name_or_path == BUILTIN_TINY:
        weights = int(tiny.vocab_size) * int(tiny.hidden_size)
        needs.append(("model.tiny.vocab_size", tiny.vocab_size, weights * PARAMETER_BYTES,
                      f"an embedding of {weights} trained weights"))
    return needs


def check(cfg) -> None:
    """Raise a UserError, in one line naming the key, for the first value whose floor exceeds available_bytes(), and
    for a task kwarg `num_*` beyond the model's context (each is at least a token of a prompt: a foreign run's
    `num_digits: 100000000` built 10^8 numbers before `mrl eval` read its checkpoint)."""
    have = available_bytes()
    for key, value, need, what in _needs(cfg):
        if need > have:
            raise UserError(f"{key}={value}: {what} need at least {need / 2**30:.1f} GiB, more than the "
                            f"{have / 2**30:.1f} GiB of memory here; lower {key}")
    task = OmegaConf.to_container(cfg.rewards.task, resolve=True) if cfg.rewards.get("task") is not None else {}
    counts = {name: value for name, value in (task or {}).items() if name.startswith("num_") and type(value) is int}
    if not counts:
        return
    try:
        context = context_length(cfg.model) or 1 << 20
    except ModelLoadError:  # a model that is not here: mrl.modeling.models.check says so in its own line
        return
    for name, value in counts.items():
        if value > context:
            raise UserError(f"rewards.task.{name}={value}: each is at least a token of a prompt, beyond the model's "
                            f"context of {context} tokens; lower rewards.task.{name}")
