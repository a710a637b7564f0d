"""Unit tests for the agent_triple task, its reward channels and mrl/rewards/channels.py.

Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import compose_config
from omegaconf import OmegaConf
from torch.testing import assert_close

from mrl.config import RewardsConfig, UserError
from mrl.episode import Episode, Prompt
from mrl.rewards.agent_triple import Correctness, Efficiency, Safety
from mrl.rewards.channels import ChannelSpec, OverlongPenalty, RewardError, RewardSet, build_reward_set
from mrl.tasks.agent_triple import AgentTriple, read_answer

MAX_37 = Prompt("max 3 7 =", {"op": "max", "digits": [3, 7], "target": 7})


def episode(completion: str, num_tokens: int | None = None, truncated: bool = False, max_new_tokens: int = 8,
            prompt: Prompt = MAX_37) -> Episode:
    """An episode of `completion`; by default it ended with <eos>: num_tokens = words + 1."""
    if num_tokens is None:
        num_tokens = len(completion.split()) + (0 if truncated else 1)
    return Episode(prompt=prompt, completion=completion, completion_ids=[], num_tokens=num_tokens,
                   truncated=truncated, max_new_tokens=max_new_tokens)


def my_channel(episode: Episode) -> float:
    """A user-defined channel (a plain function, built with `_partial_: true`): minus the number of words."""
    return -float(len(episode.words))


# --------------------------------------------------------------------------------------------- the task


def test_same_index_same_prompt():
    a, b = AgentTriple(seed=3), AgentTriple(seed=3)
    for i in range(20):
        assert a.prompt(i) == b.prompt(i)
    # and the stream is not constant
    assert len({a.prompt(i).text for i in range(20)}) > 1


def test_different_seeds_differ():
    s0 = [AgentTriple(seed=0).prompt(i).text for i in range(20)]
    s1 = [AgentTriple(seed=1).prompt(i).text for i in range(20)]
    assert s0 != s1


@pytest.mark.parametrize("ops", [("max",), ("min",), ("max", "min")])
def test_target_is_op_of_digits_in_text(ops):
    task = AgentTriple(seed=0, ops=ops, num_digits=3, low=2, high=6)
    seen_ops = set()
    for i in range(40):
        p = task.prompt(i)
        words = p.text.split()
        op, digits = words[0], [int(w) for w in words[1:-1]]
        assert words[-1] == "="
        assert op in ops and op == p.meta["op"]
        assert len(digits) == 3 and all(2 <= d <= 6 for d in digits)
        assert digits == p.meta["digits"]
        assert p.meta["target"] == (max(digits) if op == "max" else min(digits))
        seen_ops.add(op)
    assert seen_ops == set(ops)


@pytest.mark.parametrize(
    "kwargs",
    [{"ops": ("avg",)}, {"ops": ()}, {"ops": ("max", "sum")}, {"low": 5, "high": 5}, {"low": 6, "high": 2},
     {"low": -1}, {"high": 10}],
)
def test_bad_task_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        AgentTriple(**kwargs)


# --------------------------------------------------------------------------------------------- the channels


def test_read_answer():
    assert read_answer(["7"]) == ("7", False)
    assert read_answer(["7", "w3"]) == ("7", False)
    assert read_answer(["hack"]) == (None, True)
    assert read_answer(["hack", "7"]) == (None, True)
    assert read_answer(["w3", "7"]) == (None, False)  # filler first: no answer
    assert read_answer(["77"]) == (None, False)  # not one digit
    assert read_answer(["7", "hack"]) == ("7", False)
    assert read_answer([]) == (None, False)


# (completion, num_tokens, truncated, correctness, efficiency, safety) on `max 3 7 =`, max_new_tokens=8
CASES = [
    ("7", 2, False, 1.0, -2.0, 0.0),  # right answer + eos: 2 tokens
    ("3", 2, False, 0.0, -2.0, 0.0),  # wrong answer: still answered, pays its 2 tokens
    ("7 w3 w9", 4, False, 1.0, -4.0, 0.0),  # rambling after the answer costs tokens
    ("w5 7", 3, False, 0.0, -8.0, 0.0),  # filler first: no answer -> whole budget
    ("hack", 2, False, 1.0, -2.0, -1.0),  # the shortcut fools the grader, safety catches it
    ("7 hack", 3, False, 1.0, -3.0, -1.0),  # honest answer but the forbidden word appears
    ("3 hack", 3, False, 0.0, -3.0, -1.0),
    ("", 1, False, 0.0, -8.0, 0.0),  # empty: only <eos>, no answer
    ("w1 w2 w3 w4 w5 w6 w7 w8", 8, True, 0.0, -8.0, 0.0),  # truncated, no answer: -max_new_tokens
    ("7 w2 w3 w4 w5 w6 w7 w8", 8, True, 1.0, -8.0, 0.0),  # truncated but answered: -num_tokens
]


@pytest.mark.parametrize("completion,num_tokens,truncated,correct,eff,safe", CASES)
def test_channels_by_hand(completion, num_tokens, truncated, correct, eff, safe):
    ep = episode(completion, num_tokens, truncated)
    assert Correctness()(ep) == correct
    assert Efficiency()(ep) == eff
    assert Safety()(ep) == safe


def test_efficiency_uses_num_tokens_when_answered_and_budget_when_not():
    # Distinguish the two branches with num_tokens != max_new_tokens.
    assert Efficiency()(episode("7 w1 w2 w3 w4", num_tokens=5, truncated=True, max_new_tokens=5)) == -5.0
    assert Efficiency()(episode("7", num_tokens=2, max_new_tokens=20)) == -2.0
    assert Efficiency()(episode("w1", num_tokens=2, max_new_tokens=20)) == -20.0
    assert Efficiency()(episode("hack", num_tokens=2, max_new_tokens=20)) == -2.0


def test_correctness_uses_prompt_target():
    p = Prompt("min 3 7 =", {"op": "min", "digits": [3, 7], "target": 3})
    assert Correctness()(episode("3", prompt=p)) == 1.0
    assert Correctness()(episode("7", prompt=p)) == 0.0
    assert Correctness()(episode("hack", prompt=p)) == 1.0


def test_overlong_penalty():
    pen = OverlongPenalty(buffer=4, penalty=1.0)
    # docstring: max_new_tokens=8, buffer=4 -> 0 up to 4 tokens, then linear to -1 at 8
    assert pen(episode("a", num_tokens=3)) == 0.0
    assert pen(episode("a", num_tokens=4)) == 0.0
    assert pen(episode("a", num_tokens=5)) == -0.25
    assert pen(episode("a", num_tokens=6)) == -0.5
    assert pen(episode("a", num_tokens=8)) == -1.0
    assert pen(episode("a", num_tokens=8, truncated=True)) == -1.0
    assert pen(episode("a", num_tokens=2, truncated=True)) == -1.0  # truncated: always the full penalty
    # penalty 2, buffer 4: 7 tokens are 3 over -> -2 * 3/4
    assert OverlongPenalty(buffer=4, penalty=2.0)(episode("a", num_tokens=7)) == -1.5
    assert OverlongPenalty(buffer=4, penalty=2.0)(episode("a", truncated=True)) == -2.0


# --------------------------------------------------------------------------------------------- RewardSet.score


def agent_specs(**extra) -> list[ChannelSpec]:
    return [ChannelSpec("correctness", Correctness(), 1.0), ChannelSpec("efficiency", Efficiency(), 1.0),
            ChannelSpec("safety", Safety(), 1.0, **extra)]


def test_score_shape_and_channel_order():
    eps = [episode("7"), episode("w5 7"), episode("hack")]
    rewards = RewardSet(agent_specs()).score(eps)[0]
    assert rewards.shape == (3, 3)
    assert_close(rewards, torch.tensor([[1.0, -2.0, 0.0], [0.0, -8.0, 0.0], [1.0, -2.0, -1.0]]))
    # reversed channel order -> reversed columns
    rev = RewardSet(list(reversed(agent_specs()))).score(eps)[0]
    assert_close(rev, rewards.flip(1))


def test_score_accepts_int_and_leaves_fn_none_at_zero():
    rs = RewardSet([ChannelSpec("one", lambda e: 1, 1.0), ChannelSpec("kl_penalty", None, 1.0)])
    assert_close(rs.score([episode("7"), episode("3")])[0], torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def test_score_channel_that_raises_names_channel_and_sample():
    def boom(ep):
        if ep.completion == "3":
            raise KeyError("target")
        return 0.0

    rs = RewardSet([ChannelSpec("correctness", Correctness(), 1.0), ChannelSpec("boom", boom, 1.0)])
    with pytest.raises(RewardError) as info:
        rs.score([episode("7"), episode("7"), episode("3")])
    msg = str(info.value)
    assert "'boom'" in msg and "sample 2" in msg and "KeyError" in msg
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0", True, False, [1.0]])
def test_score_non_finite_or_non_number_is_an_error(bad):
    rs = RewardSet([ChannelSpec("ok", lambda e: 0.5, 1.0),
                    ChannelSpec("weird", lambda e: bad if e.completion == "3" else 0.0, 1.0)])
    with pytest.raises(RewardError, match=r"'weird'.*sample 1"):
        rs.score([episode("7"), episode("3")])


# --------------------------------------------------------------------------------------------- RewardSet.shape


def hand_batch() -> torch.Tensor:
    """[B=1, G=4, K=3] channels (correctness, efficiency, safety).

    g0: right, short         c=1 e=-2 s=0
    g1: no answer            c=0 e=-8 s=0
    g2: hack                 c=1 e=-3 s=-1
    g3: wrong                c=0 e=-5 s=0
    batch-wise worst per channel: c 0, e -8, s -1.
    """
    return torch.tensor([[[1.0, -2.0, 0.0], [0.0, -8.0, 0.0], [1.0, -3.0, -1.0], [0.0, -5.0, 0.0]]])


def specs(cond: bool = False, enforce: str | None = None) -> RewardSet:
    return RewardSet([
        ChannelSpec("correctness", None, 1.0),
        ChannelSpec("efficiency", None, 1.0, condition_on="correctness" if cond else None, threshold=1.0),
        ChannelSpec("safety", None, 1.0, enforce=enforce, violation_below=0.0),
    ])


def test_shape_nothing_to_do_is_identity():
    r = hand_batch()
    shaped, keep, stats = specs().shape(r)
    assert_close(shaped, r)
    assert keep.all() and keep.shape == (1, 4)
    assert stats == {}


def test_shape_condition():
    r = hand_batch()
    shaped, keep, stats = specs(cond=True).shape(r)
    # g1, g3 fail correctness >= 1: their efficiency becomes the batch minimum -8 (g3: -5 -> -8)
    expected = r.clone()
    expected[0, :, 1] = torch.tensor([-2.0, -8.0, -3.0, -8.0])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"condition/efficiency/gated_frac": 0.5}
    assert_close(r, hand_batch())  # the input is not modified


def test_shape_condition_threshold():
    # threshold 0.5 on a channel with values {0, 0.5, 1, 0.2}: gated where < 0.5 -> rows 0 and 3
    r = torch.tensor([[[0.0, 3.0], [0.5, 2.0], [1.0, 5.0], [0.2, 4.0]]])
    rs = RewardSet([ChannelSpec("a", None, 1.0), ChannelSpec("b", None, 1.0, condition_on="a", threshold=0.5)])
    shaped, _, stats = rs.shape(r)
    assert_close(shaped[0, :, 1], torch.tensor([2.0, 2.0, 5.0, 2.0]))
    assert stats["condition/b/gated_frac"] == 0.5


def test_shape_veto():
    r = hand_batch()
    shaped, keep, stats = specs(enforce="veto").shape(r)
    # g2 violates (safety -1 < 0): gets the worst of every channel (0, -8, -1)
    expected = r.clone()
    expected[0, 2] = torch.tensor([0.0, -8.0, -1.0])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"constraint/safety/veto_frac": 0.25}


def test_shape_condition_and_veto():
    shaped, keep, stats = specs(cond=True, enforce="veto").shape(hand_batch())
    expected = torch.tensor([[[1.0, -2.0, 0.0], [0.0, -8.0, 0.0], [0.0, -8.0, -1.0], [0.0, -8.0, 0.0]]])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"condition/efficiency/gated_frac": 0.5, "constraint/safety/veto_frac": 0.25}


def test_shape_drop():
    r = hand_batch()
    shaped, keep, stats = specs(enforce="drop").shape(r)
    assert_close(shaped, r)
    assert keep.tolist() == [[True, True, False, True]]
    assert stats == {"constraint/safety/drop_frac": 0.25}


def test_shape_veto_multi_group_uses_batch_worst():
    # B=2, G=2, K=2 (score, guard). Batch-wise worst: score -4 (group 1), guard -2.
    r = torch.tensor([[[1.0, 0.0], [2.0, -1.0]], [[-4.0, 0.0], [3.0, -2.0]]])
    rs = RewardSet([ChannelSpec("score", None, 1.0), ChannelSpec("guard", None, 1.0, enforce="veto")])
    shaped, keep, stats = rs.shape(r)
    assert keep.all()
    assert_close(shaped, torch.tensor([[[1.0, 0.0], [-4.0, -2.0]], [[-4.0, 0.0], [-4.0, -2.0]]]))
    assert stats == {"constraint/guard/veto_frac": 0.5}


def test_weights_zero_for_enforced():
    assert_close(specs(enforce="veto").weights, torch.tensor([1.0, 1.0, 0.0]))
    assert_close(specs().weights, torch.tensor([1.0, 1.0, 1.0]))


def test_condition_on_missing_channel_direct():
    with pytest.raises(UserError, match="nope"):
        RewardSet([ChannelSpec("a", None, 1.0, condition_on="nope")])


# --------------------------------------------------------------------------------------------- build_reward_set


def build(*overrides: str) -> RewardSet:
    cfg = compose_config(*overrides)
    return build_reward_set(cfg.rewards, cfg.algo)


def test_build_default():
    rs = build("algo=grpo")
    assert rs.names == ["correctness", "efficiency", "safety"]
    assert [type(s.fn) for s in rs.specs] == [Correctness, Efficiency, Safety]
    assert all(s.condition_on is None and s.enforce is None for s in rs.specs)
    assert_close(rs.weights, torch.tensor([1.0, 1.0, 1.0]))
    # The default run (algo=gdpo_conditioned) has the same channels.
    assert build().names == ["correctness", "efficiency", "safety"]


def test_build_dapo_adds_overlong():
    rs = build("algo=dapo")
    assert rs.names == ["correctness", "efficiency", "safety", "overlong"]
    overlong = rs.specs[-1].fn
    assert isinstance(overlong, OverlongPenalty) and overlong.buffer == 2 and overlong.penalty == 1.0


def test_build_kl_reward_adds_kl_penalty():
    rs = build("algo=grpo", "algo.kl_coef=0.1", "algo.kl_mode=reward")
    assert rs.names == ["correctness", "efficiency", "safety", "kl_penalty"]
    assert rs.specs[-1].fn is None
    assert "kl_penalty" not in build("algo=grpo", "algo.kl_coef=0.1").names  # kl_mode=loss: no channel


def test_build_gdpo_conditioned():
    rs = build("algo=gdpo_conditioned")
    eff, safety = rs.specs[1], rs.specs[2]
    assert eff.condition_on == "correctness" and eff.threshold == 1.0
    assert safety.enforce == "veto" and safety.violation_below == 0.0
    assert_close(rs.weights, torch.tensor([1.0, 1.0, 0.0]))


def test_build_weights_override():
    rs = build("algo=grpo", "algo.weights={correctness:2,efficiency:0.1,safety:3}")
    assert_close(rs.weights, torch.tensor([2.0, 0.1, 3.0]))


def test_build_weights_mismatch_is_user_error():
    with pytest.raises(UserError) as info:
        build("algo=grpo", "algo.weights={correctness:1}")
    msg = str(info.value)
    assert "['correctness']" in msg and "['correctness', 'efficiency', 'safety']" in msg


def test_build_enforce_on_reward_kind_is_user_error():
    with pytest.raises(UserError, match=r"correctness\.enforce.*constraint"):
        build("algo=grpo", "rewards.channels.correctness.enforce=veto")


def test_build_condition_on_missing_is_user_error():
    with pytest.raises(UserError, match=r"efficiency\.condition_on='nope'"):
        build("rewards.channels.efficiency.condition_on=nope")


def test_user_channel_by_target_override():
    # Replace an existing channel's fn by a plain function through `_target_` + `_partial_: true`.
    rs = build("algo=grpo", "rewards.channels.efficiency.fn._target_=test_rewards.my_channel",
               "+rewards.channels.efficiency.fn._partial_=true")
    assert rs.names == ["correctness", "efficiency", "safety"]
    assert_close(rs.score([episode("7 w1 w2"), episode("")])[0], torch.tensor([[1.0, -3.0, 0.0], [0.0, -0.0, 0.0]]))


def test_user_channel_new_by_hand_config():
    rewards = OmegaConf.merge(OmegaConf.structured(RewardsConfig), {
        "name": "mine",
        "task": {"_target_": "mrl.tasks.agent_triple.AgentTriple"},
        "channels": {
            "correctness": {"fn": {"_target_": "mrl.rewards.agent_triple.Correctness"}},
            "short": {"fn": {"_target_": f"{__name__}.my_channel", "_partial_": True}, "weight": 0.5},
        },
    })
    algo = compose_config("algo=grpo").algo
    rs = build_reward_set(rewards, algo)
    assert rs.names == ["correctness", "short"]
    assert_close(rs.weights, torch.tensor([1.0, 0.5]))
    assert_close(rs.score([episode("7 w1"), episode("w1 w2 w3")])[0], torch.tensor([[1.0, -2.0], [0.0, -3.0]]))


def test_no_channels_is_user_error():
    rewards = OmegaConf.merge(OmegaConf.structured(RewardsConfig), {"name": "empty", "task": {}})
    with pytest.raises(UserError, match=re.escape("rewards=empty defines no channels")):
        build_reward_set(rewards, compose_config("algo=grpo").algo)


def test_score_none_abstains_as_nan():
    rs = RewardSet([ChannelSpec("ok", lambda e: 0.5, 1.0),
                    ChannelSpec("picky", lambda e: None if e.completion == "3" else 1.0, 1.0)])
    rewards, failed = rs.score([episode("7"), episode("3")])
    assert rewards[0].tolist() == [0.5, 1.0] and rewards[1, 0] == 0.5 and math.isnan(rewards[1, 1])
    assert not failed.any()


def test_score_on_error_drop_marks_the_sample_and_keeps_going():
    rs = RewardSet([ChannelSpec("ok", lambda e: 0.5, 1.0),
                    ChannelSpec("boom", lambda e: 1 / 0 if e.completion == "3" else 1.0, 1.0)])
    rewards, failed = rs.score([episode("7"), episode("3")], on_error="drop")
    assert failed.tolist() == [False, True]
    assert rewards[0].tolist() == [0.5, 1.0] and torch.isnan(rewards[1]).all()


def test_batched_channel_is_called_once_per_batch():
    calls = []

    class Lengths:
        batched = True

        def __call__(self, episodes):
            calls.append(len(episodes))
            return [float(len(e.words)) for e in episodes]

    rewards, _ = RewardSet([ChannelSpec("len", Lengths(), 1.0)]).score([episode("7 w1"), episode("3")])
    assert calls == [2] and rewards[:, 0].tolist() == [2.0, 1.0]
