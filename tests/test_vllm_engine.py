"""vLLM as the rollout engine (`rollout.engine=vllm`, mrl/generation/vllm_engine.py) and the importance weight that
corrects its small off-policy gap (mrl.algo.losses.sampler_importance_weights).

The weight, the gap, the LoRA merge and the refusals run everywhere; the engine's own tests skip where vLLM is not
importable (`make install-vllm`) or SmolLM2 is not built (`make smollm2`): greedy tokens equal to HF `generate`'s over
multi-turn tool episodes, sampled log-probs equal to the trainer's, a weight sync that changes the next rollout (and
restoring that restores it), seeded prompts longer than one prefill step.  Training runs with vLLM are in
test_vllm_training.py (each closes its own vLLM, which would break this module's shared engine).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import compose_config

from mrl.algo.losses import logprob_gap, sampler_importance_weights
from mrl.core.config import ModelConfig, UserError
from mrl.generation import rollout
from mrl.generation.rollout import ROLLOUT_ENGINES, InProcessEngine, Sampling
from mrl.generation.vllm_engine import plain_weights
from mrl.train.validation import validate

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
CPU = torch.device("cpu")
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not (SMOLLM2 / "config.json").exists(),
    reason="needs vLLM (make install-vllm) and SmolLM2 (make smollm2)")
# The trainer's compute dtype where the schema has one (bf16 on a CPU with AMX by default): float32 here, so that the
# gap measured is the engines' and not bf16's rounding.
FP32 = ["model.compute_dtype=float32"] if "compute_dtype" in {f.name for f in fields(ModelConfig)} else []


def test_importance_weights_by_hand():
    """Two rows of three tokens, the last of row 1 padding.  log r = old - sampler:
    row 0: 1.0, -0.5, 0.2  -> r = 2.718, 0.607, 1.221; the row's sum 0.7 -> 2.014
    row 1: 0.1,  0.3, pad  -> r = 1.105, 1.350;        the row's sum 0.4 -> 1.492"""
    old = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.2, -9.0]])
    sampler = torch.tensor([[-2.0, -1.5, -0.5], [-0.6, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    e = math.exp
    cases = {
        "token_truncate": [[2.0, e(-0.5), e(0.2)], [e(0.1), e(0.3), 0.0]],  # min(r, 2)
        "token_mask": [[0.0, e(-0.5), e(0.2)], [e(0.1), e(0.3), 0.0]],  # r > 2 -> 0
        "sequence_truncate": [[2.0, 2.0, 2.0], [e(0.4), e(0.4), 0.0]],  # min(e^0.7, 2) on every token of the row
        "sequence_mask": [[0.0, 0.0, 0.0], [e(0.4), e(0.4), 0.0]],  # e^0.7 > 2: the whole row out
        "none": [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]],
    }
    for mode, expected in cases.items():
        weights = sampler_importance_weights(old, sampler, mask, mode, 2.0)
        assert torch.allclose(weights, torch.tensor(expected), atol=1e-6), mode
    # A larger cap keeps the whole row: e^0.7 = 2.014 < 2.1
    assert torch.allclose(sampler_importance_weights(old, sampler, mask, "sequence_mask", 2.1)[0],
                          torch.full((3,), e(0.7)))
    # No gradient flows through the weight, whatever the old log-probs carry.
    assert not sampler_importance_weights(old.requires_grad_(), sampler, mask, "token_truncate", 2.0).requires_grad
    with pytest.raises(UserError, match="rollout.importance_weight='tis': choose one of token_truncate"):
        sampler_importance_weights(old, sampler, mask, "tis", 2.0)


def test_logprob_gap_by_hand():
    """|old - sampler| on the generated tokens: 1.0, 0.5, 0.2, 0.1, 0.3 (the padding's 8.0 left out)."""
    old = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.2, -9.0]])
    sampler = torch.tensor([[-2.0, -1.5, -0.5], [-0.6, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    mean, largest = logprob_gap(old, sampler, mask)
    assert mean == pytest.approx(2.1 / 5) and largest == pytest.approx(1.0)
    assert logprob_gap(old, sampler, torch.zeros_like(mask)) == (0.0, 0.0)


def test_the_update_weighs_each_token_by_the_truncated_ratio(cfg, model, tokenizer):
    """One micro-batch's policy loss with sampler log-probs equals the loss without them with each token's
    surrogate multiplied by min(exp(old - sampler), 2), by hand; its gap metrics are the tokens' |old - sampler|."""
    from conftest import algo_settings

    from mrl.chat.protocols import WordsProtocol
    from mrl.core.episode import Prompt
    from mrl.generation.rollout import generate
    from mrl.modeling.models import Actor
    from mrl.train.batch import StepBatch
    from mrl.train.update import micro_loss, policy_forward

    protocol = WordsProtocol(tokenizer, {}, tuple(str(d) for d in range(10)), 1)
    torch.manual_seed(0)
    rollouts = generate(model, tokenizer, [Prompt("add 3 4 ="), Prompt("7")], 2, Sampling(6), protocol, CPU)
    mask = rollouts.completion_mask.float()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * mask
    settings = algo_settings(compose_config("algo=grpo", "algo.loss_agg=token_mean", "algo.entropy_coef=0",
                                          "algo.kl_coef=0"))
    actor = Actor(model)
    tokens = float(mask.sum())
    plain, _ = micro_loss(settings, actor, StepBatch(rollouts, loss_mask=mask, advantages=advantages), tokens, tokens,
                          1.0)
    with torch.no_grad():
        old = policy_forward(actor, rollouts)[0]  # ratio 1 at the first step: the surrogate is -advantage
    torch.manual_seed(1)
    sampler = (old - torch.randn_like(mask)) * mask  # log r = old - sampler ~ N(0, 1): some tokens above log 2
    rollouts.sampler_logprobs = sampler
    weighted, stats = micro_loss(settings, actor, StepBatch(rollouts, loss_mask=mask, advantages=advantages), tokens,
                                 tokens, 1.0)
    weights = torch.clamp(torch.exp(old - sampler), max=2.0) * mask
    assert (weights == 2.0).any() and (weights[mask.bool()] < 2.0).any()  # both sides of the cap are exercised
    assert plain.item() == pytest.approx((-advantages * mask).sum().item() / tokens, rel=1e-5)
    assert weighted.item() == pytest.approx((-advantages * weights).sum().item() / tokens, rel=1e-5)
    gap = (old - sampler).abs() * mask
    assert stats["rollout/logprob_gap"] == pytest.approx(gap.sum().item() / tokens, rel=1e-5)
    assert stats["rollout/logprob_gap_max"] == pytest.approx(gap.max().item(), rel=1e-5)


def test_lora_weights_reach_the_engine_merged(cfg):
    """What vLLM loads from a LoRA policy: the plain model's names, each adapted weight W + B A (alpha / r), equal to
    peft's own merge; the training module keeps its adapters."""
    from peft import LoraConfig, get_peft_model

    from mrl.modeling.models import load_causal_lm, resolve_model_path

    base = load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU)
    plain_names = set(base.state_dict())
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B starts at 0: make the adapters change something
    weights = dict(plain_weights(policy))
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert set(weights) == plain_names == set(merged)
    for name, tensor in merged.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name
    changed = [n for n in weights if not torch.equal(weights[n], dict(base.named_parameters()).get(
        n.replace("q_proj.weight", "q_proj.base_layer.weight").replace("v_proj.weight", "v_proj.base_layer.weight"),
        weights[n]))]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    assert any("lora_A" in n for n, _ in policy.named_parameters())  # not merged into the training module


def test_vllm_refusals_name_the_fix(monkeypatch):
    """The built-in tiny model, vLLM not installed, several ranks: one line each, at validation (before anything is
    written); ZeRO-3 is not refused (its weights are gathered for vLLM)."""
    with pytest.raises(UserError, match=r"rollout.engine=vllm: vLLM cannot run the built-in tiny model"):
        validate(compose_config("rollout.engine=vllm"))
    monkeypatch.setattr(rollout, "vllm_missing", lambda: "vLLM is not installed")
    with pytest.raises(UserError, match=r"rollout.engine=vllm: vLLM is not installed: pip install 'mrl\[vllm\]'"):
        validate(compose_config("rollout.engine=vllm", f"model.name_or_path={SMOLLM2}"))
    monkeypatch.setattr(rollout, "vllm_missing", lambda: None)
    monkeypatch.setattr(rollout, "unsupported_model", lambda model_dir: None)
    zero3 = compose_config("rollout.engine=vllm", f"model.name_or_path={SMOLLM2}", "deepspeed=zero3")
    assert rollout.vllm_refusal(zero3) is None  # its weights are gathered for vLLM
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"rollout.engine=vllm: one vLLM per rank is not built \(2 ranks\): run on one "
                                        r"process, or rollout.engine=auto"):
        validate(compose_config("rollout.engine=vllm", f"model.name_or_path={SMOLLM2}", "deepspeed=zero2"))
    with pytest.raises(UserError, match="rollout.importance_weight='tis'"):
        validate(compose_config("rollout.importance_weight=tis"))
    with pytest.raises(UserError, match="rollout.importance_cap"):
        validate(compose_config("rollout.importance_cap=0.5"))


def test_auto_keeps_the_training_module_where_vllm_cannot_run(monkeypatch, cfg, model, tokenizer):
    """`auto` without vLLM installed, or with the tiny model, decodes in the training module as before."""
    monkeypatch.setattr(rollout, "vllm_missing", lambda: "vLLM is not installed")
    assert isinstance(ROLLOUT_ENGINES["auto"](compose_config(f"model.name_or_path={SMOLLM2}"), model, tokenizer, CPU),
                      InProcessEngine)
    monkeypatch.setattr(rollout, "vllm_missing", lambda: None)
    assert isinstance(ROLLOUT_ENGINES["auto"](cfg, model, tokenizer, CPU), InProcessEngine)  # builtin:tiny


def test_the_cli_refuses_vllm_on_the_tiny_model_with_exit_2(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "mrl.cli", "train", "rollout.engine=vllm", "logger=none",
                           f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "mrl: error: rollout.engine=vllm: vLLM cannot run the built-in tiny model" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not run.exists()


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 on calc_agent (its own chat format; greedy, it calls the calc tool, whose result is appended, then
    answers): the config, a live policy whose weights differ from the dir's (as a warm start's or a resume's do), its
    tokenizer, protocol and 3 prompts."""
    from mrl.envs.task import build_task, episode_protocol
    from mrl.modeling.models import load_causal_lm, load_tokenizer

    cfg = compose_config("model=smollm2_local", f"model.name_or_path={SMOLLM2}", "rewards=calc_agent",
                         "trainer.max_new_tokens=48",
                         *FP32, shrink=False)
    policy = load_causal_lm(str(SMOLLM2), cfg.model, CPU).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1 + 0.01 * torch.randn_like(p))
    tokenizer = load_tokenizer(str(SMOLLM2))
    task = build_task(cfg)
    return cfg, policy, tokenizer, episode_protocol(cfg, tokenizer, task), [task.prompt(i) for i in range(3)]


@pytest.fixture(scope="module")
def vllm_engine(smollm2):
    """One engine for the module's tests (a start takes ~30 s), shut down after them (its process group with it)."""
    cfg, policy, tokenizer, _, _ = smollm2
    engine = ROLLOUT_ENGINES["vllm"](cfg, policy, tokenizer, CPU)
    yield engine
    engine.close()


TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention")


@needs_vllm
def test_greedy_episodes_equal_hf_generates(smollm2, vllm_engine):
    """Greedy, fp32: the same tokens, masks and layout as the HF engine on the live policy (not the dir's weights),
    over multi-turn episodes (the calc tool's result appended between turns)."""
    cfg, policy, tokenizer, protocol, prompts = smollm2
    sampling = Sampling(48, greedy=True)
    hf = InProcessEngine(policy, tokenizer, CPU).generate(prompts, 2, sampling, protocol)
    ours = vllm_engine.generate(prompts, 2, sampling, protocol)
    for name in TENSORS:
        assert torch.equal(getattr(hf, name), getattr(ours, name)), name
    assert [e.completion for e in ours.episodes] == [e.completion for e in hf.episodes]
    assert all(e.observation_tokens > 0 and len(e.turns) >= 2 for e in ours.episodes)  # a tool's result, then more
    assert ours.sampler_logprobs is not None and hf.sampler_logprobs is None


@needs_vllm
def test_sampled_logprobs_are_the_trainers(smollm2, vllm_engine):
    """Sampled at temperature 0.8 with top-k 40: vLLM's log-prob of each token is the trainer's (logits / T, top-k
    truncated: what the loss scores) within 1e-3 in fp32; a seed fixes the tokens."""
    from mrl.modeling.models import Actor
    from mrl.train.update import policy_forward

    cfg, policy, tokenizer, protocol, prompts = smollm2
    sampling = Sampling(32, temperature=0.8, top_k=40)
    torch.manual_seed(1)
    first = vllm_engine.generate(prompts[:2], 4, sampling, protocol)
    torch.manual_seed(1)
    again = vllm_engine.generate(prompts[:2], 4, sampling, protocol)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert len({tuple(r) for r in first.completion_ids.tolist()}) > 2  # each row its own draw
    with torch.no_grad():
        trainer = policy_forward(Actor(policy), first, sampling.temperature, warp=sampling.truncation())[0]
    mean, largest = logprob_gap(trainer, first.sampler_logprobs, first.completion_mask.float())
    assert largest < 1e-3, (mean, largest)


@needs_vllm
def test_a_weight_sync_changes_the_next_rollout_and_restoring_restores_it(smollm2, vllm_engine):
    cfg, policy, tokenizer, protocol, prompts = smollm2
    sampling = Sampling(24, greedy=True)
    before = vllm_engine.generate(prompts, 1, sampling, protocol).completion_ids
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    assert torch.equal(vllm_engine.generate(prompts, 1, sampling, protocol).completion_ids, before)  # its own copy
    vllm_engine.sync_weights(policy)
    moved = vllm_engine.generate(prompts, 1, sampling, protocol).completion_ids
    hf_moved = InProcessEngine(policy, tokenizer, CPU).generate(prompts, 1, sampling, protocol).completion_ids
    assert torch.equal(moved, hf_moved) and not torch.equal(moved, before)
    policy.load_state_dict(saved)
    vllm_engine.sync_weights(policy)
    assert torch.equal(vllm_engine.generate(prompts, 1, sampling, protocol).completion_ids, before)


@needs_vllm
def test_seeded_requests_longer_than_one_prefill_batch_sample(smollm2, vllm_engine):
    """Prompts whose tokens together pass one step's prefill budget (held-out evaluation's long tool prompts): each
    prompt is prefilled whole (chunked, vLLM 0.32's CPU runner rewinds the seeded request's generator and fails:
    "CPU Generator does not use offset"), and the same seeds draw the same tokens."""
    sampler = vllm_engine.sampler
    length = sampler.settings.max_model_len // 2 - 8
    rows = torch.randint(100, 40000, (3, length), generator=torch.Generator().manual_seed(0)).tolist()
    torch.manual_seed(2)
    first = sampler.turn(rows, [4] * 3, Sampling(4), [], ())
    torch.manual_seed(2)
    again = sampler.turn(rows, [4] * 3, Sampling(4), [], ())
    assert [ids for ids, _ in first] == [ids for ids, _ in again] and all(len(ids) == 4 for ids, _ in first)
