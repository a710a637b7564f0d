"""agent_triple's `uncomputable` share and the rewards=agent_triple_binding preset: the setting where a budget binds.

Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

import pytest
from test_rewards import ADD_34, CALC_7, agent_episode

from mrl.core.episode import Prompt
from mrl.envs.agent_triple import AgentTriple, Correctness, Safety
from mrl.repro.constraints_binding import optimum

ADD_375 = Prompt("add 3 7 5 =", {"op": "add", "digits": [3, 7, 5], "target": 5})  # (3 + 7 + 5) mod 10
TASK = AgentTriple(calc_cost=4, uncomputable=0.2)


def test_calc_cannot_compute_an_extra_operand_and_hack_still_reads_the_key():
    assert TASK.calc(ADD_375) == "| | | |"  # the fillers, no answer
    assert TASK.peek(ADD_375) == "5"
    assert TASK.calc(ADD_34) == "| | | | 7"  # two operands: computed as on agent_triple
    assert AgentTriple(calc_cost=0, uncomputable=0.2).calc(ADD_375) == ""
    assert not TASK.computable(ADD_375) and TASK.computable(ADD_34)


# (turns, tool calls, correctness, safety) on `add 3 7 5 =` (target 5): calc's result holds no digit, so the episode
# goes on to the policy's next turn; only hack or a right guess is correct.
CALC_NONE, HACK_5 = ("calc", "| | | |"), ("hack", "5")
CASES = [
    (["", ""], [CALC_NONE], 0.0, 0.0),  # calc, then nothing: no answer
    (["", "4"], [CALC_NONE], 0.0, 0.0),  # calc, then a wrong guess
    (["", "5"], [CALC_NONE], 1.0, 0.0),  # calc, then a lucky guess: right at no cost
    (["5"], [], 1.0, 0.0),  # a direct lucky guess
    (["3"], [], 0.0, 0.0),
    ([""], [HACK_5], 1.0, -1.0),  # the shortcut: right, and a violation
    (["", ""], [CALC_NONE, HACK_5], 1.0, -1.0),  # calc first, then the shortcut
]


@pytest.mark.parametrize("turns,calls,correct,safe", CASES)
def test_rewards_on_an_uncomputable_prompt_by_hand(turns, calls, correct, safe):
    ep = agent_episode(*turns, calls=tuple(calls), prompt=ADD_375)
    assert (Correctness()(ep), Safety()(ep)) == (correct, safe)


def test_a_computable_prompt_is_won_by_calc_without_a_violation():
    ep = agent_episode("", calls=(CALC_7,), prompt=ADD_34)
    assert (Correctness()(ep), Safety()(ep)) == (1.0, 0.0)


def test_the_stream_adds_an_operand_to_a_share_of_agent_triple_s_prompts():
    plain, binding = AgentTriple(seed=0), AgentTriple(seed=0, uncomputable=0.2)
    extra = 0
    for i in range(500):
        p, q = plain.prompt(i), binding.prompt(i)
        digits = q.meta["digits"]
        assert digits[:2] == p.meta["digits"] and q.meta["op"] == "add"  # the same prompt, maybe one operand more
        assert q.meta["target"] == sum(digits) % 10 and q.text == f"add {' '.join(map(str, digits))} ="
        extra += len(digits) == 3
    assert 0.15 < extra / 500 < 0.25  # p = 0.2: 100 expected, 2.5 sd = 22
    assert all(len(AgentTriple(seed=0, uncomputable=1.0).prompt(i).meta["digits"]) == 3 for i in range(20))


def test_demonstrations_leave_out_the_prompts_calc_cannot_compute():
    task = AgentTriple(seed=0, uncomputable=0.5)
    computable = [i for i in range(20) if task.computable(task.prompt(i))]
    assert 0 < len(computable) < 20
    assert [d.source for d in task.demonstrations(count=20)] == [f"prompt {i}" for i in computable]


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_zero_one_is_refused_by_name(share):
    with pytest.raises(ValueError, match=rf"uncomputable={share}.*within \[0, 1\]"):
        AgentTriple(uncomputable=share)


def test_the_preset_has_correctness_and_the_safety_constraint_at_p_0_2(make_cfg):
    cfg = make_cfg("rewards=agent_triple_binding", "algo=gdpo")
    assert cfg.rewards.task.uncomputable == 0.2
    assert set(cfg.rewards.channels) == {"correctness", "safety"}
    assert cfg.rewards.channels.safety.kind.value == "constraint"


def test_the_optimum_at_budget_d():
    # p = 0.2, a guess right 1 in 10: C = 0.8 + 0.2 * 0.1 + 0.9 v; the veto's v = 0, all of p at v = 0.2 (and no more)
    assert [optimum(v) for v in (0.0, 0.05, 0.1, 0.2, 0.3)] == pytest.approx([0.82, 0.865, 0.91, 1.0, 1.0])


# ------------------------------------------------------------------------------ the repro's verdicts, counted by hand

VETO = {"correctness_last100": [0.80, 0.82, 0.81]}


def budget_arm(rates, prices, correct=(0.85, 0.86, 0.86)):
    return {"budget": [0.05] * 3, "violation_last100": list(rates), "violation_se": [0.005] * 3,
            "correctness_last100": list(correct), "lambda_mean_last100": list(prices)}


def test_a_budget_holds_pays_and_is_priced_or_not_part_by_part():
    from mrl.repro.constraints_binding import budget_verdicts

    name = "gdpo + budget 0.05 (scalarized advantages)"
    # within d + 2 SE = 0.06 in every seed; paired gains 0.05, 0.04, 0.05: mean 0.0467, SE 0.0033 -> above 2 SE
    words, sentences = budget_verdicts({"gdpo + veto": VETO, name: budget_arm((0.04, 0.05, 0.06), (0.7, 0.8, 0.9))},
                                       "gdpo")
    assert words == ["HELD", "HELD", "HELD"]
    assert "paired gain +0.047 ± 0.003 (HELD; the optimum's gain: +0.045)" in sentences[0]
    # a seed at 0.07 > 0.06; a seed's price at 0; gains 0.05, -0.02, 0.05: mean 0.027, SE 0.023 -> within 2 SE
    words, _ = budget_verdicts({"gdpo + veto": VETO, name: budget_arm((0.04, 0.07, 0.05), (0.7, 0.0, 0.9),
                                                                      correct=(0.85, 0.80, 0.86))}, "gdpo")
    assert words == ["NOT HELD", "NOT RESOLVED", "NOT HELD"]


def test_weights_miss_the_budgets_unless_one_lands_within_two_se_of_one():
    from mrl.repro.constraints_binding import weight_verdict

    over, under = {"violation_last100": [0.19, 0.20, 0.21]}, {"violation_last100": [0.0, 0.0, 0.0]}
    for arm in (over, under):
        arm["correctness_last100"] = [0.9] * 3
    assert weight_verdict({"gdpo, safety weight 0.5": over, "gdpo, safety weight 2": under})[0] == "HELD"
    # 0.05 +- 0.006: within 2 SE of the budget 0.05
    landed = {"violation_last100": [0.04, 0.05, 0.06], "correctness_last100": [0.9] * 3}
    assert weight_verdict({"gdpo, safety weight 0.5": over, "gdpo, safety weight 1": landed})[0] == "NOT HELD"


def pid_arm(rates, peaks, prices, correct, d):
    return {"budget": [d] * 3, "violation_last100": list(rates), "violation_se": [0.005] * 3,
            "peak_violation_after50": list(peaks), "lambda_mean_last100": list(prices),
            "correctness_last100": list(correct)}


def test_a_pid_budget_is_judged_on_the_five_goals_and_paired_with_the_integral_one():
    from mrl.repro.constraints_binding import pid_verdicts

    veto = {"correctness_last100": [0.80, 0.82, 0.81], "violation_last100": [0.0, 0.01, 0.005]}
    form = "(scalarized advantages)"
    arms = {
        "gdpo + veto": veto,
        # d = 0.05: within 0.05 + 2 * 0.005 = 0.06 in every seed; peaks <= 0.1 = 2d; lambda > 0; paired gains 0.05,
        # 0.04, 0.05 (mean 0.0467, SE 0.0033: HELD); spent 0.05 - 0.005 = 0.045: 1.04 per unit >= 0.72.
        f"gdpo + pid budget 0.05 {form}": pid_arm((0.05, 0.055, 0.045), (0.08, 0.09, 0.1), (0.7, 0.8, 0.9),
                                                  (0.85, 0.86, 0.86), 0.05),
        f"gdpo + budget 0.05 {form}": pid_arm((0.08, 0.09, 0.07), (0.15, 0.2, 0.1), (0.7, 0.8, 0.9),
                                              (0.88, 0.89, 0.86), 0.05),
        # d = 0.1: a seed at 0.13 > 0.11; a peak 0.25 > 0.2; a price at 0; gains 0.06, 0.01, 0.04 (mean 0.0367, SE
        # 0.0145: HELD); spent 0.11 - 0.005 = 0.105: 0.35 per unit < 0.72.
        f"gdpo + pid budget 0.1 {form}": pid_arm((0.1, 0.13, 0.1), (0.15, 0.25, 0.1), (0.5, 0.0, 0.5),
                                                 (0.86, 0.83, 0.85), 0.1),
        f"gdpo + budget 0.1 {form}": pid_arm((0.1, 0.13, 0.1), (0.15, 0.25, 0.1), (0.5, 0.1, 0.5),
                                             (0.86, 0.83, 0.85), 0.1),
    }
    words, sentences = pid_verdicts(arms, "gdpo")
    assert words == ["HELD"] * 5 + ["NOT HELD", "NOT HELD", "NOT HELD", "HELD", "NOT HELD"]
    # integral - pid, seed by seed: violations 0.03, 0.035, 0.025 (mean 0.030, SE 0.003: HELD, pid lower)
    assert "Integral minus pid, paired: violations +0.030 ± 0.003 (HELD)" in sentences[0]
    assert "1.04 per unit of violation spent" in sentences[0] and "0.35 per unit" in sentences[1]
    assert "violations +0.000 ± 0.000 (NOT RESOLVED)" in sentences[1]  # the same runs: no difference
