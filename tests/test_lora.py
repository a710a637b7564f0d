"""LoRA through peft: only adapters train, the reference is the base with adapters off (KL 0 at the start, > 0
after an update), checkpoints hold adapters and their optimizer state alone and resume exactly, `mrl export --merge`
writes a plain model with the adapted policy's log-probs, `mrl eval` reads a LoRA run, DeepSpeed trains it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from omegaconf import OmegaConf
from safetensors.torch import load_file

import mrl.train.loop
from mrl.core.config import UserError
from mrl.modeling.lora import load_policy
from mrl.modeling.models import Actor, cache_kwarg, checkpointed, load_causal_lm, resolve_model_path
from mrl.modeling.trainable import OPTIMIZER_FILE
from mrl.runs.export import export
from mrl.runs.restore import merged_policy, trained_weights
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.evaluate import evaluate
from mrl.train.loop import train

CPU = torch.device("cpu")
# lr 1e-2: adapters move enough in two steps for the merged model to differ visibly from the base.
LORA = ["model.lora.r=4", "model.lora.alpha=8", "algo=grpo", "algo.kl_coef=0.1", "trainer.lr=1e-2"]
# A wider tiny model (~1.2M parameters) and rank 2: adapters are a share of it (2.8%) like rank 16's of a 1B model.
WIDE = ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.lora.r=2", "model.lora.alpha=4"]


def train_run(run_dir: Path, *overrides: str) -> Path:
    """train() on the shrunken config, with .hydra/config.yaml written as `mrl train` would (for export, eval)."""
    cfg = compose_config(*overrides)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    train(cfg, run_dir)
    return run_dir


def token_rows(n: int = 4, length: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows that share a 4-token prompt (the shared-prompt path needs equal prompts), then random tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(4, 32, (1, 4), generator=g).expand(n, 4),
                     torch.randint(4, 32, (n, length - 4), generator=g)], 1)  # [N, L]
    mask = torch.ones_like(ids)
    return ids, mask, mask.cumsum(-1) - 1


def log_probs(actor, prompt_width: int = 0) -> torch.Tensor:
    """Next-token log-probs of every position after the prompt: [N, L-4, V]."""
    ids, mask, positions = token_rows()
    with torch.no_grad():
        logits, _ = actor(ids, mask, positions, ids.shape[1] - 3, prompt_width=prompt_width)
    return F.log_softmax(logits.float(), -1)


def base_weights(policy) -> dict[str, torch.Tensor]:
    """The base model's weights inside a peft model, keyed as in the plain model."""
    state = policy.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two GRPO steps with LoRA and KL on, checkpointed after each; the loop's own actor and reference captured."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    built = {}
    original = mrl.train.loop.build_models

    def capture(*args, **kwargs):
        built["models"] = original(*args, **kwargs)
        return built["models"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mrl.train.loop, "build_models", capture)
        train_run(run_dir, *LORA, "trainer.save_every=1")
    _, actor, _, reference = built["models"]
    return run_dir, actor, reference


def base_actor() -> Actor:
    cfg = compose_config()
    return Actor(load_causal_lm(resolve_model_path(cfg.model), cfg.model, CPU)).eval()


def test_only_adapters_train(lora_run):
    _, actor, _ = lora_run
    policy = actor.module.policy
    trainable = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in actor.module.parameters() if p.requires_grad}
    # The base is bit-identical to the model it was loaded from; the adapters moved (B starts at 0).
    fresh = base_actor().policy.state_dict()
    after = base_weights(policy)
    assert after.keys() == fresh.keys()
    assert all(torch.equal(after[k], fresh[k]) for k in fresh)
    assert all(p.abs().sum() > 0 for n, p in policy.named_parameters() if ".lora_B." in n)


def test_kl_starts_at_zero_and_the_reference_is_the_base(lora_run):
    run_dir, actor, reference = lora_run
    first, second = read_metrics(run_dir / METRICS_FILE)
    assert first["kl"] == 0.0  # the adapted policy equals the base before its first update
    assert second["kl"] > 0  # a reference that followed the adapters would stay at 0
    base = base_actor()
    actor.module.eval()
    for width in (0, 4):  # the plain forward and the shared-prompt one (KV cache through peft)
        assert torch.equal(log_probs(reference, width), log_probs(base, width))
        adapted = log_probs(actor.module, width)
        assert (adapted - log_probs(base, width)).abs().max() > 1e-3  # the reference is not the trained policy
    torch.testing.assert_close(log_probs(actor.module, 4), log_probs(actor.module, 0), atol=1e-5, rtol=0)
    assert not hasattr(reference, "parameters")  # a view of the policy, not a second model


def test_helpers_see_through_the_peft_model(lora_run):
    _, actor, _ = lora_run
    policy = actor.module.policy
    # the base model's own name for its KV cache (transformers 5.2x: `cache`; vLLM's range, <5.20: `past_key_values`)
    names = inspect.signature(type(policy.get_base_model()).forward).parameters
    assert cache_kwarg(policy) == cache_kwarg(policy.get_base_model()) in set(names) & {"cache", "past_key_values"}
    assert checkpointed(policy) is False
    policy.get_base_model().gradient_checkpointing_enable()  # both versions have it (5.25 adds activation_*)
    try:
        assert checkpointed(policy) is True
    finally:
        policy.get_base_model().gradient_checkpointing_disable()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_holds_adapters_only_and_resume_is_exact(dtype, tmp_path):
    """bfloat16: policy/ holds rounded adapters, optimizer.pt their float32 masters (and not the base's weights)."""
    overrides = [*LORA, *WIDE, f"model.dtype={dtype}", "trainer.save_every=1", "trainer.max_steps=2"]
    train_run(tmp_path / "full", *overrides)
    train_run(tmp_path / "resumed", *overrides, f"trainer.resume={tmp_path / 'full/checkpoints/step_000001'}")

    full, resumed = (tmp_path / run / "checkpoints" / "step_000002" for run in ("full", "resumed"))
    a_file, b_file = (load_file(c / "policy" / "adapter_model.safetensors") for c in (full, resumed))
    assert a_file.keys() == b_file.keys() and all(torch.equal(a_file[k], b_file[k]) for k in a_file)
    assert {v.dtype for v in a_file.values()} == {getattr(torch, dtype)}
    a, b = (torch.load(c / OPTIMIZER_FILE, weights_only=True) for c in (full, resumed))
    masters = a["masters"]
    if dtype == "float32":
        assert masters is None
    else:
        assert masters and all(".lora_" in k for k in masters) and masters.keys() == b["masters"].keys()
        assert all(torch.equal(masters[k], b["masters"][k]) for k in masters)
    for p, q in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])

    def deterministic(record):
        return {k: v for k, v in record.items() if not k.startswith(("perf/", "mem/"))}

    assert ([deterministic(r) for r in read_metrics(tmp_path / "resumed" / METRICS_FILE)]
            == [deterministic(r) for r in read_metrics(tmp_path / "full" / METRICS_FILE)])

    if dtype == "bfloat16":  # the merged export folds in the float32 masters, then rounds to model.dtype
        out, _ = export(tmp_path / "full", merge=True)
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16
        merged = merged_policy(full, compose_config(*overrides).model).state_dict()
        name = "model.layers.0.self_attn.q_proj"
        base = load_causal_lm(resolve_model_path(compose_config(*WIDE).model), compose_config().model, CPU)
        delta = merged[f"{name}.weight"] - base.state_dict()[f"{name}.weight"]  # [out, in]
        lora = {k.removeprefix("policy.base_model.model."): v for k, v in masters.items()}
        scale = 4 / 2  # alpha / r
        B, A = lora[f"{name}.lora_B.default.weight"], lora[f"{name}.lora_A.default.weight"]  # [out, r], [r, in]
        exact = B @ A * scale
        rounded = B.to(torch.bfloat16).float() @ A.to(torch.bfloat16).float() * scale  # policy/'s adapters
        assert (delta - exact).abs().max() < 1e-6 < (delta - rounded).abs().max()

    trained = trained_weights(full)  # the masters, or policy/'s adapters, keyed as the Actor's parameters
    assert trained and all(k.startswith("policy.base_model.model.") and k.endswith((".lora_A.default.weight",
                                                                                   ".lora_B.default.weight"))
                           for k in trained)
    assert all(torch.equal(trained[k], masters[k]) for k in masters) if masters else (
        trained.keys() == {f"policy.{k}".replace(".weight", ".default.weight") for k in a_file})

    # No base weights anywhere: the whole checkpoint is a few percent of the model's bytes.
    assert not list(full.rglob("model*.safetensors"))
    model_bytes = (Path(resolve_model_path(compose_config(*WIDE).model)) / "model.safetensors").stat().st_size
    checkpoint_bytes = sum(f.stat().st_size for f in full.rglob("*") if f.is_file())
    assert checkpoint_bytes <= 0.1 * model_bytes, (checkpoint_bytes, model_bytes)


def test_export_merge_gives_the_adapted_policy(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _, _ = lora_run
    out, _ = export(run_dir, tmp_path / "merged", merge=True)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert not (out / "adapter_config.json").exists()
    merged = Actor(AutoModelForCausalLM.from_pretrained(out)).eval()
    cfg = compose_config()
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model))
    adapted = Actor(PeftModel.from_pretrained(base, run_dir / "checkpoints" / "step_000002" / "policy")).eval()
    torch.testing.assert_close(log_probs(merged), log_probs(adapted), atol=1e-5, rtol=0)
    assert (log_probs(merged) - log_probs(base_actor())).abs().max() > 1e-3  # the adapters were merged

    # Without --merge: the adapter dir as it is; a checkpoint dir works as the source too.
    plain, what = export(run_dir / "checkpoints" / "step_000001", tmp_path / "adapters")
    assert (plain / "adapter_model.safetensors").exists() and "adapters" in what
    with pytest.raises(UserError, match="not empty"):
        export(run_dir, tmp_path / "adapters", merge=True)


def test_export_of_a_full_fine_tune_copies_its_policy(tmp_path):
    run_dir = train_run(tmp_path / "run", "algo=grpo", "trainer.max_steps=1", "model.dtype=bfloat16")
    out, _ = export(run_dir, merge=True)
    assert out == run_dir / "export"
    source = run_dir / "checkpoints" / "step_000001" / "policy"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_cli_export_and_eval_on_a_lora_run(lora_run, tmp_path):
    from typer.testing import CliRunner

    from mrl.cli import app

    run_dir, _, _ = lora_run
    result = CliRunner().invoke(app, ["export", str(run_dir), "--merge", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "merged, in float32" in result.output and (tmp_path / "m" / "model.safetensors").exists()
    result = CliRunner().invoke(app, ["export", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "neither a checkpoint nor a run dir" in result.output
    report = evaluate(run_dir, num_prompts=4, samples=1)
    assert report["checkpoint"] == "step_000002" and report["greedy"]["correctness"] is not None


def test_resume_must_keep_the_lora_setting(lora_run):
    run_dir, _, _ = lora_run
    checkpoint = run_dir / "checkpoints" / "step_000001"
    with pytest.raises(UserError, match="resume with model.lora.r=4 model.lora.alpha=8"):
        load_policy(compose_config("model.lora.r=8").model, "unused", CPU, checkpoint)
    with pytest.raises(UserError, match="model.lora.r=4"):
        load_policy(compose_config().model, "unused", CPU, checkpoint)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_trains_adapters_and_resumes(stage, tmp_path):
    """DeepSpeed on CPU (gloo): its checkpoint leaves the frozen base out; a resume continues the same run."""
    overrides = [*LORA, *WIDE, f"deepspeed=zero{stage}", "trainer.save_every=1", "trainer.max_steps=2"]
    train_run(tmp_path / "full", *overrides)
    train_run(tmp_path / "resumed", *overrides, f"trainer.resume={tmp_path / 'full/checkpoints/step_000001'}")
    full, resumed = (tmp_path / run / "checkpoints" / "step_000002" for run in ("full", "resumed"))
    assert (full / "deepspeed").is_dir()
    a, b = (load_file(c / "policy" / "adapter_model.safetensors") for c in (full, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a) and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    assert read_metrics(tmp_path / "full" / METRICS_FILE)[0]["kl"] == 0.0
    # DeepSpeed's files (module and optimizer states) hold the adapters alone: a few adapters' worth of bytes.  (Its
    # fixed files, zero_to_fp32.py and the like, ~0.1 MB, are left out: at this model's 4.7 MB they would dominate.)
    model_bytes = (Path(resolve_model_path(compose_config(*WIDE).model)) / "model.safetensors").stat().st_size
    adapter_bytes = (full / "policy" / "adapter_model.safetensors").stat().st_size
    ds_bytes = sum(f.stat().st_size for f in (full / "deepspeed").rglob("*.pt"))
    assert ds_bytes <= 5 * adapter_bytes and ds_bytes <= 0.1 * model_bytes, (ds_bytes, adapter_bytes, model_bytes)


def test_export_of_a_deepspeed_bf16_run_merges_the_float32_masters(tmp_path):
    """policy/ holds bf16-rounded adapters; DeepSpeed's files hold them in float32: the merge takes those."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    overrides = [*LORA, *WIDE, "deepspeed=zero2", "model.dtype=bfloat16", "trainer.max_steps=1"]
    train_run(tmp_path / "run", *overrides)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    masters = {k.removeprefix("policy.base_model.model."): v.float()
               for k, v in get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="deepspeed").items()}
    merged = merged_policy(checkpoint, compose_config(*overrides).model).state_dict()
    base = load_causal_lm(resolve_model_path(compose_config(*WIDE).model), compose_config().model, CPU)
    name = "model.layers.0.self_attn.q_proj"
    delta = merged[f"{name}.weight"] - base.state_dict()[f"{name}.weight"]  # [out, in]
    B, A = masters[f"{name}.lora_B.default.weight"], masters[f"{name}.lora_A.default.weight"]  # [out, r], [r, in]
    scale = 4 / 2  # alpha / r
    exact = B @ A * scale
    rounded = B.to(torch.bfloat16).float() @ A.to(torch.bfloat16).float() * scale  # policy/'s adapters
    assert (delta - exact).abs().max() < 1e-6 < (delta - rounded).abs().max()


def test_ppo_value_head_trains_beside_the_adapters(tmp_path):
    train_run(tmp_path / "run", *LORA, "algo=ppo", "algo.critic=head", "trainer.max_steps=1")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    assert (checkpoint / "value_head.safetensors").exists()
    assert load_file(checkpoint / "value_head.safetensors")["value_head.weight"].abs().sum() > 0
    adapters = load_file(checkpoint / "policy" / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)


def test_ppo_critic_model_is_a_full_critic_beside_the_adapters(tmp_path):
    """algo.critic=model: the critic is its own full model (not LoRA); it trains and checkpoints whole."""
    train_run(tmp_path / "run", *LORA, "algo=ppo", "algo.critic=model", "trainer.max_steps=1")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    assert (checkpoint / "policy" / "adapter_model.safetensors").exists()
    assert (checkpoint / "critic" / "model.safetensors").exists()
    assert load_file(checkpoint / "critic_head.safetensors")["value_head.weight"].abs().sum() > 0


def test_gradient_checkpointing_reaches_the_adapters():
    """With the frozen embeddings' output not requiring grad, checkpointed layers would give the adapters no
    gradient; peft makes the embeddings' output require grad, and the adapters get one."""
    cfg = compose_config("model.lora.r=4", "model.gradient_checkpointing=true")
    policy = load_policy(cfg.model, resolve_model_path(cfg.model), CPU)
    actor = Actor(policy).train()
    assert checkpointed(policy)
    ids, mask, positions = token_rows()
    logits, _ = actor(ids, mask, positions)  # [N, L, V]
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if ".lora_A." in n}
    assert grads and all(g is not None for g in grads.values())
    # B starts at 0, so A's gradient is 0 and B's is not: B's gradient tells that the backward reached the adapters.
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters()
               if ".lora_B." in n)


def test_a_half_precision_device_loads_the_frozen_base_in_half(monkeypatch):
    """On a GPU with model.dtype=bfloat16 (emulated on CPU here), only the adapters need float32 masters."""
    import mrl.modeling.precision
    import mrl.modeling.trainable
    from mrl.modeling.precision import DTYPES, Precision
    from mrl.modeling.trainable import Trainable

    def gpu_like(dtype: str, device: torch.device, compute: str = "auto") -> Precision:
        wanted = DTYPES[dtype]
        return Precision(compute=None if wanted == torch.float32 else wanted, export=wanted)

    for module in (mrl.modeling.trainable, mrl.modeling.precision):
        monkeypatch.setattr(module, "precision_for", gpu_like)
    cfg = compose_config("model.dtype=bfloat16", "model.lora.r=4")
    policy = load_policy(cfg.model, resolve_model_path(cfg.model), CPU)
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    actor = Trainable(Actor(policy), 1e-2, 0.0, 1.0, cfg.deepspeed, 4, CPU)
    ids, mask, positions = token_rows()
    logits, _ = actor(ids, mask, positions)  # [N, L, V], under bf16 autocast
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert actor.accumulate(loss, last=True) > 0
    assert all(p.abs().sum() > 0 for n, p in policy.named_parameters() if ".lora_B." in n)
