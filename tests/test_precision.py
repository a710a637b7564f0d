"""Precision is a policy: fp32 masters and optimizer states whatever model.dtype says, half compute where the device
has it, checkpoints exported in model.dtype, resumes exact."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from safetensors import safe_open

import mrl.modeling.models
import mrl.modeling.precision
import mrl.modeling.trainable
from mrl.core.config import UserError
from mrl.modeling.models import Actor, load_causal_lm, resolve_model_path
from mrl.modeling.precision import DTYPES, Precision, cast_state, compute_in, precision_for
from mrl.modeling.trainable import OPTIMIZER_FILE, Trainable, deepspeed_config
from mrl.runs.checkpoint import latest_checkpoint
from mrl.runs.restore import trained_weights
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

CPU = torch.device("cpu")
LR = 1e-6  # a real model's learning rate: an update far below bf16's resolution of a weight


def layer_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformer blocks' weights as float32 (embeddings and the head aside)."""
    return {k: v.detach().float().clone() for k, v in state.items() if ".layers." in k}


def moved_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values())


def lm_loss(actor) -> torch.Tensor:
    """Next-token cross-entropy on fixed random token rows: a gradient on every weight."""
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(0))  # [N, L]
    mask = torch.ones_like(ids)
    logits, _ = actor(ids, mask, mask.cumsum(-1) - 1)  # [N, L, V]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.fixture
def half_compute_on_cpu(monkeypatch):
    """Run the GPU policy on CPU: model.dtype=bfloat16/float16 computes (and DeepSpeed trains) in half precision
    (float16, which a CPU is refused, included)."""

    def gpu_like(dtype: str, device: torch.device, compute: str = "auto") -> Precision:
        wanted = DTYPES[dtype]
        return Precision(compute=None if wanted == torch.float32 else wanted, export=wanted)

    monkeypatch.setattr(mrl.modeling.trainable, "precision_for", gpu_like)
    monkeypatch.setattr(mrl.modeling.precision, "precision_for", gpu_like)


@pytest.mark.parametrize("native", ["AMX", "AVX512-BF16", None])
def test_policy_by_device(monkeypatch, native):
    monkeypatch.setattr(mrl.modeling.precision, "cpu_bf16", lambda: native)
    auto = torch.bfloat16 if native else None  # a CPU with native bf16 matmuls computes in bf16; one without, fp32
    assert precision_for("bfloat16", CPU) == Precision(compute=auto, export=torch.bfloat16)
    assert precision_for("float32", CPU) == Precision(compute=auto, export=torch.float32)
    assert precision_for("float32", CPU, "float32") == Precision(compute=None, export=torch.float32)
    assert precision_for("float32", CPU, "bfloat16") == Precision(compute=torch.bfloat16, export=torch.float32)
    with pytest.raises(UserError, match="compute_dtype=float16 on a CPU"):
        precision_for("float32", CPU, "float16")
    with pytest.raises(UserError, match="compute_dtype='bf16'.*auto, float32, bfloat16, float16"):
        precision_for("float32", CPU, "bf16")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert precision_for("bfloat16", cuda) == Precision(compute=torch.bfloat16, export=torch.bfloat16)
    assert precision_for("float16", cuda) == Precision(compute=torch.float16, export=torch.float16)
    assert precision_for("float32", cuda) == Precision(compute=None, export=torch.float32)
    assert precision_for("float32", cuda, "bfloat16") == Precision(compute=torch.bfloat16, export=torch.float32)
    assert precision_for("bfloat16", cuda, "float32") == Precision(compute=None, export=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # pre-Ampere: fp32 compute, bf16 export
    assert precision_for("bfloat16", cuda) == Precision(compute=None, export=torch.bfloat16)
    with pytest.raises(UserError, match="'bf16'.*bfloat16"):
        precision_for("bf16", CPU)


@pytest.mark.parametrize("native", ["AMX", None])
def test_the_compute_is_said_once_and_bf16_without_native_bf16_is_warned(monkeypatch, capsys, native):
    monkeypatch.setattr(mrl.modeling.precision, "cpu_bf16", lambda: native)
    precision = Precision(compute=torch.bfloat16, export=torch.float32)
    mrl.modeling.precision.announce.cache_clear()
    for _ in range(2):  # the policy, then the reference: said once
        compute_in(torch.nn.Linear(2, 2), precision, CPU)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["mrl: compute: bfloat16 (AMX) on cpu, float32 masters, exported in float32"] if native else \
        lines == ["mrl: warning: compute: bfloat16 (no native bf16): bf16 matmuls run ~27x slower than fp32 on such "
                  "CPUs; model.compute_dtype=auto computes in fp32 on cpu, float32 masters, exported in float32"]


def test_the_cpu_flags_name_the_native_bf16_units(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    for flags, native in [("fpu avx512f avx512_bf16 amx_bf16 amx_tile", "AMX"),
                          ("fpu avx512f avx512_bf16", "AVX512-BF16"), ("fpu avx2 avx512f", None)]:
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
            cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
        mrl.modeling.precision.cpu_bf16.cache_clear()
        assert mrl.modeling.precision.cpu_bf16() == native, flags
    mrl.modeling.precision.cpu_bf16.cache_clear()


def test_the_tiny_model_computes_in_fp32_and_a_real_model_by_the_hardware():
    assert compose_config().model.compute_dtype == "float32"
    assert compose_config("model=smollm2_local").model.compute_dtype == "auto"
    assert compose_config("model=smollm2_local", "deepspeed=zero2").deepspeed.compute_dtype == "auto"


def test_deepspeed_mode_follows_model_dtype(monkeypatch):
    ds = compose_config("deepspeed=zero2", "model.dtype=bfloat16").deepspeed
    assert ds.model_dtype == "bfloat16"  # interpolated from model.dtype
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    on_gpu = deepspeed_config(ds, precision_for(ds.model_dtype, torch.device("cuda")), 4, 1e-6, 0.0)
    assert on_gpu["bf16"] == {"enabled": True} and on_gpu["fp16"] == {"enabled": False}
    on_cpu = deepspeed_config(ds, precision_for(ds.model_dtype, CPU, ds.compute_dtype), 4, 1e-6, 0.0)
    assert on_cpu["bf16"] == on_cpu["fp16"] == {"enabled": False}  # the tiny model computes in fp32
    ds = compose_config("deepspeed=zero2", "model.compute_dtype=bfloat16").deepspeed
    on_amx = deepspeed_config(ds, precision_for(ds.model_dtype, CPU, ds.compute_dtype), 4, 1e-6, 0.0)
    assert on_amx["bf16"] == {"enabled": True} and on_amx["fp16"] == {"enabled": False}


def test_bf16_weights_would_not_train():
    """Why masters: the old behaviour (AdamW on bf16 weights) loses almost every update at lr 1e-6."""
    model_cfg = compose_config("model.dtype=bfloat16").model
    actor = Actor(load_causal_lm(resolve_model_path(model_cfg), model_cfg, CPU, weights=torch.bfloat16))
    before = layer_weights(actor.state_dict())
    optimizer = torch.optim.AdamW(actor.parameters(), lr=LR)
    lm_loss(actor).backward()
    optimizer.step()
    assert moved_fraction(before, layer_weights(actor.state_dict())) < 0.1


def test_one_step_at_lr_1e6_moves_the_weights_in_bf16():
    cfg = compose_config("model.dtype=bfloat16")
    actor = Trainable(Actor(load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU)), LR, 0.0, 1.0,
                      cfg.deepspeed, 4, CPU)
    assert all(p.dtype == torch.float32 for p in actor.module.parameters())
    before = layer_weights(actor.module.state_dict())
    actor.accumulate(lm_loss(actor), last=True)
    assert all(s.dtype == torch.float32 for group in actor.optimizer.state.values() for s in group.values()
               if s.numel() > 1)
    assert moved_fraction(before, layer_weights(actor.module.state_dict())) >= 0.9


def test_autocast_computes_in_bf16_on_fp32_weights(tokenizer):
    cfg = compose_config("model.compute_dtype=bfloat16")  # what auto picks on a CPU with AMX
    policy = load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU)
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    ids = torch.tensor([[14, 7, 11, 17]])  # "add 3 7 ="
    assert policy(input_ids=ids).logits.dtype == torch.bfloat16  # the lm head ran under autocast
    out = policy.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, 7)  # HF generate goes through the same wrapped forward
    plain = compute_in(load_causal_lm(resolve_model_path(cfg.model), compose_config().model, CPU),
                       Precision(compute=None, export=torch.float32), CPU)
    assert plain(input_ids=ids).logits.dtype == torch.float32


def test_deepspeed_bf16_mode_keeps_fp32_masters():
    """DeepSpeed's bf16 mode (on a CPU with bf16 compute): the module computes in bf16, its fp32 masters take the
    update."""
    from deepspeed.utils import safe_get_full_fp32_param

    cfg = compose_config("model.dtype=bfloat16", "model.compute_dtype=bfloat16", "deepspeed=zero2")
    actor = Trainable(Actor(load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU)), LR, 0.0, 1.0,
                      cfg.deepspeed, 4, CPU)
    assert actor.module_dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in actor.module.parameters())
    # A reference in the module's dtype computes exactly as the policy does before its first update: KL 0.
    reference = Actor(load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU, weights=actor.module_dtype))
    with torch.no_grad():
        assert torch.equal(lm_loss(actor), lm_loss(reference))
    layers = {k: p for k, p in actor.module.named_parameters() if ".layers." in k}
    before = {k: safe_get_full_fp32_param(p).clone() for k, p in layers.items()}
    assert all(v.dtype == torch.float32 for v in before.values())
    actor.accumulate(lm_loss(actor), last=True)
    after = {k: safe_get_full_fp32_param(p) for k, p in layers.items()}
    assert moved_fraction(before, after) >= 0.9


def test_float16_scales_the_loss_and_checkpoints_the_scale(half_compute_on_cpu, tmp_path):
    cfg = compose_config("model.dtype=float16")
    path = resolve_model_path(cfg.model)
    actor = Trainable(Actor(load_causal_lm(path, cfg.model, CPU)), LR, 0.0, 1.0, cfg.deepspeed, 4, CPU)
    before = layer_weights(actor.module.state_dict())
    assert actor.accumulate(lm_loss(actor), last=True) > 0  # the norm of the unscaled gradients
    assert moved_fraction(before, layer_weights(actor.module.state_dict())) >= 0.9
    scale = actor.scaler.get_scale()
    assert scale > 1
    actor.save_optimizer(tmp_path)
    resumed = Trainable(Actor(load_causal_lm(path, cfg.model, CPU)), LR, 0.0, 1.0, cfg.deepspeed, 4, CPU)
    resumed.load_optimizer(tmp_path)
    assert resumed.scaler.get_scale() == scale
    for name, value in resumed.module.state_dict().items():
        assert torch.equal(value, actor.module.state_dict()[name]), name


def test_cast_keeps_tied_weights_shared():
    shared, other = torch.ones(3), torch.zeros(2, dtype=torch.int64)
    out = cast_state({"a": shared, "b": shared, "c": shared.clone(), "ids": other}, torch.bfloat16)
    assert out["a"] is out["b"] and out["a"] is not out["c"] and out["a"].dtype == torch.bfloat16
    assert out["ids"] is other


def test_loop_trains_masters_and_exports_bf16(make_cfg, tmp_path):
    cfg = make_cfg("model.dtype=bfloat16", "algo=grpo", f"trainer.lr={LR}", "trainer.max_steps=1",
                   "algo.entropy_coef=0.01")
    init = layer_weights(load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU).state_dict())
    train(cfg, tmp_path)
    ckpt = latest_checkpoint(tmp_path)
    masters = trained_weights(ckpt)  # from optimizer.pt: policy/ is rounded
    assert masters.keys() == torch.load(ckpt / OPTIMIZER_FILE, weights_only=True)["masters"].keys()
    trained = layer_weights({k.removeprefix("policy."): v for k, v in masters.items()})
    assert all(v.dtype == torch.float32 for v in masters.values())
    assert moved_fraction(init, trained) >= 0.9
    # The exported policy is an ordinary bf16 model directory: what the weights round to.
    assert json.loads((ckpt / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(ckpt / "policy" / "model.safetensors", "pt") as file:
        exported = {k: file.get_tensor(k) for k in file.keys()}
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert torch.equal(exported["model.layers.0.mlp.up_proj.weight"],
                       masters["policy.model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ckpt / "policy", dtype="auto").dtype == torch.bfloat16


def test_bf16_resume_is_exact(make_cfg, tmp_path):
    """The exported policy/ is rounded to bf16; the masters in optimizer.pt make the resumed run the same run."""
    overrides = ["model.dtype=bfloat16", "algo=grpo", f"trainer.lr={LR}", "algo.entropy_coef=0.01",
                 "trainer.save_every=2"]
    train(make_cfg(*overrides, "trainer.max_steps=4"), tmp_path / "full")
    train(make_cfg(*overrides, "trainer.max_steps=2"), tmp_path / "stopped")
    train(make_cfg(*overrides, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'stopped'}"),
          tmp_path / "resumed")

    def deterministic(record):
        return {k: v for k, v in record.items() if not k.startswith(("perf/", "mem/"))}

    assert ([deterministic(r) for r in read_metrics(tmp_path / "resumed" / METRICS_FILE)[2:]]
            == [deterministic(r) for r in read_metrics(tmp_path / "full" / METRICS_FILE)[2:]])
    full = torch.load(latest_checkpoint(tmp_path / "full") / OPTIMIZER_FILE, weights_only=True)["masters"]
    resumed = torch.load(latest_checkpoint(tmp_path / "resumed") / OPTIMIZER_FILE, weights_only=True)["masters"]
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_trained_weights_of_float32_and_deepspeed_checkpoints(make_cfg, tmp_path):
    """float32: policy/ holds the weights unrounded; DeepSpeed: its checkpoint's fp32 partitions."""
    from safetensors.torch import load_file

    for engine in ("none", "zero2"):
        run_dir = tmp_path / engine
        train(make_cfg("algo=grpo", f"deepspeed={engine}", "trainer.max_steps=1"), run_dir)
        ckpt = latest_checkpoint(run_dir)
        weights = trained_weights(ckpt)
        exported = load_file(ckpt / "policy" / "model.safetensors")
        assert {f"policy.{k}" for k in exported} <= weights.keys()
        assert all(torch.equal(weights[f"policy.{k}"], v) for k, v in exported.items())  # fp32: no rounding


def test_bf16_compute_logs_its_logprob_gap_once_and_keeps_the_ratio_at_one(make_cfg, tmp_path):
    """bf16 compute (what auto picks on a CPU with AMX): the first step logs how far its per-token log-probs are from
    float32's on the step's rollouts (0 < mean <= max, small); later steps and fp32 runs do not.  Two epochs at lr
    1e-12: the old log-probs and the new ones come from the same bf16 forward, so every ratio is 1 (no clipping,
    approx_kl 0), as in fp32 (tests/test_train.py)."""
    final = train(make_cfg("algo=grpo", "model.compute_dtype=bfloat16", "algo.epochs=2", "trainer.lr=1e-12",
                           "trainer.max_steps=2"), tmp_path / "bf16")
    first, second = read_metrics(tmp_path / "bf16" / METRICS_FILE)
    gap, gap_max = first["perf/precision_logprob_gap"], first["perf/precision_logprob_gap_max"]
    assert 0 < gap <= gap_max < 0.5  # the tiny model's 32-token distributions, rounded to bf16's 8 bits
    assert "perf/precision_logprob_gap" not in second
    assert final["policy/approx_kl"] < 1e-9 and final["clip_frac"] == 0.0
    train(make_cfg("algo=grpo", "trainer.max_steps=1"), tmp_path / "fp32")
    assert "perf/precision_logprob_gap" not in read_metrics(tmp_path / "fp32" / METRICS_FILE)[0]


def test_the_gap_is_the_difference_of_the_two_forwards(tokenizer):
    """precision_logprob_gap against the two forwards computed here: the policy under its bf16 autocast, and the same
    weights loaded without one."""
    from mrl.generation.rollout import Rollouts, Sampling
    from mrl.train.update import AlgoSettings, policy_forward, precision_logprob_gap

    cfg = compose_config("model.compute_dtype=bfloat16", "algo=grpo")
    path = resolve_model_path(cfg.model)
    actor = Trainable(Actor(load_causal_lm(path, cfg.model, CPU)), LR, 0.0, 1.0, cfg.deepspeed, 4, CPU)
    plain = Actor(load_causal_lm(path, compose_config().model, CPU)).eval()
    prompt = torch.tensor([[14, 7, 11, 17]] * 2)  # "add 3 7 =", a group of two
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = Rollouts(prompt, torch.ones_like(prompt), torch.tensor([[3, 9, 2], [5, 2, 0]]), completion_mask,
                     completion_mask, [None, None], group_size=2)
    algo = AlgoSettings.of(cfg, Sampling.of(cfg.trainer))
    measured = precision_logprob_gap(actor, batch, algo)
    with torch.no_grad():
        low = policy_forward(actor, batch)[0]
        full = policy_forward(plain, batch)[0]
    gap = (low - full).abs()[batch.completion_mask.bool()]
    assert measured == pytest.approx({"perf/precision_logprob_gap": gap.mean().item(),
                                      "perf/precision_logprob_gap_max": gap.max().item()})
