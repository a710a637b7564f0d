"""Issue 59, item 6: memory bounded against the policy.  The BFCL gym releases what a call built when the call is cut
(no reference cycles kept) and bounds the bytes of results one episode may hold; the update's memory grows linearly
in the completion's length (the output layer and its log-softmax in chunks)."""

from __future__ import annotations

import gc
import weakref

import pytest

from mrl.envs.bfcl_agent import gym


@pytest.fixture
def world(monkeypatch):
    pytest.importorskip("bfcl_eval")
    entry = next(e for e in gym.load_entries("multi_turn_base") if e["id"] == "multi_turn_base_0")  # a file system
    return gym.World(entry)


class Big:
    """What a call holds while it runs (weak-referenceable: the test sees when it is freed)."""


@pytest.fixture
def no_automatic_gc():
    """The cycle collector only when called: what is freed is freed by the code under test, not by chance."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_cut_call_releases_what_it_built_at_once(world, monkeypatch, no_automatic_gc):
    monkeypatch.setattr(gym, "CALL_SECONDS", 0.2)
    held = []

    def grows(**kwargs):
        big = Big()
        held.append(weakref.ref(big))

        def walk():  # a closure that refers to itself (BFCL's find: recursive_search), holding what it built
            return walk, big
        while True:
            pass

    world.methods["ls"] = grows
    assert world.call("ls", {}) == "Error during execution: the call ran past 0.2 s"
    assert held[0]() is None  # the old code: alive in the closure's cycle until a full collection


def test_a_policys_find_over_a_tree_it_grew_with_cp_is_cut_and_leaves_no_cycle(world, no_automatic_gc):
    """The probe's attack, at 16 levels instead of 22: each level a dir holding the last level twice (`cp`'s copies
    share their children), so `find` lists 2^16 paths (7 MB of text: the probe's 22 levels were 1.2 GB)."""
    call = lambda name, **arguments: world.call(name, arguments)  # noqa: E731
    call("mkdir", dir_name="a"), call("cd", folder="a"), call("touch", file_name="f"), call("cd", folder="..")
    for _ in range(16):
        call("mkdir", dir_name="n"), call("cp", source="a", destination="n"), call("cd", folder="n")
        call("cp", source="a", destination="b"), call("cd", folder=".."), call("rm", file_name="a")
        call("mv", source="n", destination="a")
    found = call("find", path="a")
    assert found.endswith(gym.RESULTS_CUT) or found.startswith("Error during execution: the call ran past")
    assert len(found.encode()) <= gym.RESULT_BYTES + len(gym.RESULTS_CUT)  # the old code: 7,143,431 bytes
    assert gc.collect() == 0  # the old code: 7 cycles (find's closure and its 7 MB list among them)


def test_an_episodes_results_stop_at_result_bytes(world, monkeypatch):
    monkeypatch.setattr(gym, "RESULT_BYTES", 1000)
    monkeypatch.setattr(gym, "RESULTS_CUT", " [cut]")
    world.methods["ls"] = lambda **kwargs: "é" * 300  # 600 bytes, 300 characters
    assert world.call("ls", {}) == "é" * 300 and world.result_bytes == 600
    assert world.call("ls", {}) == "é" * 200 + " [cut]"  # 400 bytes left: 200 characters of 2 bytes
    assert world.call("ls", {}) == " [cut]" and world.result_bytes == 1000
    fresh = gym.World(world.entry)  # the bound is per episode: a new world starts at 0
    assert fresh.call("pwd", {}) == '{"current_working_directory": "/workspace"}' and fresh.result_bytes == 43
