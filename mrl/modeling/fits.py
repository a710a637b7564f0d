"""Config values that size what a run holds in memory, checked against the memory this machine can give it, before
anything is written (issue 44: `trainer.group_size=1e8` grew to the memory cap and died in a MemoryError traceback;
without a cap, the OOM killer picks a process).

Each count is priced at a floor of what one item costs (a rollout's token ids, masks, log-probs and its Episode are
well over ROW_BYTES), so a refused value could never have run, and any value that could is let through: the check
catches absurd counts in one line naming the key, not tight ones (those still meet the machine's own limit).
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mrl.core.config import TinyModelSpec, UserError
from mrl.modeling.models import BUILTIN_TINY, SPECIAL_TOKENS, TASK_WORDS, ModelLoadError, context_length

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
        needs += _tiny_needs({k: int(v) for k, v in tiny.items()})
    lora = cfg.model.get("lora")
    dims = _layers_and_width(cfg.model) if lora is not None and int(lora.r) > 0 else None
    if dims is not None:
        layers, hidden = dims
        weights = int(lora.r) * layers * 2 * hidden  # one adapted hidden x hidden projection a layer, at least
        needs.append(("model.lora.r", lora.r, weights * PARAMETER_BYTES,
                      f"{weights} trained adapter weights (r x {layers} layers x 2 x {hidden}, one module a layer)"))
    return needs


def _layers_and_width(model) -> tuple[int, int] | None:
    """(num_hidden_layers, hidden_size) of the built-in model's spec or a local model dir's config.json, or None
    where they cannot be read without loading the model (a hub id)."""
    if model.name_or_path == BUILTIN_TINY:
        tiny = model.get("tiny") or TINY_SIZES
        return int(tiny["num_hidden_layers"]), int(tiny["hidden_size"])
    try:
        config = json.loads((Path(os.path.expanduser(model.name_or_path)) / "config.json").read_text())
        config = config.get("text_config", config)
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (layers, hidden) if type(layers) is int and type(hidden) is int and layers > 0 and hidden > 0 else None


TINY_VOCAB_MIN = len(SPECIAL_TOKENS) + len(TASK_WORDS)  # mrl.modeling.models.tiny_vocab's fixed words
TINY_SIZES = {f.name: f.default for f in fields(TinyModelSpec) if f.name != "init_seed"}


def tiny_weights(spec: dict[str, int]) -> tuple[int, int]:
    """The built-in model's trained weights (Llama layout, tied embedding; the norms' few left out): (the embedding,
    the layers: each its attention's q, k, v and o and its MLP's gate, up and down projections).

    >>> tiny_weights(TINY_SIZES)  # 32 x 64; 2 x (64 x 64 x 2 + 64 x 32 x 2 + 3 x 64 x 128)
    (2048, 73728)
    """
    hidden = spec["hidden_size"]
    kv = spec["num_key_value_heads"] * (hidden // spec["num_attention_heads"])  # k and v's width
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * spec["intermediate_size"]
    return spec["vocab_size"] * hidden, spec["num_hidden_layers"] * layer


def tiny_problem(spec: dict[str, int]) -> str | None:
    """Why these sizes cannot make a Llama model (each a one-line refusal naming the key), or None."""
    for key in TINY_SIZES:
        if spec[key] < 1:
            return f"model.tiny.{key}={spec[key]}: a size is at least 1 (the built-in model's is {TINY_SIZES[key]})"
    if spec["vocab_size"] < TINY_VOCAB_MIN:
        return (f"model.tiny.vocab_size={spec['vocab_size']}: the built-in tokenizer has {TINY_VOCAB_MIN} fixed words "
                f"(special tokens and the tasks' words); give at least {TINY_VOCAB_MIN}")
    hidden, heads, kv = spec["hidden_size"], spec["num_attention_heads"], spec["num_key_value_heads"]
    if hidden % heads or (hidden // heads) % 2:
        return (f"model.tiny.num_attention_heads={heads}: each head's width, hidden_size / num_attention_heads, must "
                f"be a whole even number (rotary embeddings turn pairs), and hidden_size is {hidden}: give a divisor "
                f"of {hidden} such as {TINY_SIZES['num_attention_heads']}")
    if heads % kv:
        return (f"model.tiny.num_key_value_heads={kv}: must divide num_attention_heads={heads} (grouped-query "
                "attention shares each key/value head among a group of query heads)")
    return None


def _tiny_needs(spec: dict[str, int]) -> list[tuple[str, Any, int, str]]:
    """The built-in model's weights, the embedding's and the layers', each named by the size that is the most times
    the built-in model's among those that multiply it (the one to lower)."""
    if (problem := tiny_problem(spec)) is not None:
        raise UserError(problem)
    blame = lambda *keys: max(keys, key=lambda k: spec[k] / TINY_SIZES[k])  # noqa: E731
    embedding, layers = tiny_weights(spec)
    return [(f"model.tiny.{key}", spec[key], weights * PARAMETER_BYTES, f"{weights} trained weights ({what})")
            for key, weights, what in (
                (blame("vocab_size", "hidden_size"), embedding, "the embedding"),
                (blame("num_hidden_layers", "hidden_size", "intermediate_size"), layers,
                 f"{spec['num_hidden_layers']} layers"),
                (blame(*TINY_SIZES), embedding + layers, "the whole model"))]


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
