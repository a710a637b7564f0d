"""Unit tests for mrl/algo/losses.py.  Every expected value is worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import mrl.algo.losses
from mrl.algo.losses import (
    aggregate,
    clipped_surrogate,
    entropy_from_logits,
    kl_k3,
    linear_token_logprobs,
    token_logprobs,
    truncate,
    value_loss,
)

TOL = dict(rtol=1e-9, atol=1e-9)


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ------------------------------------------------------------------------------------------ aggregate


def test_aggregate_hand_example():
    per_token = t64([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # seq_mean: seq 0 mean (1+2+3)/3 = 2, seq 1 mean 4/1 = 4 -> (2 + 4) / 2 = 3
    assert_close(aggregate(per_token, mask, "seq_mean"), t64(3.0), **TOL)
    # token_mean: (1+2+3+4) / 4 = 2.5
    assert_close(aggregate(per_token, mask, "token_mean"), t64(2.5), **TOL)
    # explicit denom: seq_mean (2 + 4) / 4 = 1.5; token_mean 10 / 8 = 1.25
    assert_close(aggregate(per_token, mask, "seq_mean", denom=4), t64(1.5), **TOL)
    assert_close(aggregate(per_token, mask, "token_mean", denom=8), t64(1.25), **TOL)


def test_aggregate_fully_masked_sequence():
    # A sequence with no generated tokens contributes 0 (no 0/0): seq_mean (2 + 0) / 2 = 1; token_mean 6 / 3 = 2.
    per_token = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert_close(aggregate(per_token, mask, "seq_mean"), t64(1.0), **TOL)
    assert_close(aggregate(per_token, mask, "token_mean"), t64(2.0), **TOL)


@pytest.mark.parametrize("agg", ["seq_mean", "token_mean"])
def test_aggregate_micro_batches_sum_to_whole(agg):
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    whole = aggregate(per_token, mask, agg)
    denom = float(per_token.shape[0]) if agg == "seq_mean" else float(mask.sum())  # 6 or 20
    parts = [slice(0, 2), slice(2, 6)]
    summed = sum(aggregate(per_token[s], mask[s], agg, denom=denom) for s in parts)
    assert_close(summed, whole, **TOL)
    # Without denom each micro-batch is normalized by its own count and the sum does not match.
    naive = sum(aggregate(per_token[s], mask[s], agg) for s in parts)
    assert not torch.allclose(naive, whole)


def test_aggregate_modes_differ_with_unequal_lengths():
    # Long sequences weigh more under token_mean: [[1,1,1,1],[0,...]] with lengths 4 and 1
    #   seq_mean (1 + 0) / 2 = 0.5; token_mean 4 / 5 = 0.8
    per_token = t64([[1.0, 1.0, 1.0, 1.0], [0.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert_close(aggregate(per_token, mask, "seq_mean"), t64(0.5), **TOL)
    assert_close(aggregate(per_token, mask, "token_mean"), t64(0.8), **TOL)


def test_aggregate_unknown_raises():
    with pytest.raises(ValueError):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "sum")
    with pytest.raises(ValueError):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "mean")


@pytest.mark.parametrize("agg", ["seq_mean", "token_mean"])
def test_masked_token_value_does_not_leak(agg):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    junk = base.clone()
    junk[mask == 0] = 1e30  # huge but finite

    a = base.clone().requires_grad_(True)
    b = junk.clone().requires_grad_(True)
    out_a = aggregate(a, mask, agg)
    out_b = aggregate(b, mask, agg)
    assert_close(out_b, out_a, **TOL)
    out_a.backward()
    out_b.backward()
    assert_close(b.grad, a.grad, **TOL)
    assert torch.equal(a.grad[mask == 0], torch.zeros_like(a.grad[mask == 0]))
    # Hand check of the gradient on unmasked tokens: token_mean 1/8 (2 + 4 + 2 = 8 tokens);
    # seq_mean 1/(N * len) = 1/(3*len)
    if agg == "token_mean":
        assert_close(a.grad[mask == 1], torch.full((8,), 1 / 8, dtype=torch.float64), **TOL)
    else:
        assert_close(a.grad[0, :2], t64([1 / 6, 1 / 6]), **TOL)
        assert_close(a.grad[1], t64([1 / 12] * 4), **TOL)
        assert_close(a.grad[2, [0, 2]], t64([1 / 6, 1 / 6]), **TOL)


def test_masked_logprob_junk_does_not_leak_through_surrogate():
    # A moderately large junk logprob on a masked token (exp(30) is finite) changes neither loss nor gradient.
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(2, 4, generator=gen, dtype=torch.float64) * 0.1
    old = logp.detach() + torch.randn(2, 4, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    junk = logp.clone()
    junk[mask == 0] = 30.0
    a = logp.clone().requires_grad_(True)
    b = junk.clone().requires_grad_(True)
    la = aggregate(clipped_surrogate(a, old, adv, 0.2, 0.28)[0], mask, "token_mean")
    lb = aggregate(clipped_surrogate(b, old, adv, 0.2, 0.28)[0], mask, "token_mean")
    assert_close(lb, la, **TOL)
    la.backward()
    lb.backward()
    assert_close(b.grad, a.grad, **TOL)


# ---------------------------------------------------------------------------------- clipped_surrogate


def test_clipped_surrogate_hand_values():
    # clip_low = 0.2, clip_high = 0.28 -> ratio clamped to [0.8, 1.28]
    #  ratio  adv | unclipped  clipped     min   -> loss   clipped?
    #  1.10    2  |   2.20      2.20       2.20  -> -2.20   0   inside
    #  1.50    1  |   1.50      1.28       1.28  -> -1.28   1   above, A>0: clipped chosen
    #  1.50   -1  |  -1.50     -1.28      -1.50  ->  1.50   0   above, A<0: unclipped chosen
    #  0.50    1  |   0.50      0.80       0.50  -> -0.50   0   below, A>0: unclipped chosen
    #  0.50   -1  |  -0.50     -0.80      -0.80  ->  0.80   1   below, A<0: clipped chosen
    #  1.25    1  |   1.25      1.25       1.25  -> -1.25   0   inside only thanks to clip-higher (> 1.2)
    #  0.85   -1  |  -0.85     -0.85      -0.85  ->  0.85   0   inside
    #  1.50    0  |   0         0          0     ->  0      0   zero advantage
    ratio = t64([[1.10, 1.50, 1.50, 0.50], [0.50, 1.25, 0.85, 1.50]])
    adv = t64([[2.0, 1.0, -1.0, 1.0], [-1.0, 1.0, -1.0, 0.0]])
    old = t64([[-1.0, -0.3, -2.0, -0.7], [-1.5, -0.2, -0.9, -3.0]])
    logp = old + torch.log(ratio)
    loss, was_clipped = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert_close(loss, t64([[-2.20, -1.28, 1.50, -0.50], [0.80, -1.25, 0.85, 0.0]]), rtol=1e-12, atol=1e-12)
    assert torch.equal(was_clipped, t64([[0, 1, 0, 0], [1, 0, 0, 0]]))
    assert was_clipped.dtype == logp.dtype


def test_clipped_surrogate_symmetric_clip_would_bind():
    # Same ratio 1.25, A = 1 with clip_high = 0.2: clamp to 1.2 -> loss -1.2, clipped.
    logp = torch.log(t64([[1.25]]))
    loss, was_clipped = clipped_surrogate(logp, t64([[0.0]]), t64([[1.0]]), clip_low=0.2, clip_high=0.2)
    assert_close(loss, t64([[-1.2]]), rtol=1e-12, atol=1e-12)
    assert was_clipped.item() == 1.0


def test_clipped_surrogate_gradient_zero_where_clipped():
    # d loss / d logp = -ratio * A where unclipped is chosen, 0 where the (saturated) clipped term is chosen.
    #  ratio 1.10, A 2: -2.2;  ratio 1.5, A 1: 0;  ratio 1.5, A -1: 1.5;  ratio 0.5, A -1: 0
    ratio = t64([1.10, 1.50, 1.50, 0.50])
    adv = t64([2.0, 1.0, -1.0, -1.0])
    logp = torch.log(ratio).requires_grad_(True)
    loss, _ = clipped_surrogate(logp, torch.zeros(4, dtype=torch.float64), adv, 0.2, 0.28)
    loss.sum().backward()
    assert_close(logp.grad, t64([-2.2, 0.0, 1.5, 0.0]), rtol=1e-12, atol=1e-12)


def test_clipped_indicator_matches_chosen_term_random():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    logp = old + torch.randn(8, 16, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    loss, was_clipped = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    ratio = torch.exp(logp - old)
    out_of_range = (ratio < 0.8) | (ratio > 1.28)
    # Clipped term chosen and different <=> (ratio > 1.28 and A > 0) or (ratio < 0.8 and A < 0)
    expect = ((ratio > 1.28) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    assert torch.equal(was_clipped.bool(), expect)
    assert expect.any() and (~expect & out_of_range).any()  # both kinds of out-of-range tokens occur
    assert set(was_clipped.unique().tolist()) <= {0.0, 1.0}
    # Where not clipped the loss is the unclipped term; where clipped it is the bound times A.
    assert_close(loss[~expect], -(ratio * adv)[~expect], rtol=1e-12, atol=1e-12)
    bound = torch.where(ratio > 1.28, t64(1.28), t64(0.8))
    assert_close(loss[expect], -(bound * adv)[expect], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------- kl_k3


def test_kl_k3_zero_when_equal():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
    assert torch.equal(kl_k3(x, x.clone()), torch.zeros(3, 5))


def test_kl_k3_hand_values():
    # logp=-1.0, ref=-0.5: r = 0.5, exp(0.5) - 0.5 - 1 = 1.6487213 - 1.5 = 0.1487213
    # logp=-0.5, ref=-1.5: r = -1,  exp(-1) + 1 - 1 = 0.3678794   (swapped sign would give e - 2 = 0.7182818)
    logp = t64([[-1.0, -0.5]])
    ref = t64([[-0.5, -1.5]])
    out = kl_k3(logp, ref)
    assert_close(out, t64([[0.1487213, 0.3678794]]), rtol=0, atol=1e-7)
    assert_close(out, t64([[math.exp(0.5) - 1.5, math.exp(-1.0)]]), **TOL)


def test_kl_k3_nonnegative_random():
    gen = torch.Generator().manual_seed(5)
    logp = torch.randn(16, 32, generator=gen) * 2
    ref = torch.randn(16, 32, generator=gen) * 2
    out = kl_k3(logp, ref)
    assert out.shape == (16, 32)
    assert (out >= 0).all()
    assert (out > 0).any()


# ------------------------------------------------------------------------------------ entropy_from_logits


@pytest.mark.parametrize("vocab", [2, 7, 50])
def test_entropy_uniform_is_log_v(vocab):
    logits = torch.full((2, 3, vocab), 3.7)
    out = entropy_from_logits(logits)
    assert out.shape == (2, 3)
    assert_close(out, torch.full((2, 3), math.log(vocab)), rtol=1e-6, atol=1e-6)


def test_entropy_one_hot_is_zero():
    logits = torch.zeros(2, 4, 10)
    logits[..., 3] = 100.0
    out = entropy_from_logits(logits)
    assert_close(out, torch.zeros(2, 4), rtol=0, atol=1e-6)


def test_entropy_two_class_hand_value():
    # logits [0, ln 3] -> p = [0.25, 0.75]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.3465736 + 0.2157616 = 0.5623351
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert_close(entropy_from_logits(logits), torch.tensor([[0.5623351]]), rtol=0, atol=1e-6)


def test_entropy_low_precision_input_is_float32():
    logits = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    assert_close(out, torch.full((1, 2), math.log(4.0)), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ token_logprobs


def chunked_scores(monkeypatch, chunk: int, entropy_grad: bool):
    """token_logprobs at LOGIT_CHUNK=`chunk` on a fixed random problem (N=3, T=5, H=8, V=11, temperature 0.7),
    backward through 2 * log-probs + 3 * entropies -> (log-probs, entropies, d hidden, d head weight, rows the
    head saw per call, whether the entropy carried gradients)."""
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_CHUNK", chunk)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    rows = []

    def counted(h):
        rows.append(len(h))
        return head(h)

    logprobs, entropy = token_logprobs(counted, hidden, targets, 11, 0.7, entropy=True, entropy_grad=entropy_grad)
    (2 * logprobs.sum() + 3 * entropy.sum()).backward() if entropy_grad else (2 * logprobs.sum()).backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, head.weight.grad, rows, entropy.requires_grad


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_token_logprobs_in_chunks_equal_full_logits_values_and_gradients(monkeypatch, entropy_grad):
    whole = chunked_scores(monkeypatch, 10**6, entropy_grad)  # one chunk: the logits of all 15 positions at once
    chunked = chunked_scores(monkeypatch, 2 * 11, entropy_grad)  # 2 positions a chunk: 8 chunks
    # the reference: full [N, T, V] logits, log-softmax, by hand
    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(8, 11), torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    logp = torch.log_softmax(head(hidden) / 0.7, -1)  # [3, 5, 11]
    logprobs, entropy = logp.gather(2, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    (2 * logprobs.sum() + (3 * entropy.sum() if entropy_grad else 0)).backward()
    for got in (whole, chunked):
        assert_close(got[0], logprobs.detach(), rtol=1e-5, atol=1e-6)
        assert_close(got[1], entropy.detach(), rtol=1e-5, atol=1e-6)
        assert_close(got[2], hidden.grad, rtol=1e-5, atol=1e-6)
        assert_close(got[3], head.weight.grad, rtol=1e-5, atol=1e-6)
        assert got[5] == entropy_grad  # logged only, unless an entropy bonus trains it
    assert whole[4] == [15]
    # at most 2 positions' logits at a time, in the forward (8 chunks) and again in the backward (recomputed)
    assert max(chunked[4]) == 2 and sum(chunked[4]) == 2 * 15


def test_token_logprobs_without_entropy_or_gradients():
    head = torch.nn.Linear(4, 6)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(head, torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), 6)
    assert logprobs.shape == (2, 3) and entropy is None and (logprobs < 0).all()


def linear_scores(monkeypatch, chunk: int, dtype=torch.float32, frozen: bool = False, keep: bool = True):
    """linear_token_logprobs at LOGIT_CHUNK=`chunk` on a fixed problem (N=3, T=5, H=8, V=11, temperature 0.7), its
    logits kept for the backward (`keep`) or recomputed there, backward through a weighted sum of the log-probs
    (uneven weights, one of them 0) -> (log-probs, entropies, d hidden, d weight)."""
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_CHUNK", chunk)
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_KEEP", 10**6 if keep else 0)
    torch.manual_seed(0)
    weight = torch.randn(11, 8, dtype=dtype, requires_grad=not frozen)
    hidden = torch.randn(3, 5, 8, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    upstream = torch.randn(3, 5, dtype=dtype)
    upstream[1, 2] = 0.0  # a masked-out token
    logprobs, entropy = linear_token_logprobs(hidden, weight, targets, 0.7, entropy=True)
    (upstream * logprobs).sum().backward()
    return logprobs.detach(), entropy, hidden.grad, weight.grad


def reference_scores():
    """The same problem through full [N, T, V] logits and autograd's log-softmax."""
    torch.manual_seed(0)
    weight, hidden = torch.randn(11, 8, requires_grad=True), torch.randn(3, 5, 8, requires_grad=True)
    targets, upstream = torch.randint(0, 11, (3, 5)), torch.randn(3, 5)
    upstream[1, 2] = 0.0
    logp = torch.log_softmax(hidden @ weight.t() / 0.7, -1)  # [3, 5, 11]
    logprobs = logp.gather(2, targets[..., None]).squeeze(-1)
    (upstream * logprobs).sum().backward()
    return logprobs.detach(), -(logp.exp() * logp).sum(-1).detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [10**6, 2 * 11, 11])  # one chunk of 15 positions; 2 positions; 1 position
@pytest.mark.parametrize("keep", [True, False])  # the logits kept for the backward, or recomputed there
def test_linear_token_logprobs_equal_full_logits_values_and_gradients(monkeypatch, chunk, keep):
    got, expected = linear_scores(monkeypatch, chunk, keep=keep), reference_scores()
    for a, b in zip(got, expected):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not got[1].requires_grad  # the entropy is logged, never trained through this path
    assert (got[0] < 0).all() and got[3].abs().sum() > 0


@pytest.mark.parametrize("keep", [True, False])
def test_linear_token_logprobs_gradcheck_in_float64(monkeypatch, keep):
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_CHUNK", 2 * 5)  # 2 positions a chunk
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_KEEP", 10**6 if keep else 0)
    torch.manual_seed(1)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda h, w: linear_token_logprobs(h, w, targets, 1.3)[0], (hidden, weight))


@pytest.mark.parametrize("chunk,keep", [(10**6, True), (2 * 512, False), (2 * 512, True)])  # one chunk; 2 positions
def test_linear_token_logprobs_under_autocast_match_the_autograd_path(monkeypatch, chunk, keep):  # a chunk
    """Under bf16 autocast (a GPU's mixed precision; CPU autocast here) the forward computes bf16 logits, and the
    backward, which autograd runs outside autocast, must recompute them in bf16 too: confident tokens (p near 1)
    have a gradient g * (1 - p) that a float32 recomputation against the bf16 log-normalizer turns into noise.
    token_logprobs' checkpointed chunks restore autocast when they recompute: both ways must agree."""
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_CHUNK", chunk)
    monkeypatch.setattr(mrl.algo.losses, "LOGIT_KEEP", 10**6 if keep else 0)

    def run(way):
        torch.manual_seed(0)
        hidden = torch.randn(2, 4, 16, requires_grad=True)
        weight = (torch.randn(512, 16) * 6).requires_grad_(True)
        with torch.no_grad():
            targets = (hidden @ weight.t()).argmax(-1)  # the most likely tokens: confident ones
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs = way(hidden, weight, targets)
        logprobs.sum().backward()  # outside autocast, as the loop's backward
        return logprobs.detach().float(), hidden.grad, weight.grad

    linear = run(lambda h, w, t: linear_token_logprobs(h, w, t)[0])
    autograd = run(lambda h, w, t: token_logprobs(lambda x: x @ w.t(), h, t, 512)[0])
    assert linear[0].exp().mean() > 0.9  # confident
    for got, expected in zip(linear, autograd):
        assert ((got - expected).norm() / expected.norm()).item() < 0.02


@pytest.mark.parametrize("keep,products", [(True, 3 * 3), (False, 4 * 3)])
def test_linear_token_logprobs_keeps_the_logits_it_may(monkeypatch, keep, products):
    """15 positions in chunks of 6: the output layer's products are 3 a chunk (the logits, then the hidden states' and
    the weight's gradients) where the logits are kept, 4 where the backward recomputes them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountProducts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default):
                CountProducts.count += 1
            return func(*args, **(kwargs or {}))

    with CountProducts():
        linear_scores(monkeypatch, 6 * 11, keep=keep)
    assert CountProducts.count == products


def test_linear_token_logprobs_of_no_positions():
    hidden, weight = torch.zeros(0, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    logprobs, entropy = linear_token_logprobs(hidden, weight, torch.zeros(0, 3, dtype=torch.long), entropy=True)
    assert logprobs.shape == entropy.shape == (0, 3)
    logprobs.sum().backward()
    assert hidden.grad.shape == (0, 3, 4) and torch.equal(weight.grad, torch.zeros(5, 4))


def test_linear_token_logprobs_with_a_frozen_output_layer(monkeypatch):
    """A LoRA policy's output layer is frozen: no weight gradient is computed, the hidden states' is unchanged."""
    logprobs, _, grad_hidden, grad_weight = linear_scores(monkeypatch, 2 * 11, frozen=True)
    expected = reference_scores()
    assert grad_weight is None
    assert_close(logprobs, expected[0], rtol=1e-5, atol=1e-6)
    assert_close(grad_hidden, expected[2], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- value_loss


def test_value_loss_hand_values():
    # clip = 0.2
    #  v    old   R   | clip(v)            (v-R)^2   (clip-R)^2   0.5*max
    #  1.0  0.9   1.5 | 0.9+0.1 = 1.0       0.25      0.25         0.125   clip does not bind
    #  1.5  1.0   2.0 | 1.0+0.2 = 1.2       0.25      0.64         0.32    clip binds (upper)
    #  1.5  1.0   1.0 | 1.2                 0.25      0.04         0.125   clipped but max takes unclipped
    #  0.0  1.0   0.0 | 1.0-0.2 = 0.8       0.00      0.64         0.32    clip binds (lower)
    v = t64([[1.0, 1.5, 1.5, 0.0]]).requires_grad_(True)
    old = t64([[0.9, 1.0, 1.0, 1.0]])
    ret = t64([[1.5, 2.0, 1.0, 0.0]])
    out = value_loss(v, old, ret, clip=0.2)
    assert_close(out, t64([[0.125, 0.32, 0.125, 0.32]]), rtol=1e-12, atol=1e-12)
    # Gradient: v - R where the unclipped term wins; 0 where the saturated clipped term wins.
    #   [1.0-1.5, 0, 1.5-1.0, 0] = [-0.5, 0, 0.5, 0]
    out.sum().backward()
    assert_close(v.grad, t64([[-0.5, 0.0, 0.5, 0.0]]), rtol=1e-12, atol=1e-12)


def test_value_loss_large_clip_is_plain_mse():
    gen = torch.Generator().manual_seed(6)
    v = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    old = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    ret = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    assert_close(value_loss(v, old, ret, clip=1e9), 0.5 * (v - ret) ** 2, **TOL)


# ------------------------------------------------------------------------------------ top_k / top_p truncation


def test_truncate_keeps_what_hf_top_k_and_top_p_keep_and_the_target():
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]]))
    top2 = TopKLogitsWarper(2)
    out = truncate(logits, torch.tensor([0, 3]), top2)
    # Row 0: the top 2 (0.5, 0.3) renormalized: 0.625, 0.375.  Row 1: its target, token 3, is kept besides the top 2:
    # 0.4, 0.3, 0.1 renormalized over 0.8: 0.5, 0.375, 0.125.
    assert_close(out.softmax(-1), torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.5, 0.375, 0.0, 0.125]]))
    # top_p 0.7: HF keeps the smallest head whose mass reaches 0.7: 0.5 + 0.3 (row 0), 0.4 + 0.3 (row 1).
    nucleus = truncate(logits, torch.tensor([0, 0]), TopPLogitsWarper(0.7))
    assert torch.isinf(nucleus).tolist() == [[False, False, True, True], [False, False, True, True]]
    both = LogitsProcessorList([TopKLogitsWarper(3), TopPLogitsWarper(0.7)])
    assert torch.equal(truncate(logits, torch.tensor([0, 0]), both), nucleus)
    assert truncate(logits, torch.tensor([0, 0]), None) is logits


def test_entropy_and_its_gradient_of_a_truncated_distribution_are_finite():
    logits = torch.tensor([[1.0, 0.0, -torch.inf, -torch.inf]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    p = math.exp(1) / (math.exp(1) + 1)  # two tokens left
    assert_close(entropy, torch.tensor([-(p * math.log(p) + (1 - p) * math.log(1 - p))]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2:].eq(0).all()


def test_token_logprobs_with_a_warp_score_the_truncated_distribution():
    from transformers import TopKLogitsWarper

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6, bias=False)
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3))
    logprobs, entropy = token_logprobs(head, hidden, targets, 6, 0.7, entropy_grad=True, warp=TopKLogitsWarper(2))
    logits = head(hidden) / 0.7  # [2, 3, 6]
    kept = logits >= logits.topk(2, -1).values[..., -1:]
    kept.scatter_(-1, targets[..., None], True)
    logp = torch.log_softmax(logits.masked_fill(~kept, -torch.inf), -1)
    assert_close(logprobs, logp.gather(-1, targets[..., None]).squeeze(-1))
    assert_close(entropy, -(logp.exp() * logp.masked_fill(~kept, 0)).sum(-1))
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all()
