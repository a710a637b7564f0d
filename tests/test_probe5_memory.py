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


# ---- the update: a long batch's layers keep only their inputs ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_policy():
    import torch
    from conftest import compose_config

    from mrl.modeling.models import load_causal_lm, resolve_model_path

    cfg = compose_config()
    return load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu")).double()


def long_batch(rows: int = 2, prompt: int = 6, completion: int = 40):
    import torch

    from mrl.generation.rollout import Rollouts

    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, 32, (1, prompt), generator=gen).expand(rows, -1).clone()  # one prompt, shared
    ids = torch.randint(4, 32, (rows, completion), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, completion // 2:] = 0  # a shorter second rollout
    return Rollouts(prompt_ids, torch.ones_like(prompt_ids), ids * mask, mask, mask, [None] * rows, rows)


def gradients(policy, batch, shared: bool = False):
    """The completion's log-probs under `policy` in training, and the gradients of a fixed weighting of them;
    `shared`: the prompt run once for the rows that share it (the update's way for short batches)."""
    import torch

    from mrl.modeling.models import Actor, position_ids

    policy.zero_grad(set_to_none=True)
    actor = Actor(policy).train()
    logprobs, _, _ = actor(batch.input_ids, batch.attention_mask, position_ids(batch.attention_mask),
                           batch.completion_ids.shape[1] + 1, prompt_width=batch.prompt_ids.shape[1] if shared else 0,
                           targets=batch.completion_ids, scored=batch.completion_mask)
    (logprobs * torch.linspace(-1, 1, logprobs.shape[1], dtype=logprobs.dtype)).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


# long_batch's estimate (mrl.modeling.models.saved_bytes): 62 positions (the prompt's last and 40 completion tokens,
# the prompt's last and 20) x 2 layers x (64 + 128) x 16 bytes
SAVED = 62 * 2 * 192 * 16


def test_a_batch_over_checkpoint_bytes_replays_its_layers_with_the_same_gradients(tiny_policy, monkeypatch):
    from mrl.modeling.models import saved_bytes

    assert saved_bytes(tiny_policy, 62) == SAVED
    layers = tiny_policy.get_decoder().layers
    calls = []  # the input shape of each call of a layer's MLP (a replayed layer calls it a second time)
    hooks = [layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape)) for layer in layers]
    try:
        counted_runs(tiny_policy, layers, calls, monkeypatch)
    finally:
        for hook in hooks:
            hook.remove()


def counted_runs(tiny_policy, layers, calls, monkeypatch):
    import torch

    from mrl.modeling import models

    batch = long_batch()  # 2 rows x (6 + 40) columns = 92 tokens
    plain_logprobs, plain = gradients(tiny_policy, batch)
    assert [tuple(c) for c in calls] == [(2, 46, 64)] * len(layers)  # once a layer, all of it saved for the backward
    monkeypatch.setattr(models, "CHECKPOINT_BYTES", SAVED - 1)
    calls.clear()
    logprobs, replayed = gradients(tiny_policy, batch, shared=True)  # (checkpointed: the plain path, not shared)
    assert [tuple(c) for c in calls] == [(2, 46, 64)] * (2 * len(layers))  # again in the backward: input kept alone
    assert not models.checkpointed(tiny_policy)  # as it was after the forward
    assert logprobs.equal(plain_logprobs) and all(replayed[n].equal(plain[n]) for n in plain)  # the same numbers
    monkeypatch.setattr(models, "CHECKPOINT_BYTES", SAVED)  # not over: as before, the prompt shared
    calls.clear()
    gradients(tiny_policy, batch, shared=True)
    assert sorted(map(tuple, calls)) == sorted([(1, 6, 64), (1, 20, 64), (1, 40, 64)] * len(layers))
    with torch.no_grad():  # no gradients, nothing to replay: scoring runs once a layer whatever its length
        monkeypatch.setattr(models, "CHECKPOINT_BYTES", 0)
        calls.clear()
        models.Actor(tiny_policy).train()(batch.input_ids, batch.attention_mask,
                                          models.position_ids(batch.attention_mask), 41, targets=batch.completion_ids)
    assert len(calls) == len(layers)


def test_saved_activations_grow_by_the_layer_inputs_alone_once_checkpointed(tiny_policy, monkeypatch):
    """What autograd saves for the backward outside the replayed layers, per token, at two lengths: the difference is
    linear in the tokens, and once the layers replay it loses what the 2 layers saved (their projections, attention,
    MLP: 30-odd tensors a token), keeping each layer's input, the final norm's and the output layer's."""
    import torch

    from mrl.modeling import models

    def saved_bytes(completion: int) -> int:
        total = []

        def pack(tensor):
            total.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gradients(tiny_policy, long_batch(completion=completion))
        return sum(total)

    plain = saved_bytes(80) - saved_bytes(40)  # 2 rows x 40 more tokens
    monkeypatch.setattr(models, "CHECKPOINT_BYTES", 0)
    replayed = saved_bytes(80) - saved_bytes(40)
    assert 0 < replayed < plain / 4, (replayed, plain)
