"""mrl/algo/shaping.py: conditions (GDPO Eq. 8), violations, vetoes and drops, on values worked out by hand."""

import torch
from test_rewards import hand_batch  # [1, 4, 3]: (correctness, efficiency, safety) of 4 rollouts
from torch.testing import assert_close

from mrl.algo.shaping import condition, drop, veto, violations

NAN = float("nan")


GATED = torch.tensor([0.0, -20.0, 0.0])  # what each channel pays with its gate closed


def test_condition_pays_the_gated_value_where_the_condition_fails():
    # efficiency conditioned on correctness >= 1: g1 and g3 are wrong, so they pay -20 instead of -8 and -5
    shaped, passed = condition(hand_batch(), torch.tensor([-1, 0, -1]), torch.tensor([1.0, 1.0, 1.0]), GATED)
    assert_close(shaped, torch.tensor([[[1.0, -2.0, 0.0], [0.0, -20.0, 0.0], [1.0, -3.0, -1.0], [0.0, -20.0, 0.0]]]))
    assert passed[0, :, 1].tolist() == [True, False, True, False]
    assert passed[..., 0].all() and passed[..., 2].all()  # unconditioned channels: the gate is always open


def test_condition_is_the_paper_s_eq8():
    # GDPO Eq. 8: correctness [1, 0, 1, 0], length [1, 1, 1, 1] -> gated length [1, 0, 1, 0] (gated value 0)
    rewards = torch.tensor([[[1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]])
    shaped, _ = condition(rewards, torch.tensor([-1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert_close(shaped[0, :, 1], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert_close(shaped[0, :, 0], rewards[0, :, 0])


def test_condition_at_its_threshold_passes_and_an_abstention_closes_the_gate():
    # threshold 0.5 on a: 0.5 passes (>=), 0.4 fails, NaN (abstained) fails; b pays 7 where it passes, -1 elsewhere
    rewards = torch.tensor([[[0.5, 3.0], [0.4, 3.0], [NAN, 3.0], [0.9, 3.0]]])
    shaped, passed = condition(rewards, torch.tensor([-1, 0]), torch.tensor([0.0, 0.5]), torch.tensor([0.0, -1.0]))
    assert shaped[0, :, 1].tolist() == [3.0, -1.0, -1.0, 3.0]
    assert passed[0, :, 1].tolist() == [True, False, False, True]


def test_conditions_read_the_rewards_as_scored_so_a_chain_does_not_compound():
    # c <- b <- a: a = 0 closes b's gate (b pays 0), but c reads b's scored 5 >= 1 and keeps its 7
    rewards = torch.tensor([[[0.0, 5.0, 7.0]]])
    shaped, _ = condition(rewards, torch.tensor([-1, 0, 1]), torch.tensor([1.0, 1.0, 1.0]),
                          torch.tensor([0.0, 0.0, -3.0]))
    assert shaped.tolist() == [[[0.0, 0.0, 7.0]]]


def test_violations_are_strictly_below_and_an_abstention_is_none():
    rewards = torch.tensor([[[0.0], [-1.0], [NAN], [-0.5]]])
    assert violations(rewards, torch.tensor([0.0]))[0, :, 0].tolist() == [False, True, False, True]


def test_a_veto_gates_every_other_channel_of_a_violator_and_keeps_the_constraint_s_value():
    # g2 violates safety (-1 < 0): correctness pays 0, efficiency -20; safety keeps the -1 that shows it
    violated = violations(hand_batch(), torch.tensor([-1e9, -1e9, 0.0]))
    vetoed = veto(hand_batch(), violated, torch.tensor([False, False, True]), GATED)
    assert_close(vetoed, torch.tensor([[[1.0, -2.0, 0.0], [0.0, -8.0, 0.0], [0.0, -20.0, -1.0], [0.0, -5.0, 0.0]]]))


def test_only_a_vetoing_channel_vetoes():
    violated = violations(hand_batch(), torch.tensor([0.0, 0.0, 0.0]))  # efficiency "violates" everywhere
    assert_close(veto(hand_batch(), violated, torch.tensor([False, False, False]), GATED), hand_batch())


def test_a_drop_leaves_out_the_violators_of_its_channels_only():
    violated = violations(hand_batch(), torch.tensor([0.0, 0.0, 0.0]))  # efficiency < 0 everywhere, safety on g2
    assert drop(violated, torch.tensor([False, False, True])).tolist() == [[True, True, False, True]]
    assert drop(violated, torch.tensor([False, False, False])).tolist() == [[True, True, True, True]]
    assert drop(violated, torch.tensor([False, True, False])).tolist() == [[False, False, False, False]]
