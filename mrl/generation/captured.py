"""mrl's captured decoder: the native decoder's layers (mrl/generation/decoder.py) stepped one token at a time over
static buffers, the step captured once per shape bucket in a `torch.cuda.CUDAGraph` and replayed for every token.

HF `generate` and the native decoder launch every kernel of every layer from Python at every token: a 28-layer model
is ~400 launches a step, each a few microseconds of CPU, longer together than the GPU takes to read the weights
(Qwen3-0.6B in bf16: 1.2 GB at ~4.3 TB/s, ~0.3 ms).  A replayed graph launches them all at once.  How it departs from
the native decoder, and why:

- **Static buffers per shape bucket.**  A graph replays fixed addresses and shapes, so each bucket (rows rounded up
  to a power of two, at least ROWS_MIN; keys up to prompt + budget rounded up to a multiple of LENGTH_QUANTUM) owns
  its keys and values per layer [R, KV heads, S, head dim], the attention mask [R, S], the step's token, position and
  cursor, and the logits [R, V].  Allocated once, kept for the run (the MAX_BUCKETS last used), so the next training
  step's rollouts, of the same shapes, replay the same capture.  Padding rows attend to themselves only.
- **One step function** (`Bucket.step`): write the token's keys and values at the cursor, allow that key, run every
  layer over all S keys (the mask hides the rest), write the logits, advance cursor and positions.  On CUDA it is
  captured at the bucket's first use (after warm-up on a side stream) and replayed; elsewhere it runs eagerly, the
  same function over the same buffers, which is what the CPU tests check.
- **The prompt runs eagerly** (the first step, n tokens, into the same buffers: its shape changes every turn), and
  the groups' shared prompt cache is copied in front, as the native decoder copies it.
- **Sampling right after each replay**, eagerly: HF's own warpers (`Sampling.warpers`: temperature, then top-k, then
  top-p, what `mrl.algo.losses.truncate` scores), the draw, the stop ids and stopping criteria exactly as in
  `NativeDecoder`: a few kernels next to the graph's hundreds, and the very tokens HF draws for the same seed.
- **Weights are read where they are.**  The optimizer updates parameters in place (AdamW; DeepSpeed's bf16 module
  copies under ZeRO-1/2), so a capture stays valid after every step: no re-capture per step.  A parameter that moved
  to new storage (ZeRO-3 gathers into fresh tensors every round; `load_state_dict(assign=True)`) changes the
  fingerprint checked at every call, and the buckets are captured again.
- **LoRA stays in the graph, unmerged**: peft's adapted projections are called as the model calls them (base + B A x
  times the scale), so the tokens are HF `generate`'s on the adapted model, and the in-place update of A and B reaches
  the graph as the base weights' does.  Merging for decoding would write every adapted weight twice a step (merge,
  unmerge) and round the merged weight in bf16 otherwise than the unmerged product the trainer scores: the rollouts
  would come from a slightly different model.
- **Autocast** (mrl.modeling.precision.compute_in, float32 masters on a GPU) is captured with its weight cache off, as
CUDA
  graphs require: the casts of the weights to bf16 then run inside the graph at every token (about 4x the bytes of
  bf16 weights); DeepSpeed's bf16 mode holds bf16 weights and pays none of it.

Where a model's captured tokens differ from HF `generate`'s, `first_use_check` says so (greedy, at the first use);
`rollout.engine=captured` then refuses, and `auto` on CUDA generates with HF `generate`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from contextlib import nullcontext
from typing import Callable

import torch
from torch import Tensor

from mrl.generation.decoder import DecodeRequest, NativeDecoder, next_tokens
from mrl.modeling.models import hf_model, position_ids
from mrl.modeling.precision import autocast_of

ROWS_MIN = 8  # rows of the smallest bucket
LENGTH_QUANTUM = 128  # keys: prompt + budget rounded up to this
MAX_BUCKETS = 4  # shape buckets kept per model (each holds its KV buffers: rows x length x layers x 2 x heads x dim)
KV_SHARE = 0.25  # on CUDA, kept buckets' KV buffers stay under this share of the device's memory (they outlive the
# generation round, through the update, as a serving engine's KV pool does): older buckets go first
WARMUP = 3  # eager steps on a side stream before capturing: cuBLAS handles and kernel choices made outside the graph
CHECK_ROWS, CHECK_WIDTH, CHECK_TOKENS = 16, 12, 8  # the first-use check: greedy rows compared with HF generate
CHECK_MIN_EQUAL = 0.9  # share of rows that must equal HF generate's (random weights tie logits: rounding may flip one)


def bucket_shape(rows: int, length: int) -> tuple[int, int]:
    """(rows, keys) of the bucket that holds `rows` rows of `length` positions (prompt + budget): rows rounded up to
    a power of two of at least ROWS_MIN, keys up to a multiple of LENGTH_QUANTUM: bucket_shape(12, 130) is
    (16, 256)."""
    return max(ROWS_MIN, 1 << (rows - 1).bit_length()), -(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM


class StaticKV:
    """Per layer, keys and values [R, KV heads, S, head dim], allocated at the bucket's probe in the dtype the layer
    writes, at fixed addresses for the graph.  The prompt writes rows [:A] at positions start..start+n-1 (an int
    `start`); the captured step writes every row at the cursor (a tensor `start` [1]) and attends to all S keys."""

    def __init__(self, rows: int, size: int):
        self.rows, self.size = rows, size
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def write(self, layer: int, start: int | Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer == len(self.keys):  # the probe: zeros, so masked keys are finite (0 x NaN would reach the output)
            _, heads, _, dim = k.shape
            self.keys.append(k.new_zeros(self.rows, heads, self.size, dim))
            self.values.append(v.new_zeros(self.rows, heads, self.size, dim))
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(start, Tensor):
            keys.index_copy_(2, start, k)
            values.index_copy_(2, start, v)
            return keys, values
        rows, end = k.shape[0], start + k.shape[2]
        keys[:rows, :, start:end] = k
        values[:rows, :, start:end] = v
        return keys[:rows, :, :end], values[:rows, :, :end]

    def load(self, cache, cache_rows: Tensor, start: int) -> None:
        """Copy the first `start` positions of `cache` row cache_rows[a] into row a (the groups' shared prompts)."""
        for layer, cached in enumerate(cache.layers):
            self.keys[layer][:len(cache_rows), :, :start] = cached.keys[cache_rows]
            self.values[layer][:len(cache_rows), :, :start] = cached.values[cache_rows]


class Bucket:
    """The static buffers of one shape and the step over them, captured in a CUDA graph on CUDA."""

    def __init__(self, native: NativeDecoder, rows: int, size: int):
        self.native, self.rows, self.size = native, rows, size
        device = native.decoder.embed_tokens.weight.device
        self.kv = StaticKV(rows, size)
        self.allowed = torch.zeros(rows, size, dtype=torch.bool, device=device)  # [R, S] the keys each row sees
        self.token = torch.zeros(rows, dtype=torch.long, device=device)  # [R] the step's input
        self.position = torch.zeros(rows, dtype=torch.long, device=device)  # [R] its rotary position
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)  # [1] the key it writes
        with autocast_of(native.model):  # the probe: allocates every layer's buffers in the dtype it writes
            native.forward(self.token[:1, None], self.position[:1, None], self.allowed[:1], 0, self.kv)
        self.graph = None
        self.logits: Tensor | None = None  # [R, V] the step's output (the graph's own tensor once captured)
        if device.type == "cuda":
            self.capture()

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values))

    def step(self) -> Tensor:
        """One token for every row: its keys and values at the cursor, attention over the S keys its row allows ->
        logits [R, V]; the cursor and positions advance.  Nothing in it depends on Python state that changes."""
        self.allowed.index_fill_(1, self.cursor, True)
        hidden = self.native.layers(self.token[:, None], self.position[:, None], self.allowed[:, None, None, :],
                                    self.cursor, self.kv)
        logits = self.native.logits(hidden)
        self.cursor.add_(1)
        self.position.add_(1)
        return logits

    def capture(self) -> None:
        """Warm up on a side stream, then record `step` (its own memory pool: buckets replay in any order)."""
        autocast = getattr(self.native.model, "compute_autocast", None)
        context = (lambda: autocast(cache_enabled=False)) if autocast is not None else nullcontext
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), context():
            for _ in range(WARMUP):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), context():
            self.logits = self.step()

    def start(self, attention_mask: Tensor, positions: Tensor) -> None:
        """Ready for a call of A rows, `attention_mask` [A, L]: nothing allowed but their prompts, cursor at L, each
        row's next position after its last (`positions` [A, L])."""
        rows, width = attention_mask.shape
        self.allowed.zero_()
        self.allowed[:rows, :width] = attention_mask.bool()
        self.cursor.fill_(width)
        self.position.zero_()
        self.position[:rows] = positions[:, -1] + 1

    def replay(self, token: Tensor) -> Tensor:
        """Logits [A, V] of the next token after `token` [A]."""
        self.token[:len(token)] = token
        if self.graph is not None:
            self.graph.replay()
        else:
            with autocast_of(self.native.model):
                self.logits = self.step()
        return self.logits[:len(token)]


class CapturedDecoder:
    """Continues batches as `NativeDecoder` does (its contract: ids [A, L + n], ended rows padded), one replay per
    token after the prompt; keeps its buckets for the run (see the module's docstring)."""

    def __init__(self, model):
        self.native = NativeDecoder(model)
        self.model = self.native.model
        self.buckets: OrderedDict[tuple[int, int], Bucket] = OrderedDict()
        self.fingerprint = weight_addresses(self.model)

    def __deepcopy__(self, memo) -> None:
        return None  # a copy of the model captures its own graphs over its own weights

    @property
    def device(self) -> torch.device:
        return self.native.decoder.embed_tokens.weight.device

    def bucket(self, rows: int, length: int) -> Bucket:
        """The bucket for `rows` rows of `length` positions: a kept one, or a new one (the oldest dropped past
        MAX_BUCKETS); all dropped when a weight moved to new storage since they were captured."""
        fingerprint = weight_addresses(self.model)
        if fingerprint != self.fingerprint:
            self.buckets.clear()
            self.fingerprint = fingerprint
        shape = bucket_shape(rows, length)
        if shape not in self.buckets:
            limit = kv_limit(self.device)
            while self.buckets and (len(self.buckets) >= MAX_BUCKETS or sum(
                    b.kv_bytes for b in self.buckets.values()) + self.kv_bound(*shape) > limit):
                self.buckets.popitem(last=False)
            self.buckets[shape] = Bucket(self.native, *shape)
        self.buckets.move_to_end(shape)
        return self.buckets[shape]

    def kv_bound(self, rows: int, size: int) -> int:
        """At most the bytes of a bucket's KV buffers (float32 keys and values), before it exists."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * rows * heads * size * head_dim * 4

    def __call__(self, request: DecodeRequest, warp: Callable | None,
                 draw: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """`NativeDecoder.__call__`'s contract; `draw` (probabilities [A, V] -> tokens [A]): None for the native
        decoder's own on this device, `mrl.generation.decoder.multinomial` for HF's very tokens."""
        if request.budget < 1:
            raise ValueError(f"budget={request.budget}: decode at least one token")
        with torch.inference_mode():
            ids = self._sample(request, warp, draw or self.native.draw)
        return ids.clone()

    def _sample(self, request: DecodeRequest, warp: Callable | None, draw: Callable[[Tensor], Tensor]) -> Tensor:
        input_ids, cache, budget = request.input_ids, request.cache, request.budget
        rows, width = input_ids.shape
        device = input_ids.device
        bucket = self.bucket(rows, width + budget)
        start = 0 if cache is None else cache.get_seq_length()
        positions = position_ids(request.attention_mask)  # [A, L], as prompt_cache and policy_forward
        bucket.start(request.attention_mask, positions)
        if start:
            bucket.kv.load(cache, request.cache_rows, start)
        with autocast_of(self.model):  # the prompt's uncached positions, eagerly, into the bucket's buffers
            scores = self.native.logits(self.native.forward(input_ids[:, start:], positions[:, start:],
                                                            bucket.allowed[:rows], start, bucket.kv))
        stops = torch.tensor(request.stop_ids, dtype=torch.long, device=device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        ids = input_ids
        for t in range(budget):
            ids, token = next_tokens(ids, scores, warp, draw, unfinished, request.pad_id, stops, request.criteria)
            if t == budget - 1 or not unfinished.any():
                break
            scores = bucket.replay(token)
        return ids


def kv_limit(device: torch.device) -> float:
    """Bytes the kept buckets' KV buffers may take on `device`: KV_SHARE of a GPU's memory; a CPU's: no limit (the
    eager step's buckets are small, and MAX_BUCKETS bounds them)."""
    if device.type != "cuda":
        return float("inf")
    return KV_SHARE * torch.cuda.get_device_properties(device).total_memory


def weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """Where every parameter and buffer of `model` lives: a graph reads these addresses (a change: capture again)."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


ATTRIBUTE = "_mrl_captured_decoder"


def captured_decoder(model) -> CapturedDecoder:
    """The captured decoder of `model` (the HF model under a peft wrapper), made once and kept with its buckets for
    as long as the model lives: an attribute of the model (a cycle the garbage collector frees with it; a weak-keyed
    table would keep it alive, the decoder referring to its model)."""
    model = hf_model(model)
    decoder = vars(model).get(ATTRIBUTE)
    if decoder is None:
        decoder = CapturedDecoder(model)
        setattr(model, ATTRIBUTE, decoder)
    return decoder


_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()

# (model, an uncached request without criteria) -> HF generate's greedy ids [A, L + n]
Reference = Callable[[torch.nn.Module, DecodeRequest], Tensor]


def first_use_check(model, reference: Reference) -> str | None:
    """Why the captured decoder's greedy tokens are not HF generate's on `model`, in one line; None when at least
    CHECK_MIN_EQUAL of CHECK_ROWS rows (random prompts, half left-padded) are equal over CHECK_TOKENS tokens.  Once
    per model (the verdict is kept), in eval mode, the mode restored."""
    model = hf_model(model)
    if model not in _VERDICTS:
        _VERDICTS[model] = _agreement(model, reference) or ""
    return _VERDICTS[model] or None


def _agreement(model, reference: Reference) -> str | None:
    device = captured_decoder(model).device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (CHECK_ROWS, CHECK_WIDTH), generator=generator).to(device)
    mask = torch.ones_like(ids)
    for row in range(0, CHECK_ROWS, 2):
        mask[row, :1 + row % (CHECK_WIDTH - 1)] = 0
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = ids.masked_fill(mask == 0, pad)
    stop_ids = [vocab]  # no token stops: every row compares all its tokens
    training = model.training
    model.eval()
    try:
        request = DecodeRequest(ids, mask, CHECK_TOKENS, stop_ids, pad)
        expected = reference(model, request)
        computed = captured_decoder(model)(request, None)
    finally:
        model.train(training)
    equal = int((expected == computed).all(1).sum()) if expected.shape == computed.shape else 0
    if equal < CHECK_MIN_EQUAL * CHECK_ROWS:
        return (f"model type {model.config.model_type!r}: the captured decoder's greedy tokens equal HF generate's on "
                f"{equal} of {CHECK_ROWS} rows ({CHECK_TOKENS} tokens each), under {CHECK_MIN_EQUAL:.0%}")
    return None
