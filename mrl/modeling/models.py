"""Load the policy, the frozen reference and the critic through transformers' Auto* classes.

The built-in tiny model goes through the same path as a real one: it is built once from a config with random
weights, saved as an ordinary model directory (config.json, model.safetensors, tokenizer.json), then loaded back
with AutoModelForCausalLM / AutoTokenizer.  No network is touched.  Models load with float32 weights (the masters
that train) and compute in `model.dtype` where the device has it (mrl/modeling/precision.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from mrl.algo.losses import linear_token_logprobs, token_logprobs
from mrl.core.config import ModelConfig, TinyModelSpec, UserError
from mrl.core.data import hub_unreachable
from mrl.modeling.local_models import BUILT_LOCALLY
from mrl.modeling.precision import MASTER, autocast_of, compute_in, model_precision

BUILTIN_TINY = "builtin:tiny"
SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
# Words the built-in tasks use; the rest of the vocabulary is filler, so that a random policy rarely emits a
# meaningful word by chance (as a real LM's huge vocabulary makes any one action rare).
TASK_WORDS = [str(d) for d in range(10)] + ["add", "max", "min", "=", "|", "calc", "hack", "lookup", "ans", "x",
                                           "+", "*"]


class ModelLoadError(UserError):
    """A model path or hub id that cannot be loaded; the message is meant for the user."""


def tiny_vocab(vocab_size: int) -> list[str]:
    specials = list(SPECIAL_TOKENS.values())
    fixed = specials + TASK_WORDS
    if vocab_size < len(fixed):
        raise ValueError(f"tiny vocab_size must be >= {len(fixed)}, got {vocab_size}")
    return fixed + [f"w{i}" for i in range(vocab_size - len(fixed))]


def build_tiny_model(spec: TinyModelSpec, directory: Path) -> Path:
    """Write a random-init Llama-style causal LM and its word-level tokenizer to `directory`; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = tiny_vocab(spec.vocab_size)
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, padding_side="left", **SPECIAL_TOKENS)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model = LlamaForCausalLM(config)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, directory)
    except OSError:  # another process built the same spec first
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def tiny_model_dir(spec: TinyModelSpec) -> Path:
    """The cached directory of the tiny model for `spec`, built on first use (one per distinct spec)."""
    key = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]
    cache = Path(os.environ.get("MRL_CACHE", Path.home() / ".cache" / "mrl")) / "models" / f"tiny-{key}"
    if not (cache / "config.json").exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_model(spec, cache)
    return cache


def resolve_model_path(cfg: ModelConfig) -> str:
    """The directory or hub id to load; the tiny model is built (or found in the cache) here."""
    if cfg.name_or_path == BUILTIN_TINY:
        spec = cfg.tiny if cfg.tiny is not None else TinyModelSpec()
        return str(tiny_model_dir(TinyModelSpec(**dict(spec))))
    name = os.path.expanduser(cfg.name_or_path)
    if os.path.isdir(name):  # an existing directory wins over a hub id of the same spelling (models/smollm2-...)
        return name
    if name in BUILT_LOCALLY:
        raise ModelLoadError(f"model.name_or_path={cfg.name_or_path!r} is built on this machine: run "
                             f"`{BUILT_LOCALLY[name]}` first (no hub needed)")
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.isabs(name) or name.count("/") > 1
    if looks_local:
        raise ModelLoadError(
            f"model.name_or_path={cfg.name_or_path!r}: no such directory. Give an existing model directory, "
            f"a hub id such as Qwen/Qwen3-0.6B, or {BUILTIN_TINY}."
        )
    check_hub_model(cfg.name_or_path)
    return name


def check_hub_model(hub_id: str) -> None:
    """A hub id that is not in the local HF cache needs the Hub: without it, one line at once, where
    huggingface_hub would retry for ~50 s after the run dir exists."""
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
            return
    except ValueError:  # not a valid repo id: transformers says so when it loads
        return
    reason = hub_unreachable()
    if reason is not None:
        local = f"models/{hub_id.split('/')[-1]}"
        raise ModelLoadError(f"model.name_or_path={hub_id!r} is not a local directory nor in the HF cache, and the "
                             f"Hub cannot be reached: {reason}. Download it where there is a network (hf download "
                             f"{hub_id} --local-dir {local}) and give model.name_or_path={local}")


def quiet_transformers() -> None:
    """No per-file progress bars: they flood logs on every load and checkpoint."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {err}".splitlines()[0]) from err
    tokenizer.padding_side = "left"  # generation appends on the right
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, cfg: ModelConfig, device: torch.device, weights: torch.dtype = MASTER) -> nn.Module:
    """The causal LM at `path`, computing per `cfg.dtype` on `device`.  `weights`: float32 for a model that trains;
    a frozen reference takes the trained module's `module_dtype`, so that both compute alike."""
    from transformers import AutoModelForCausalLM

    precision = model_precision(cfg, device)
    kwargs = {"dtype": weights}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise ModelLoadError(
            f"cannot load model {path!r}: not a model directory and not reachable on the hub "
            f"({str(err).splitlines()[0]})"
        ) from err
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return compute_in(model.to(device), precision, device)


# Config keys of families whose forward transforms the output layer's logits (Actor.logits applies each).
# Soft caps, cap * tanh(logits / cap): Gemma 2-4 and nanochat; RecurrentGemma; xLSTM.
SOFT_CAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier", *SOFT_CAPS)


def _zero_linear(hidden_size: int) -> nn.Linear:
    """A scalar head that starts at value 0 everywhere, so early GAE is driven by the rewards."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class Actor(nn.Module):
    """The policy, optionally with a scalar value head on its last hidden state (PPO with `algo.critic=head`)."""

    def __init__(self, policy: nn.Module, value_head: bool = False):
        super().__init__()
        self.policy = policy
        self.value_head = _zero_linear(policy.config.hidden_size) if value_head else None

    def forward(self, input_ids, attention_mask, position_ids, keep: int = 0, prompt_width: int = 0,
                targets: torch.Tensor | None = None, temperature: float = 1.0, entropy: bool = False,
                entropy_grad: bool = False, warp=None, scored: torch.Tensor | None = None):
        """The last `keep` positions (0: all L) of each row.

        Without `targets`: (logits [N, keep, V], values [N, keep] or None).
        With `targets` [N, K], K <= keep: (log-probs [N, K] of targets[:, k] at kept position k, of logits /
        temperature, truncated by `warp` (top_k / top_p: mrl.algo.losses.truncate) when given; entropies [N, K] or None
        without `entropy` or `entropy_grad`; values [N, keep] or None).  The
        output layer then runs a chunk of positions at a time: no [N, K, V] tensor exists, in the forward or the
        backward (mrl.algo.losses.linear_token_logprobs where plain_output_weight allows, its gradient by hand; else
        mrl.algo.losses.token_logprobs, recomputed by autograd).  Inside forward, so that an engine (DeepSpeed) sees one
        call.  `scored` [N, K] (with `targets`): the positions to score, the output layer running on those alone
        (the rest: log-prob and entropy 0); None: all K.

        Only the completion's positions need logits: at a real vocabulary (49k) and a long chat prompt, the output
        layer over the prompt's positions would cost more than the rest of the model, and its memory most of all.

        `prompt_width` > 0: the first `prompt_width` columns are a prompt that the rows of a group share, and `keep`
        covers at most the completion and the prompt's last position.  Each distinct prompt then runs once and its
        keys and values serve every row that has it (exact: gradients reach it from all of them).  A group of G
        rollouts of a 250-token chat prompt and 60 completion tokens costs ~(250 + 8*60) token passes, not 8*310.

        Each of these is a strategy for the numbers `reference_logprobs` computes plainly (one padded forward, full
        logits): tests/test_step_cost.py proves them equal.
        """
        long = self.training and torch.is_grad_enabled() and \
            saved_bytes(self.policy, int(attention_mask[:, -keep:].sum())) > CHECKPOINT_BYTES
        with autocast_of(self.policy), layers_checkpointed(self.policy, long):  # (the output layer: chunked below)
            if prompt_width and not (self.training and checkpointed(self.policy)):
                # (checkpointed layers drop the cache in training, so those take the plain path)
                hidden = self._shared_prompt_states(input_ids, attention_mask, position_ids, prompt_width)
            else:
                hidden = self.policy.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                                   position_ids=position_ids, use_cache=False).last_hidden_state
            hidden = hidden[:, -keep:]  # [N, keep, H]
            if targets is not None:
                scored_hidden = hidden[:, :targets.shape[1]]  # [N, K, H]
                at = None if scored is None else scored.bool()  # [N, K]
                if at is not None:  # the scored positions alone, as one row: [1, M, H], [1, M]
                    scored_hidden, targets = scored_hidden[at][None], targets[at][None]
                weight = None if entropy_grad or warp is not None else self.plain_output_weight()
                outputs = (linear_token_logprobs(scored_hidden, weight, targets, temperature / self.logit_multiplier(),
                                                 entropy)
                           if weight is not None else
                           token_logprobs(self.logits, scored_hidden, targets, self.vocab_size, temperature, entropy,
                                          entropy_grad, warp))
                if at is not None:  # back to [N, K], 0 where not scored
                    outputs = tuple(None if x is None else x.new_zeros(at.shape).index_put((at,), x[0])
                                    for x in outputs)
            else:
                outputs = (self.logits(hidden),)
        values = None
        if self.value_head is not None:
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        return *outputs, values

    @property
    def vocab_size(self) -> int:
        head = self.policy.get_output_embeddings()
        return getattr(head, "out_features", None) or self.policy.config.get_text_config().vocab_size

    def check_logits(self) -> None:
        """Refuse a model whose own forward transforms the output layer's logits in a way `logits` does not apply (a
        family mrl does not know): the trainer would score tokens under another distribution than the policy samples
        from.  One forward of 8 positions, at load, before any engine partitions the weights."""
        ids = (torch.arange(1, 9, device=self.policy.device) % self.vocab_size)[None]  # [1, 8]
        gap = logits_gap(self.policy, lambda: self.policy(input_ids=ids).logits,
                         lambda: self.logits(self.policy.get_decoder()(input_ids=ids).last_hidden_state))
        if gap is not None:
            family = self.policy.config.get_text_config().model_type
            raise UserError(
                f"model type {family!r}: its forward transforms the output layer's logits in a way mrl does not "
                f"apply (largest difference {gap:.3g}); mrl scores tokens through Actor.logits in "
                f"mrl/modeling/models.py, "
                f"which applies {', '.join(LOGIT_TRANSFORMS)}: add this family's transform there, or train another "
                "model")

    def plain_output_weight(self) -> torch.Tensor | None:
        """The output layer's weight [V, H] when its logits are hidden @ weight.T times `logit_multiplier()` (no bias,
        no soft cap, not an adapter-wrapped layer, not a ZeRO-3 partition), so that
        mrl.algo.losses.linear_token_logprobs may compute them, the multiplier folded into the temperature; else None
        (token_logprobs calls `logits`)."""
        head = self.policy.get_output_embeddings()
        if type(head) is not nn.Linear or head.bias is not None or self.soft_cap() is not None \
                or hasattr(head.weight, "ds_id"):
            return None
        return head.weight

    def logit_multiplier(self) -> float:
        """The constant the family multiplies the output layer's logits by (1 for most): Cohere's logit_scale,
        Granite's 1 / logits_scaling (HyperCLOVAX, MuP, multiplies by it instead), Falcon-H1's lm_head_multiplier."""
        config = self.policy.config.get_text_config()
        multiplier = 1.0
        if getattr(config, "logit_scale", None) is not None and config.model_type.startswith("cohere"):
            multiplier *= config.logit_scale  # (MPT's config has the key too, and its forward ignores it)
        if getattr(config, "logits_scaling", None) is not None:
            scaling = config.logits_scaling
            multiplier = multiplier * scaling if config.model_type == "hyperclovax" else multiplier / scaling
        if getattr(config, "lm_head_multiplier", None) is not None:
            multiplier *= config.lm_head_multiplier
        return float(multiplier)

    def soft_cap(self) -> float | None:
        """The family's soft cap of its logits, cap * tanh(logits / cap), or None (SOFT_CAPS)."""
        config = self.policy.config.get_text_config()
        return next((c for c in (getattr(config, key, None) for key in SOFT_CAPS) if c is not None), None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The policy's logits from its last hidden states [..., H] -> [..., V]: its output layer and the scaling or
        soft-capping its family applies after it (LOGIT_TRANSFORMS), as the model's own forward computes them."""
        logits = self.policy.get_output_embeddings()(hidden)
        multiplier, cap = self.logit_multiplier(), self.soft_cap()
        if multiplier != 1.0:
            logits = logits * multiplier
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def _shared_prompt_states(self, input_ids, attention_mask, position_ids, prompt_width: int) -> torch.Tensor:
        """Last hidden states [N, 1 + L - W, H]: the prompt's last position, then every later one."""
        W = prompt_width
        # Rows with equal prompt ids and mask share one prompt pass: `first[u]` is distinct prompt u's first row.
        distinct, row_prompt = torch.unique(torch.cat([input_ids[:, :W], attention_mask[:, :W]], 1), dim=0,
                                            return_inverse=True)  # [U, 2W], [N]
        rows = torch.arange(len(row_prompt), device=row_prompt.device)
        first = torch.full_like(rows[: len(distinct)], len(rows)).scatter_reduce(0, row_prompt, rows, "amin")  # [U]
        decoder = self.policy.get_decoder()
        # On a CPU the completions run in buckets of rows of similar length, each to its own longest: a row is not
        # computed past its end for the sake of a longer row in another bucket (rows of a bucket see the same keys
        # as before, so each row's states are the one-batch states).  Positions past a bucket's width are zeros:
        # padding.  On a GPU, where padding costs less than another forward's launches, one bucket (not measured).
        tail_columns = torch.arange(1, input_ids.shape[1] - W + 1, device=input_ids.device)
        lengths = (attention_mask[:, W:] * tail_columns).amax(1)  # [N] each row's last attended column + 1
        buckets = length_buckets(lengths, BUCKET_COST) if input_ids.device.type == "cpu" \
            else [torch.arange(len(lengths), device=lengths.device)]
        widths = [max(1, int(lengths[rows].max())) for rows in buckets]
        # The ids every decoder call computes (the distinct prompts, then each bucket's tails) looked up in one call,
        # where each call would look up its own: a lookup's backward fills a dense gradient of the whole embedding
        # (SmolLM2: 49,152 x 576, 113 MB: ~60 ms each, at ten calls a step; measured).
        ids = [input_ids[first, :W], *(input_ids[rows, W:W + width] for rows, width in zip(buckets, widths))]
        embedded = decoder.get_input_embeddings()(torch.cat([part.flatten() for part in ids]))  # [tokens, H]
        prompt_embeds, *tail_embeds = [flat.view(*part.shape, -1)
                                       for flat, part in zip(embedded.split([part.numel() for part in ids]), ids)]
        cache = empty_cache(self.policy)
        head = decoder(inputs_embeds=prompt_embeds, attention_mask=attention_mask[first, :W],
                       position_ids=position_ids[first, :W], use_cache=True, **{cache_kwarg(decoder): cache})
        states = []
        for rows, width, embeds in zip(buckets, widths, tail_embeds):
            bucket_cache = rows_of(cache, row_prompt[rows])  # [U, ...] -> [n, ...], differentiable
            tail = decoder(inputs_embeds=embeds, attention_mask=attention_mask[rows, :W + width],
                           position_ids=position_ids[rows, W:W + width], use_cache=True,
                           **{cache_kwarg(decoder): bucket_cache}).last_hidden_state  # [n, width, H]
            states.append(nn.functional.pad(tail, (0, 0, 0, input_ids.shape[1] - W - width)))
        order = torch.cat(buckets).argsort()  # bucketed rows -> rows
        return torch.cat([head.last_hidden_state[row_prompt, -1:], torch.cat(states)[order]], 1)


def reference_logprobs(policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """The plain reference for what `Actor.forward` computes with `targets`: the log-probs [N, T] of the completion
    `completion_ids` [N, T] (the last T columns of `input_ids` [N, L]) under `policy`'s own forward, every row padded
    and its prompt its own, the full logits [N, T, V] / temperature, log_softmax; 0 where `completion_mask` is 0.

    Actor.forward gets the same numbers faster, by strategies each of which leaves them unchanged: a group's shared
    prompt run once (`prompt_width`), CPU rows in length buckets, one embedding lookup, the output layer a chunk at a
    time on the scored tokens alone.  tests/test_step_cost.py holds it to this function, values and gradients."""
    T = completion_ids.shape[1]
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                    use_cache=False).logits  # [N, L, V]
    logprobs = (logits[:, -T - 1:-1] / temperature).log_softmax(-1)  # position P-1+t predicts completion token t
    return logprobs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) * completion_mask  # [N, T]


BUCKET_COST = 16  # what another forward of the completions costs on a CPU, in tokens computed (fixed per-call work)


def length_buckets(lengths: torch.Tensor, cost: int) -> list[torch.Tensor]:
    """Rows [N] by their lengths, cut into buckets of similar length so that a bucket computed to its longest
    row's length costs least: the sum over buckets of rows x longest + `cost` each (fewest padded tokens, a
    bucket's fixed cost weighed against them).  Rows in order of length; an exact partition of the sorted rows
    (dynamic programming over where each bucket starts).  -> row indices per bucket, shortest bucket first.

    >>> [b.tolist() for b in length_buckets(torch.tensor([64, 10, 12, 60]), 16)]
    [[1, 2], [3, 0]]
    >>> [b.tolist() for b in length_buckets(torch.tensor([64, 60, 62]), 16)]  # 2 tokens saved: not worth a call
    [[1, 2, 0]]
    """
    order = lengths.argsort(stable=True)
    sorted_lengths = lengths[order].tolist()
    n = len(sorted_lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest cut of the j shortest rows
    start = [0] * (n + 1)  # where the last bucket of best[j] starts
    for j in range(1, n + 1):
        for i in range(j):  # rows i .. j-1 in one bucket, computed to the longest of them, sorted_lengths[j-1]
            spent = best[i] + (j - i) * sorted_lengths[j - 1] + cost
            if spent < best[j]:
                best[j], start[j] = spent, i
    cuts, j = [], n
    while j > 0:
        cuts.append((start[j], j))
        j = start[j]
    return [order[i:j] for i, j in reversed(cuts)]


def rows_of(cache, rows: torch.Tensor):
    """A copy of `cache` holding its rows `rows` [A] (a group's shared prompt -> one row per rollout); `cache`
    stays as it was (a layer's update and batch_select_indices rebind its tensors: copies of the layer objects
    suffice).  Differentiable."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    twin.batch_select_indices(rows)
    return twin


def logits_gap(model: nn.Module, own: Callable[[], torch.Tensor], mine: Callable[[], torch.Tensor]) -> float | None:
    """The largest difference between the logits `own()` (the model's forward) and `mine()` (mrl's way to the same
    logits) compute, when over 1% of the largest logit; None when they agree.  Both run in eval mode (no dropout;
    the mode is restored), without gradients, under the model's autocast."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_of(model):
            expected, computed = own().float(), mine().float()
    finally:
        model.train(training)
    gap = (expected - computed).abs().max().item()
    return gap if gap > 1e-2 * max(expected.abs().max().item(), 1e-6) else None


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them.  [N, L] -> [N, L]."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def empty_cache(model: nn.Module):
    """A KV cache to fill with a forward pass (and to grow token by token in `generate`)."""
    from transformers import DynamicCache

    return DynamicCache(config=hf_model(model).config)


# A forward with gradients whose layers would save more than this for the backward (`saved_bytes`) keeps only each
# decoder layer's input, and the backward runs the layer again (HF's activation checkpointing, for that forward
# alone): SmolLM2's 30 layers save ~1 MB a completion token otherwise (a 4,500-token completion x 2 rollouts took
# 13.6 GB), ~70 KB a token so, for a second forward of the layers (~30% more update time).  1 GiB is ~1,000 of
# SmolLM2's completion tokens a micro-batch: the CPU runs' 12 x 48 run as before; the built-in model never reaches it.
# model.gradient_checkpointing=true checkpoints every forward.
CHECKPOINT_BYTES = 1 << 30


def saved_bytes(model: nn.Module, tokens: int) -> int:
    """What the decoder layers of `model` save for the backward over `tokens` positions, estimated: 16 bytes a
    position a layer per unit of hidden_size + intermediate_size (measured on SmolLM2: 0.87 MB a completion token at
    30 x (576 + 1536), where this says 1.01)."""
    config = hf_model(model).config.get_text_config()
    hidden = config.hidden_size
    width = hidden + (getattr(config, "intermediate_size", None) or 4 * hidden)
    return tokens * config.num_hidden_layers * width * 16


@contextlib.contextmanager
def layers_checkpointed(model: nn.Module, on: bool):
    """Every decoder layer of `model` activation-checkpointed for the block (a forward: its backward replays what
    the forward recorded, whatever the flag says by then), when `on` and not already so; as it was after."""
    hf = hf_model(model)
    if not on or checkpointed(hf) or not getattr(hf, "supports_gradient_checkpointing", False):
        yield
        return
    replay = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    hf._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=replay)  # flags only: no hooks added
    try:
        yield
    finally:
        hf._set_gradient_checkpointing(enable=False)


def checkpointed(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (its name changed in transformers 5)."""
    model = hf_model(model)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def cache_kwarg(model: nn.Module) -> str:
    """The forward's name for the KV cache: `cache` since transformers 5.2x, `past_key_values` before."""
    return _cache_kwarg_of(type(hf_model(model)).forward)


@functools.cache
def _cache_kwarg_of(forward: Callable) -> str:  # once per class: reading a signature takes ~0.2 ms, twice a step
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model itself: a peft model's base model (its adapters injected and active), else `model`.
    A peft model's forward takes **kwargs, so its signature and attributes do not tell what the model accepts."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


class ValueModel(nn.Module):
    """A separate critic (PPO with `algo.critic=model`): a copy of the policy's backbone with a scalar head."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = _zero_linear(backbone.config.hidden_size)

    def forward(self, input_ids, attention_mask, position_ids):  # -> [N, L]
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def load_value_model(path: str, cfg: ModelConfig, device: torch.device) -> ValueModel:
    """The critic's backbone comes from the same weights as the policy (a checkpoint's critic/ on resume)."""
    from transformers import AutoModel

    precision = model_precision(cfg, device)
    backbone = AutoModel.from_pretrained(path, dtype=MASTER)
    if cfg.gradient_checkpointing:
        backbone.gradient_checkpointing_enable()
    return ValueModel(compute_in(backbone.to(device), precision, device)).to(device)


def check(cfg) -> None:
    """The model the run trains: its directory exists (a hub id is checked when it loads), and its context holds
    `trainer.max_new_tokens`."""
    context = context_length(cfg.model)
    if context is not None and cfg.trainer.max_new_tokens > context:
        raise UserError(f"trainer.max_new_tokens={cfg.trainer.max_new_tokens} is more than the model's context of "
                        f"{context} tokens (max_position_embeddings): give at most {context}")


def context_length(model) -> int | None:
    """The model's context in tokens (max_position_embeddings of the tiny spec or of a local config.json), or None
    where it cannot be read without loading the model (a hub id).  A local directory that is missing is refused."""
    if model.name_or_path == BUILTIN_TINY:  # built on first use: its spec says
        path = None
    else:
        path = resolve_model_path(model)
    if path is None:
        return int(model.tiny.max_position_embeddings) if model.get("tiny") is not None else None
    config = Path(path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int and value > 0 else None
