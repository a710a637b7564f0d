"""The update phase (mrl.train.update.update) on a hand-built batch: its gradient against the loss written out by hand.

AdamW's first step ignores the loss's scale, so "the weights moved" cannot see a wrong denominator, a wrong sign or
a wrong bound; the gradient can.  A stand-in for mrl.modeling.trainable.Trainable records the gradient at each optimizer
step instead of stepping, and the expected gradient comes from one plain forward of the whole batch (the model's own
logits, log-softmax, the formulas below), float64 so that the comparison is tight.  Then what the real optimizer
does with it: the entropy bonus raises the entropy, KL in the loss pulls toward the reference, and clipping binds
on a second epoch.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import algo_settings, compose_config

from mrl.generation.rollout import Rollouts
from mrl.modeling.models import Actor, load_causal_lm, position_ids, resolve_model_path
from mrl.train.batch import StepBatch
from mrl.train.update import micro_loss, policy_forward, update

N, P, T = 6, 3, 5
LENGTHS = [5, 2, 4, 1, 3, 5]  # generated tokens per rollout: unequal, so seq_mean and token_mean differ


class GradCapture:
    """mrl.modeling.trainable.Trainable's contract for `update`: records the gradient at each step instead of
    stepping."""

    def __init__(self, module):
        self.module = module
        self.steps: list[dict[str, torch.Tensor]] = []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def accumulate(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()
        if last:
            self.steps.append({n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None})
            self.module.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def policy():
    cfg = compose_config()
    return load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu")).double().eval()


def hand_batch() -> tuple[Rollouts, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 32, (N, P), generator=gen)
    completion = torch.randint(4, 32, (N, T), generator=gen)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])
    batch = Rollouts(prompt, torch.ones_like(prompt), completion * mask, mask, mask, [None] * N, 3)
    return batch, mask.double()


def inputs(policy, batch, mask, temperature, gen_seed=4):
    """Old log-probs off the current ones by known amounts (ratios from 0.55 to 1.6, so that both clip bounds bind
    somewhere), a reference off by others, and advantages of both signs, per token."""
    with torch.no_grad():
        current, _, _ = policy_forward(Actor(policy), batch, temperature)
    gen = torch.Generator().manual_seed(gen_seed)
    offsets = torch.empty(N, T, dtype=torch.float64).uniform_(-0.6, 0.47, generator=gen)
    old = current - offsets  # ratio = exp(offset)
    ref = current + torch.empty(N, T, dtype=torch.float64).uniform_(-0.5, 0.5, generator=gen)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.2], dtype=torch.float64)[:, None] * mask
    return old, ref, advantages


def hand_loss(policy, batch, mask, old, ref, advantages, *, temperature, clip_low, clip_high, agg, entropy_coef,
              kl_coef):
    """The update's loss on the whole batch, written out: -min(r A, clip(r, 1 - low, 1 + high) A) - c_H H
    + c_KL k3, aggregated per token or per sequence."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], 1)
    logits = policy(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention)).logits
    logits = logits[:, P - 1:-1].double() / temperature  # [N, T, V]: position t scores completion token t
    log_all = torch.log_softmax(logits, -1)
    logp = log_all.gather(-1, batch.completion_ids[..., None]).squeeze(-1)  # [N, T]
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_low, 1 + clip_high) * advantages)
    entropy = -(log_all.exp() * log_all).sum(-1)
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # http://joschu.net/blog/kl-approx.html
    per_token = surrogate - entropy_coef * entropy + kl_coef * kl
    if agg == "token_mean":
        return (per_token * mask).sum() / mask.sum()
    return ((per_token * mask).sum(-1) / mask.sum(-1)).sum() / N


def update_gradient(policy, micro: int, scale: float = 1.0, **settings):
    """(the gradient `update` computes, the hand-written loss's gradient) on the hand-built batch."""
    overrides = [f"trainer.micro_batch_size={micro}", f"trainer.temperature={settings['temperature']}",
                 f"algo.clip_low={settings['clip_low']}", f"algo.clip_high={settings['clip_high']}",
                 f"algo.loss_agg={settings['agg']}", f"algo.entropy_coef={settings['entropy_coef']}",
                 f"algo.kl_coef={settings['kl_coef']}", "algo.kl_mode=loss", "algo.epochs=1",
                 "trainer.num_mini_batches=1"]
    cfg = compose_config(*overrides)
    batch, mask = hand_batch()
    old, ref, advantages = inputs(policy, batch, mask, settings["temperature"])
    advantages = advantages * scale
    capture = GradCapture(Actor(policy))
    update(algo_settings(cfg), capture, None, StepBatch(batch, loss_mask=mask, advantages=advantages, old_logprobs=old,
                                           ref_logprobs=ref if settings["kl_coef"] else None))
    policy.zero_grad(set_to_none=True)
    hand_loss(policy, batch, mask, old, ref, advantages, **settings).backward()
    expected = {f"policy.{n}": p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    assert len(capture.steps) == 1
    return capture.steps[0], expected


SETTINGS = dict(temperature=0.7, clip_low=0.2, clip_high=0.28)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("micro,scale", [(1, 1.0), (2, 10.0), (4, 1.0), (6, 10.0)])
def test_update_gradient_equals_the_hand_written_loss(policy, agg, micro, scale):
    """Every micro-batch split (6 rows as 6, 3, 2 or 1 micro-batches) and two loss scales: the accumulated gradient
    is the whole mini-batch's, with the entropy bonus and KL in the loss switched on."""
    got, expected = update_gradient(policy, micro, scale, agg=agg, entropy_coef=0.05, kl_coef=0.1, **SETTINGS)
    assert set(got) == set(expected)
    largest = max(g.abs().max().item() for g in expected.values())
    assert largest > 1e-3  # the comparison could fail
    for name in expected:
        # (the entropy is computed in float32, mrl.algo.losses.entropy_from_logits: ~1e-7 relative)
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6 * largest, msg=name)


def test_update_gradient_without_entropy_or_kl(policy):
    got, expected = update_gradient(policy, 4, agg="token_mean", entropy_coef=0.0, kl_coef=0.0, **SETTINGS)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-7, atol=1e-12, msg=name)


def test_the_hand_batch_has_tokens_clipped_by_each_bound(policy):
    # The checks above could miss a swapped bound if no ratio left [1 - low, 1 + high]: on both sides some do.
    batch, mask = hand_batch()
    old, _, advantages = inputs(policy, batch, mask, SETTINGS["temperature"])
    with torch.no_grad():
        current, _, _ = policy_forward(Actor(policy), batch, SETTINGS["temperature"])
    ratio = torch.exp(current - old)[mask.bool()]
    sign = advantages[mask.bool()]
    assert ((ratio < 1 - SETTINGS["clip_low"]) & (sign < 0)).any()  # the lower bound binds
    assert ((ratio > 1 + SETTINGS["clip_high"]) & (sign > 0)).any()  # the upper bound binds
    # between the two bounds, where wiring one to the other changes what is clipped
    assert ((ratio > 1 + SETTINGS["clip_low"]) & (ratio < 1 + SETTINGS["clip_high"]) & (sign > 0)).any()
    assert ((ratio < 1 - SETTINGS["clip_low"]) & (ratio > 1 - SETTINGS["clip_high"]) & (sign < 0)).any()


# ------------------------------------------------------------------------ micro_loss's value, worked out by hand


class GivenActor:
    """An actor whose outputs are given, whatever the ids (mrl.modeling.models.Actor's contract for policy_forward:
    log-probs [M, T], entropies [M, T], values [M, T + 1] or None)."""

    def __init__(self, logprobs, entropy, values=None):
        self.outputs = logprobs, entropy, values

    def __call__(self, *args, **kwargs):
        return self.outputs


LN2, LN1_5 = math.log(2.0), math.log(1.5)
# Two rows of a micro-batch, 3 generated tokens of the 6 in its mini-batch (of 4 sequences).  The masked-out tokens
# carry large advantages, entropies and value errors: a loss that read them would be far off.
MICRO_MASK = [[1, 1, 0], [1, 0, 0]]
LOG_RATIO = [[LN1_5, -LN2, 0.0], [0.0, 0.0, 0.0]]  # ratios 1.5 (clipped at 1.28), 0.5 (clipped at 0.8), 1
MICRO_ADVANTAGES = [[2.0, -1.0, 10.0], [0.5, 10.0, 10.0]]
MICRO_ENTROPY = [[2.0, 1.0, 5.0], [0.5, 5.0, 5.0]]
REF_MINUS_LOGP = [[LN2, 0.0, LN2], [-LN2, LN2, LN2]]  # k3 = 1 - ln 2, 0, ln 2 - 1/2 on the generated tokens
VALUES = [[2.0, -1.0, 9.0], [2.5, 9.0, 9.0]]
OLD_VALUES = [[2.0, -1.5, 9.0], [2.5, 9.0, 9.0]]  # the second token's value moved 0.5 > value_clip 0.2: clipped
RETURNS = [[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]
# Per generated token: the clipped surrogate -min(r A, clip(r) A) = -2.56, 0.8, -0.5; the value loss
# 0.5 max((v - R)^2, (clip(v) - R)^2) = 0.5, 0.845 (clip(v) = -1.3), 0.125.
HAND = {  # (loss, {metric: value}) for entropy_coef 0.1, kl_coef 0.3 (in the loss), vf_coef 0.5 with a value head
    "token_mean": ((-2.26 - 0.1 * 3.5 + 0.3 * 0.5) / 6, 1.47 / 6,
                   {"loss/policy": -2.26 / 6, "entropy": 3.5 / 6, "kl": 0.5 / 6, "clip_frac": 2 / 6,
                    "policy/approx_kl": (LN1_5 - 1 / 3 + 1 - LN2) / 6}),
    # per sequence (row 0's mean over its 2 tokens, row 1's token) summed, over the mini-batch's 4 sequences
    "seq_mean": (((-2.56 + 0.8) / 2 - 0.5 - 0.1 * (1.5 + 0.5) + 0.3 * ((1 - LN2) / 2 + LN2 - 0.5)) / 4,
                 ((0.5 + 0.845) / 2 + 0.125) / 4,
                 {"loss/policy": ((-2.56 + 0.8) / 2 - 0.5) / 4, "entropy": 3.5 / 6, "kl": 0.5 / 6,
                  "clip_frac": 2 / 6, "policy/approx_kl": (LN1_5 - 1 / 3 + 1 - LN2) / 6}),
}


@pytest.mark.parametrize("head", [False, True], ids=["no_value_head", "value_head"])
@pytest.mark.parametrize("agg,denom", [("token_mean", 6.0), ("seq_mean", 4.0)])
def test_micro_loss_is_the_number_worked_out_by_hand(agg, denom, head):
    """micro_loss on a hand-built micro-batch, its actor's outputs given: the loss is the clipped surrogate minus
    the entropy bonus plus KL, (plus the value head's loss), over the generated tokens only, divided by the
    mini-batch's denominator, not the micro-batch's own count; the metrics are its parts of the token means."""
    algo = compose_config("algo.clip_low=0.2", "algo.clip_high=0.28", f"algo.loss_agg={agg}", "algo.kl_mode=loss",
                          "algo.entropy_coef=0.1", "algo.kl_coef=0.3", "algo.vf_coef=0.5",
                          "algo.value_clip=0.2").algo
    t = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64, requires_grad=True)
    values = torch.cat([t(VALUES), torch.zeros(2, 1, dtype=torch.float64)], 1) if head else None  # [M, T + 1]
    ids = torch.zeros(2, 3, dtype=torch.long)
    rollouts = Rollouts(ids[:, :1], torch.ones(2, 1, dtype=torch.long), ids, t(MICRO_MASK).long(),
                        torch.ones_like(ids), [None, None], 2)
    micro = StepBatch(rollouts, loss_mask=t(MICRO_MASK), advantages=t(MICRO_ADVANTAGES), returns=t(RETURNS),
                      old_logprobs=logprobs.detach() - t(LOG_RATIO),
                      ref_logprobs=logprobs.detach() + t(REF_MINUS_LOGP), old_values=t(OLD_VALUES))
    loss, stats = micro_loss(algo, GivenActor(logprobs, t(MICRO_ENTROPY), values), micro, denom, 6.0, 1.0)
    policy_loss, value_loss, metrics = HAND[agg]
    expected = policy_loss + 0.5 * value_loss if head else policy_loss
    assert loss.item() == pytest.approx(expected, rel=1e-6) and loss.requires_grad
    assert stats == pytest.approx({**metrics, "loss/total": expected, **({"loss/value": value_loss} if head else {})},
                                  rel=1e-6)


# ------------------------------------------------------------------------------ what the optimizer does with it


def real_update(policy, *overrides: str, reference=None, advantages_scale: float = 0.0):
    """Two optimizer steps (AdamW, mrl.modeling.trainable.Trainable) on the hand-built batch with zero advantages
    (unless scaled): only the entropy bonus or the KL move the policy.  Returns the update's metrics sums."""
    from mrl.modeling.trainable import Trainable

    cfg = compose_config("trainer.micro_batch_size=3", "trainer.lr=0.01", *overrides)
    batch, mask = hand_batch()
    actor = Trainable(Actor(policy), cfg.trainer.lr, 0.0, 1.0, cfg.deepspeed, 3, torch.device("cpu"))
    with torch.no_grad():
        old, _, _ = policy_forward(actor.module, batch, cfg.trainer.temperature)
        ref = policy_forward(Actor(reference), batch, cfg.trainer.temperature)[0] if reference is not None else None
    advantages = torch.linspace(-1, 1, N, dtype=torch.float64)[:, None] * mask * advantages_scale
    sums, steps = update(algo_settings(cfg), actor, None,
                         StepBatch(batch, loss_mask=mask, advantages=advantages, old_logprobs=old,
                                   ref_logprobs=ref))
    return sums, steps, batch, mask


def mean_entropy(policy, batch, mask) -> float:
    with torch.no_grad():
        _, entropy, _ = policy_forward(Actor(policy), batch, 1.0, entropy=True)
    return ((entropy * mask).sum() / mask.sum()).item()


def fresh(double=True):
    cfg = compose_config()
    model = load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu"))
    return model.double() if double else model


def test_the_entropy_bonus_raises_the_entropy():
    policy = fresh()
    batch, mask = hand_batch()
    before = mean_entropy(policy, batch, mask)
    real_update(policy, "algo.entropy_coef=1.0", "algo.epochs=2")
    assert mean_entropy(policy, batch, mask) > before + 1e-4


def test_kl_in_the_loss_pulls_toward_the_reference():
    policy, reference = fresh(), fresh()
    with torch.no_grad():  # a reference elsewhere: the policy's output layer, moved
        reference.lm_head.weight.add_(0.5 * torch.randn_like(reference.lm_head.weight,
                                                             generator=torch.Generator().manual_seed(0)))
    batch, mask = hand_batch()

    def kl() -> float:
        with torch.no_grad():
            logp, _, _ = policy_forward(Actor(policy), batch, 1.0)
            ref, _, _ = policy_forward(Actor(reference), batch, 1.0)
        return ((torch.exp(ref - logp) - (ref - logp) - 1) * mask).sum().item() / mask.sum().item()

    before = kl()
    real_update(policy, "algo.kl_coef=1.0", "algo.kl_mode=loss", "algo.epochs=2", reference=reference)
    assert kl() < before - 1e-4


def test_clipping_binds_on_the_second_epoch():
    """Epoch 1 scores at the sampling policy (ratio 1: nothing clipped); after its steps at a large learning rate,
    epoch 2's ratios leave the clip range and some tokens are clipped."""
    policy = fresh()
    sums, steps, _, _ = real_update(policy, "algo.epochs=1", "trainer.lr=0.05", advantages_scale=5.0)
    assert steps == 1 and sums["clip_frac"] == 0.0
    policy = fresh()
    sums, steps, _, _ = real_update(policy, "algo.epochs=2", "trainer.lr=0.05", advantages_scale=5.0)
    assert steps == 2 and sums["clip_frac"] > 0.0
