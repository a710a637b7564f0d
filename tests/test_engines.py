"""The rollout-engine seam (mrl.generation.rollout.RolloutEngine): the HF engine behind it samples what `generate`
samples, and another engine, registered by name, trains without a change to the loop."""

from __future__ import annotations

import pytest
import torch

from mrl.chat.protocols import Tool, WordsProtocol
from mrl.core.episode import Episode, Prompt
from mrl.generation.rollout import ROLLOUT_ENGINES, InProcessEngine, Rollouts, Sampling, generate
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

CPU = torch.device("cpu")
TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention")


def test_the_hf_engine_samples_what_generate_samples(model, tokenizer):
    """Same seed, same tokens: the seam adds nothing to the HF path (multi-turn, tools, a shared prompt cache)."""
    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [Prompt("add 3 4 ="), Prompt("7"), Prompt("max 2 9 =")]
    sampling = Sampling(10, temperature=0.9, top_k=20)
    torch.manual_seed(0)
    direct = generate(model, tokenizer, prompts, 4, sampling, protocol, CPU)
    torch.manual_seed(0)
    engine = ROLLOUT_ENGINES["hf"](None, model, tokenizer, CPU)
    assert isinstance(engine, InProcessEngine)
    through = engine.generate(prompts, 4, sampling, protocol)
    assert sum(len(e.tool_calls) for e in direct.episodes) > 0  # later turns were generated too
    for name in TENSORS:
        assert torch.equal(getattr(direct, name), getattr(through, name)), name
    assert through.episodes == direct.episodes
    engine.sync_weights(model)  # it samples from the live module: nothing to do, nothing changes


class ScriptedEngine:
    """Another generator behind the seam, without the policy: each prompt's rollouts answer, in turn, the target and
    the digit after it (`same`: all the target), one digit then <eos>, token-in/token-out.  Records the loop's
    calls."""

    copies_weights = False  # it reads the live policy

    def __init__(self, policy: torch.nn.Module, tokenizer, same: bool):
        self.policy, self.tokenizer, self.same = policy, tokenizer, same
        self.initial = {k: v.clone() for k, v in policy.state_dict().items()}
        self.calls: list[str] = []

    def generate(self, prompts: list[Prompt], group_size: int, sampling: Sampling,
                 protocol: WordsProtocol) -> Rollouts:
        self.calls.append("generate")
        encoded = [protocol.prompt_ids(p) for p in prompts]
        width = max(len(ids) for ids in encoded)
        eos = self.tokenizer.eos_token_id
        prompt_ids, prompt_mask, completion_ids, episodes = [], [], [], []
        for b, prompt in enumerate(prompts):
            for g in range(group_size):
                answer = str((prompt.meta["target"] + (0 if self.same else g % 2)) % 10)
                digit = self.tokenizer.encode(answer, add_special_tokens=False)
                prompt_ids.append([self.tokenizer.pad_token_id] * (width - len(encoded[b])) + encoded[b])
                prompt_mask.append([0] * (width - len(encoded[b])) + [1] * len(encoded[b]))
                completion_ids.append(digit + [eos])
                episodes.append(Episode(prompt, answer, digit, len(digit) + 1, False, sampling.max_new_tokens,
                                        turns=[answer]))
        ids = torch.tensor(completion_ids)
        return Rollouts(torch.tensor(prompt_ids), torch.tensor(prompt_mask), ids, torch.ones_like(ids),
                        torch.ones_like(ids), episodes, group_size)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        assert policy is self.policy  # the live policy, the one the builder was given
        self.calls.append("sync")

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def scripted(monkeypatch):
    """Registers `scripted` and `scripted_same` in ROLLOUT_ENGINES; yields the engines the runs build."""
    built: list[ScriptedEngine] = []

    def builder(same: bool):
        def build(cfg, policy, tokenizer, device):
            built.append(ScriptedEngine(policy, tokenizer, same))
            return built[-1]
        return build

    monkeypatch.setitem(ROLLOUT_ENGINES, "scripted", builder(same=False))
    monkeypatch.setitem(ROLLOUT_ENGINES, "scripted_same", builder(same=True))
    return built


def test_a_registered_engine_drives_training_and_is_synced_after_each_update(scripted, make_cfg, tmp_path):
    cfg = make_cfg("algo=grpo", "rollout.engine=scripted", "trainer.max_steps=2")
    final = train(cfg, tmp_path)
    [engine] = scripted
    assert engine.calls == ["generate", "sync", "generate", "sync", "close"]  # a sync after each update; closed
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2]
    # The loop scored and trained on what the engine returned: half of each group right, every answer 2 tokens.
    assert all(r["reward/correctness/mean"] == 0.5 and r["reward/efficiency/mean"] == -2.0 for r in records)
    assert final["loss/policy"] is not None and final["adv/std"] > 0
    after = engine.policy.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in engine.initial.items())  # the policy it was handed learned


def test_no_update_no_sync(scripted, make_cfg, tmp_path):
    """Dynamic sampling that finds no live group skips the update: the weights did not move, nothing to sync."""
    cfg = make_cfg("algo=dapo", "rollout.engine=scripted_same", "trainer.max_steps=1", "algo.max_gen_batches=2")
    final = train(cfg, tmp_path)
    assert scripted[0].calls == ["generate", "generate", "close"]  # two rounds of dead groups, no update
    assert final["dapo/skipped_update"] == 1.0
