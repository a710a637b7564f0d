"""The update phase (mrl.loop.update) on a hand-built batch: its gradient against the loss written out by hand.

AdamW's first step ignores the loss's scale, so "the weights moved" cannot see a wrong denominator, a wrong sign or
a wrong bound; the gradient can.  A stand-in for mrl.engine.Trainable records the gradient at each optimizer step
instead of stepping, and the expected gradient comes from one plain forward of the whole batch (the model's own
logits, log-softmax, the formulas below), float64 so that the comparison is tight.  Then what the real optimizer
does with it: the entropy bonus raises the entropy, KL in the loss pulls toward the reference, and clipping binds
on a second epoch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from mrl.loop import update
from mrl.models import Actor, load_causal_lm, position_ids, resolve_model_path
from mrl.rollout import Rollouts, policy_forward

N, P, T = 6, 3, 5
LENGTHS = [5, 2, 4, 1, 3, 5]  # generated tokens per rollout: unequal, so seq_mean and token_mean differ


class GradCapture:
    """mrl.engine.Trainable's contract for `update`: records the gradient at each step instead of stepping."""

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
    update(cfg, capture, None, batch, mask, advantages, None, old, ref if settings["kl_coef"] else None, None)
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
        # (the entropy is computed in float32, mrl.losses.entropy_from_logits: ~1e-7 relative)
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


# ------------------------------------------------------------------------------ what the optimizer does with it


def real_update(policy, *overrides: str, reference=None, advantages_scale: float = 0.0):
    """Two optimizer steps (AdamW, mrl.engine.Trainable) on the hand-built batch with zero advantages (unless
    scaled): only the entropy bonus or the KL move the policy.  Returns the update's metrics sums."""
    from mrl.engine import Trainable

    cfg = compose_config("trainer.micro_batch_size=3", "trainer.lr=0.01", *overrides)
    batch, mask = hand_batch()
    actor = Trainable(Actor(policy), cfg.trainer.lr, 0.0, 1.0, cfg.deepspeed, 3, torch.device("cpu"))
    with torch.no_grad():
        old, _, _ = policy_forward(actor.module, batch, cfg.trainer.temperature)
        ref = policy_forward(Actor(reference), batch, cfg.trainer.temperature)[0] if reference is not None else None
    advantages = torch.linspace(-1, 1, N, dtype=torch.float64)[:, None] * mask * advantages_scale
    sums, steps = update(cfg, actor, None, batch, mask, advantages, None, old, ref, None)
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
