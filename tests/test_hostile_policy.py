"""A policy is an adversary by construction: each attack of issue 30's probe on the chat protocol and the BFCL
multi-turn gym, with its payload.  Whatever a policy writes, parsing is total (an invalid call, never an exception),
the gym's scorer ends in bounded time and memory, and no world sees another's state (the ground truth included).

Each payload is first shown to be hostile to what stood before (the C decoder's RecursionError, the exponential state
walk, the shared module data), then shown harmless now."""

from __future__ import annotations

import copy
import decimal
import json
import random
import sys
import time

import pytest
from test_bfcl_agent import entry, play, scripted
from test_protocols import TEMPLATES, build_chat_model

from mrl.chat.protocols import CHARS_PER_TOKEN, _cut_to, read_call
from mrl.core import safe_json
from mrl.envs.bfcl_agent import BfclAgentTask, gym, scores
from mrl.envs.tool_call import parse_call
from mrl.modeling.models import load_tokenizer

DEEP = '{"name": "ls", "arguments": ' + "[" * 1000  # the issue's `<tool_call>[[[[...`
DIGITS = '{"name": "add", "arguments": {"a": ' + "9" * 4301 + ', "b": 1}}'
DEEP_ARGUMENTS = '{"name": "ls", "arguments": {"a": ' + "[" * 600 + "]" * 600 + "}}"
SURROGATE = '{"name": "echo", "arguments": {"content": "\\ud800"}}'
STRING_ARGUMENTS = json.dumps({"name": "ls", "arguments": "[" * 5000})


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    return load_tokenizer(str(build_chat_model(tmp_path_factory.mktemp("hostile") / "hermes", TEMPLATES["hermes"])))


# ----------------------------------------------------------------------------------------- parsing is total


def test_the_payloads_crash_pythons_own_decoder():
    with pytest.raises(RecursionError):
        json.loads(DEEP + "]" * 1000 + "}")
    with pytest.raises(ValueError, match="Exceeds the limit"):
        json.loads(DIGITS)
    arguments = json.loads(DEEP_ARGUMENTS)["arguments"]
    with pytest.raises(RecursionError):  # what the gym's size check did with it
        copy.deepcopy(arguments)


@pytest.mark.parametrize("payload, error", [
    (DEEP, "the tool call is nested deeper than 32 levels"),
    (DEEP + "]" * 1000 + "}", "the tool call is nested deeper than 32 levels"),
    (DIGITS, "the tool call has a number of 4301 characters (999999999999...), over the 40 allowed"),
    (DEEP_ARGUMENTS, "the tool call is nested deeper than 32 levels"),
    (SURROGATE, "the tool call has a string that is not valid Unicode (a lone surrogate)"),
    ('{"name": "ls", "arguments": "' + "x" * 200_000 + '"}', "the tool call is 200031 characters, over the 100000 "
                                                             "allowed"),
])
def test_a_hostile_call_is_an_invalid_call_not_an_exception(payload, error):
    name, arguments, said = read_call(payload)
    assert (name, arguments) == ("", {})
    assert said.startswith(error + "; write <tool_call>"), said
    assert parse_call(payload) is None  # tool_call's channel reads the completion the same way


def test_arguments_written_as_a_deep_json_string_stay_a_string():
    name, arguments, error = read_call(STRING_ARGUMENTS)
    assert (name, arguments, error) == ("ls", "[" * 5000, None)  # then refused by the tool as not an object


def test_no_text_makes_read_call_raise():
    rng = random.Random(30)
    alphabet = ['{', '}', '[', ']', '"', '\\', ':', ',', '9', '-', 'e', '.', 'name', 'arguments', ' ', '\\ud800',
                'NaN', 'true', 'null']
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        name, arguments, error = read_call(text)
        assert isinstance(name, str) and (error is None or error.startswith("the tool call"))
    for depth in (31, 32, 33, 999, 1001, 100_000):
        error = read_call('{"name": "f", "arguments": ' + "[" * depth + "]" * depth + "}")[2]
        assert (error is None) == (depth < 32), (depth, error)  # the object itself is one level


def test_hostile_calls_in_a_bfcl_episode_are_invalid_calls_and_score(hermes):
    task = BfclAgentTask(categories=["multi_turn_base"], max_calls_per_turn=5)
    e = task.entries["multi_turn_base_1"]
    turns = [f"<tool_call>{payload}</tool_call>" for payload in (DEEP, DIGITS, DEEP_ARGUMENTS, SURROGATE)]
    episode = play(hermes, task, e["id"], turns + ["Done.<|im_end|>"] * 4, max_new=30_000)
    assert [(c.name, c.valid) for c in episode.tool_calls] == [("", False)] * 4
    assert all(c.observation.startswith("error: the tool call ") for c in episode.tool_calls)
    assert scores(episode) == {"correctness": 0.0, "turns": 0.0, "efficiency": 0.0, "safety": 0.0}


# ------------------------------------------------------------------------------- the gym: bounded, total


def test_hostile_arguments_are_error_results_of_the_gym():
    world = gym.World(entry("multi_turn_base_0"))
    deep = json.loads(DEEP_ARGUMENTS)["arguments"]
    assert world.call("ls", deep) == "Error during execution: an argument of ls is nested deeper than 32 levels"
    e = entry("multi_turn_base_0")
    calls = [[("ls", deep)]] + [[] for _ in e["ground_truth"][1:]]
    assert gym.replay(e, calls) == {"correctness": 0.0, "turns": 0.0, "efficiency": 0.0, "safety": 0.0}


def math_world() -> gym.World:
    return gym.World(entry(next(e["id"] for e in gym.load_entries("multi_turn_base")
                                if "MathAPI" in e["involved_classes"])))


def test_an_uninterruptible_precision_is_refused_before_it_runs_and_decimals_context_is_restored():
    world, prec = math_world(), decimal.getcontext().prec
    start = time.perf_counter()
    assert world.call("square_root", {"number": 2, "precision": 3_000_000}) == \
        "Error during execution: precision=3000000 of square_root is beyond 1000"
    assert world.call("logarithm", {"value": 8, "base": 2, "precision": 10 ** 9}).endswith("is beyond 1000")
    assert time.perf_counter() - start < 1.0
    assert world.call("square_root", {"number": 2, "precision": 50}) == \
        "{'result': Decimal('1.4142135623730950488016887242096980785696718753769')}"  # BFCL's own text
    assert decimal.getcontext().prec == prec  # BFCL sets the thread's context; the call ran in a local one


def dag(rounds: int) -> list[gym.Call]:
    """Each round doubles the paths to the same few directories: `cp` shares a directory's contents, and `mv`
    puts the original and the copy under one new directory."""
    calls = []
    for _ in range(rounds):
        calls += [("cp", {"source": "documents", "destination": "e"}), ("mkdir", {"dir_name": "f"}),
                  ("mv", {"source": "documents", "destination": "f"}), ("mv", {"source": "e", "destination": "f"}),
                  ("mv", {"source": "f", "destination": "documents"})]
    return calls


def test_a_file_system_of_shared_directories_is_walked_once_per_directory():
    e = entry("multi_turn_base_2")  # cp is available; the user's home holds `documents`
    world = gym.World(e)
    assert all("rror" not in world.call(*call) for call in dag(20))  # 2**20 paths to the deepest file
    start = time.perf_counter()
    flat = gym.leaves(world.state())
    assert len(flat) < 200 and time.perf_counter() - start < 1.0
    assert sum(isinstance(v, gym.Shared) for v in flat.values()) >= 20
    start = time.perf_counter()
    result = gym.replay(e, [dag(20)] + [[] for _ in e["ground_truth"][1:]])
    assert result == {"correctness": 0.0, "turns": 0.0, "efficiency": -1.0, "safety": -1.0}
    assert time.perf_counter() - start < 10.0


def test_an_episode_beyond_max_calls_is_a_violation_not_a_walk():
    e = entry("multi_turn_base_2")
    verdict = gym.check(e, [[("pwd", {})] * (gym.MAX_CALLS + 1)])
    assert not verdict.correct and verdict.violations == [f"{gym.MAX_CALLS + 1} calls, over the 500 the checks run"]


def test_a_state_too_deep_to_walk_is_a_violation_not_a_crash():
    e = entry("multi_turn_base_2")
    calls = [c for i in range(60) for c in (("mkdir", {"dir_name": f"d{i}"}), ("cd", {"folder": f"d{i}"}))]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(150)  # 60 directories deep then is past what deepcopy walks
    try:
        verdict = gym.check(e, [calls])
    finally:
        sys.setrecursionlimit(old)
    assert verdict.violations == ["a state nested too deep to compare"] and not verdict.correct


def test_a_megabyte_result_is_cut_to_the_budget_without_tokenizing_it(hermes):
    result = json.dumps({"matches": [f"./documents/f/documents/f/e/file{i}.txt" for i in range(400_000)]})
    assert len(result) > 15_000_000  # what `find` returned on the shared-directory tree
    start = time.perf_counter()
    ids, kept, cut = _cut_to(hermes, result, 512, lambda s: s)
    assert time.perf_counter() - start < 5.0  # was 4.4 s to 60 s and 4.5 GB per call
    assert cut and len(ids) <= 512 and result.startswith(kept) and len(kept) <= 512 * CHARS_PER_TOKEN
    short = "a small result"
    assert _cut_to(hermes, short, 512, lambda s: s) == (hermes(short, add_special_tokens=False).input_ids, short,
                                                        False)


def test_bounded_check_is_iterative_at_any_depth():
    value: list = []
    for _ in range(100_000):
        value = [value]
    assert safe_json.check(value) == "is nested deeper than 32 levels"
    assert safe_json.check({"a": [1, 2 ** 60]}, max_int=2 ** 53) == "has an integer beyond 9007199254740992"
    assert safe_json.check({"a": [1, 2 ** 50]}, max_int=2 ** 53) is None


# ------------------------------------------------------------------------------------ worlds are isolated


EXTENSION_CARD = "2345678923456789"  # a card TravelAPI's long-context scenario adds from a module-level dict


def test_a_charge_in_one_world_leaves_the_module_level_cards_of_the_next_alone():
    e = entry("multi_turn_long_context_155")
    world = gym.World(e)
    cards = world.instances["TravelAPI"].credit_card_list
    assert EXTENSION_CARD in cards and EXTENSION_CARD not in e["initial_config"]["TravelAPI"].get(
        "credit_card_list", {})
    balance = cards[EXTENSION_CARD]["balance"]
    for text in e["ground_truth"][0]:
        world.call_string(text)
    result = world.call("purchase_insurance", {"access_token": "abc123xyz", "insurance_type": "comprehensive",
                                               "booking_id": "3426812", "insurance_cost": -1e300,
                                               "card_id": EXTENSION_CARD})
    assert "insurance_id" in result and world.instances["TravelAPI"].credit_card_list[EXTENSION_CARD]["balance"] \
        == 1e300  # the attack landed in this world
    assert gym.World(e).instances["TravelAPI"].credit_card_list[EXTENSION_CARD]["balance"] == balance
    assert gym.replay(e, gym.gold_calls(e))["correctness"] == 1.0


def test_a_mention_on_a_tweet_without_mentions_reaches_no_other_tweet():
    e = next(x for x in gym.load_entries("multi_turn_base") if "TwitterAPI" in x["involved_classes"])
    world = gym.World(e)
    world.call("authenticate_twitter", {"username": world.instances["TwitterAPI"].username,
                                        "password": world.instances["TwitterAPI"].password})
    posted = json.loads(world.call("post_tweet", {"content": "hello"}))
    world.call("mention", {"tweet_id": posted["id"], "mentioned_usernames": ["@evil"]})
    assert world.instances["TwitterAPI"].tweets[posted["id"]]["mentions"] == ["@evil"]
    for other in (world, gym.World(e)):
        other.call("authenticate_twitter", {"username": other.instances["TwitterAPI"].username,
                                            "password": other.instances["TwitterAPI"].password})
        fresh = json.loads(other.call("post_tweet", {"content": "plain"}))
        assert fresh["mentions"] == [], fresh


def reachable(instances: dict) -> list:
    """Every dict, list and set reachable from a world's instances, private attributes included."""
    found, seen, stack = [], set(), list(instances.values())
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, (list, set)):
            found.append(item)
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type) and type(item).__module__.startswith(
                gym.SOURCE):
            stack.extend(vars(item).values())
    return found


def every_function_called(e: dict, world: gym.World, examples: dict[str, dict]) -> None:
    for text in (s for turn in e["ground_truth"] for s in turn):
        world.call_string(text)
    for name in sorted(world.methods):
        world.call(name, copy.deepcopy(examples.get(name, {})))


@pytest.fixture(scope="module")
def examples() -> dict[str, dict]:
    """Arguments of one ground-truth call of every function BFCL's multi-turn data calls."""
    found = {}
    for category in gym.CATEGORIES:
        for e in gym.load_entries(category):
            for turn in gym.gold_calls(e):
                for name, arguments in turn:
                    found.setdefault(name, arguments)
    return found


@pytest.mark.parametrize("category", gym.CATEGORIES)
def test_a_world_changed_through_every_function_and_every_object_leaves_fresh_worlds_alone(category, examples):
    """The probe: every function called (the ground truth's calls, then each function once more), then every
    container reachable from the world's instances changed in place; a fresh world of every entry is as before."""
    entries = gym.load_entries(category)[::10]
    classes = {c for e in entries for c in e["involved_classes"]}
    assert classes == set(gym.CLASSES)  # the probe reaches every class the gym loads
    before = {e["id"]: gym.leaves(gym.World(e).state()) for e in entries}
    for e in entries:
        world = gym.World(e)
        every_function_called(e, world, examples)
        for item in reachable(world.instances):
            if isinstance(item, dict):
                item["__probe__"] = "probe"
            elif isinstance(item, list):
                item.append("probe")
            else:
                item.add("probe")
    for e in entries:
        assert gym.leaves(gym.World(e).state()) == before[e["id"]], e["id"]


# ------------------------------------------------------------------- the ground truth played as a policy


MUTATED = [f"{c}_{n}" for c in gym.CATEGORIES for n in (90, 147)]  # the entries a perfect episode scored 0 on


def hostile_turns(e: dict) -> list[str]:
    """The issue's attacks, whatever `e`'s classes: mentions, charges, deep and huge calls."""
    attacks = [{"name": "mention", "arguments": {"tweet_id": 0, "mentioned_usernames": ["@evil"]}},
               {"name": "purchase_insurance", "arguments": {"access_token": "abc123xyz", "insurance_cost": -1e300,
                                                            "insurance_type": "x", "booking_id": "3426812",
                                                            "card_id": EXTENSION_CARD}},
               {"name": "square_root", "arguments": {"number": 2, "precision": 3_000_000}}]
    return [f"<tool_call>{json.dumps(a)}</tool_call>" for a in attacks] + [f"<tool_call>{DEEP}</tool_call>"]


def gold_scores(hermes, entries: list[str]) -> dict[str, dict]:
    # max_calls_per_turn: BFCL's ground truth makes up to 34 calls in one user turn
    tasks = {c: BfclAgentTask(categories=[c], eval_percent=0, max_calls_per_turn=40) for c in gym.CATEGORIES}
    found = {}
    for entry_id in entries:
        task = tasks[entry_id.rsplit("_", 1)[0]]
        e = task.entries[entry_id]
        found[entry_id] = scores(play(hermes, task, entry_id, scripted(gym.gold_calls(e)), max_new=20_000))
    return found


def test_the_ground_truth_as_a_policy_scores_as_its_replay_before_and_after_a_hostile_rollout(hermes):
    perfect = {"correctness": 1.0, "turns": 1.0, "efficiency": 0.0, "safety": 0.0}
    assert all(gym.replay(entry(i), gym.gold_calls(entry(i))) == perfect for i in MUTATED)
    assert gold_scores(hermes, MUTATED) == {i: perfect for i in MUTATED}
    task = BfclAgentTask(categories=["multi_turn_long_context"], eval_percent=0, max_calls_per_turn=40)
    for entry_id in ("multi_turn_long_context_155", "multi_turn_long_context_147"):
        play(hermes, task, entry_id, hostile_turns(task.entries[entry_id]) + ["Done.<|im_end|>"] * 8)
    assert gold_scores(hermes, MUTATED) == {i: perfect for i in MUTATED}


@pytest.mark.slow
def test_the_ground_truth_as_a_policy_scores_as_its_replay_on_every_entry(hermes):
    ids = [e["id"] for c in gym.CATEGORIES for e in gym.load_entries(c) if e["id"] != "multi_turn_miss_func_49"]
    perfect = {"correctness": 1.0, "turns": 1.0, "efficiency": 0.0, "safety": 0.0}
    got = gold_scores(hermes, ids)
    assert {i: s for i, s in got.items() if s != perfect} == {}

