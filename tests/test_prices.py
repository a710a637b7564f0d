"""A budget's price as a PID controller (price.kind=pid, mrl/algo/prices.py): a step response worked out by hand, the
price's bounds, the integral price as its kp = kd = 0 case, the config's gains relative to the budget, the
controller's memory restored on resume.  Every expected value is worked out in the comments; budgets and gains are
binary fractions, so the arithmetic is exact in float64."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from conftest import assert_one_line_validation_error

from mrl.algo.advantages import dual_step
from mrl.algo.prices import PidGains, PidState, absolute_gains, pid_step
from mrl.core.config import PID_DEFAULTS
from mrl.rewards.channels import ChannelSpec, RewardSet, build_reward_set
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

SAFETY = "rewards.channels.safety"
PID = [f"{SAFETY}.enforce=budget", f"{SAFETY}.price.kind=pid"]

# d = 1/4; relative gains kp 1/2, ki 1/4, kd 1/4 -> per unit of cost kp 2, ki 1, kd 1; EMA weight 1/2, delay 2.
D = 0.25
GAINS = PidGains(kp=2.0, ki=1.0, kd=1.0, ema=0.5, delay=2, cap=10.0)
# A step response: the cost rises above the budget (0.5, then 1.0), comes back to it (0.25 three times), then falls
# below it (0.0).  Per step (c_bar = 0.5 c_bar + 0.5 J; I += 1 (J - 0.25); P = 2 (c_bar - 0.25);
# D = max(0, c_bar - c_bar two steps back), the oldest kept while fewer):
#   J     c_bar    I      P        D      lambda
#   0.5   0.5      0.25   0.5      0      0.75     (c_bar starts at J)
#   1.0   0.75     1.0    1.0      0.25   2.25     (D: 0.75 - 0.5, one step back: only one EMA kept yet)
#   0.25  0.5      1.0    0.5      0      1.5      (c_bar 0.5 vs 0.5 two steps back)
#   0.25  0.375    1.0    0.25     0      1.25     (falling: D stays 0)
#   0.25  0.3125   1.0    0.125    0      1.125    (at the budget: I holds, P decays with c_bar)
#   0.0   0.15625  0.75   -0.1875  0      0.5625   (below: P turns negative at once, I falls by 0.25)
COSTS = [0.5, 1.0, 0.25, 0.25, 0.25, 0.0]
BY_HAND = [(0.5, 0.25, 0.5, 0.0, 0.75), (0.75, 1.0, 1.0, 0.25, 2.25), (0.5, 1.0, 0.5, 0.0, 1.5),
           (0.375, 1.0, 0.25, 0.0, 1.25), (0.3125, 1.0, 0.125, 0.0, 1.125), (0.15625, 0.75, -0.1875, 0.0, 0.5625)]


def test_a_step_response_term_by_term_by_hand():
    state, path = PidState(integral=0.0), []
    for cost, (ema, integral, p, d, price) in zip(COSTS, BY_HAND):
        lam, state = pid_step(state, cost, D, GAINS)
        assert (state.ema, state.integral, state.p, state.d, lam) == (ema, integral, p, d, price)
        path.append(lam)
    # The integral price (kp = kd = 0) on the same costs: 0.25, 1.0, 1.0, 1.0, 1.0, 0.75 -- it pays a third of the
    # PID's price at the first step over budget, and only a quarter less at the step the cost drops below.
    state, integral = PidState(0.0), []
    for cost in COSTS:
        lam, state = pid_step(state, cost, D, PidGains(0.0, 1.0, 0.0, 0.5, 2, 10.0))
        integral.append(lam)
    assert integral == [0.25, 1.0, 1.0, 1.0, 1.0, 0.75]
    assert path == [0.75, 2.25, 1.5, 1.25, 1.125, 0.5625]


def test_no_rollout_scored_leaves_the_controller_where_it_was():
    lam, state = pid_step(PidState(integral=0.0), 0.5, D, GAINS)
    again, same = pid_step(state, math.nan, D, GAINS)
    assert again == lam == 0.75 and same == state


def test_the_price_is_never_below_0_nor_above_the_cap():
    # By hand, cap 1, d = 1/4, kp 2, ki 1, EMA weight 1/2, costs 1, 1, then 0s:
    #   J = 1: c_bar 1, I 0.75, P 1.5: 2.25 -> 1 (the cap)   J = 1: c_bar 1, I 1.5 -> 1 (capped: no wind-up), P 1.5 -> 1
    #   J = 0: c_bar 0.5, I 0.75, P 0.5: 1.25 -> 1           J = 0: c_bar 0.25, I 0.5, P 0: 0.5
    #   J = 0: c_bar 0.125, I 0.25, P -0.25: 0               J = 0: c_bar 0.0625, I 0, P -0.375: 0, not below
    # (Had I wound up to 1.5, the third step would pay 1 and the fourth 1.0, not 0.5.)
    capped = PidGains(kp=2.0, ki=1.0, kd=0.0, ema=0.5, delay=1, cap=1.0)
    state, prices, integrals = PidState(integral=0.0), [], []
    for cost in [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]:
        lam, state = pid_step(state, cost, D, capped)
        prices.append(lam)
        integrals.append(state.integral)
    assert prices == [1.0, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert integrals == [0.75, 1.0, 0.75, 0.5, 0.25, 0.0] and state.p == -0.375
    # Any costs, any gains: 0 <= lambda <= cap and 0 <= I <= cap at every step.
    rng = random.Random(0)
    for _ in range(200):
        gains = PidGains(rng.uniform(0, 50), rng.uniform(0, 5), rng.uniform(0, 50), rng.uniform(0, 0.99),
                         rng.randint(1, 12), rng.uniform(0.1, 10))
        state, budget = PidState(integral=rng.uniform(0, gains.cap)), rng.uniform(0.01, 0.5)
        for _ in range(60):
            lam, state = pid_step(state, rng.choice([0.0, 1.0, rng.random(), math.nan]), budget, gains)
            assert 0.0 <= lam <= gains.cap and 0.0 <= state.integral <= gains.cap


def test_kp_and_kd_zero_is_the_integral_price_bit_for_bit():
    # dual_step (the integral price) and pid_step with kp = kd = 0 and ki = lambda_lr, on 300 random steps (costs on
    # a 64-rollout grid, NaNs, the caps hit): the same float64 at every step.
    rng = random.Random(1)
    for lr, budget, cap in [(0.1, 0.05, 10.0), (0.1, 0.1, 10.0), (0.7, 0.03, 0.4)]:
        gains = PidGains(kp=0.0, ki=lr, kd=0.0, ema=0.9, delay=10, cap=cap)
        lam, state = torch.tensor([0.0], dtype=torch.float64), PidState(integral=0.0)
        for _ in range(300):
            cost = rng.choice([rng.randint(0, 64) / 64, rng.randint(0, 8) / 64, math.nan])
            lam = dual_step(lam, torch.tensor([cost], dtype=torch.float64), torch.tensor([budget], dtype=torch.float64),
                            torch.tensor([lr], dtype=torch.float64), torch.tensor([cap], dtype=torch.float64))
            price, state = pid_step(state, cost, budget, gains)
            assert price == lam.item()


def test_the_integral_kind_is_the_old_formula_bit_for_bit():
    # enforce: budget with no price settings (kind integral, lambda_lr 0.1, d 0.05) through the RewardSet, against the
    # formula written out in plain floats: lambda <- min(10, max(0, lambda + 0.1 * (cost - 0.05))).
    reward_set = RewardSet([ChannelSpec("correctness", None, 1.0),
                            ChannelSpec("safety", None, 1.0, enforce="budget", kind="constraint", budget=0.05)])
    rng, lam = random.Random(2), 0.0
    for _ in range(300):
        violations = rng.randint(0, 20)
        values = torch.tensor([[1.0, -1.0]] * violations + [[1.0, 0.0]] * (64 - violations))
        metrics = reward_set.update_prices(values)
        assert metrics["constraint/safety/lambda"] == lam == metrics["constraint/safety/price_i"]
        assert metrics["constraint/safety/price_p"] == metrics["constraint/safety/price_d"] == 0.0
        lam = min(10.0, max(0.0, lam + 0.1 * ((0.0 - (-violations) / 64) - 0.05)))
        assert reward_set.prices["safety"] == lam
    assert not reward_set.controllers


def pid_set(gains: PidGains = GAINS, budget: float = D) -> RewardSet:
    return RewardSet([ChannelSpec("correctness", None, 1.0),
                      ChannelSpec("safety", None, 1.0, enforce="budget", kind="constraint", budget=budget, pid=gains)])


def test_the_reward_set_logs_the_terms_of_the_price_each_step_paid():
    # The costs of the step response as 8 rollouts each (4, 8, 2, 2, 2, 0 violations): each step logs the price it
    # paid and that price's terms, i.e. the previous row of BY_HAND (the first step: lambda_init 0, all terms 0).
    reward_set, paid = pid_set(), [(0.0, 0.0, 0.0, 0.0)]
    paid += [(price, p, integral, d) for _, integral, p, d, price in BY_HAND]
    for cost, (price, p, integral, d) in zip(COSTS, paid):
        violations = int(cost * 8)
        metrics = reward_set.update_prices(torch.tensor([[1.0, -1.0]] * violations + [[1.0, 0.0]] * (8 - violations)))
        assert [metrics[f"constraint/safety/{k}"] for k in ("lambda", "price_p", "price_i", "price_d", "cost")] == \
            [price, p, integral, d, cost]
    assert reward_set.prices == {"safety": 0.5625} and reward_set.weights.tolist() == [1.0, 0.5625]


def safety_spec(cfg) -> ChannelSpec:
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    return reward_set.specs[reward_set.names.index("safety")]


def test_gains_are_relative_to_the_budget(make_cfg):
    # kp 0.5, ki 0.01, kd 0.25 relative: at d = 0.25 per unit of cost 2, 0.04, 1 (each / d); at d = 0.5 half that.
    assert absolute_gains(0.5, 0.01, 0.25, 0.25) == (2.0, 0.04, 1.0)
    for budget, expected in [(0.25, (2.0, 0.04, 1.0)), (0.5, (1.0, 0.02, 0.5))]:
        cfg = make_cfg("algo=gdpo", *PID, f"{SAFETY}.budget={budget}", f"{SAFETY}.price.kp=0.5",
                       f"{SAFETY}.price.ki=0.01", f"{SAFETY}.price.kd=0.25", f"{SAFETY}.price.ema=0.75")
        spec = safety_spec(cfg)
        assert (spec.pid.kp, spec.pid.ki, spec.pid.kd, spec.pid.ema, spec.pid.delay, spec.pid.cap) == \
            (*expected, 0.75, PID_DEFAULTS["delay"], 10.0)
    # Unset keys take PID_DEFAULTS; the integral kind (the default) builds no controller.
    cfg = make_cfg("algo=gdpo", *PID, f"{SAFETY}.budget=0.25")
    spec = safety_spec(cfg)
    assert spec.pid == PidGains(PID_DEFAULTS["kp"] / 0.25, PID_DEFAULTS["ki"] / 0.25, PID_DEFAULTS["kd"] / 0.25,
                                PID_DEFAULTS["ema"], PID_DEFAULTS["delay"], 10.0)
    cfg = make_cfg("algo=gdpo", PID[0], f"{SAFETY}.budget=0.25")
    assert safety_spec(cfg).pid is None


def test_kp_and_kd_zero_through_the_config_is_the_integral_run_at_a_binary_budget(make_cfg):
    # ki relative = lambda_lr * d: at d = 1/4 the division by d is exact, so the pid price is the integral price.
    costs = [rng_cost / 64 for rng_cost in random.Random(3).choices(range(0, 40), k=100)]
    sets = []
    for extra in [[], [f"{SAFETY}.price.kind=pid", f"{SAFETY}.price.kp=0", f"{SAFETY}.price.kd=0",
                       f"{SAFETY}.price.ki=0.025"]]:
        cfg = make_cfg("algo=gdpo", PID[0], f"{SAFETY}.budget=0.25", *extra)
        sets.append(build_reward_set(cfg.rewards, cfg.algo))
    k = sets[0].names.index("safety")
    for cost in costs:
        values = torch.zeros(64, len(sets[0].names))
        values[: int(cost * 64), k] = -1.0
        assert sets[0].update_prices(values)["constraint/safety/lambda"] == \
            sets[1].update_prices(values)["constraint/safety/lambda"]
    assert sets[0].prices == sets[1].prices and sets[0].prices["safety"] > 0


@pytest.mark.parametrize("overrides, named", [
    ([PID[0], f"{SAFETY}.budget=0.05", f"{SAFETY}.price.kp=1"], ["price.kp", "price.kind=pid"]),
    ([*PID, f"{SAFETY}.budget=0"], ["price.kind=pid needs", "budget > 0"]),
    ([*PID, f"{SAFETY}.budget=0.05", f"{SAFETY}.price.ema=1"], ["price.ema=1", "< 1"]),
    ([*PID, f"{SAFETY}.budget=0.05", f"{SAFETY}.price.kd=-0.5"], ["price.kd=-0.5", ">= 0"]),
    ([*PID, f"{SAFETY}.budget=0.05", f"{SAFETY}.price.delay=0"], ["price.delay=0", ">= 1"]),
    ([f"{SAFETY}.price.kind=pid"], ["price prices a budget", "enforce=budget"]),
])
def test_bad_price_settings_fail_in_one_line_naming_the_key(overrides, named):
    assert_one_line_validation_error(["algo=gdpo", *overrides], named)


def test_the_controller_is_checkpointed_and_restored_exactly_on_resume(make_cfg, tmp_path):
    # Strong gains on a small budget, so that every term moves and none is a round number: a lost EMA, history or
    # integral term would change the price of steps 3-4.
    overrides = ["algo=gdpo", *PID, f"{SAFETY}.budget=0.0625", f"{SAFETY}.price.kp=0.5", f"{SAFETY}.price.ki=0.3",
                 f"{SAFETY}.price.kd=0.7", f"{SAFETY}.price.ema=0.6", f"{SAFETY}.price.delay=2",
                 "trainer.max_steps=4", "trainer.save_every=2"]
    train(make_cfg(*overrides), tmp_path / "full")
    keys = [f"constraint/safety/{k}" for k in ("lambda", "cost", "price_p", "price_i", "price_d")]
    full = [[r[k] for k in keys] for r in read_metrics(tmp_path / "full" / METRICS_FILE)]
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert saved["prices"] == {"safety": full[2][0]}  # the price step 3 pays, and its terms: P + I + D
    terms = saved["controllers"]["safety"]
    assert (terms["p"], terms["integral"], terms["d"]) == tuple(full[2][2:])
    assert full[2][0] == pytest.approx(max(0.0, sum(full[2][2:])))
    assert len(terms["history"]) == 2 and terms["ema"] == terms["history"][-1]

    train(make_cfg(*overrides[:-2], "trainer.max_steps=2", "trainer.save_every=2"), tmp_path / "stopped")
    train(make_cfg(*overrides, f"trainer.resume={tmp_path / 'stopped'}"), tmp_path / "resumed")
    resumed = [[r[k] for k in keys] for r in read_metrics(tmp_path / "resumed" / METRICS_FILE)]
    assert resumed == full
    assert all(row[2] != 0 for row in full[1:])  # P moved at every step after the first
