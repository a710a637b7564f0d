"""Prompts -> G sampled completions each -> token tensors and Episodes (the policy's log-probs of them:
mrl/train/update.py).

Layout of a batch of N = B*G rollouts, grouped by prompt (rows g*G .. g*G+G-1 are prompt g's group):
prompt tokens left-padded to P, completion tokens right-padded to T, so that row n's sequence is
prompt_ids[n] ++ completion_ids[n] and completion token t sits at position P + t.  Where every prompt of a batch
starts with the same S >= SHARED_PREFIX_MIN tokens (a system prompt, fixed examples), those come first and the rest
of each prompt is left-padded after them (`prompt_layout`): padding in the middle, masked, positions skipping it.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mrl.algo.losses import SAMPLER_WEIGHTS
from mrl.chat.protocols import ToolProtocol, Turn
from mrl.chat.stops import Stops, first_stop, spelled_stop
from mrl.core.config import Registry, UserError
from mrl.core.distributed import warn, world_size
from mrl.core.episode import Episode, Prompt, ToolCall
from mrl.generation.captured import captured_decoder, first_use_check
from mrl.generation.decoder import DecodeRequest, NativeDecoder, mismatch, unsupported
from mrl.generation.vllm_engine import INSTALL as VLLM_INSTALL
from mrl.generation.vllm_engine import VllmSampler, VllmSettings, unsupported_model
from mrl.generation.vllm_engine import missing as vllm_missing
from mrl.modeling.models import BUILTIN_TINY, cache_kwarg, empty_cache, hf_model, position_ids, rows_of
from mrl.modeling.precision import model_precision


@dataclass
class Rollouts:
    prompt_ids: Tensor  # [N, P] left-padded (after the shared prefix, where there is one: prompt_layout)
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded
    completion_mask: Tensor  # [N, T] 1 on generated tokens (end-of-sequence included): what the losses train on
    completion_attention: Tensor  # [N, T] 1 on every transcript token (generated and observed), 0 on padding
    episodes: list[Episode]
    group_size: int
    # [N, T] the sampler's log-prob of each generated token (0 elsewhere), where another engine than the trainer's
    # module drew them (vLLM): what the update measures the gap to and weighs by (mrl.algo.losses.logprob_gap)
    sampler_logprobs: Tensor | None = None

    @property
    def num_groups(self) -> int:
        return len(self.episodes) // self.group_size

    @property
    def input_ids(self) -> Tensor:  # [N, P+T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # [N, P+T]: the model reads observations as it did while generating
        return torch.cat([self.prompt_mask, self.completion_attention], dim=1)

    def take(self, rows: Tensor) -> "Rollouts":
        """The rollouts at `rows` [M] (a micro-batch, or whole groups)."""
        rows = rows.to(self.prompt_ids.device)
        return Rollouts(
            self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows], self.completion_mask[rows],
            self.completion_attention[rows], [self.episodes[r] for r in rows.tolist()], self.group_size,
            None if self.sampler_logprobs is None else self.sampler_logprobs[rows],
        )

    def trimmed(self) -> "Rollouts":
        """The same rows without the columns every row pads: prompt columns no row attends to (left padding, or
        the padding after a shared prefix) and completion columns past the longest transcript.  Positions and
        attention are unchanged (positions skip padding), so each row's log-probs are the untrimmed batch's at
        T' = the kept completion width (at least 1)."""
        prompt = self.prompt_mask.bool().any(0)  # [P]
        filled = self.completion_attention.bool().any(0).nonzero()  # [k, 1]
        width = int(filled.max()) + 1 if len(filled) else 1
        if bool(prompt.all()) and width == self.completion_ids.shape[1]:
            return self
        return Rollouts(self.prompt_ids[:, prompt], self.prompt_mask[:, prompt], self.completion_ids[:, :width],
                        self.completion_mask[:, :width], self.completion_attention[:, :width], self.episodes,
                        self.group_size,
                        None if self.sampler_logprobs is None else self.sampler_logprobs[:, :width])

    def group_rows(self, groups: Tensor) -> Tensor:
        """Group indices [B'] -> their rows [B'*G]."""
        return (groups.reshape(-1, 1) * self.group_size + torch.arange(self.group_size)).reshape(-1)

    def select_groups(self, groups: Tensor) -> "Rollouts":
        """Whole groups, by group index [B'] -> B'*G rollouts."""
        return self.take(self.group_rows(groups))

    @staticmethod
    def concat(parts: list["Rollouts"], pad_id: int, min_width: int = 0) -> "Rollouts":
        """Stack rollouts from several generation rounds, re-padding prompts on the left, completions on the right
        (to at least `min_width` tokens).  The sampler's log-probs only where every part has them (one engine)."""
        completion_len = max(min_width, *(p.completion_ids.shape[1] for p in parts))
        if len(parts) == 1 and parts[0].completion_ids.shape[1] == completion_len:
            return parts[0]
        prompt_len = max(p.prompt_ids.shape[1] for p in parts)

        def left(x: Tensor, value: int) -> Tensor:
            return F.pad(x, (prompt_len - x.shape[1], 0), value=value)

        def right(x: Tensor, value: int) -> Tensor:
            return F.pad(x, (0, completion_len - x.shape[1]), value=value)

        return Rollouts(
            torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            torch.cat([left(p.prompt_mask, 0) for p in parts]),
            torch.cat([right(p.completion_ids, pad_id) for p in parts]),
            torch.cat([right(p.completion_mask, 0) for p in parts]),
            torch.cat([right(p.completion_attention, 0) for p in parts]),
            [e for p in parts for e in p.episodes],
            parts[0].group_size,
            None if any(p.sampler_logprobs is None for p in parts)
            else torch.cat([right(p.sampler_logprobs, 0) for p in parts]),
        )


def end_token_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: exactly these settings (mrl's `trainer.*`), whatever the model's generation_config.json
    says (a checkpoint's repetition_penalty or top_k would sample from a distribution the loss does not assume)."""

    max_new_tokens: int  # tokens the policy generates per episode, all turns together
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    greedy: bool = False  # the most likely token (evaluation)

    @classmethod
    def of(cls, trainer, greedy: bool = False) -> "Sampling":
        return cls(trainer.max_new_tokens, trainer.temperature, trainer.top_p, trainer.top_k, greedy)

    def generation_config(self, max_new_tokens: int, eos_ids: list[int], pad_id: int):
        from transformers import GenerationConfig

        drawn = {"do_sample": False} if self.greedy else {
            "do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id,
                                use_cache=True, **drawn)

    def warpers(self):
        """What HF generate does to the next token's logits before drawing it, for these settings (its own
        warper classes, in its order); None when greedy."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper

        if self.greedy:
            return None
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        warpers.extend(self.truncation() or [])
        return warpers

    def truncation(self):
        """The warpers after the temperature (top_k, then top_p: HF's classes and order), or None when neither is
        set: what the loss applies to logits / temperature so that it scores the distribution the sampler drew from
        (mrl.algo.losses.truncate)."""
        from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList()
        if self.top_k != 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers or None


@contextmanager
def own_generation_config(model):
    """HF generate fills every setting left unset from `model.generation_config` (repetition_penalty, min_p, ...);
    a blank one stands in while mrl generates, so only Sampling's settings act."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class StopStrings:
    """HF stopping criterion: a row stops once its turn's text spells a stop string (stops.first_stop's test,
    on the window of newest tokens).  Only for vocabularies that spell strings across tokens (Stops.by_text)."""

    def __init__(self, tokenizer, stops: Stops, start: int):
        self.tokenizer, self.stops, self.start = tokenizer, stops, start

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:  # [N, L] -> [N] bool
        turn = input_ids[:, self.start:]
        first = max(0, turn.shape[1] - self.stops.window)
        texts = decode_texts(self.tokenizer, turn[:, first:].tolist(), skip_special_tokens=False)
        return torch.tensor([spelled_stop(t, first == 0, self.stops) is not None for t in texts],
                            device=input_ids.device)


def decode_texts(tokenizer, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`[tokenizer.decode(row, skip_special_tokens) for row in rows]`, in one call to the Rust tokenizer where
    transformers' own decode would be that call and nothing else (a fast tokenizer that neither overrides decoding
    nor cleans up spaces): its per-call Python costs more than the decoding, ~20 us a row."""
    from transformers import PreTrainedTokenizerBase
    try:
        from transformers import TokenizersBackend as Fast  # transformers 5
    except ImportError:
        from transformers import PreTrainedTokenizerFast as Fast  # transformers 4: the same decode

    kind, own = type(tokenizer), vars(tokenizer)
    if (isinstance(tokenizer, Fast) and kind._decode is Fast._decode and kind.decode is PreTrainedTokenizerBase.decode
            and "_decode" not in own and "decode" not in own and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)
    return [tokenizer.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


# Below this many tokens, computing a shared prefix once saves less than its separate forward costs.
SHARED_PREFIX_MIN = 32


def shared_prefix_length(rows: list[list[int]]) -> int:
    """How many leading tokens all `rows` share (0 below SHARED_PREFIX_MIN, or for one row), leaving every row two
    tokens of its own: the last one, which `prompt_cache` leaves uncached, and one before it.

    >>> shared_prefix_length([[1] * 40 + [2, 3, 4], [1] * 40 + [5, 6]])
    40
    >>> shared_prefix_length([[1] * 40 + [2], [1] * 40 + [5, 6]])  # the shorter row keeps two tokens
    39
    >>> shared_prefix_length([[1] * 10 + [2, 3], [1] * 10 + [5, 6]])  # too short to be worth a forward of its own
    0
    """
    if len(rows) < 2:
        return 0
    length = min(len(row) for row in rows) - 2
    first = rows[0]
    for row in rows[1:]:
        length = next((i for i in range(length) if row[i] != first[i]), length)
    return length if length >= SHARED_PREFIX_MIN else 0


def prompt_layout(rows: list[list[int]], shared: int, pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[B, shared + W] ids and mask: the `shared` tokens every row starts with, then each row's rest left-padded to
    the longest rest W.  With shared 0, plain left padding.

    >>> ids, mask = prompt_layout([[7, 7, 1], [7, 7, 2, 3]], 2, 0, torch.device("cpu"))
    >>> ids.tolist(), mask.tolist()
    ([[7, 7, 0, 1], [7, 7, 2, 3]], [[1, 1, 0, 1], [1, 1, 1, 1]])
    """
    rest_ids, rest_mask = _left_pad([row[shared:] for row in rows], pad_id, device)
    prefix = torch.tensor(rows[0][:shared], dtype=torch.long, device=device).expand(len(rows), shared)
    return torch.cat([prefix, rest_ids], 1), torch.cat([torch.ones_like(prefix), rest_mask], 1)


@torch.no_grad()
def prompt_cache(model, prompt_ids: Tensor, prompt_mask: Tensor, shared: int = 0):
    """The KV cache of each prompt but its last token ([B, P] -> B rows of P-1 positions), or None for one-token
    prompts.  `generate` then runs only the last token and what follows: HF generate needs one uncached input token,
    and the layout (`prompt_layout`) makes the last column every prompt's own last token.  The first `shared`
    columns, the same in every row, are computed once and copied to every row."""
    if prompt_ids.shape[1] < 2:
        return None
    cache, kwarg = empty_cache(model), cache_kwarg(model)
    mask = prompt_mask[:, :-1]
    positions = position_ids(mask)
    if shared:
        model(input_ids=prompt_ids[:1, :shared], attention_mask=mask[:1, :shared], position_ids=positions[:1, :shared],
              use_cache=True, logits_to_keep=1, **{kwarg: cache})
        cache.batch_repeat_interleave(prompt_ids.shape[0])
    model(input_ids=prompt_ids[:, shared:-1], attention_mask=mask, position_ids=positions[:, shared:], use_cache=True,
          logits_to_keep=1, **{kwarg: cache})
    return cache


def _rows_of(cache, rows: Tensor):
    """A copy of `cache` holding its rows `rows` [A] (groups' shared prompts -> one row per rollout)."""
    return None if cache is None else rows_of(cache, rows)


def _right_pad(rows: list[list[float]], value: float, device: torch.device) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=device)


def hf_decode(model, request: DecodeRequest, sampling: Sampling) -> Tensor:
    """One turn's tokens by HF `generate`: `request.input_ids` [A, L] continued by at most `request.budget` tokens
    (mrl.generation.decoder.DecodeRequest's contract) -> [A, L + n], ended rows padded with `request.pad_id`."""
    config = sampling.generation_config(request.budget, request.stop_ids, request.pad_id)
    criteria = [request.criteria] if request.criteria is not None else None
    with own_generation_config(model):
        return model.generate(input_ids=request.input_ids, attention_mask=request.attention_mask,
                              generation_config=config, stopping_criteria=criteria,
                              **{cache_kwarg(model): _rows_of(request.cache, request.cache_rows)})


def native_decode(model, request: DecodeRequest, sampling: Sampling,
                  draw: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`hf_decode`'s contract, by mrl's native decoder (mrl/generation/decoder.py), with less Python per token: greedy,
    the same tokens; sampled, the same distribution, drawn by `draw` (None: mrl.generation.decoder.draw_for the device;
    `mrl.generation.decoder.multinomial`: HF's very tokens for the same seed).  Llama-family models only
    (mrl.generation.decoder.unsupported); one whose logits turn out to differ from its forward's
    (mrl.generation.decoder.mismatch) is refused."""
    reason = mismatch(model)
    if reason is not None:
        raise UserError(f"{reason}; set rollout.engine=hf to generate with HF generate")
    return NativeDecoder(model, draw)(request, sampling.warpers())


_TOLD: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models auto_decode said it leaves to HF generate


def auto_decode(model, request: DecodeRequest, sampling: Sampling) -> Tensor:
    """`native_decode` where mrl's native decoder computes the model's own logits (mrl.generation.decoder.mismatch),
    else `hf_decode` (said once per model, on stderr)."""
    reason = mismatch(model)
    if reason is not None and hf_model(model) not in _TOLD:
        _TOLD.add(hf_model(model))
        warn(f"rollout.engine=auto: {reason}; generating with HF generate instead")
    decode = native_decode if reason is None else hf_decode
    return decode(model, request, sampling)


def hf_greedy(model, request: DecodeRequest) -> Tensor:
    """HF generate's greedy tokens: what the captured decoder is checked against at its first use."""
    return hf_decode(model, request, Sampling(request.budget, greedy=True))


def captured_decode(model, request: DecodeRequest, sampling: Sampling,
                    draw: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`hf_decode`'s contract by mrl's captured decoder (mrl/generation/captured.py: static KV buffers per shape bucket,
    the per-token step a CUDA graph on CUDA, eager elsewhere): `native_decode`'s tokens, `draw` as there.  Refused in
    one line where its greedy tokens differ from HF generate's at its first use
    (mrl.generation.captured.first_use_check)."""
    reason = first_use_check(model, hf_greedy)
    if reason is not None:
        raise UserError(f"rollout.engine=captured: {reason}; set rollout.engine=hf to generate with HF generate")
    return captured_decoder(model)(request, sampling.warpers(), draw)


def auto_cuda_decode(model, request: DecodeRequest, sampling: Sampling) -> Tensor:
    """`auto` on CUDA, by measurement: `captured_decode` where the captured decoder runs the model and its greedy
    tokens equal HF generate's at its first use, else `hf_decode`; which one and why, said once per model."""
    reason = unsupported(model) or first_use_check(model, hf_greedy)
    if hf_model(model) not in _TOLD:
        _TOLD.add(hf_model(model))
        warn("rollout.engine=auto: " + (f"HF generate decodes ({reason})" if reason is not None else
             "the captured decoder decodes (CUDA graphs: its greedy tokens equal HF generate's at its first use)"))
    decode = hf_decode if reason is not None else captured_decode
    return decode(model, request, sampling)


_UNKNOWN_TOLD: "weakref.WeakSet[Any]" = weakref.WeakSet()  # tokenizers warn_unknown_tokens has warned about


def warn_unknown_tokens(tokenizer, rows: list[list[int]], model) -> None:
    """Say once per tokenizer (once per run) when a prompt's tokens are mostly (> 50%) the unknown token: the model
    cannot read that text (the built-in tiny model's word-level vocabulary fed English prose), so nothing it learns
    depends on the prompt.  rows: each prompt's token ids."""
    unk = tokenizer.unk_token_id
    if unk is None or tokenizer in _UNKNOWN_TOLD:
        return
    shares = [row.count(unk) / len(row) for row in rows if row]
    mostly = [share for share in shares if share > 0.5]
    if mostly:
        _UNKNOWN_TOLD.add(tokenizer)
        name = getattr(model, "name_or_path", None) or tokenizer.name_or_path
        warn(f"{len(mostly)} of {len(rows)} prompts are mostly unknown tokens to {name} (up to {max(mostly):.0%} "
             f"{tokenizer.unk_token}): the model cannot read them; use a model whose vocabulary covers the prompts "
             "(the built-in tiny model knows only its tasks' words)")


Decode = Callable[[Any, DecodeRequest, Sampling], Tensor]  # (model, one turn's request, sampling) -> ids [A, L + n]


@dataclass
class EpisodeState:
    """One rollout while `generate` samples it, turn by turn (nanochat's per-row state): its tokens so far, the turns
    the protocol read, and its environment."""

    prompt: Prompt
    group: int  # its prompt's index: its row of the shared prompt cache
    world: Any  # the protocol's environment for this episode; None: stateless
    max_new_tokens: int  # tokens the policy may generate, all turns together
    ids: list[int] = field(default_factory=list)  # policy and observation tokens
    mask: list[int] = field(default_factory=list)  # 1 where the policy generated the token
    logprobs: list[float] = field(default_factory=list)  # the sampler's log-prob of each token (observations: 0)
    turns: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    ended: bool = False

    @property
    def generated(self) -> int:
        return sum(self.mask)

    @property
    def left(self) -> int:
        """Tokens the policy may still generate."""
        return self.max_new_tokens - self.generated

    def extend(self, new: list[int], turn: Turn, logprobs: list[float] | None = None) -> None:
        """Append a turn: the policy's tokens `new` (mask 1; the sampler's log-probs of them, where it gave them), then
        the protocol's observation (mask 0)."""
        self.ids += [*new, *turn.observation]
        self.mask += [1] * len(new) + [0] * len(turn.observation)
        self.logprobs += [*(logprobs or [0.0] * len(new)), *[0.0] * len(turn.observation)]
        self.turns.append(turn.text)
        self.calls += turn.calls
        self.ended = turn.ended

    def goes_on(self, turn: Turn, max_turns: int) -> bool:
        """Whether another turn follows `turn`, the last one: after a call's result or the user's next message (an
        observation), unless the episode ended, within the budget and `max_turns`."""
        return bool(turn.calls or turn.observation) and not turn.ended and self.left > 0 \
            and len(self.turns) < max_turns

    def episode(self, body: list[int], text: str, prompt_text: str) -> Episode:
        """The finished rollout, its transcript's ids without end-of-turn tokens `body` decoded as `text`."""
        return Episode(prompt=self.prompt, completion=text, completion_ids=body, num_tokens=self.generated,
                       truncated=not self.ended, max_new_tokens=self.max_new_tokens, tool_calls=self.calls,
                       turns=self.turns, observation_tokens=len(self.mask) - self.generated, prompt_text=prompt_text)


# One turn of the active episodes -> each row's new tokens (at least up to where its turn ended; later ones are cut)
# and the sampler's log-probs of them, or None where the sampler is the trainer's own module.
DrawTurn = Callable[[list[EpisodeState]], list[tuple[list[int], list[float] | None]]]


class EpisodeBatch:
    """B prompts x G episodes, sampled turn by turn by any engine (`run`), laid out as `Rollouts`: the prompts, their
    layout (`prompt_layout`, the shared prefix first), how a turn ends, each episode's state."""

    def __init__(self, tokenizer, prompts: list[Prompt], group_size: int, sampling: Sampling, protocol: ToolProtocol,
                 end_ids: list[int], device: torch.device):
        self.tokenizer, self.protocol, self.group_size, self.device = tokenizer, protocol, group_size, device
        self.encoded = [protocol.prompt_ids(p) for p in prompts]
        self.prefix = shared_prefix_length(self.encoded)
        self.shared_ids, self.shared_mask = prompt_layout(self.encoded, self.prefix, tokenizer.pad_token_id,
                                                          device)  # [B, P]
        self.stops = replace(protocol.stops, end_ids=protocol.stops.end_ids | set(end_ids))
        self.stop_ids = sorted(self.stops.end_ids | set(self.stops.by_id or ()))
        self.states = [EpisodeState(prompt, g, protocol.environment(prompt), sampling.max_new_tokens)
                       for g, prompt in enumerate(prompts) for _ in range(group_size)]

    def run(self, draw: DrawTurn) -> Rollouts:
        """The episodes, turn by turn: `draw` samples each turn of the active ones; a turn ends at an end-of-turn
        token, at the protocol's stop strings (`first_stop`) or at the budget; the protocol reads it, and a tool's
        result (mask 0) continues the episode.  Returns them as `Rollouts`, with the sampler's log-probs where `draw`
        gave them."""
        active, sampled = self.states, False
        while active:
            drawn = draw(active)
            news, logps, reasons = [], [], []
            for state, (new, logprobs) in zip(active, drawn):
                new = new[: state.left]
                stop = first_stop(self.tokenizer, new, self.stops)
                end = len(new) if stop is None else stop[0] + 1
                news.append(new[:end])
                logps.append(None if logprobs is None else logprobs[:end])
                reasons.append(None if stop is None else stop[1])
                sampled |= logprobs is not None
            still_active = []
            for state, new, logprobs, text, reason in zip(active, news, logps, decode_texts(self.tokenizer, news),
                                                          reasons):
                turn = self.protocol.turn(state.prompt, text, reason, state.world)
                state.extend(new, turn, logprobs)
                if state.goes_on(turn, self.protocol.max_turns):
                    still_active.append(state)
            active = still_active
        return self.rollouts(sampled)

    def rollouts(self, sampled: bool) -> Rollouts:
        states, device, pad_id = self.states, self.device, self.tokenizer.pad_token_id
        rows = torch.arange(len(states), device=device) // self.group_size  # [N]: each rollout's prompt
        prompt_ids, prompt_mask = self.shared_ids[rows], self.shared_mask[rows]  # [N, P]
        shown = decode_texts(self.tokenizer, self.encoded, skip_special_tokens=False)
        bodies = [[t for t in state.ids if t not in self.stops.end_ids] for state in states]
        episodes = [state.episode(body, text, shown[state.group])
                    for state, body, text in zip(states, bodies, decode_texts(self.tokenizer, bodies))]
        completion_ids = _right_pad([state.ids for state in states], pad_id, device)  # [N, T]
        completion_mask = _right_pad([state.mask for state in states], 0, device)  # [N, T]: observations, padding: 0
        completion_attention = _right_pad([[1] * len(state.ids) for state in states], 0, device)  # [N, T]
        sampler_logprobs = _right_pad([state.logprobs for state in states], 0.0, device).float() \
            if sampled else None  # [N, T]
        return Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, completion_attention, episodes,
                        self.group_size, sampler_logprobs)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], group_size: int, sampling: Sampling,
             protocol: ToolProtocol, device: torch.device, decode: Decode = hf_decode) -> Rollouts:
    """Sample `group_size` episodes per prompt (KV cache), turn by turn, token-in/token-out; `decode` draws each
    turn's tokens (HF `generate`, or mrl's native decoder).

    A turn ends at an end-of-turn token, at the protocol's stop strings (a tool call, an answer word), or at the
    policy's budget (`max_new_tokens` generated tokens per episode, all turns together).  The protocol reads the
    turn: a tool call's result is appended as tokens (mask 0: never trained on) and the episode goes on, up to
    `protocol.max_turns` turns, unless it ended.  The ids trained on are exactly the ids sampled.
    """
    model = hf_model(model)  # a peft model's generate keeps its own generation_config: go to the HF model
    batch = EpisodeBatch(tokenizer, prompts, group_size, sampling, protocol, end_token_ids(model, tokenizer), device)
    warn_unknown_tokens(tokenizer, batch.encoded, model)
    # Each prompt is computed once per turn's generate call, not once per rollout: its cache is copied to the
    # group's rows (and the prefix all prompts share, once for all).  Inputs are then [the prompt, laid out to P |
    # the episode so far, left-padded], so that every row's prompt sits where the cache has it (padding in the
    # middle is masked, positions skip it).
    shared = prompt_cache(model, batch.shared_ids, batch.shared_mask, batch.prefix)
    pad_id = tokenizer.pad_token_id

    def draw(active: list[EpisodeState]) -> list[tuple[list[int], None]]:
        groups = torch.tensor([state.group for state in active], device=device)  # [A]
        so_far, so_far_mask = _left_pad([state.ids for state in active], pad_id, device)
        input_ids = torch.cat([batch.shared_ids[groups], so_far], 1)  # [A, P + C]
        attention_mask = torch.cat([batch.shared_mask[groups], so_far_mask], 1)
        budget = max(state.left for state in active)
        criteria = StopStrings(tokenizer, batch.stops, input_ids.shape[1]) if batch.stops.by_text else None
        request = DecodeRequest(input_ids, attention_mask, budget, batch.stop_ids, pad_id, shared, groups, criteria)
        output = decode(model, request, sampling)
        return [(output[row, input_ids.shape[1]:].tolist(), None) for row in range(len(active))]

    return batch.run(draw)


class RolloutEngine(Protocol):
    """Generation, behind one seam: prompts, G, sampling settings and the episode protocol in, `Rollouts` out,
    token-in/token-out (the ids trained on are the ids sampled).  The loop calls `sync_weights` after every update,
    so that the next rollouts sample the new weights; an engine that samples from the training module itself has
    nothing to do there.  `close` ends it when its run (or evaluation) does: an engine of its own (vLLM) releases its
    memory and process group there, not at the interpreter's exit.  Implementations are built by name from
    `ROLLOUT_ENGINES` (config: `rollout.engine`)."""

    tokenizer: Any  # the policy's: its pad id joins the rollouts of several calls (mrl.train.evaluate.in_chunks)
    # Whether it holds a copy of the policy's weights (vLLM): the loop then builds and syncs it with the weights
    # whole (ZeRO-3 gathers them for the span); one that samples from the training module needs no gather there.
    copies_weights: bool

    def generate(self, prompts: list[Prompt], group_size: int, sampling: Sampling,
                 protocol: ToolProtocol) -> Rollouts: ...

    def sync_weights(self, policy: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


class InProcessEngine:
    """The policy in this process, `generate` above: mrl's own turn loop on the live training module (a shared prompt
    KV cache per group), each turn decoded by `decode`: HF `generate` (`hf_decode`), mrl's native decoder
    (`native_decode`), its captured variant (`captured_decode`), or the one `auto` picks (`auto_decode`,
    `auto_cuda_decode`).  Nothing to sync: it samples from the weights the optimizer just stepped in place (the
    captured decoder's graphs read them there)."""

    copies_weights = False

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, decode: Decode = hf_decode):
        self.model, self.tokenizer, self.device, self.decode = model, tokenizer, device, decode

    def generate(self, prompts: list[Prompt], group_size: int, sampling: Sampling,
                 protocol: ToolProtocol) -> Rollouts:
        self.model.eval()  # the update leaves it in train mode (gradient checkpointing, dropout)
        return generate(self.model, self.tokenizer, prompts, group_size, sampling, protocol, self.device,
                        self.decode)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        pass

    def close(self) -> None:
        pass


class VllmEngine:
    """vLLM in this process (mrl.generation.vllm_engine.VllmSampler): mrl's turn loop (`EpisodeBatch.run`, the same
    layout, stops, tool turns and masks as `generate`), each turn of the active episodes one batch of token-id requests
    to vLLM, which returns the tokens and their log-probs (`Rollouts.sampler_logprobs`).  `sync_weights` loads the
    policy's weights after every update."""

    copies_weights = True

    def __init__(self, sampler, tokenizer, device: torch.device, end_ids: list[int]):
        self.sampler, self.tokenizer, self.device, self.end_ids = sampler, tokenizer, device, end_ids

    def generate(self, prompts: list[Prompt], group_size: int, sampling: Sampling,
                 protocol: ToolProtocol) -> Rollouts:
        batch = EpisodeBatch(self.tokenizer, prompts, group_size, sampling, protocol, self.end_ids, self.device)
        # vLLM matches a stop string anywhere in the text; a whole-word stop (the words protocol) is left to
        # first_stop, which cuts the turn where the in-process engines stop it.
        strings = batch.stops.strings if batch.stops.by_text and not batch.stops.words else ()

        def draw(active: list[EpisodeState]) -> list[tuple[list[int], list[float]]]:
            rows = [batch.encoded[state.group] + state.ids for state in active]
            return self.sampler.turn(rows, [state.left for state in active], sampling, batch.stop_ids, strings)

        return batch.run(draw)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        self.sampler.load(policy)

    def close(self) -> None:
        self.sampler.close()


# rollout.engine -> a builder (cfg, the policy module, tokenizer, device) -> RolloutEngine.  A builder gets the live
# policy, so an engine holding its own copy of the weights starts from the run's (a resume's included).
def own_decoder_engine(name: str, decode: Decode) -> Callable[[Any, torch.nn.Module, Any, torch.device],
                                                                InProcessEngine]:
    """The builder of `rollout.engine=name`: the turn loop with one of mrl's decoders, refused in one line for a
    model it cannot run (mrl.generation.decoder.unsupported)."""
    def build(cfg, policy: torch.nn.Module, tokenizer, device: torch.device) -> InProcessEngine:
        reason = unsupported(policy)
        if reason is not None:
            raise UserError(f"rollout.engine={name}: mrl's {name} decoder cannot run this model ({reason}); "
                            "use rollout.engine=auto or hf")
        return InProcessEngine(policy, tokenizer, device, decode)
    return build


def vllm_refusal(cfg) -> tuple[str, str] | None:
    """Why vLLM cannot sample for this config and the fix, (why, fix); None when it can.  Imports vLLM where it is
    installed and the model is a local dir (to read its config: mrl.generation.vllm_engine.unsupported_model)."""
    if cfg.model.name_or_path == BUILTIN_TINY:
        return (f"vLLM cannot run the built-in tiny model ({BUILTIN_TINY}: a word-level vocabulary of its own)",
                "use a model vLLM knows (model=smollm2_local after `make smollm2`), or rollout.engine=auto")
    if world_size() > 1:  # each rank's vLLM would take the launcher's group for its own (TRL: external_launcher)
        return (f"one vLLM per rank is not built ({world_size()} ranks)",
                "run on one process, or rollout.engine=auto (mrl's decoders on every rank)")
    if vllm_missing() is not None:
        return vllm_missing(), VLLM_INSTALL
    reason = unsupported_model(os.path.expanduser(cfg.model.name_or_path))
    return None if reason is None else (reason, "use a model vLLM serves, or rollout.engine=auto")


def refuse_vllm(cfg) -> None:
    """`rollout.engine=vllm` where vLLM cannot sample for `cfg`: one line, why and the fix."""
    refusal = vllm_refusal(cfg)
    if refusal is not None:
        raise UserError("rollout.engine=vllm: {}: {}".format(*refusal))


def build_vllm(cfg, policy: torch.nn.Module, tokenizer, device: torch.device) -> VllmEngine:
    """`rollout.engine=vllm`: vLLM in this process, started from the live policy's weights (a warm start's or a
    resumed checkpoint's), computing in the trainer's compute dtype (mrl.modeling.precision: bf16 on a CPU with native
    bf16 matmuls under `auto`, model.dtype on a GPU), as the training module's own decoders do."""
    refuse_vllm(cfg)
    dtype = model_precision(cfg.model, device).compute or torch.float32
    sampler = VllmSampler(policy, tokenizer, device, VllmSettings.of(cfg), dtype)
    return VllmEngine(sampler, tokenizer, device, end_token_ids(hf_model(policy), tokenizer))


def auto_engine(cfg, policy: torch.nn.Module, tokenizer, device: torch.device) -> InProcessEngine | VllmEngine:
    """vLLM where it is installed and serves the model; else on CUDA the captured decoder where it passes its
    first-use check, else HF generate (`auto_cuda_decode`, said in one line); elsewhere the native decoder where it
    runs the model (its structure, then its logits at the first use), else HF generate.  Where vLLM is installed,
    one line says whether it samples, and if not, why (the built-in tiny model, a model it cannot serve); where it
    is not, nothing is said of it (nor is it imported)."""
    refusal = vllm_refusal(cfg) if cfg is not None else None
    if cfg is not None and refusal is None:
        warn("rollout.engine=auto: vLLM samples (installed, and it serves the model); rollout.engine=native or hf "
             "decodes in the training module instead")
        return build_vllm(cfg, policy, tokenizer, device)
    if refusal is not None and vllm_missing() is None:
        warn(f"rollout.engine=auto: vLLM is installed but does not sample ({refusal[0]}); mrl's decoders sample in "
             "the training module")
    if device.type == "cuda":
        return InProcessEngine(policy, tokenizer, device, auto_cuda_decode)
    return InProcessEngine(policy, tokenizer, device, hf_decode if unsupported(policy) else auto_decode)


# (cfg, policy, tokenizer, device) -> RolloutEngine
ROLLOUT_ENGINES = Registry("rollout.engine", "mrl/generation/rollout.py ROLLOUT_ENGINES", {
    "hf": lambda cfg, policy, tokenizer, device: InProcessEngine(policy, tokenizer, device),
    "native": own_decoder_engine("native", native_decode),
    "captured": own_decoder_engine("captured", captured_decode),
    "vllm": build_vllm,
    "auto": auto_engine,
})


def check(cfg) -> None:
    """`rollout.engine` names a registered engine, one that can run here (vllm: installed, not the tiny model);
    `rollout.importance_weight` a mode of mrl.algo.losses.SAMPLER_WEIGHTS."""
    ROLLOUT_ENGINES.choose(cfg.rollout.engine, "auto samples with vLLM where it is installed and runs the model, "
                           "else from the training module with mrl's captured decoder on CUDA where it passes its "
                           "first-use check, mrl's native decoder elsewhere where it runs the model, else HF generate")
    SAMPLER_WEIGHTS.choose(cfg.rollout.importance_weight, "token_truncate weighs each token by min(r, cap), as TRL's "
                           "vllm_importance_sampling_correction")
    if cfg.rollout.engine == "vllm":
        refuse_vllm(cfg)
