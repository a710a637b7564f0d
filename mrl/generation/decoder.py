"""mrl's native sampling loop for Llama-family decoders: the decoder's own modules, driven without HF `generate`.

HF `generate` and the model's forward spend most of a small model's decode step in Python (logits processors, stopping
criteria, cache and mask bookkeeping, output dataclasses), not in arithmetic. `NativeDecoder` runs the same layers
(the model's embedding, norms, projections, MLPs and rotary embedding modules, so LoRA adapters and every rope scaling
apply as in the model) with a preallocated KV buffer, one boolean mask grown in place, and HF's own sampling warpers,
and returns what `model.generate` returns: the input ids followed by the sampled ones, finished rows padded. Greedy,
it picks the tokens HF `generate` picks (up to the rounding of `packed_linear`, oneDNN's different order of the same
sums: equal in every test and on SmolLM2); sampling, it draws from the same distribution, on a CPU by `inverse_cdf`
(one uniform number per row) where HF draws with `torch.multinomial` (one exponential number per vocabulary entry: ~12
ms of each decode step of 8 rows at SmolLM2's 49k vocabulary on a CPU, against ~4 ms). With `multinomial`, the draw
elsewhere (a GPU draws exponentials fast) and the same seed, it draws the very tokens HF `generate` draws (tested).

Families whose decoder layer is norm -> attention (rotary, grouped-query, full causal) -> norm -> MLP: Llama
(SmolLM2), Qwen2, Qwen3 (with its per-head q/k norms) and Mistral without a sliding window.  Anything else, a
sliding-window layer included, gets a one-line reason from `unsupported` (`rollout.engine=auto` then decodes with HF
`generate`), and a model whose forward turns out to differ is refused at its first use (`NativeDecoder.check`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from mrl.modeling.models import hf_model, logits_gap, position_ids
from mrl.modeling.precision import autocast_of

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported(model) -> str | None:
    """Why `NativeDecoder` cannot run `model`, in one line; None when it can (by its structure: `NativeDecoder`
    also compares its logits with the model's own forward at its first use)."""
    model = hf_model(model)
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model_type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if not type(model).__module__.startswith("transformers.models."):
        return f"{type(model).__name__} is the checkpoint's own code (trust_remote_code), not transformers' class"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None):
        return f"{config.model_type} with sliding-window attention layers"
    return None


@dataclass(frozen=True)
class DecodeRequest:
    """One decoding turn: what every decoder (HF `generate`, the native and the captured one) is asked to continue.

    Rows end at a token of `stop_ids` or when `criteria(ids [A, L'], None) -> [A]` says so; later tokens are
    `pad_id`.  `cache`: an HF cache of B rows holding the first C < L positions, row `cache_rows[a]` being row a's
    (the groups' shared prompts), or None."""

    input_ids: Tensor  # [A, L] left-padded
    attention_mask: Tensor  # [A, L]
    budget: int  # at most this many new tokens
    stop_ids: list[int]
    pad_id: int
    cache: Any = None
    cache_rows: Tensor | None = None  # [A]
    criteria: Callable | None = None


def multinomial(probs: Tensor) -> Tensor:
    """One token per row of `probs` [A, V] -> [A], as HF `generate` draws it (`torch.multinomial`)."""
    return torch.multinomial(probs, 1).squeeze(1)


def draw_for(device: torch.device) -> Callable[[Tensor], Tensor]:
    """The native decoder's draw on `device`: `inverse_cdf` on a CPU, whose random numbers are slow to make, else HF's
    own (`multinomial`: no float64 copy of a large batch's probabilities)."""
    return inverse_cdf if device.type == "cpu" else multinomial


def inverse_cdf(probs: Tensor, uniform: Tensor | None = None) -> Tensor:
    """One token per row of `probs` [A, V] (unnormalized weights >= 0, each row's sum > 0) -> [A]: the first token
    whose cumulative weight exceeds `uniform` [A] (in [0, 1); drawn by `torch.rand` when None) times the row's total.
    A token of weight 0 is never drawn: its cumulative weight equals its predecessor's.  Weights that are not finite,
    or a row summing to 0, raise ValueError, as `torch.multinomial` does."""
    cdf = probs.double().cumsum(-1)  # float64: the rounding over a 152k vocabulary stays far below any token's share
    totals = cdf[:, -1:]
    if not bool(((totals > 0) & torch.isfinite(totals)).all()):
        raise ValueError("probabilities contain inf or nan, or a row sums to 0: the policy's logits diverged")
    if uniform is None:
        # float64, at most 1 - 2^-53: a token of probability under float32's 2^-24 keeps its own chance, and the
        # threshold stays strictly below its row's total (the product rounds to at most the total minus one ulp)
        uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    threshold = uniform.double()[:, None] * totals
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1)


# The native decoder stops computing finished rows once at most this share of the rows it computes is unfinished:
# dropping rows copies their keys and values, so it waits until a quarter has finished, not one row at a time.
COMPACT_AT = 0.75
# A decode step's large projections on a CPU run through oneDNN with their weights packed once per decode call (the
# kernels torch's CPU compiler gives a frozen linear layer), where F.linear's GEMM is slow at a decode step's few rows.
# Measured on 2 Xeon cores, one thread, weights read from memory (docs/measured.md, "Packed projections"): at 4 to 64
# rows 0.45-0.85x F.linear's time (the output layer at 8 rows 10.0 against 26.0 ms), even at 256; below 4 rows (its
# 3-row product costs what its 1-row one does) and for SmolLM2's 192 x 576 keys and values F.linear is faster.
# Packing costs about a copy of the weights.
PACKED_MIN_WEIGHT = 2 ** 18  # elements: SmolLM2's 576 x 576 projections and up
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 4, 256  # beyond 256 (a prompt's pass) the module's own call


@dataclass(frozen=True)
class Packed:
    """A linear layer's weight in oneDNN's layout and its bias, both in the dtype its products compute in."""

    weight: Tensor
    bias: Tensor | None


def pack(linear: torch.nn.Linear, rows: int, dtype: torch.dtype) -> Packed:
    """`linear`'s weight in oneDNN's layout for products of about `rows` rows, in `dtype` (a copy: the weight as it
    is now).  In bf16, half the copy's bytes, and the cast autocast would redo at every step done once: SmolLM2's
    output layer at 24 rows 9.5 ms a product, against 54 ms under autocast and 22 ms packed in fp32 (one thread)."""
    bias = None if linear.bias is None else linear.bias.to(dtype)
    return Packed(torch.ops.mkldnn._reorder_linear_weight(linear.weight.to(dtype), rows), bias)


def packed_linear(x: Tensor, packed: Packed) -> Tensor:
    """`linear(x)` for x [..., in] from the layer `pack`ed, in its dtype (as autocast's `linear` in that dtype)."""
    flat = x.reshape(-1, x.shape[-1]).to(packed.weight.dtype)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed.weight, packed.bias, "none", [], "")
    return out.view(*x.shape[:-1], -1)


def plain(module: torch.nn.Module) -> bool:
    """Whether calling `module` is its class's forward and nothing else: no hooks of its own (ZeRO-3 gathers
    through them), no forward replaced on the instance (accelerate's hooks do that)."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def packed_dtype(model) -> torch.dtype | None:
    """The dtype `NativeDecoder` packs `model`'s projections in: its compute dtype (float32, or bf16 under its
    autocast, mrl.modeling.precision.compute_in); None where it packs none (float16)."""
    dtype = getattr(model, "compute_dtype", None) or torch.float32
    return dtype if dtype in (torch.float32, torch.bfloat16) else None


def packable_linears(model) -> set[torch.nn.Module]:
    """The projections of `model` that `NativeDecoder` computes by `packed_linear`: on a CPU with oneDNN, in float32
    or bf16 compute, without global module hooks, `plain` modules of exactly `nn.Linear` (not an adapter's wrapper)
    with float32 weights of at least PACKED_MIN_WEIGHT elements.  Elsewhere (a GPU, float16) a module is called as
    it is."""
    from torch.nn.modules import module as torch_module

    if packed_dtype(model) is None or torch_module._global_forward_hooks \
            or torch_module._global_forward_pre_hooks or not torch.backends.mkldnn.is_available():
        return set()
    return {module for module in model.modules()
            if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and module.weight.numel() >= PACKED_MIN_WEIGHT
            and plain(module)}


def mlp_classes() -> tuple[type, ...]:
    """The MLP classes of FAMILIES, each down_proj(act_fn(gate_proj(x)) * up_proj(x))."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    return LlamaMLP, Qwen2MLP, Qwen3MLP, MistralMLP


_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def mismatch(model) -> str | None:
    """Why `NativeDecoder` computes other next-token logits than `model`'s own forward, or None when they agree
    (`NativeDecoder.check`, once per model, at its first use: during generation, where ZeRO-3's weights are whole)."""
    model = hf_model(model)
    if model not in _VERDICTS:
        _VERDICTS[model] = NativeDecoder(model).check() or ""
    return _VERDICTS[model] or None


def next_tokens(ids: Tensor, scores: Tensor, warp: Callable | None, draw: Callable[[Tensor], Tensor],
                unfinished: Tensor, pad_id: int, stops: Tensor, criteria: Callable | None,
                live: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One decoding step's token per row, as HF generate picks it: the warped distribution's draw (the argmax when
    `warp` is None: greedy), `pad_id` for rows already finished; appended to `ids` [A, L] -> ([A, L + 1], token
    [A]).  `unfinished` [A] is updated in place: a row ends at a stop id or where `criteria` says so.

    `live` [A'] (sorted rows of `ids`): `scores` [A', V] are those rows' alone, the others having finished (the
    native decoder stops computing them); each row draws what it draws with every row scored (`draw_rows`)."""
    scores = scores.float()  # [A', V]
    rows = ids if live is None else ids[live]
    token = draw_rows(draw, warp(rows, scores).softmax(-1), live, len(ids)) if warp is not None \
        else scores.argmax(-1)
    if live is not None:
        token = torch.full((len(ids),), pad_id, dtype=token.dtype, device=token.device).index_copy_(0, live, token)
    token = torch.where(unfinished, token, pad_id)
    ids = torch.cat([ids, token[:, None]], 1)
    unfinished &= ~torch.isin(token, stops)
    if criteria is not None:
        unfinished &= ~criteria(ids, None).bool()
    return ids, token


def draw_rows(draw: Callable[[Tensor], Tensor], probs: Tensor, live: Tensor | None, rows: int) -> Tensor:
    """`draw(probs)` [A'] for the rows `live` [A'] of a batch of `rows`, the same tokens as those rows draw when all
    `rows` are drawn at once: `inverse_cdf` gets the uniform numbers of the whole batch, another draw (HF's
    `multinomial`, whose random numbers are laid out per row and entry) the finished rows as uniform weights."""
    if live is None or len(live) == rows:
        return draw(probs)
    if draw is inverse_cdf:
        return inverse_cdf(probs, torch.rand(rows, dtype=torch.float64, device=probs.device)[live])
    full = probs.new_ones(rows, probs.shape[1]).index_copy_(0, live, probs)  # [rows, V]
    return draw(full)[live]


class NativeDecoder:
    """Samples continuations of a batch with a KV cache, as `model.generate` does (see the module's docstring)."""

    def __init__(self, model, draw: Callable[[Tensor], Tensor] | None = None):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the native decoder cannot run this model: {reason}")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = hf_model(model)  # carries the autocast of mrl.modeling.precision.compute_in, if any
        self.decoder = self.model.model  # embed_tokens, layers, norm, rotary_emb
        self.rotate = apply_rotary_pos_emb  # every supported family rotates the same way (rotate_half)
        self.attend = sdpa_attention_forward  # HF's own SDPA call: its kernel choice per device (GQA, masks)
        # On a CPU, torch's SDPA groups the query heads itself (`enable_gqa`) under a mask, where HF's call copies the
        # keys and values out to every query head (`repeat_kv`) whenever a mask is given: SmolLM2's 3 KV heads made
        # 9, in every layer at every token (decode attention 4x slower, measured); on a GPU, masked GQA would leave
        # the fused kernels, so HF's call stays.
        self.grouped = self.decoder.embed_tokens.weight.device.type == "cpu"
        # probabilities [A, V] -> tokens [A]
        self.draw = draw if draw is not None else draw_for(self.decoder.embed_tokens.weight.device)
        self.packable = packable_linears(self.model)
        self.packed_dtype = packed_dtype(self.model)
        self.packed: dict[torch.nn.Module, Packed] = {}  # packable module -> its weight packed, during a call
        # MLPs whose formula the decoder may spell out, to compute their projections by packed_linear
        own_mlps = mlp_classes()
        self.packed_mlps = {layer.mlp for layer in self.decoder.layers
                            if type(layer.mlp) in own_mlps and plain(layer.mlp)
                            and {layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj} <= self.packable}

    def __call__(self, request: DecodeRequest, warp: Callable | None) -> Tensor:
        """Continue `request.input_ids` [A, L] by at most `request.budget` tokens (DecodeRequest's contract).

        `warp`: a logits processor (HF's warpers) before sampling, or None for the most likely token; the token is
        then drawn from the softmax by `self.draw`.  Returns [A, L + n], 1 <= n <= budget: the loop stops when every
        row has ended.
        """
        if request.budget < 1:
            raise ValueError(f"budget={request.budget}: decode at least one token")
        # Inference mode: no autograd bookkeeping per op (~10% of a small model's decode step); the ids leave as an
        # ordinary tensor.
        with torch.inference_mode():
            # packed per call: the weights as they are now (the trainer updates them in place between rollouts)
            self.packed = {linear: pack(linear, len(request.input_ids), self.packed_dtype)
                           for linear in self.packable}
            try:
                ids = self._sample(request, warp)
            finally:
                self.packed = {}
        return ids.clone()

    def _sample(self, request: DecodeRequest, warp: Callable | None) -> Tensor:
        input_ids, cache, budget = request.input_ids, request.cache, request.budget
        rows, width = input_ids.shape
        device = input_ids.device
        start = 0 if cache is None else cache.get_seq_length()
        allowed = torch.zeros(rows, width + budget, dtype=torch.bool, device=device)  # the keys each row attends to
        allowed[:, :width] = request.attention_mask.bool()
        cache_rows = request.cache_rows
        # Cascade attention where rows share prompts (a group's rollouts), not one row a prompt (greedy evaluation).
        if self.grouped and start and cache_rows is not None and len(cache_rows) >= 2 * len(cache_rows.unique()):
            buffers = SharedPrefixKV(cache, cache_rows, allowed[:, :start], width + budget)
        else:
            buffers = KVBuffers(cache if start else None, cache_rows, width + budget)
        positions = position_ids(request.attention_mask)  # [A, L], as prompt_cache and policy_forward
        stops = torch.tensor(request.stop_ids, dtype=torch.long, device=device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        ids, step_ids, step_positions = input_ids, input_ids[:, start:], positions[:, start:]
        live = torch.arange(rows, device=device)  # [A'] the rows computed: the unfinished, and a few finished
        for _ in range(budget):
            with autocast_of(self.model):
                scores = self.logits(self.forward(step_ids, step_positions, allowed, start, buffers))
            ids, token = next_tokens(ids, scores, warp, self.draw, unfinished, request.pad_id, stops,
                                     request.criteria, live)
            if not unfinished.any():
                break
            start += step_ids.shape[1]
            step_ids, step_positions = token[live, None], step_positions[:, -1:] + 1
            going = unfinished[live]  # [A']
            if int(going.sum()) <= COMPACT_AT * len(live):  # a quarter finished: stop computing them
                live, step_ids, step_positions, allowed = live[going], step_ids[going], step_positions[going], \
                    allowed[going]
                buffers.select(going, start)
            allowed[:, start] = True
        return ids

    def check(self) -> str | None:
        """Why this decoder's next-token logits differ from the model's own forward (a variant the structural checks
        of `unsupported` let through), in one line; None when they agree.  2 rows of 8 positions, one left-padded,
        in eval mode (no dropout)."""
        ids = (torch.arange(3, 19, device=self.decoder.embed_tokens.weight.device) % self.model.config.vocab_size)
        ids = ids.view(2, 8)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        positions = position_ids(mask)
        buffers = KVBuffers(None, None, ids.shape[1])
        gap = logits_gap(self.model,
                         lambda: self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1],
                         lambda: self.logits(self.forward(ids, positions, mask.bool(), 0, buffers)))
        if gap is not None:
            return (f"model type {self.model.config.model_type!r}: mrl's native decoder computes other logits than "
                    f"this model's forward (largest difference {gap:.3g})")
        return None

    def forward(self, ids: Tensor, positions: Tensor, allowed: Tensor, start: int, buffers: "KVBuffers") -> Tensor:
        """The decoder on positions start .. start+n-1 (ids, positions [A, n]), their keys and values written into
        `buffers`; `allowed` [A, S]: the keys each row may attend to.  -> the last position's final hidden state
        [A, H]."""
        n = ids.shape[1]
        end = start + n
        # [A, 1, n, end]: a query sees the keys its row allows up to itself, and always itself: a left-padding
        # query allows nothing else, and a query that attends to nothing is NaN in some SDPA kernels (a zero in
        # CPU's), which would reach the later layers' keys.
        query = start + torch.arange(n, device=ids.device)[:, None]  # [n, 1]
        key = torch.arange(end, device=ids.device)  # [end]
        mask = (allowed[:, None, None, :end] & (key <= query)) | (key == query)
        return self.layers(ids, positions, mask, start, buffers)

    def layers(self, ids: Tensor, positions: Tensor, mask: Tensor, start: int | Tensor, buffers) -> Tensor:
        """The decoder on ids, positions [A, n] with the attention mask [A, 1, n, S] (True: attend), each layer's
        keys and values stored by `buffers.write(layer, start, k, v)` (KVBuffers, or mrl.generation.captured's static
        ones, whose `start` is a tensor) -> the last position's final hidden state [A, H]."""
        rows, n = ids.shape
        hidden = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(hidden, positions)
        for i, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            heads = (rows, n, -1, attention.head_dim)
            q, k = self._project(attention.q_proj, x).view(heads), self._project(attention.k_proj, x).view(heads)
            if hasattr(attention, "q_norm"):  # Qwen3: an RMS norm per head, before the rotation
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = buffers.write(i, start, k, self._project(attention.v_proj, x).view(heads).transpose(1, 2))
            if isinstance(buffers, SharedPrefixKV):  # keys, values: the rows' own, after the prompts they share
                out = buffers.attend(i, q, keys, values, mask, attention.scaling)
            else:
                out = self._attend(attention, q, keys, values, mask)  # [A, n, heads, D]
            hidden = hidden + self._project(attention.o_proj, out.reshape(rows, n, -1))
            hidden = hidden + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return self.decoder.norm(hidden[:, -1])

    def _attend(self, attention: torch.nn.Module, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Scaled dot-product attention of q [A, heads, n, D] over keys, values [A, KV heads, S, D] under `mask`
        [A, 1, n, S] (True: attend) -> [A, n, heads, D], query head h reading KV head h // (heads / KV heads), as
        HF's `repeat_kv` lays them out."""
        if not self.grouped:
            return self.attend(attention, q, keys, values, mask, scaling=attention.scaling)[0]
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                               scale=attention.scaling,
                                                               enable_gqa=q.shape[1] != keys.shape[1])
        return out.transpose(1, 2)

    def _project(self, linear: torch.nn.Module, x: Tensor) -> Tensor:
        packed = self.packed.get(linear)
        if packed is not None and PACKED_MIN_ROWS * x.shape[-1] <= x.numel() <= PACKED_MAX_ROWS * x.shape[-1]:
            return packed_linear(x, packed)
        return linear(x)

    def _mlp(self, mlp: torch.nn.Module, x: Tensor) -> Tensor:
        """`mlp(x)`; for a family's own MLP class whose three projections are packable, its formula spelled out, so
        that they are computed by `packed_linear`."""
        if mlp not in self.packed_mlps:
            return mlp(x)
        return self._project(mlp.down_proj, mlp.act_fn(self._project(mlp.gate_proj, x)) * self._project(mlp.up_proj, x))

    def logits(self, hidden: Tensor) -> Tensor:
        return self._project(self.model.lm_head, hidden)


class KVBuffers:
    """Per layer, keys and values [A, KV heads, size, head dim], preallocated at a layer's first write in the dtype
    of what is written (HF's cache holds the same), with the cached prefix of each row (`cache` row `cache_rows[a]`)
    copied in front: the shared prompts are copied once, into the buffers, not first into a cache per row."""

    def __init__(self, cache, cache_rows: Tensor | None, size: int):
        self.cache, self.cache_rows, self.size = cache, cache_rows, size
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [A, KV heads, n, head dim] at positions start..start+n-1 -> this layer's keys and values
        [A, KV heads, start+n, head dim]."""
        if layer == len(self.keys):
            rows, heads, _, dim = k.shape
            self.keys.append(k.new_empty(rows, heads, self.size, dim))
            self.values.append(v.new_empty(rows, heads, self.size, dim))
            if self.cache is not None:
                cached = self.cache.layers[layer]
                self.keys[layer][:, :, :start] = cached.keys[self.cache_rows]
                self.values[layer][:, :, :start] = cached.values[self.cache_rows]
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def select(self, rows: Tensor, end: int) -> None:
        """Keep only `rows` (a boolean mask [A]) of every layer's buffers, their first `end` positions copied."""
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                kept = old.new_empty(int(rows.sum()), *old.shape[1:])
                kept[:, :, :end] = old[rows, :, :end]
                buffers[layer] = kept


class SharedPrefixKV(KVBuffers):
    """Keys and values where the rows of a group share their prompt's (cascade attention): each distinct prompt's
    cached C positions once ([U, KV heads, C, head dim], the cache's own tensors, not copied), and per row only what
    follows ([A, KV heads, size - C, head dim], written and returned by `write`).  Decode attention reads the KV
    cache once per token; at a group of 6 rollouts of a ~230-token prompt, ~4/5 of what it read was six copies of
    the prompt's keys and values.  `attend` reads each prompt's once for all its rows."""

    def __init__(self, cache, cache_rows: Tensor, prefix_allowed: Tensor, size: int):
        super().__init__(None, None, size - prefix_allowed.shape[1])
        self.prefix = prefix_allowed.shape[1]  # C
        self.prefix_keys = [layer.keys for layer in cache.layers]  # [U, KV heads, C, D] a layer
        self.prefix_values = [layer.values for layer in cache.layers]
        self._group(cache_rows, prefix_allowed)

    def _group(self, groups: Tensor, prefix_allowed: Tensor) -> None:
        """Row a reads prompt groups[a] [A], whose keys it may attend to are prefix_allowed[a] [A, C] (the same for
        every row of a prompt): each row's slot among its prompt's rows, and the prompts' masks [U, 1, 1, C]."""
        self.groups = groups
        counts = torch.bincount(groups, minlength=len(self.prefix_keys[0]))  # [U]
        order = torch.argsort(groups, stable=True)
        self.slots = torch.empty_like(groups)
        self.slots[order] = torch.arange(len(groups), device=groups.device) - (counts.cumsum(0) - counts)[groups[order]]
        self.width = int(counts.max())  # R: the most rows of one prompt
        mask = torch.zeros(len(counts), self.prefix, dtype=torch.bool, device=groups.device)
        mask[groups] = prefix_allowed
        self.prefix_mask = mask[:, None, None, :]

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [A, KV heads, n, D] at positions start..start+n-1 (>= C) -> this layer's keys and values after
        the prompt, [A, KV heads, start+n-C, D]."""
        return super().write(layer, start - self.prefix, k, v)

    def attend(self, layer: int, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
        """Attention of q [A, heads, n, D] over the row's prompt (shared) and its own keys, values [A, KV heads, S,
        D] under `mask` [A, 1, n, C + S] -> [A, n, heads, D], query head h reading KV head h // (heads / KV heads)
        (HF's `repeat_kv` layout).  A decode step (n = 1) computes each part's softmax apart and merges the two by
        their maxima and sums: the one softmax over all keys, to float rounding.  Under bf16 compute it does so in
        fp32, as SDPA's kernel accumulates (bf16 scores would keep 3 digits), and returns bf16 as SDPA does."""
        heads, n = q.shape[1:3]
        if n > 1:  # a turn's first call (the prompt's last token, a transcript so far): once, through SDPA's kernel,
            # whose memory grows with n where the scores below would grow with n^2
            return torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat([self.prefix_keys[layer][self.groups], keys], 2),
                torch.cat([self.prefix_values[layer][self.groups], values], 2), attn_mask=mask, scale=scale,
                enable_gqa=heads != keys.shape[1]).transpose(1, 2)
        wide = torch.promote_types(q.dtype, torch.float32)  # bf16 -> fp32; fp32, fp64 as they are
        with torch.autocast(q.device.type, enabled=False):
            out = self._decode_attend(layer, q.to(wide), keys.to(wide), values.to(wide), mask, scale)
        return out.to(q.dtype)

    def _decode_attend(self, layer: int, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float):
        """`attend` of one decode step (n = 1), in q's dtype."""
        rows, heads, _, dim = q.shape
        kv_heads = keys.shape[1]
        per_kv = heads // kv_heads
        prefix_keys, prefix_values = (x[layer].to(q.dtype) for x in (self.prefix_keys, self.prefix_values))
        prompts = len(prefix_keys)
        # The prompt part: a prompt's rows' queries side by side, [U, KV, R * per_kv, D] against its C keys.
        grouped = q.new_zeros(prompts, self.width, heads, dim)
        grouped[self.groups, self.slots] = q[:, :, 0]
        grouped = grouped.view(prompts, self.width, kv_heads, per_kv, dim).transpose(1, 2)
        grouped = grouped.reshape(prompts, kv_heads, -1, dim)
        scores = torch.matmul(grouped, prefix_keys.transpose(-1, -2)).mul_(scale)  # [U, KV, R*p, C]
        scores.masked_fill_(~self.prefix_mask, -torch.inf)
        top = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)  # a prompt of padding: 0
        weights = scores.sub_(top).exp_()
        prompt_sum = weights.sum(-1, keepdim=True)
        prompt_out = torch.matmul(weights, prefix_values)  # unnormalized

        def to_rows(x: Tensor) -> Tensor:  # [U, KV, R * per_kv, ...] -> [A, KV, per_kv, ...]
            x = x.view(prompts, kv_heads, self.width, per_kv, x.shape[-1]).transpose(1, 2)
            return x[self.groups, self.slots]
        prompt_out, prompt_sum, top = to_rows(prompt_out), to_rows(prompt_sum), to_rows(top)
        # The row's own part, [A, KV, per_kv, S], every query seeing at least itself.
        own = torch.matmul(q.reshape(rows, kv_heads, per_kv, dim), keys.transpose(-1, -2)).mul_(scale)
        own.masked_fill_(~mask[:, :, :, self.prefix:], -torch.inf)  # [A, 1, 1, S]: the same for every head
        most = torch.maximum(top, own.amax(-1, keepdim=True))
        own_weights = own.sub_(most).exp_()
        prompt_scale = (top - most).exp_()
        total = own_weights.sum(-1, keepdim=True).add_(prompt_sum * prompt_scale)
        out = torch.matmul(own_weights, values).add_(prompt_out * prompt_scale).div_(total)  # [A, KV, per_kv, D]
        return out.view(rows, heads, 1, dim).transpose(1, 2)

    def select(self, rows: Tensor, end: int) -> None:
        super().select(rows, end - self.prefix)
        self._group(self.groups[rows], self.prefix_mask[self.groups[rows], 0, 0])
