"""Loss terms: pure tensor functions over token-level tensors.

Shapes: N sequences in the micro-batch, T completion tokens.  `mask` [N, T] is 1 on tokens the policy generated
and 0 on padding, prompt and tool-observation tokens, so those never enter any loss.

Aggregation (`agg`) and gradient accumulation: a mini-batch is split into micro-batches, and the loss of each
micro-batch is divided by the *mini-batch's* count (`denom`: its number of sequences for `seq_mean`, of generated
tokens for `token_mean`), so the accumulated gradient equals that of the whole mini-batch in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from mrl.core.config import Registry

# The most logits token_logprobs holds at once: [positions, V] of 2^24 elements, 64 MB in fp32.
LOGIT_CHUNK = 2**24
# The most logits linear_token_logprobs keeps from its forward for its backward (256 MB in fp32), rather than run
# the output layer again: a BFCL micro-batch's ~600 scored tokens at SmolLM2's 49k vocabulary (118 MB) are kept,
# a 152k vocabulary's thousands of positions recomputed a chunk at a time.
LOGIT_KEEP = 2**26


def seq_mean(per_token: Tensor, mask: Tensor, denom: float | None = None) -> Tensor:
    """Mean over each sequence's tokens, summed over sequences, / denom (default N): GRPO's sample-level mean."""
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return per_seq.sum() / (denom if denom is not None else per_token.shape[0])


def token_mean(per_token: Tensor, mask: Tensor, denom: float | None = None) -> Tensor:
    """Sum over every token, / denom (default: the number of tokens): DAPO's token-level loss, where long sequences
    weigh in proportion to their length."""
    return (per_token * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))


@dataclass(frozen=True)
class Aggregation:
    """A loss aggregation: `reduce(per_token [N, T], mask [N, T], denom) -> scalar`, and what its mini-batch
    denominator counts (`per_token`: generated tokens; else sequences with one or more), so that the micro-batches of
    a mini-batch add up to its loss."""

    reduce: Callable[[Tensor, Tensor, "float | None"], Tensor]
    per_token: bool


AGGREGATIONS = Registry("algo.loss_agg", "mrl/algo/losses.py AGGREGATIONS", {
    "seq_mean": Aggregation(seq_mean, per_token=False),
    "token_mean": Aggregation(token_mean, per_token=True),
})


def aggregate(per_token: Tensor, mask: Tensor, agg: str, denom: float | None = None) -> Tensor:
    """Reduce [N, T] per-token values to a scalar by the aggregation `agg` names (AGGREGATIONS)."""
    return AGGREGATIONS.choose(agg).reduce(per_token, mask.to(per_token.dtype), denom)


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped objective with separate bounds (DAPO's clip-higher when clip_high > clip_low).

    logprobs, old_logprobs, advantages: [N, T].  Returns (per-token loss [N, T], per-token clipped indicator [N, T]).
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [N, T]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, was_clipped


def sampler_importance_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str,
                               cap: float) -> Tensor:
    """The truncated importance weight of each generated token for rollouts drawn by another engine (vLLM), whose
    probabilities differ a little from the trainer's: r = exp(old - sampler), the trainer's log-prob of the token at
    the sampling weights over the sampler's (TRL's `vllm_importance_sampling_correction`, verl's TIS).  `mode`
    (SAMPLER_WEIGHTS): token_truncate min(r_t, cap) per token; token_mask r_t, or 0 where r_t > cap;
    sequence_truncate / sequence_mask the same on the row's r = exp(sum of its tokens' log-ratios), given to each of
    its tokens.  Without gradients (a weight, not a path).  All [N, T] -> [N, T], 0 where `mask` is 0.

    >>> old, sampler, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    >>> sampler_importance_weights(old, sampler, mask, "token_truncate", 2.0)  # e^1 = 2.72 truncated to 2
    tensor([[2., 1.]])
    >>> sampler_importance_weights(old, sampler, mask, "token_mask", 2.0)
    tensor([[0., 1.]])
    """
    return SAMPLER_WEIGHTS.choose(mode)(old_logprobs.detach().float(), sampler_logprobs.float(), mask.float(), cap)


def _per_token(old: Tensor, sampler: Tensor, mask: Tensor) -> Tensor:  # [N, T] log r_t, 0 off the mask
    return (old - sampler) * mask


def _per_sequence(old: Tensor, sampler: Tensor, mask: Tensor) -> Tensor:  # [N, T]: each row's log r on its tokens
    return _per_token(old, sampler, mask).sum(-1, keepdim=True).expand_as(mask)


def _truncated(log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    return lambda old, sampler, mask, cap: log_ratio(old, sampler, mask).exp().clamp(max=cap) * mask


def _masked(log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def weight(old: Tensor, sampler: Tensor, mask: Tensor, cap: float) -> Tensor:
        ratio = log_ratio(old, sampler, mask).exp()
        return ratio.masked_fill(ratio > cap, 0.0) * mask
    return weight


# rollout.importance_weight -> (old [N, T], sampler [N, T], mask [N, T], cap) -> weights [N, T]; "none": all 1.
SAMPLER_WEIGHTS = Registry("rollout.importance_weight", "mrl/algo/losses.py SAMPLER_WEIGHTS", {
    "token_truncate": _truncated(_per_token),
    "token_mask": _masked(_per_token),
    "sequence_truncate": _truncated(_per_sequence),
    "sequence_mask": _masked(_per_sequence),
    "none": lambda old, sampler, mask, cap: mask,
})


def logprob_gap(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> tuple[float, float]:
    """(mean, max) over the generated tokens (`mask`) of |old - sampler|, the trainer's log-prob of each sampled token
    against the sampler's: how far off-policy another engine's rollouts are (0, 0 with no token).  All [N, T]."""
    gap = (old_logprobs.detach().float() - sampler_logprobs.float()).abs() * mask  # [N, T]
    tokens = float(mask.sum())
    return (float(gap.sum()) / tokens, float(gap.max())) if tokens else (0.0, 0.0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference), Schulman's k3 estimator: exp(r) - r - 1 with r = ref - policy.

    Unbiased, always >= 0, low variance.  logprobs, ref_logprobs: [N, T] -> [N, T].
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of the categorical distribution.  logits: [N, T, V] -> [N, T]; -inf logits (tokens a
    truncation left out) have probability 0 and add 0 (no NaN, in the forward or the backward)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    logp = logp.masked_fill(torch.isneginf(logits), 0.0)
    return -(logp.exp() * logp).sum(-1)


def truncate(logits: Tensor, targets: Tensor, warp: Callable[[Tensor | None, Tensor], Tensor] | None) -> Tensor:
    """The logits of the distribution the sampler drew from under top_k / top_p: -inf on every token the sampler's
    own warpers (`warp`: HF's TopK / TopP classes, in HF's order, after the temperature) leave out, so that log
    softmax is the truncated, renormalized distribution.  The target is always kept: the policy the update moves
    may drop a sampled token from its top-k (its log-prob would be -inf and the ratio 0; in the sampler's own
    distribution it is always inside).  logits [c, V] (already / temperature), targets [c] -> [c, V].

    >>> from transformers import TopKLogitsWarper
    >>> truncate(torch.tensor([[2., 1., 0.]]), torch.tensor([0]), TopKLogitsWarper(1)).tolist()
    [[2.0, -inf, -inf]]
    """
    if warp is None:
        return logits
    kept = torch.isfinite(warp(None, logits.detach()))  # [c, V]
    kept[torch.arange(len(targets), device=targets.device), targets] = True
    return logits.masked_fill(~kept, -torch.inf)


def token_logprobs(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, vocab_size: int,
                   temperature: float = 1.0, entropy: bool = False, entropy_grad: bool = False,
                   warp: Callable | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` and (optionally) the entropy of softmax(head(hidden) / temperature), truncated by `warp`
    (top_k / top_p, see `truncate`) when given, never holding the [N, T, V] logits.  hidden [N, T, H], targets
    [N, T] -> (log-probs [N, T], entropy [N, T] or None).

    `head` (the output layer) runs on at most LOGIT_CHUNK / vocab_size positions at a time; log p = logit -
    logsumexp (no log-softmax is kept).  With gradients and more than one chunk, each chunk's logits are recomputed
    in the backward instead of kept (activation checkpointing, as TRL's chunked log-prob head): the output layer runs
    forward twice, and memory no longer grows with N x T x V.  The entropy carries gradients only with
    `entropy_grad` (an entropy bonus in the loss), else it is computed without (logged only).
    """
    N, T, H = hidden.shape
    flat, ids = hidden.reshape(N * T, H), targets.reshape(N * T)
    with_entropy = entropy or entropy_grad

    def score(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:  # [c, H], [c] -> [c], [c]
        logits = truncate(head(h).float() / temperature, t, warp)  # [c, V]
        logprobs = logits.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
        if not with_entropy:
            return logprobs, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logprobs, entropy_from_logits(logits)

    rows = max(1, LOGIT_CHUNK // vocab_size)
    chunks = list(zip(flat.split(rows), ids.split(rows)))
    recompute = len(chunks) > 1 and torch.is_grad_enabled() and flat.requires_grad
    scored = [checkpoint(score, h, t, use_reentrant=False) if recompute else score(h, t) for h, t in chunks]
    logprobs = torch.cat([lp for lp, _ in scored]).view(N, T)
    return logprobs, torch.cat([e for _, e in scored]).view(N, T) if with_entropy else None


def linear_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                          entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """token_logprobs for an output layer that is a plain linear map (logits = hidden @ weight.T), with its gradient
    written by hand: hidden [N, T, H], weight [V, H], targets [N, T] -> (log-probs [N, T] in float32, entropy [N, T]
    (no gradient) or None).

    Memory: the forward keeps the inputs and one log-normalizer per position; the backward recomputes each chunk's
    logits and adds its share of the weight's gradient into one [V, H] buffer in place.  Autograd through
    token_logprobs' checkpointed chunks holds two [V, H] gradients at once (the running sum and the chunk's) and the
    softmax's intermediates besides.  At a 152k vocabulary, hidden 896, 16 x 128 positions (scripts/bench_head.py,
    CPU): 728 MiB above the inputs (519 of them the weight's gradient itself) instead of 1705, in 0.69x the time.
    The output layer runs once when all the logits fit LOGIT_KEEP (they are kept for the backward), else twice
    (forward, and recomputed a chunk at a time in the backward).  The same math, to float rounding
    (tests/test_losses.py).
    """
    N, T, H = hidden.shape
    logprobs, entropies = _LinearLogprobs.apply(hidden.reshape(N * T, H), weight, targets.reshape(N * T),
                                                temperature, max(1, LOGIT_CHUNK // weight.shape[0]), entropy,
                                                N * T * weight.shape[0] <= LOGIT_KEEP)
    return logprobs.view(N, T), entropies.view(N, T) if entropy else None


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], `rows` positions at a time.  hidden [M, H], weight
    [V, H], targets [M] -> (log-probs [M], entropies [M] or an empty tensor).

    d log p_t / d logits = onehot(t) - softmax(logits): the backward needs only the logits (kept from the forward
    with `keep`, else recomputed) and the saved log-normalizer.  The matmuls run in one compute dtype, chosen in the
    forward and kept for the backward: the autocast dtype where autocast is on (bf16 on a GPU, as the model's own
    output layer would run), else hidden's.  Autograd runs the backward outside autocast, and logits recomputed in
    another precision than the saved log-normalizer's would not sum to one (a confident token's gradient,
    g * (1 - p), would be rounding noise).  The softmax and the weight's gradient are float32 (float64 for float64
    inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, rows: int, entropy: bool, keep: bool):
        device = hidden.device.type
        ctx.compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        wide = torch.promote_types(ctx.compute, torch.float32)
        logprobs = torch.empty(len(hidden), dtype=wide, device=hidden.device)  # [M]
        log_norm = torch.empty_like(logprobs)  # [M]
        entropies = torch.empty_like(logprobs) if entropy else logprobs.new_empty(0)
        # Kept (at most LOGIT_KEEP logits): the backward reads them rather than run the output layer again, as
        # autograd would keep them; else each chunk is recomputed there, so that memory stays one chunk's.
        kept = logprobs.new_empty(len(hidden), weight.shape[0]) if keep else logprobs.new_empty(0)  # [M, V]
        with torch.autocast(device, enabled=False):
            w = weight.to(ctx.compute)
            for start in range(0, len(hidden), rows):
                span = slice(start, start + rows)
                product = hidden[span].to(ctx.compute) @ w.t()
                logits = kept[span].copy_(product) if keep else product.to(wide)  # [c, V], not the model's
                logits.div_(temperature)
                log_norm[span] = torch.logsumexp(logits, -1)
                logprobs[span] = logits.gather(1, targets[span, None]).squeeze(1) - log_norm[span]
                if entropy:  # H = log Z - sum_v p_v * logit_v
                    entropies[span] = log_norm[span] - torch.softmax(logits, -1).mul_(logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, log_norm, kept)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropies):
        hidden, weight, targets, log_norm, kept = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        wide = log_norm.dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.compute)
            for start in range(0, len(hidden), ctx.rows):
                span = slice(start, start + ctx.rows)
                h = hidden[span].to(ctx.compute)
                upstream = grad_logprobs[span].to(wide)  # [c]
                if kept.numel():  # -g * softmax, beside the kept logits
                    grad_logits = (kept[span] - log_norm[span, None]).exp_().mul_(-upstream[:, None])
                else:  # recomputed as in the forward; -g * softmax in the logits' own buffer
                    logits = (h @ w.t()).to(wide).div_(ctx.temperature)  # [c, V]
                    grad_logits = logits.sub_(log_norm[span, None]).exp_().mul_(-upstream[:, None])
                grad_logits[torch.arange(len(upstream), device=upstream.device), targets[span]] += upstream  # +g*onehot
                grad_logits /= ctx.temperature
                if want_hidden:
                    grad_hidden[span] = grad_logits.to(ctx.compute) @ w
                if want_weight:
                    grad_weight.addmm_(grad_logits.t(), h.to(wide))  # in place: no second [V, H]
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None, None, None, None, None, None)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """PPO's clipped value loss, per token: 0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2).  All [N, T]."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
