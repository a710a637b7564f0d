"""rewards=bfcl end to end: BFCL records as prompts (their own tools and messages, a held-out split fixed by id,
few-shot), the model's calls read from its chat format, and the channels' values on hand-made episodes."""

from __future__ import annotations

import json

import pytest
from conftest import compose_config
from test_protocols import chat_dirs, rollout, tok  # noqa: F401  the chat-model fixtures

from mrl.chat.protocols import ChatProtocol
from mrl.core.config import UserError
from mrl.core.episode import Episode, Prompt, ToolCall
from mrl.envs.bfcl import BfclTask, Correctness, Format, GradedCorrectness, NoCall, RightFunctions, held_out
from mrl.envs.bfcl import files as bfcl_data
from mrl.envs.bfcl import grader as bfcl
from mrl.envs.task import build_task, episode_protocol
from mrl.rewards.channels import build_reward_set


def answer(*calls: tuple[str, dict]) -> str:
    return "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls) \
        + "<|im_end|>"


def episode(prompt: Prompt, *calls: ToolCall) -> Episode:
    return Episode(prompt, "", [], 5, False, 64, list(calls))


@pytest.fixture(scope="module")
def simple():
    return BfclTask(["simple_python"], seed=0)


def test_the_held_out_split_is_fixed_by_record_id(simple):
    other = BfclTask(["simple_python", "multiple"], seed=7)
    held = {e["id"] for e in simple.split.eval}
    assert held == {e["id"] for e in other.split.eval if e["category"] == "simple_python"}  # whatever the seed or mix
    assert not held & {e["id"] for e in simple.split.train} and len(held) + len(simple.split.train) == 400
    assert 60 <= len(held) <= 100 and all(held_out(i, 20) for i in held)
    assert {simple.prompt(i).meta["id"] for i in range(len(simple.split))} == {e["id"] for e in simple.split.train}


def test_a_prompt_carries_the_records_tools_messages_and_ground_truth(simple):
    entry = simple.split.eval[0]
    prompt = simple.eval_prompts()[0]
    assert prompt.tools == bfcl_data.tool_schemas(entry) and prompt.messages == bfcl.messages(entry)
    assert prompt.text == entry["question"][0][-1]["content"]
    assert prompt.meta == {k: entry[k] for k in ("id", "category", "ground_truth", "function")}


def test_fewshot_shows_solved_train_records_and_declares_their_functions():
    task = BfclTask(["simple_python"], seed=0, fewshot=1)
    prompt, entry = task.eval_prompts()[0], task.split.eval[0]
    shot_user, shot_call, question = prompt.messages
    assert (shot_user["role"], shot_call["role"], question["role"]) == ("user", "assistant", "user")
    (call,) = shot_call["tool_calls"]
    shot = next(e for e in task.split.train if e["question"][0][-1]["content"] == shot_user["content"])
    assert bfcl.grade(shot, [(call["function"]["name"], call["function"]["arguments"])])  # a right answer
    names = [t["function"]["name"] for t in prompt.tools]
    assert names[0] == entry["function"][0]["name"] and call["function"]["name"] in names
    assert task.eval_prompts()[0] == prompt  # the same shots every time


def test_shared_fewshot_puts_the_same_shortest_examples_first_in_every_prompt(tok):  # noqa: F811
    task = BfclTask(["simple_python"], seed=0, fewshot=2, fewshot_shared=True)
    size = lambda e: len(json.dumps([e["question"], e["function"]]))  # noqa: E731
    accepted = [e for e in task.split.train if bfcl.grade(e, bfcl.gold_calls(e))]
    first, second = task.shared_shots[:2]
    assert size(first) == min(size(e) for e in accepted)  # the shortest, then the shortest of another function
    assert size(second) == min(size(e) for e in accepted if e["function"][0]["name"] != first["function"][0]["name"])
    prompts = task.eval_prompts()
    shot_turns = [m for shot in (first, second) for m in (shot["question"][0][-1]["content"],)]
    for prompt, entry in zip(prompts, task.split.eval, strict=True):
        assert [m["content"] for m in prompt.messages[0:4:2]] == shot_turns  # the same examples, in order
        assert prompt.messages[-1]["content"] == entry["question"][0][-1]["content"]
        names = [t["function"]["name"] for t in prompt.tools]
        assert names[:2] == [first["function"][0]["name"], second["function"][0]["name"]]  # declared first
        assert entry["function"][0]["name"] in names
    # every rendered prompt starts with the same declarations of both examples: one prefix, computed once
    protocol = ChatProtocol(tok, parallel_calls=True)
    texts = [tok.decode(protocol.prompt_ids(p)) for p in prompts]
    common = texts[0][:next(i for i, c in enumerate(texts[0]) if any(t[i] != c for t in texts[1:]))]
    assert first["function"][0]["description"] in common and second["function"][0]["description"] in common
    assert first["question"][0][-1]["content"] not in common
    # a train record that is one of the examples gets the spare instead, never itself
    own = task.to_prompt(first)
    assert [m["content"] for m in own.messages[0:4:2]] == [second["question"][0][-1]["content"],
                                                           task.shared_shots[2]["question"][0][-1]["content"]]


def test_bad_task_settings_are_one_line():
    with pytest.raises(UserError, match="categories is empty"):
        BfclTask([])
    with pytest.raises(UserError, match="simple_java.*choose|supported"):
        BfclTask(["simple_java"])
    with pytest.raises(UserError, match="force a call on the irrelevance"):
        BfclTask(["irrelevance"], answer_prefix="<tool_call>")


def test_channels_on_hand_made_episodes():
    entry = next(e for e in bfcl.load_entries("parallel") if e["id"] == "parallel_0")
    prompt = BfclTask(["parallel"]).to_prompt(entry)  # spotify.play twice: Taylor Swift 20, Maroon 5 15
    swift, maroon = ("spotify.play", {"artist": "Taylor Swift", "duration": 20}), \
        ("spotify.play", {"artist": "Maroon 5", "duration": 15})
    channels = (Format(), Correctness(), RightFunctions(), NoCall())

    def values(*calls: ToolCall):
        return tuple(c(episode(prompt, *calls)) for c in channels)

    assert values(ToolCall(*maroon), ToolCall(*swift)) == (1.0, 1.0, 1.0, None)  # any order
    assert values(ToolCall(*swift)) == (1.0, 0.0, 0.0, None)  # one call dropped
    assert values(ToolCall(*swift), ToolCall("spotify.play", {**maroon[1], "duration": "15"})) == \
        (1.0, 0.0, 1.0, None)  # "15" is no integer
    assert values(ToolCall(*swift), ToolCall(*maroon), ToolCall("", {}, "error: not JSON", valid=False)) == \
        (0.0, 1.0, 1.0, None)  # an unparseable block is no call to BFCL, but not well formed
    assert values() == (0.0, 0.0, 0.0, None)
    shot = ToolCall("calculate_triangle_area", {"base": 10, "height": 5})  # a few-shot example's call, copied
    assert values(shot) == (0.0, 0.0, 0.0, None)  # declared for the example, but not the record's own
    irrelevant = BfclTask(["irrelevance"]).to_prompt(bfcl.load_entries("irrelevance")[0])
    bmi = ToolCall("determine_body_mass_index", {"weight": 70, "height": 1.8})
    assert tuple(c(episode(irrelevant)) for c in channels) == (None, 1.0, None, 0.0)
    assert tuple(c(episode(irrelevant, bmi)) for c in channels) == (None, 0.0, None, -1.0)
    garbled = ToolCall("", {}, "error: not JSON", valid=False)
    assert tuple(c(episode(irrelevant, garbled)) for c in channels) == (None, 1.0, None, 0.0)


def test_graded_correctness_credits_names_parameters_and_values_as_toolrl():
    """ToolRL's 6 * (name Jaccard, by count + per matched call (key Jaccard + values right)) / S_max - 3, worked by
    hand."""
    entry = next(e for e in bfcl.load_entries("parallel") if e["id"] == "parallel_0")
    prompt = BfclTask(["parallel"]).to_prompt(entry)  # spotify.play twice: S_max = 1 + 2 calls + 4 keys = 7
    swift, maroon = ToolCall("spotify.play", {"artist": "Taylor Swift", "duration": 20}), \
        ToolCall("spotify.play", {"artist": "Maroon 5", "duration": 15})

    def graded(*calls: ToolCall) -> float | None:
        return GradedCorrectness()(episode(prompt, *calls))

    assert graded(maroon, swift) == graded(swift, maroon) == 3.0  # matched one to one, any order
    assert graded(swift) == graded(maroon) == pytest.approx(6 * (1 / 2 + 1 + 2) / 7 - 3)  # one call missing: names
    # 1 of 2 by count, the other matched to the answer it fits, not to the first of the ground truth
    assert graded(swift, ToolCall("spotify.play", {"artist": "Maroon 5", "duration": "15"})) == \
        pytest.approx(6 * (1 + 2 + 3) / 7 - 3)  # one value of the wrong type
    assert graded(swift, maroon, ToolCall("play_song", {"artist": "Maroon 5"})) == \
        pytest.approx(6 * (2 / 3 + 2 + 4) / 7 - 3)  # a function nobody asked for: names 2 of 3
    assert graded(swift, maroon, swift) == pytest.approx(6 * (2 / 3 + 2 + 4) / 7 - 3)  # a call repeated costs too
    assert graded(ToolCall("spotify.play", {**swift.arguments, "volume": 3}), maroon) == \
        pytest.approx(6 * (1 + 2 / 3 + 1 + 4) / 7 - 3)  # an extra key: key Jaccard 2/3
    assert graded(ToolCall("spotify.play", {"artist": "Maroon 5", "duration": 20})) == \
        pytest.approx(6 * (1 / 2 + 1 + 1) / 7 - 3)  # half right for either call: one of them credited
    assert graded(ToolCall("spotify.play", ["Taylor Swift", 20])) == pytest.approx(6 * (1 / 2) / 7 - 3)  # no object
    assert graded() == graded(ToolCall("", {}, "error: not JSON", valid=False)) == -3.0
    assert graded(ToolCall("calculate_triangle_area", {"base": 10, "height": 5})) == -3.0  # another function
    triangle = BfclTask(["simple_python"]).to_prompt(bfcl.load_entries("simple_python")[0])  # unit may be left out
    area = {"base": 10, "height": 5}  # S_max = 1 + 1 + 3 keys (base, height, unit)
    assert GradedCorrectness()(episode(triangle, ToolCall("calculate_triangle_area", area))) == 3.0  # unit left out
    assert GradedCorrectness()(episode(triangle, ToolCall("calculate_triangle_area", {**area, "unit": "units"}))) \
        == 3.0  # given right
    assert GradedCorrectness()(episode(triangle, ToolCall("calculate_triangle_area", {**area, "unit": "cm"}))) == \
        pytest.approx(6 * (1 + 1 + 2) / 5 - 3)  # given wrong: its value not right
    irrelevant = BfclTask(["irrelevance"]).to_prompt(bfcl.load_entries("irrelevance")[0])
    assert GradedCorrectness()(episode(irrelevant)) is None  # no_call grades those


def test_the_matching_is_the_best_one_to_one():
    """The Hungarian solver against every one-to-one matching, on random credit tables with ties and zeros."""
    import itertools
    import random

    def brute(credit: list[list[float]]) -> float:
        rows, columns = range(len(credit)), range(len(credit[0]))
        return max(sum(credit[r][c] for r, c in zip(chosen, order))
                   for k in range(len(credit) + 1) for chosen in itertools.combinations(rows, k)
                   for order in itertools.permutations(columns, k))

    rng = random.Random(0)
    for _ in range(200):
        credit = [[rng.choice([0.0, 1.0, rng.random() * 3]) for _ in range(rng.randint(1, 5))]]
        credit += [[rng.choice([0.0, 1.0, rng.random() * 3]) for _ in credit[0]] for _ in range(rng.randint(0, 3))]
        assert bfcl._best_matching(credit) == pytest.approx(brute(credit))


def test_a_models_calls_to_the_records_tools_are_read_and_graded(tok):  # noqa: F811
    task = BfclTask(["parallel"])
    prompt = task.to_prompt(next(e for e in bfcl.load_entries("parallel") if e["id"] == "parallel_0"))
    protocol = ChatProtocol(tok, {}, parallel_calls=task.parallel_calls)
    assert "spotify.play" in tok.decode(protocol.prompt_ids(prompt))  # the record's own tool reaches the model
    reply = answer(("spotify.play", {"artist": "Maroon 5", "duration": 15}),
                   ("spotify.play", {"artist": "Taylor Swift", "duration": 20}))
    r, _ = rollout(tok, protocol, lambda t: reply, [prompt], max_new=400)
    ep = r.episodes[0]
    assert [c.valid for c in ep.tool_calls] == [True, True] and not ep.truncated
    assert (Format()(ep), Correctness()(ep)) == (1.0, 1.0)


def test_the_preset_composes_and_builds(tok):  # noqa: F811
    cfg = compose_config("rewards=bfcl", "rewards.task.categories=[simple_python,irrelevance]")
    task = build_task(cfg)
    reward_set = build_reward_set(cfg.rewards, cfg.algo)
    assert reward_set.names[:4] == ["format", "correctness", "right_functions", "no_call"]
    assert cfg.rewards.pass_channel == "correctness"
    assert {p.meta["category"] for p in task.eval_prompts()} == {"simple_python", "irrelevance"}
    cfg.model.use_chat_template = True
    protocol = episode_protocol(cfg, tok, task)
    assert protocol.parallel_calls and protocol.stops.strings == ()  # a turn's calls end only with the turn
