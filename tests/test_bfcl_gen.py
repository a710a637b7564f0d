"""bfcl_gen: generated BFCL-format multi-turn entries (mrl/envs/bfcl_gen.py) scored by bfcl_agent's checks, with no
model: the ground truth replays to full marks on every held-out entry and on train entries of two seeds; dropping the
first state-changing call (a math entry's first call: it changes no state) fails every entry; a destructive call outside
the task's scope is a safety violation on every entry; the holdouts are the same for every seed, never drawn for
training, and reported each under its own eval/<holdout>/ keys; the demonstrations play through the chat protocol to
solved episodes."""

from __future__ import annotations

import ast
import json
from types import SimpleNamespace

import pytest
import torch
from test_protocols import TEMPLATES, build_chat_model, rollout
from test_sft import chat_model_overrides, round_trip

from mrl.chat.protocols import ChatProtocol
from mrl.core.config import UserError
from mrl.core.episode import Prompt
from mrl.envs import bfcl_gen
from mrl.envs.bfcl_agent import gym, scores
from mrl.envs.bfcl_gen import BfclGenTask, entry_by_id, holdout, replay, train_entry
from mrl.modeling.models import load_tokenizer
from mrl.train.evaluate import HeldOut, eval_metrics, summarize

PERFECT = {"correctness": 1.0, "turns": 1.0, "efficiency": 0.0, "safety": 0.0}
STATELESS_FAMILIES = {"math_multiply", "math_add_divide"}  # MathAPI alone: results are checked, no state changes


@pytest.fixture(scope="module")
def entries() -> list[dict]:
    """Every held-out entry, and 28 train entries (2 per training family) of seeds 0 and 1."""
    return [*holdout("id"), *holdout("ood"), *(train_entry(seed, i) for seed in (0, 1) for i in range(28))]


def test_families_cover_the_six_kinds_of_class_in_one_to_three_user_turns(entries):
    assert len(bfcl_gen.TRAIN_FAMILIES) >= 12 and len(bfcl_gen.OOD_FAMILIES) >= 3
    assert not set(bfcl_gen.TRAIN_FAMILIES) & set(bfcl_gen.OOD_FAMILIES)
    classes = {c for e in entries for c in e["involved_classes"]}
    assert classes == {"GorillaFileSystem", "MessageAPI", "TicketAPI", "MathAPI", "VehicleControlAPI", "TradingBot"}
    assert {len(e["question"]) for e in entries} == {1, 2, 3}
    assert {e["category"] for e in entries} == set(bfcl_gen.FAMILIES)


def test_the_ground_truth_replays_to_full_marks_on_every_entry(entries):
    for e in entries:
        assert replay(e, gym.gold_calls(e)) == PERFECT, e["id"]
        world = gym.World(e)  # and no ground-truth call is refused by its class
        for text in (s for turn in e["ground_truth"] for s in turn):
            result = world.call_string(text)[1]
            assert not result.startswith("Error") and '"error"' not in result, (e["id"], text, result)


def first_state_change(e: dict) -> tuple[int, int] | None:
    """(turn, index) of the ground truth's first call that changes a public value of the world, or None."""
    world = gym.World(e)
    for t, calls in enumerate(e["ground_truth"]):
        for i, text in enumerate(calls):
            before = gym.leaves(world.state())
            world.call_string(text)
            if gym.leaves(world.state()) != before:
                return t, i
    return None


def test_dropping_the_first_state_changing_call_fails_every_entry_that_has_one(entries):
    stateless = set()
    for e in entries:
        where = first_state_change(e)
        if where is None:
            stateless.add(e["category"])
            where = (0, 0)  # a stateless entry: its first call's result is what the check wants
        calls = [list(turn) for turn in gym.gold_calls(e)]
        del calls[where[0]][where[1]]
        result = replay(e, calls)
        assert result["correctness"] == 0.0 and result["turns"] < 1.0, (e["id"], where, result)
    assert stateless == STATELESS_FAMILIES


def destructive_call(e: dict) -> gym.Call:
    """A call outside the task's scope that damages what the task never touches: a file it never names deleted,
    another message deleted, another ticket closed, the pending order cancelled, the parking brake engaged; on a
    math entry (no state) a file deletion the entry does not even offer."""
    named = " ".join(s for turn in e["ground_truth"] for s in turn)
    config = e["initial_config"]
    if "GorillaFileSystem" in config:
        top = next(iter(config["GorillaFileSystem"]["root"].values()))["contents"]
        victim = next(n for n, node in top.items() if node["type"] == "file" and repr(n) not in named)
        return "rm", {"file_name": victim}
    if "MessageAPI" in config:
        return "delete_message", {"receiver_id": next(iter(config["MessageAPI"]["inbox"][0]))}
    if "TicketAPI" in config:
        ids = [t["id"] for t in config["TicketAPI"]["ticket_queue"] if f"ticket_id={t['id']}" not in named]
        return "close_ticket", {"ticket_id": ids[0]}
    if "TradingBot" in config:
        return "cancel_order", {"order_id": int(next(iter(config["TradingBot"]["orders"])))}
    if "VehicleControlAPI" in config:
        return "activateParkingBrake", {"mode": "engage"}
    return "rm", {"file_name": "notes.txt"}


def test_a_destructive_call_outside_the_tasks_scope_is_a_safety_violation_on_every_entry(entries):
    for e in entries:
        calls = [list(turn) for turn in gym.gold_calls(e)]
        calls[0].insert(0, destructive_call(e))
        assert replay(e, calls)["safety"] == -1.0, e["id"]
        violations = gym.check(e, calls).violations
        if e["category"] in STATELESS_FAMILIES:
            assert violations == ["turn 0: called 'rm', not available in this turn"]
        else:  # collateral damage, not an unavailable function
            assert len(violations) == 1 and "which the ground truth never changes" in violations[0], violations
    # by hand: fs_touch/0 of the id holdout deletes one of its two untouched top-level files
    e = holdout("id")[0]
    assert e["id"] == "bfcl_gen/id/fs_touch/0" and destructive_call(e)[0] == "rm"


def test_the_holdouts_are_fixed_sized_interleaved_and_never_trained_on():
    zero, five = BfclGenTask(seed=0), BfclGenTask(seed=5)
    held = zero.eval_prompts()
    assert [p.meta["id"] for p in held] == [p.meta["id"] for p in five.eval_prompts()]
    assert len(held) == 2 * 156 and [p.meta["holdout"] for p in held[:4]] == ["id", "ood", "id", "ood"]
    by_holdout = {name: [p.meta for p in held if p.meta["holdout"] == name] for name in ("id", "ood")}
    assert {m["category"] for m in by_holdout["id"]} == set(bfcl_gen.TRAIN_FAMILIES)
    assert {m["category"] for m in by_holdout["ood"]} == set(bfcl_gen.OOD_FAMILIES)
    signature = bfcl_gen._signature
    held_signatures = {signature(entry_by_id(p.meta["id"])) for p in held}
    assert len(held_signatures) == 312  # no two held-out entries alike
    for task in (zero, five):
        train = [task.prompt(i) for i in range(300)]
        assert not {signature(entry_by_id(p.meta["id"])) for p in train} & held_signatures
        assert {p.meta["category"] for p in train} == set(bfcl_gen.TRAIN_FAMILIES)
    assert zero.prompt(3).meta["id"] != five.prompt(3).meta["id"]  # the seed draws the training stream
    assert zero.prompt(3).text == BfclGenTask(seed=0).prompt(3).text  # the same index, the same prompt


def test_a_train_draw_equal_to_a_held_out_entry_is_drawn_again(monkeypatch):
    """Force a collision: the train stream's entry 0 is declared held out, so it is redrawn under /r1."""
    first = entry_by_id("bfcl_gen/train9/fs_touch/0")
    monkeypatch.setattr(bfcl_gen, "_held_signatures", lambda size: frozenset({bfcl_gen._signature(first)}))
    assert train_entry(9, 0)["id"] == "bfcl_gen/train9/fs_touch/0/r1"
    assert train_entry(9, 1)["id"] == "bfcl_gen/train9/fs_echo_cat/0"


def test_an_id_regenerates_its_entry_and_a_bad_id_is_refused_in_one_line():
    e = holdout("ood")[2]
    assert e["id"] == "bfcl_gen/ood/ood_file_to_message/0"
    assert entry_by_id.__wrapped__(e["id"]) == e  # uncached: generated again from the id alone
    assert e["involved_classes"] == ["GorillaFileSystem", "MessageAPI"]
    cat, send = e["ground_truth"][0]
    content = ast.literal_eval(send.split("message=", 1)[1][:-1])
    assert json.loads(gym.World(e).call_string(cat)[1]) == {"file_content": content}  # the message is the file's
    with pytest.raises(UserError, match="no bfcl_gen entry id.*family one of"):
        entry_by_id("bfcl_gen/id/fs_teleport/0")


def test_bad_task_settings_are_refused_naming_the_value():
    with pytest.raises(UserError, match="holdout_entries=0"):
        BfclGenTask(holdout_entries=0)
    with pytest.raises(UserError, match="max_calls_per_turn=1"):
        BfclGenTask(max_calls_per_turn=1)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    return load_tokenizer(str(build_chat_model(tmp_path_factory.mktemp("bfcl_gen") / "hermes", TEMPLATES["hermes"])))


def test_an_episode_plays_its_three_user_turns_and_the_channels_find_its_entry(hermes):
    task = BfclGenTask(seed=0)
    e = next(e for e in holdout("id") if len(e["question"]) == 3)
    prompt = task.to_prompt(e, "id")
    assert prompt.meta == {"id": e["id"], "category": "ticket_create", "user_turns": 3, "gold_only": False,
                           "source": "bfcl_gen", "holdout": "id"}
    turns = [t for calls in gym.gold_calls(e) for t in
             [f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls]
             + ["Done.<|im_end|>"]]
    protocol = ChatProtocol(hermes, {}, task.max_turns, 512, environment=task.environment)
    replies = iter(turns)
    episode = rollout(hermes, protocol, lambda text: next(replies, "<|im_end|>"), [prompt], 4000)[0].episodes[0]
    assert [c.user_turn for c in episode.tool_calls] == [0, 1, 2]
    assert scores(episode) == PERFECT
    new_id = json.loads(episode.tool_calls[0].observation)["id"]  # the ticket the user's "its" means
    assert episode.tool_calls[1].arguments == {"ticket_id": new_id, "updates": {"priority": int(
        e["ground_truth"][1][0].split("'priority': ")[1].rstrip("})"))}}


def test_demonstrations_are_the_train_streams_ground_truth_and_play_to_solved_episodes(hermes):
    task = BfclGenTask(seed=2)
    demos = task.demonstrations("train", count=28)
    assert [d.source for d in demos] == [task.prompt(i).meta["id"] for i in range(28)]
    first = entry_by_id(demos[0].source)
    assert [r.calls for r in demos[0].replies] == [(c,) for c in gym.gold_calls(first)[0]] + [()]
    with pytest.raises(UserError, match="only the 'train' split"):
        task.demonstrations("eval")
    count, bad = round_trip(hermes, [*chat_model_overrides(hermes), "rewards=bfcl_gen"])
    assert count == 64 and bad == []


def test_each_holdout_gets_its_own_eval_keys_worked_by_hand():
    """4 prompts (id, ood, id, ood), 2 channels, greedy and 2 samples each: every number below by hand."""
    prompts = [Prompt(text=str(i), meta={"id": i, "holdout": h}) for i, h in enumerate(["id", "ood", "id", "ood"])]
    greedy = torch.tensor([[1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [1.0, 0.0]])  # [P, K]: correctness, safety
    sampled = torch.tensor([[1.0, 0.0], [1.0, 0.0],  # prompt 0 (id)
                            [0.0, -1.0], [0.0, 0.0],  # prompt 1 (ood)
                            [0.0, 0.0], [1.0, -1.0],  # prompt 2 (id)
                            [0.0, 0.0], [0.0, 0.0]])  # prompt 3 (ood)
    held = HeldOut(prompts, ["correctness", "safety"], SimpleNamespace(rewards=greedy),
                   SimpleNamespace(rewards=sampled), 2)
    metrics = eval_metrics(summarize(held, "correctness"))
    assert metrics["eval/correctness/mean"] == 0.5 and metrics["eval/accuracy"] == 0.5
    assert metrics["eval/id/correctness/mean"] == 0.5 and metrics["eval/id/safety/mean"] == 0.0
    assert metrics["eval/ood/correctness/mean"] == 0.5 and metrics["eval/ood/safety/mean"] == -0.5
    assert metrics["eval/id/correctness/mean@2"] == 0.75 and metrics["eval/ood/correctness/mean@2"] == 0.0
    assert metrics["eval/id/safety/mean@2"] == -0.25 and metrics["eval/ood/safety/mean@2"] == -0.25
    assert metrics["eval/id/accuracy"] == 0.5 and metrics["eval/ood/accuracy"] == 0.5
    # a task without holdouts logs no such keys
    plain = HeldOut([Prompt(text="x", meta={"id": 0})], ["correctness"], SimpleNamespace(rewards=greedy[:1, :1]),
                    None, 0)
    assert sorted(eval_metrics(summarize(plain, "correctness"))) == ["eval/accuracy", "eval/correctness/mean"]
