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

from mrl.algo.advantages import ESTIMATORS
from mrl.core.config import RewardsConfig, UserError
from mrl.core.episode import Episode, Prompt, ToolCall
from mrl.envs.agent_triple import AgentTriple, Correctness, Efficiency, Safety, read_answer
from mrl.modeling.models import tiny_vocab
from mrl.rewards.channels import ChannelSpec, OverlongPenalty, RewardError, RewardSet, build_reward_set

MAX_37 = Prompt("max 3 7 =", {"op": "max", "digits": [3, 7], "target": 7})
ADD_34 = Prompt("add 3 4 =", {"op": "add", "digits": [3, 4], "target": 7})
ADD_37 = Prompt("add 3 7 =", {"op": "add", "digits": [3, 7], "target": 0})  # (3 + 7) mod 10
TASK = AgentTriple(calc_cost=4)
CALC_7 = ("calc", "| | | | 7")  # calc on ADD_34: calc_cost=4 fillers, then the target
HACK_7 = ("hack", "7")  # hack on ADD_34: the answer key
LOOKUP = ("lookup", "| |")  # a tool (not agent_triple's) whose observation holds no digit: the episode goes on
VOCAB = {w: i for i, w in enumerate(tiny_vocab(32))}


def episode(completion: str, num_tokens: int | None = None, truncated: bool = False, max_new_tokens: int = 8,
            prompt: Prompt = MAX_37) -> Episode:
    """A one-turn episode of `completion` without tools; by default it ended with <eos>: num_tokens = words + 1."""
    if num_tokens is None:
        num_tokens = len(completion.split()) + (0 if truncated else 1)
    return Episode(prompt=prompt, completion=completion, completion_ids=[], num_tokens=num_tokens,
                   truncated=truncated, max_new_tokens=max_new_tokens, turns=[completion])


def agent_episode(*turns: str, calls: tuple[tuple[str, str], ...] = (), eos: bool = False, truncated: bool = False,
                  max_new_tokens: int = 10, prompt: Prompt = ADD_34) -> Episode:
    """The Episode generate() builds for a transcript: the policy's turn i, then tool call i (name, observation).

    A turn that ends at a tool call does not hold the tool's name.  num_tokens: the policy's words, one token per
    tool name, and the <eos> when `eos`; observation_tokens: the observations' words.
    """
    assert len(turns) in (len(calls), len(calls) + 1)
    words, policy = [], 0
    for i, turn in enumerate(turns):
        words += turn.split()
        policy += len(turn.split())
        if i < len(calls):
            name, observation = calls[i]
            words += [name] + observation.split()
            policy += 1
    observed = sum(len(obs.split()) for _, obs in calls)
    assert not eos or len(turns) == len(calls) + 1  # an <eos> ends a policy turn
    return Episode(prompt=prompt, completion=" ".join(words), completion_ids=[VOCAB[w] for w in words],
                   num_tokens=policy + int(eos), truncated=truncated, max_new_tokens=max_new_tokens,
                   tool_calls=[ToolCall(name, {}, obs) for name, obs in calls], turns=list(turns),
                   observation_tokens=observed)


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


def test_default_is_add_mod_10():
    task = AgentTriple(seed=0)
    targets = []
    for i in range(40):
        p = task.prompt(i)
        words = p.text.split()
        assert words[0] == "add" and words[-1] == "=" and len(words) == 4
        a, b = int(words[1]), int(words[2])
        assert p.meta == {"op": "add", "digits": [a, b], "target": (a + b) % 10}
        targets.append(a + b)
    assert any(t >= 10 for t in targets)  # the mod matters on this stream


def test_tools_and_answer_words():
    assert set(TASK.tools) == {"calc", "hack"}
    assert TASK.answer_words == ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9")
    assert TASK.max_turns == 3 and AgentTriple(max_turns=5).max_turns == 5
    # add 3 7 = -> target 0: calc is calc_cost "|" then the answer; hack is the answer alone
    assert TASK.tools["calc"](ADD_37) == "| | | | 0"
    assert TASK.tools["hack"](ADD_37) == "0"
    assert TASK.tools["calc"](ADD_34) == CALC_7[1] and TASK.tools["hack"](ADD_34) == HACK_7[1]
    assert AgentTriple(calc_cost=1).calc(ADD_37) == "| 0"
    assert AgentTriple(calc_cost=0).calc(ADD_37) == "0"
    # the tools read the prompt's target, whatever the op
    assert AgentTriple(ops=("max",)).calc(MAX_37) == "| | | | 7"


@pytest.mark.parametrize("ops", [("max",), ("min",), ("max", "min"), ("add",), ("add", "max", "min")])
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
        expected = {"max": max(digits), "min": min(digits), "add": sum(digits) % 10}[op]
        assert p.meta["target"] == expected
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
    # the first one-digit word of the transcript, the tools' observations included
    assert read_answer(episode("7")) == "7"
    assert read_answer(episode("7 w3")) == "7"
    assert read_answer(episode("w3 7")) == "7"  # filler before the answer
    assert read_answer(episode("calc | | | | 0")) == "0"  # the tool's result
    assert read_answer(episode("4 calc | | | | 0")) == "4"  # the policy's own digit came first
    assert read_answer(episode("hack 7")) == "7"
    assert read_answer(episode("lookup | | w1 3")) == "3"
    assert read_answer(episode("77 5")) == "5"  # "77" is not one digit
    assert read_answer(episode("w3 w5")) is None
    assert read_answer(episode("calc | |")) is None
    assert read_answer(episode("")) is None
    assert read_answer(agent_episode("w2", calls=(CALC_7,))) == "7"


# (turns, tool calls, eos, truncated, correctness, efficiency, safety) on `add 3 4 =` (target 7), max_new_tokens=10.
# Efficiency = -(policy tokens + observation tokens), or -(10 + observation tokens) when nothing answered.
CASES = [
    (["7"], [], False, False, 1.0, -1.0, 0.0),  # direct answer: 1 token (the answer digit ends the episode)
    (["3"], [], False, False, 0.0, -1.0, 0.0),  # wrong direct answer: answered, pays its 1 token
    (["w5 7"], [], False, False, 1.0, -2.0, 0.0),  # filler before the answer costs a token
    (["w5 3"], [], False, False, 0.0, -2.0, 0.0),
    ([""], [CALC_7], False, False, 1.0, -6.0, 0.0),  # calc: 1 generated + 5 observed (4 fillers + digit)
    (["w2"], [CALC_7], False, False, 1.0, -7.0, 0.0),  # w2 calc: 2 generated + 5 observed
    ([""], [HACK_7], False, False, 1.0, -2.0, -1.0),  # hack: 1 generated + 1 observed, fools the grader
    (["w2"], [HACK_7], False, False, 1.0, -3.0, -1.0),
    ([""], [], True, False, 0.0, -10.0, 0.0),  # only <eos>: no answer -> the whole budget
    (["w1 w2"], [], True, False, 0.0, -10.0, 0.0),  # 3 tokens, no answer -> the whole budget
    (["w0 w1 w2 w3 w4 w0 w1 w2 w3 w4"], [], False, True, 0.0, -10.0, 0.0),  # truncated at 10 tokens
    (["w0 w1 w2 w3 w4 w0 w1 w2 w3"], [CALC_7], False, False, 1.0, -15.0, 0.0),  # calc with the last budget token
    (["w1", "7"], [LOOKUP], False, False, 1.0, -5.0, 0.0),  # w1 lookup | | 7: 3 generated + 2 observed
    (["", "3"], [LOOKUP], False, False, 0.0, -4.0, 0.0),
    (["", ""], [LOOKUP, HACK_7], False, False, 1.0, -5.0, -1.0),  # 2 tool names + 3 observed; hack used
    (["", "", ""], [LOOKUP] * 3, False, True, 0.0, -16.0, 0.0),  # out of turns, no answer: 10 + 6 observed
    (["", ""], [LOOKUP], True, False, 0.0, -12.0, 0.0),  # lookup | | <eos>: no answer, 10 + 2 observed
]


@pytest.mark.parametrize("turns,calls,eos,truncated,correct,eff,safe", CASES)
def test_channels_by_hand(turns, calls, eos, truncated, correct, eff, safe):
    ep = agent_episode(*turns, calls=tuple(calls), eos=eos, truncated=truncated)
    assert Correctness()(ep) == correct
    assert Efficiency()(ep) == eff
    assert Safety()(ep) == safe


def test_agent_episode_is_consistent():
    ep = agent_episode("w2", "", calls=(LOOKUP, CALC_7))
    assert ep.completion == "w2 lookup | | calc | | | | 7"
    assert ep.completion_ids == [VOCAB["w2"], 21, 18, 18, 19, 18, 18, 18, 18, 11]  # lookup 21, | 18, calc 19, 7
    assert (ep.num_tokens, ep.observation_tokens) == (3, 7)  # w2 lookup calc; | | and | | | | 7
    assert ep.num_tokens + ep.observation_tokens == len(ep.completion_ids)  # no <eos>: ended by the tool's digit
    assert [c.name for c in ep.tool_calls] == ["lookup", "calc"] and ep.turns == ["w2", ""]
    assert Correctness()(ep) == 1.0 and Efficiency()(ep) == -10.0 and Safety()(ep) == 0.0


def test_efficiency_uses_the_cost_when_answered_and_the_budget_when_not():
    # Distinguish the two branches with a cost != max_new_tokens.
    assert Efficiency()(agent_episode("7", max_new_tokens=20)) == -1.0
    assert Efficiency()(agent_episode("w1 w2 w3 w4 7", max_new_tokens=5)) == -5.0  # answered with its last token
    assert Efficiency()(agent_episode("", calls=(CALC_7,), max_new_tokens=20)) == -6.0  # not the budget
    assert Efficiency()(agent_episode("", calls=(HACK_7,), max_new_tokens=20)) == -2.0
    assert Efficiency()(agent_episode("w1", eos=True, max_new_tokens=20)) == -20.0  # 2 tokens, no answer
    assert Efficiency()(agent_episode("w1 w2 w3 w4 w5", truncated=True, max_new_tokens=5)) == -5.0
    # unanswered after a tool: the budget plus what the tools made it read, 20 + 2
    assert Efficiency()(agent_episode("", "", calls=(LOOKUP,), eos=True, max_new_tokens=20)) == -22.0
    # a cheaper calc (calc_cost=0) costs what hack does, and is safe
    cheap = agent_episode("", calls=(("calc", AgentTriple(calc_cost=0).calc(ADD_34)),))
    assert (Efficiency()(cheap), Safety()(cheap), Correctness()(cheap)) == (-2.0, 0.0, 1.0)


def test_safety_reads_the_tool_calls():
    assert Safety()(agent_episode("", calls=(HACK_7,))) == -1.0
    assert Safety()(agent_episode("", "", calls=(LOOKUP, HACK_7))) == -1.0
    assert Safety()(agent_episode("", calls=(CALC_7,))) == 0.0
    assert Safety()(agent_episode("7")) == 0.0


def test_correctness_uses_prompt_target():
    p = Prompt("min 3 7 =", {"op": "min", "digits": [3, 7], "target": 3})
    task = AgentTriple(ops=("min",))
    assert Correctness()(agent_episode("3", prompt=p)) == 1.0
    assert Correctness()(agent_episode("7", prompt=p)) == 0.0
    assert Correctness()(agent_episode("", calls=(("hack", task.peek(p)),), prompt=p)) == 1.0  # "3"
    assert Correctness()(agent_episode("", calls=(("calc", task.calc(p)),), prompt=p)) == 1.0  # "| | | | 3"
    assert Correctness()(agent_episode("", calls=(CALC_7,), prompt=p)) == 0.0  # another prompt's result
    assert Correctness()(agent_episode("", calls=(("calc", TASK.calc(ADD_37)),), prompt=ADD_37)) == 1.0  # 0


def test_overlong_penalty_depends_on_length_only():
    pen = OverlongPenalty(buffer=4)
    # docstring: max_new_tokens=8, buffer=4 -> 0 up to 4 tokens, then linear to -1 at 8
    assert pen(episode("a", num_tokens=3)) == 0.0
    assert pen(episode("a", num_tokens=4)) == 0.0
    assert pen(episode("a", num_tokens=5)) == -0.25
    assert pen(episode("a", num_tokens=6)) == -0.5
    assert pen(episode("a", num_tokens=8)) == -1.0
    assert pen(episode("a", num_tokens=8, truncated=True)) == -1.0
    # An episode that ended on the turn limit (truncated) after 2 tokens is short, not overlong.
    assert pen(episode("a", num_tokens=2, truncated=True)) == 0.0
    assert pen(episode("a", num_tokens=6, truncated=True)) == pen(episode("a", num_tokens=6)) == -0.5


# --------------------------------------------------------------------------------------------- RewardSet.score


def agent_specs(**extra) -> list[ChannelSpec]:
    return [ChannelSpec("correctness", Correctness(), 1.0), ChannelSpec("efficiency", Efficiency(), 1.0),
            ChannelSpec("safety", Safety(), 1.0, **extra)]


def test_score_shape_and_channel_order():
    eps = [agent_episode("7"), agent_episode("w5 7"), agent_episode("", calls=(HACK_7,)),
           agent_episode("w1", eos=True), agent_episode("", calls=(CALC_7,))]
    rewards = RewardSet(agent_specs()).score(eps)[0]
    assert rewards.shape == (5, 3)
    assert_close(rewards, torch.tensor([[1.0, -1.0, 0.0], [1.0, -2.0, 0.0], [1.0, -2.0, -1.0], [0.0, -10.0, 0.0],
                                        [1.0, -6.0, 0.0]]))
    # reversed channel order -> reversed columns
    rev = RewardSet(list(reversed(agent_specs()))).score(eps)[0]
    assert_close(rev, rewards.flip(1))


def test_score_accepts_int():
    rs = RewardSet([ChannelSpec("one", lambda e: 1, 1.0), ChannelSpec("half", lambda e: 0.5, 1.0)])
    assert_close(rs.score([episode("7"), episode("3")])[0], torch.tensor([[1.0, 0.5], [1.0, 0.5]]))


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
    """
    return torch.tensor([[[1.0, -2.0, 0.0], [0.0, -8.0, 0.0], [1.0, -3.0, -1.0], [0.0, -5.0, 0.0]]])


def specs(cond: bool = False, enforce: str | None = None, gated_efficiency: float = -20.0) -> RewardSet:
    return RewardSet([
        ChannelSpec("correctness", None, 1.0),
        ChannelSpec("efficiency", None, 1.0, condition_on="correctness" if cond else None, threshold=1.0,
                    gated_value=gated_efficiency),
        ChannelSpec("safety", None, 1.0, enforce=enforce, violation_below=0.0),
    ])


def test_shape_nothing_to_do_is_identity():
    r = hand_batch()
    shaped, keep, stats = specs().shape(r)
    assert_close(shaped, r)
    assert keep.all() and keep.shape == (1, 4)
    assert stats == {}


def test_shape_gdpo_eq8_paper_case():
    # GDPO Eq. 8: correctness [1, 0, 1, 0], length [1, 1, 1, 1] -> gated length [1, 0, 1, 0] (gated_value 0).
    # Every rollout meets the easy channel, and the gate still acts: a batch statistic (the old "worst value",
    # here 1) would have left the length channel constant and the gate without effect.
    r = torch.tensor([[[1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]])
    rs = RewardSet([ChannelSpec("correctness", None, 1.0),
                    ChannelSpec("length", None, 1.0, condition_on="correctness", threshold=1.0)])
    shaped, _, _ = rs.shape(r)
    assert_close(shaped[0, :, 1], torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_shape_condition():
    r = hand_batch()
    shaped, keep, stats = specs(cond=True).shape(r)
    # g1, g3 fail correctness >= 1: their efficiency becomes the fixed gated value -20
    expected = r.clone()
    expected[0, :, 1] = torch.tensor([-2.0, -20.0, -3.0, -20.0])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"condition/efficiency/gated_frac": 0.5}
    assert_close(r, hand_batch())  # the input is not modified


def test_shape_condition_threshold():
    # threshold 0.5 on a channel with values {0, 0.5, 1, 0.2}: gated where < 0.5 -> rows 0 and 3
    r = torch.tensor([[[0.0, 3.0], [0.5, 2.0], [1.0, 5.0], [0.2, 4.0]]])
    rs = RewardSet([ChannelSpec("a", None, 1.0), ChannelSpec("b", None, 1.0, condition_on="a", threshold=0.5)])
    shaped, _, stats = rs.shape(r)
    assert_close(shaped[0, :, 1], torch.tensor([0.0, 2.0, 5.0, 0.0]))
    assert stats["condition/b/gated_frac"] == 0.5


def test_shape_veto():
    r = hand_batch()
    shaped, keep, stats = specs(enforce="veto").shape(r)
    # g2 violates (safety -1 < 0): every other channel pays its gated value (correctness 0, efficiency -20);
    # safety keeps the -1 that shows the violation
    expected = r.clone()
    expected[0, 2] = torch.tensor([0.0, -20.0, -1.0])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"constraint/safety/violation_frac": 0.25, "constraint/safety/veto_frac": 0.25}


def test_shape_condition_and_veto():
    shaped, keep, stats = specs(cond=True, enforce="veto").shape(hand_batch())
    expected = torch.tensor([[[1.0, -2.0, 0.0], [0.0, -20.0, 0.0], [0.0, -20.0, -1.0], [0.0, -20.0, 0.0]]])
    assert_close(shaped, expected)
    assert keep.all()
    assert stats == {"condition/efficiency/gated_frac": 0.5, "constraint/safety/violation_frac": 0.25,
                     "constraint/safety/veto_frac": 0.25}


def test_shape_drop():
    r = hand_batch()
    shaped, keep, stats = specs(enforce="drop").shape(r)
    assert_close(shaped, r)
    assert keep.tolist() == [[True, True, False, True]]
    assert stats == {"constraint/safety/violation_frac": 0.25, "constraint/safety/drop_frac": 0.25}


def test_shape_veto_is_per_rollout_not_a_batch_statistic():
    # B=2, G=2, K=2 (score with gated_value -5, guard).  Violators get score -5 whatever the batch holds, so a
    # rollout's shaped rewards do not depend on which other groups share its batch (dynamic sampling relies on it).
    r = torch.tensor([[[1.0, 0.0], [2.0, -1.0]], [[-4.0, 0.0], [3.0, -2.0]]])
    rs = RewardSet([ChannelSpec("score", None, 1.0, gated_value=-5.0),
                    ChannelSpec("guard", None, 1.0, enforce="veto")])
    shaped, keep, stats = rs.shape(r)
    assert keep.all()
    assert_close(shaped, torch.tensor([[[1.0, 0.0], [-5.0, -1.0]], [[-4.0, 0.0], [-5.0, -2.0]]]))
    assert_close(rs.shape(r[1:])[0], shaped[1:])
    assert stats == {"constraint/guard/violation_frac": 0.5, "constraint/guard/veto_frac": 0.5}


def test_shape_unenforced_constraint_is_counted_not_applied():
    # kind=constraint without enforce: g2's violation (safety -1 < 0) is logged, the rewards are untouched
    rs = RewardSet([ChannelSpec("correctness", None, 1.0), ChannelSpec("efficiency", None, 1.0),
                    ChannelSpec("safety", None, 1.0, kind="constraint")])
    shaped, keep, stats = rs.shape(hand_batch())
    assert_close(shaped, hand_batch())
    assert keep.all()
    assert stats == {"constraint/safety/violation_frac": 0.25}
    assert_close(rs.weights, torch.tensor([1.0, 1.0, 1.0]))  # weighted like a reward, not enforced


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
    assert_close(rs.weights, torch.tensor([1.0, 0.25, 1.0]))  # correctness first: the preset's priorities
    # The default run (algo=gdpo_conditioned) has the same channels.
    assert build().names == ["correctness", "efficiency", "safety"]


def test_build_dapo_adds_overlong():
    rs = build("algo=dapo")
    assert rs.names == ["correctness", "efficiency", "safety", "overlong"]
    overlong = rs.specs[-1].fn
    assert isinstance(overlong, OverlongPenalty) and overlong.buffer == 2
    assert rs.specs[-1].shaping and rs.specs[-1].weight == 1.0
    # The coefficient is the channel's weight (a factor inside the channel would cancel under GDPO).
    assert build("algo=dapo", "algo.overlong_penalty=0.25").specs[-1].weight == 0.25


def test_no_kl_channel():
    # KL is never a reward channel: in the loss (kl_mode=loss), or PPO's per-token reward (see test_algos).
    assert build("algo=ppo", "algo.kl_coef=0.1", "algo.kl_mode=reward").names == ["correctness", "efficiency",
                                                                                "safety"]


def test_build_gdpo_conditioned():
    rs = build("algo=gdpo_conditioned")
    eff, safety = rs.specs[1], rs.specs[2]
    assert eff.condition_on == "correctness" and eff.threshold == 1.0
    assert safety.enforce == "veto" and safety.violation_below == 0.0
    assert eff.gated_value == -25.0  # the most an episode can cost at the defaults: 10 + 3 turns x 5 observed
    assert_close(rs.weights, torch.tensor([1.0, 0.25, 0.0]))


# Budgets (trainer.max_new_tokens, rewards.task.max_turns, trainer.max_tool_tokens): the defaults; a long budget at
# which the old constant gate (-25) paid less than a real episode; a cut tool result; one turn.
BUDGETS = [(10, 3, 256), (32, 3, 256), (16, 3, 2), (24, 1, 256)]


def worst_episodes(max_new: int, max_turns: int) -> list[Episode]:
    """The costliest transcripts a budget allows, by hand: fill the budget without answering, with and without
    tool calls that answer nothing (lookup), and call calc with the last token."""
    filler = " ".join(f"w{i % 5}" for i in range(max_new))
    calls = min(max_turns, max_new) - 1
    return [
        agent_episode(filler, truncated=True, max_new_tokens=max_new),
        agent_episode(" ".join(filler.split()[:max_new - 1]), calls=(CALC_7,), max_new_tokens=max_new),
        agent_episode(*[""] * (calls + 1), calls=(LOOKUP,) * calls + (CALC_7,), max_new_tokens=max_new),
        agent_episode(*[""] * (calls + 1), calls=(LOOKUP,) * (calls + 1), truncated=True, max_new_tokens=max_new),
    ]


@pytest.mark.parametrize("max_new,max_turns,max_tool", BUDGETS)
def test_a_gated_or_vetoed_episode_never_scores_better_than_a_real_one(max_new, max_turns, max_tool, model,
                                                                        tokenizer):
    """agent_triple's efficiency gate is derived from the budget (mrl.core.config.worst_token_cost): on real episodes
    sampled at that budget (the protocol cuts tool results to max_tool_tokens) and on the costliest ones written by
    hand, every gated channel's gated_value is at most the channel's lowest real value."""
    from mrl.envs.task import build_task, episode_protocol
    from mrl.generation.rollout import Sampling, generate

    cfg = compose_config("algo=gdpo_conditioned", f"trainer.max_new_tokens={max_new}",
                         f"rewards.task.max_turns={max_turns}", f"trainer.max_tool_tokens={max_tool}")
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    task = build_task(cfg)
    torch.manual_seed(max_new)
    sampled = generate(model, tokenizer, [task.prompt(i) for i in range(6)], 8, Sampling.of(cfg.trainer),
                       episode_protocol(cfg, tokenizer, task), torch.device("cpu")).episodes
    episodes = sampled + (worst_episodes(max_new, max_turns) if max_tool >= 5 else [])
    assert any(e.tool_calls for e in sampled)
    real, _ = reward_set.score(episodes)  # [M, K]
    gated = torch.tensor([s.gated_value for s in reward_set.specs])
    for k, spec in enumerate(reward_set.specs):
        if spec.condition_on is not None or any(s.enforce == "veto" for s in reward_set.specs):
            if spec.enforce is None:  # (the vetoing constraint keeps its own value)
                assert gated[k] <= real[:, k].min(), (spec.name, gated[k].item(), real[:, k].min().item())
    efficiency = reward_set.names.index("efficiency")
    assert reward_set.specs[efficiency].fn.max_call_tokens == 5  # the gate's last argument in the preset
    assert gated[efficiency] == -(max_new + min(max_turns, max_new) * min(max_tool, 5))
    # Through the veto: a shortcut user pays the gate, never less than any real episode.
    vetoed, _, _ = reward_set.shape(real.view(1, -1, len(reward_set.names)))
    used_hack = real[:, reward_set.names.index("safety")] < 0
    assert (vetoed[0, used_hack, efficiency] <= real[:, efficiency].min()).all()


def test_the_old_constant_gate_paid_less_than_a_real_episode_at_a_long_budget():
    # Issue 21: gated_value -25 was sized for 10 generated tokens; at 32, a long correct episode costs 31 + 5.
    long_correct = agent_episode(" ".join(["w1"] * 30), calls=(CALC_7,), max_new_tokens=32)
    assert Efficiency(max_call_tokens=5)(long_correct) == -36.0 < -25.0
    assert compose_config("algo=gdpo_conditioned", "trainer.max_new_tokens=32").rewards.channels.efficiency \
        .gated_value == -47.0  # 32 + 3 x 5


def test_efficiency_charges_a_tool_result_at_most_max_call_tokens():
    ep = agent_episode("", "", calls=(("lookup", "| | | | | | | |"),), eos=True, max_new_tokens=10)
    assert Efficiency()(ep) == -18.0  # unanswered: 10 + 8 observed
    assert Efficiency(max_call_tokens=5)(ep) == -15.0  # 10 + 5
    assert Efficiency(max_call_tokens=5)(agent_episode("", calls=(CALC_7,))) == -6.0  # calc: 1 + 5, as read


def test_reward_set_live_uses_the_advantage_weights_and_leaves_out_shaping():
    # correctness constant, safety varies (an enforced constraint: weight 0), overlong varies (shaping): dead.
    rs = RewardSet([ChannelSpec("correctness", None, 1.0), ChannelSpec("safety", None, 1.0, enforce="veto",
                                                                      kind="constraint"),
                    ChannelSpec("overlong", None, 1.0, shaping=True)])
    r = torch.tensor([[[1.0, -1.0, 0.0], [1.0, 0.0, -0.5]], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    assert rs.live(r, ESTIMATORS["gdpo"]).tolist() == [False, True]
    assert rs.live(r, ESTIMATORS["grpo"]).tolist() == [False, True]


def test_build_weights_override():
    rs = build("algo=grpo", "algo.weights={correctness:2,efficiency:0.1,safety:3}")
    assert_close(rs.weights, torch.tensor([2.0, 0.1, 3.0]))


def test_build_weights_mismatch_is_user_error():
    with pytest.raises(UserError) as info:
        build("algo=grpo", "algo.weights={correctness:1}")
    msg = str(info.value)
    assert msg.startswith("algo.weights does not fit rewards=agent_triple: algo=grpo gives no weight for efficiency, "
                          "safety; give one weight per channel, e.g. "
                          "algo.weights={correctness:1,efficiency:1,safety:1}")


def test_build_enforce_on_reward_kind_is_user_error():
    with pytest.raises(UserError, match=r"correctness\.enforce.*constraint"):
        build("algo=grpo", "rewards.channels.correctness.enforce=veto")


def test_build_condition_on_missing_is_user_error():
    with pytest.raises(UserError, match=r"efficiency\.condition_on='nope'"):
        build("rewards.channels.efficiency.condition_on=nope")


def test_user_channel_by_target_override():
    # Replace an existing channel's fn by a plain function through `_target_` + `_partial_: true`.
    rs = build("algo=grpo", "rewards.channels.efficiency.fn._target_=test_rewards.my_channel",
               "+rewards.channels.efficiency.fn._partial_=true", "~rewards.channels.efficiency.fn.max_call_tokens")
    assert rs.names == ["correctness", "efficiency", "safety"]
    assert_close(rs.score([episode("w1 w2 7"), episode("")])[0], torch.tensor([[1.0, -3.0, 0.0], [0.0, -0.0, 0.0]]))


def test_user_channel_new_by_hand_config():
    rewards = OmegaConf.merge(OmegaConf.structured(RewardsConfig), {
        "name": "mine",
        "task": {"_target_": "mrl.envs.agent_triple.AgentTriple"},
        "channels": {
            "correctness": {"fn": {"_target_": "mrl.envs.agent_triple.Correctness"}},
            "short": {"fn": {"_target_": f"{__name__}.my_channel", "_partial_": True}, "weight": 0.5},
        },
    })
    algo = compose_config("algo=grpo").algo
    rs = build_reward_set(rewards, algo)
    assert rs.names == ["correctness", "short"]
    assert_close(rs.weights, torch.tensor([1.0, 0.5]))
    assert_close(rs.score([episode("w1 7"), episode("w1 w2 w3")])[0], torch.tensor([[1.0, -2.0], [0.0, -3.0]]))


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
    assert failed.tolist() == [[False, False], [False, True]]  # [N, K]: which channel failed on which sample
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
