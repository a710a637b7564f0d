"""Constraints with a budget (enforce: budget): the price's dual step, the two scalarizations, the price as run state.
Every expected value is worked out by hand in the comments."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import assert_one_line_validation_error
from torch.testing import assert_close

from mrl.algo.advantages import (
    ESTIMATORS,
    dual_step,
    gdpo_advantages,
    gdpo_signal,
    grpo_advantages,
    grpo_signal,
    live_groups,
    mean_cost,
)
from mrl.rewards.channels import ChannelSpec, RewardSet
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

EPS = 1e-6
BUDGET = ["rewards.channels.safety.enforce=budget", "rewards.channels.safety.budget=0.05"]


def priced(lambda_init: float = 0.0, budget: float = 0.25, lambda_lr: float = 1.0) -> RewardSet:
    """correctness (a reward, weight 1) and safety (-1 per violation: its cost is the violation indicator), priced."""
    return RewardSet([ChannelSpec("correctness", None, 1.0),
                      ChannelSpec("safety", None, 1.0, enforce="budget", kind="constraint", budget=budget,
                                  lambda_lr=lambda_lr, lambda_init=lambda_init, lambda_max=10.0)])


def rollouts(violations: int, total: int = 8) -> torch.Tensor:
    """[total, 2]: every rollout correct; the first `violations` used the shortcut (safety -1)."""
    safety = [-1.0] * violations + [0.0] * (total - violations)
    return torch.tensor([[1.0, s] for s in safety])


def test_mean_cost_is_minus_the_mean_value_over_the_rollouts_that_scored():
    # safety [-1, 0, NaN, -1]: 2 violations in 3 scored -> 0.6667; a channel nobody scored -> NaN.
    r = torch.tensor([[-1.0, math.nan], [0.0, math.nan], [math.nan, math.nan], [-1.0, math.nan]])
    cost = mean_cost(r)
    assert cost[0].item() == pytest.approx(2 / 3) and math.isnan(cost[1].item())
    assert str(mean_cost(torch.zeros(3, 1)).item()) == "0.0"  # not -0.0


def test_dual_step_over_three_steps_by_hand():
    # budget 0.25, lr 1, from lambda 0 (binary fractions: exact in float64).
    lam, d = torch.zeros(1, dtype=torch.float64), torch.tensor([0.25])
    lr, cap = torch.tensor([1.0]), torch.tensor([10.0])
    lam = dual_step(lam, torch.tensor([0.375]), d, lr, cap)  # above: 0 + 1 * (0.375 - 0.25) = 0.125
    assert lam.tolist() == [0.125]
    lam = dual_step(lam, torch.tensor([0.25]), d, lr, cap)  # at: unchanged
    assert lam.tolist() == [0.125]
    lam = dual_step(lam, torch.tensor([0.0]), d, lr, cap)  # below: 0.125 - 0.25 = -0.125, clamped at 0
    assert lam.tolist() == [0.0]
    # The cap: 9.5 + 1 * (1 - 0) = 10.5 -> 10; half a step: 0 + 0.5 * (0.375 - 0.25) = 0.0625; no rollout scored: kept.
    assert dual_step(torch.tensor([9.5, 0.0, 3.0]), torch.tensor([1.0, 0.375, math.nan]),
                     torch.tensor([0.0, 0.25, 0.25]), torch.tensor([1.0, 0.5, 1.0]),
                     torch.tensor([10.0] * 3)).tolist() == [10.0, 0.0625, 3.0]


def test_reward_set_prices_three_steps_and_weights_the_constraint_by_its_price():
    reward_set = priced()
    assert reward_set.weights.tolist() == [1.0, 0.0]  # lambda_init 0: a budget not yet exceeded costs nothing
    # Step 1: 3 of 8 rollouts violate -> cost 0.375 > 0.25: the price paid was 0, the next is 0.125.
    assert reward_set.update_prices(rollouts(3)) == {"constraint/safety/lambda": 0.0, "constraint/safety/cost": 0.375,
                                                     "constraint/safety/budget": 0.25, "constraint/safety/price_p": 0.0,
                                                     "constraint/safety/price_i": 0.0, "constraint/safety/price_d": 0.0}
    assert reward_set.prices == {"safety": 0.125}
    assert reward_set.weights.tolist() == [1.0, 0.125]  # the reward keeps its weight; the cost is priced
    # Step 2: 2 of 8 -> 0.25, at the budget: unchanged.  Step 3: none -> 0.125 - 0.25 < 0: clamped at 0.
    assert reward_set.update_prices(rollouts(2))["constraint/safety/lambda"] == 0.125
    assert reward_set.prices == {"safety": 0.125}
    assert reward_set.update_prices(rollouts(0))["constraint/safety/cost"] == 0.0
    assert reward_set.prices == {"safety": 0.0}


def test_a_budget_does_not_veto_or_drop():
    reward_set = priced(lambda_init=0.5)
    r = torch.tensor([[[1.0, -1.0], [1.0, 0.0]]])  # [B=1, G=2, K=2]
    shaped, keep, stats = reward_set.shape(r)
    assert torch.equal(shaped, r) and keep.all()
    assert stats == {"constraint/safety/violation_frac": 0.5}


def hand_batch() -> torch.Tensor:
    """[B=2, G=3, K=2] (correctness, safety), float64.  Prompt 0: correctness [1, 1, 0], safety [-1, 0, 0] (the
    first rollout took the shortcut).  Prompt 1: all correct, safety [-1, 0, 0]: only the priced cost varies."""
    return torch.tensor([[[1.0, -1.0], [1.0, 0.0], [0.0, 0.0]],
                         [[1.0, -1.0], [1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)


def test_scalarized_rewards_by_hand_at_lambda_one_half():
    # GRPO's form: r = correctness - 0.5 cost = correctness + 0.5 safety, then normalized in the group.
    # Prompt 0: [0.5, 1, 0], mean 0.5, centered [0, 0.5, -0.5], std sqrt(0.5 / 2) = 0.5 -> [0, 1, -1].
    # Prompt 1: [0.5, 1, 1], mean 5/6, centered [-1/3, 1/6, 1/6], var (1/9 + 2/36) / 2 = 1/12 -> x sqrt(12).
    weights = priced(lambda_init=0.5).weights.to(torch.float64)
    std1 = math.sqrt(1 / 12)
    expected = torch.tensor([[0.0, 0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)],
                             [-1 / 3 / (std1 + EPS), 1 / 6 / (std1 + EPS), 1 / 6 / (std1 + EPS)]], dtype=torch.float64)
    assert_close(grpo_advantages(hand_batch(), weights), expected, rtol=1e-9, atol=1e-9)


def test_scalarized_advantages_by_hand_at_lambda_one_half():
    # GDPO's form: A = Z(correctness) - 0.5 Z(cost) = Z(correctness) + 0.5 Z(safety), each Z in its group.
    # Prompt 0: Z(correctness [1, 1, 0]) = [1, 1, -2] / sqrt(3) (centered [1/3, 1/3, -2/3], std sqrt(1/3));
    #   Z(safety [-1, 0, 0]) = [-2, 1, 1] / sqrt(3).  A = [1 - 1, 1 + 0.5, -2 + 0.5] / sqrt(3) = [0, 0.866, -0.866].
    # Prompt 1: Z(correctness) = 0 (constant); A = 0.5 [-2, 1, 1] / sqrt(3) = [-0.577, 0.289, 0.289].
    weights = priced(lambda_init=0.5).weights.to(torch.float64)
    s = 1 / math.sqrt(3)
    summed = torch.tensor([[0.0, 1.5 * s, -1.5 * s], [-s, 0.5 * s, 0.5 * s]], dtype=torch.float64)
    assert_close(gdpo_advantages(hand_batch(), weights, batch_norm=False), summed, rtol=0, atol=1e-5)
    # The batch normalization: mean 0; squares 0.75 + 0.75 + 1/3 + 1/12 + 1/12 = 2, std sqrt(2 / 5).
    assert_close(gdpo_advantages(hand_batch(), weights), summed / math.sqrt(0.4), rtol=0, atol=1e-5)


def test_rescaling_the_cost_leaves_scalarized_advantages_and_changes_scalarized_rewards():
    weights = priced(lambda_init=0.5).weights.to(torch.float64)
    loud = hand_batch() * torch.tensor([1.0, 4.0], dtype=torch.float64)  # a violation now costs 4
    # Equal up to eps (1e-6) against stds of ~0.5 and ~2: a change of order 1e-6
    assert_close(gdpo_advantages(loud, weights), gdpo_advantages(hand_batch(), weights), rtol=0, atol=1e-5)
    # GRPO: prompt 0's sums become [1 - 2, 1, 0] = [-1, 1, 0]: the shortcut is now worst, not tied with the mean.
    assert_close(grpo_advantages(loud, weights)[0], torch.tensor([-1.0, 1.0, 0.0], dtype=torch.float64) / (1 + EPS),
                 rtol=0, atol=1e-9)
    assert grpo_advantages(hand_batch(), weights)[0, 0] == 0.0


def test_a_group_where_only_the_priced_cost_varies_is_live_while_the_price_is_positive():
    for estimator, signal in (("gdpo", gdpo_signal), ("grpo", grpo_signal)):
        assert live_groups(hand_batch(), priced(lambda_init=0.5).weights, signal).tolist() == [True, True]
        assert live_groups(hand_batch(), priced(lambda_init=0.0).weights, signal).tolist() == [True, False]
        assert priced(lambda_init=0.5).live(hand_batch(), ESTIMATORS[estimator]).tolist() == [True, True]


@pytest.mark.parametrize("overrides, named", [
    (["rewards.channels.safety.enforce=budget"], ["safety.budget", "budget=0.05"]),
    (["rewards.channels.safety.budget=0.05"], ["needs rewards.channels.safety.enforce=budget"]),
    ([*BUDGET[:1], "rewards.channels.safety.budget=-0.1"], ["safety.budget=-0.1", ">= 0"]),
    ([*BUDGET, "rewards.channels.safety.lambda_lr=0"], ["safety.lambda_lr=0", "> 0"]),
    ([*BUDGET, "rewards.channels.safety.lambda_init=20"], ["safety.lambda_init=20", "lambda_max"]),
])
def test_bad_budget_settings_fail_in_one_line_naming_the_key(overrides, named):
    assert_one_line_validation_error(["algo=gdpo", *overrides], named)


def test_the_price_is_logged_and_restored_exactly_on_resume(make_cfg, tmp_path):
    # lambda_lr 1 and budget 0: the price rises by the violation rate at every step, so it is non-zero and no round
    # number (a lost or rounded price would show).
    overrides = ["algo=gdpo", *BUDGET[:1], "rewards.channels.safety.budget=0", "rewards.channels.safety.lambda_lr=1",
                 "trainer.max_steps=4", "trainer.save_every=2"]
    train(make_cfg(*overrides), tmp_path / "full")
    full = read_metrics(tmp_path / "full" / METRICS_FILE)
    for before, after in zip(full, full[1:]):  # lambda_{t+1} = max(0, lambda_t + 1 * (cost_t - 0))
        paid, cost = before["constraint/safety/lambda"], before["constraint/safety/cost"]
        assert after["constraint/safety/lambda"] == paid + cost
        assert before["constraint/safety/budget"] == 0.0
    assert full[2]["constraint/safety/lambda"] > 0  # what a resume from step 2 must restore (0 if it were lost)
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "state.json").read_text())["prices"]
    assert saved == {"safety": full[2]["constraint/safety/lambda"]}  # the price step 3 pays

    train(make_cfg(*overrides[:-2], "trainer.max_steps=2", "trainer.save_every=2"), tmp_path / "stopped")
    train(make_cfg(*overrides, f"trainer.resume={tmp_path / 'stopped'}"), tmp_path / "resumed")
    resumed = read_metrics(tmp_path / "resumed" / METRICS_FILE)
    assert [r["constraint/safety/lambda"] for r in resumed] == [r["constraint/safety/lambda"] for r in full]


@pytest.mark.slow  # ~1 min alone: two ranks of DeepSpeed start
def test_two_ranks_pay_the_same_price_priced_on_every_rank_s_rollouts(tmp_path):
    from test_distributed import two_rank_run

    # Each rank samples its own rollouts (its own seed): a price from a rank's own costs would differ between them.
    run_dir = two_rank_run(tmp_path, 2, 3, "algo=gdpo", *BUDGET[:1], "rewards.channels.safety.budget=0",
                           "rewards.channels.safety.lambda_lr=1", "trainer.save_every=1")
    records = read_metrics(run_dir / METRICS_FILE)
    for step, record in enumerate(records, 1):
        ranks = [json.loads((run_dir / f"state_rank{r}_step{step}.json").read_text())["prices"] for r in (0, 1)]
        assert ranks[0] == ranks[1]
        # lambda_{t+1} = lambda_t + 1 * (cost_t - 0), cost_t over the 16 rollouts of both ranks
        assert ranks[0]["safety"] == record["constraint/safety/lambda"] + record["constraint/safety/cost"]
        assert (record["constraint/safety/cost"] * 16).is_integer()
    assert ranks[0]["safety"] > 0


def test_the_report_draws_the_price_and_the_cost_against_the_budget(tmp_path):
    from mrl.runs.report import Run, make_report, priced_panels, priced_rows, report_figure

    # Steps 1-4: price 0, 0.5, 1, 1.5; cost 0.5, 0.5, 0.5, 0.0; budget 0.05.  Last 2 steps' mean cost: 0.25.
    records = [{"step": s, "reward/safety/mean": -c, "reward/total/mean": -c, "constraint/safety/lambda": lam,
                "constraint/safety/cost": c, "constraint/safety/budget": 0.05}
               for s, lam, c in [(1, 0.0, 0.5), (2, 0.5, 0.5), (3, 1.0, 0.5), (4, 1.5, 0.0)]]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    run = Run("gdpo/seed0", tmp_path, records)
    assert priced_panels([run]) == [("safety: price (lambda)", "constraint/safety/lambda", None),
                                    ("safety: cost vs budget", "constraint/safety/cost", "constraint/safety/budget")]
    assert priced_rows([run], last=2) == (["run", "safety lambda", "safety cost", "safety budget"],
                                          [["gdpo/seed0", "1.500", "0.250", "0.050"]])
    figure = report_figure([run], ["gdpo/seed0"], ["safety", "total"], [], 1, priced_panels([run]))
    budget = [t for t in figure.data if t.name == "budget 0.05"]
    assert len(budget) == 1 and list(budget[0].y) == [0.05, 0.05] and list(budget[0].x) == [1, 4]
    assert [list(t.y) for t in figure.data if t.name == "gdpo/seed0"][2] == [0.0, 0.5, 1.0, 1.5]  # the price panel
    _, table = make_report([tmp_path], smooth=1, last=2)
    assert f"| {tmp_path.name} | 1.500 | 0.250 | 0.050 |" in table  # labelled by its dir (no .hydra)
