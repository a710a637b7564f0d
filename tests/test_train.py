"""Short CPU runs of the real loop: every preset learns something finite, checkpoints resume exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ALGOS

from mrl.modeling.models import load_causal_lm, resolve_model_path
from mrl.runs.checkpoint import latest_checkpoint
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

REQUIRED_KEYS = [
    "step", "reward/correctness/mean", "reward/correctness/std", "reward/efficiency/mean", "reward/safety/mean",
    "reward/total/mean", "adv/mean", "adv/std", "groups/dead_frac", "groups/dead_frac_raw", "loss/policy",
    "loss/value", "kl", "entropy", "clip_frac", "perf/step_s", "perf/rollout_s", "perf/update_s",
    "perf/tokens_per_s", "mem/peak_mb", "dapo/gen_batches", "dapo/rollouts_generated",
]


def initial_weights(cfg):
    model = load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu"))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("algo", ALGOS)
def test_two_steps_finite_and_parameters_change(algo, make_cfg, tmp_path):
    cfg = make_cfg(f"algo={algo}", "trainer.save_every=2")
    before = initial_weights(cfg)
    final = train(cfg, tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2]
    for key in REQUIRED_KEYS:
        assert key in final, key
    for key in ["loss/policy", "entropy", "adv/std", "reward/total/mean"]:
        assert math.isfinite(final[key]), key
    if algo == "ppo":
        assert math.isfinite(final["loss/value"])
    after = load_causal_lm(str(latest_checkpoint(tmp_path) / "policy"), cfg.model, torch.device("cpu")).state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed after two updates"


def test_ppo_value_head_and_kl_reference(make_cfg, tmp_path):
    final = train(make_cfg("algo=ppo", "algo.critic=head", "algo.kl_coef=0.05", "algo.kl_mode=loss"), tmp_path)
    assert math.isfinite(final["loss/value"]) and final["kl"] is not None and final["kl"] >= 0


def test_top_k_top_p_train_with_kl_entropy_and_a_second_epoch_finite(make_cfg, tmp_path):
    # The loss scores the truncated distribution (mrl.algo.losses.truncate): no -inf log-prob reaches the ratio, the KL
    # or the entropy, on the second epoch either (the moved policy may drop a sampled token from its own top-k).
    final = train(make_cfg("algo=grpo", "trainer.top_k=5", "trainer.top_p=0.9", "algo.kl_coef=0.05",
                           "algo.kl_mode=loss", "algo.entropy_coef=0.01", "algo.epochs=2"), tmp_path)
    for key in ("loss/policy", "loss/total", "kl", "entropy", "policy/approx_kl", "grad_norm"):
        assert math.isfinite(final[key]), key
    assert final["entropy"] < math.log(5) + 1e-6  # at most 5 tokens carry probability


def test_old_log_probs_are_scored_at_the_sampling_temperature(make_cfg, tmp_path):
    # Two epochs: the ratio's old log-probs come from batch_logprobs.  At a learning rate of 1e-12 the policy does not
    # move, so every ratio is 1 when both passes use trainer.temperature (scored at 1.0, approx_kl would be ~1e-2).
    final = train(make_cfg("algo=grpo", "trainer.temperature=0.7", "algo.epochs=2", "trainer.lr=1e-12",
                           "trainer.max_steps=1"), tmp_path)
    assert final["policy/approx_kl"] < 1e-9 and final["clip_frac"] == 0.0


def test_ppo_logs_the_kl_penalty_its_rewards_carried(make_cfg, tmp_path):
    train(make_cfg("algo=ppo", "algo.kl_coef=0.1", "algo.kl_mode=reward"), tmp_path)
    first, second = read_metrics(tmp_path / METRICS_FILE)
    assert first["reward/kl_penalty/mean"] == 0.0  # step 1 samples from the reference itself: KL exactly 0
    assert second["reward/kl_penalty/mean"] < 0  # after one update the policy has left the reference
    assert second["kl"] > 0


def test_resume_reproduces_the_uninterrupted_run(make_cfg, tmp_path):
    overrides = ["algo=ppo", "trainer.max_steps=4", "trainer.save_every=2"]
    train(make_cfg(*overrides), tmp_path / "full")
    full = read_metrics(tmp_path / "full" / METRICS_FILE)

    # The "stopped" run: the same config, stopped after step 2 (its checkpoint), then resumed from it.
    train(make_cfg(*overrides[:1], "trainer.max_steps=2", "trainer.save_every=2"), tmp_path / "stopped")
    train(make_cfg(*overrides, f"trainer.resume={tmp_path / 'stopped'}"), tmp_path / "resumed")
    resumed = read_metrics(tmp_path / "resumed" / METRICS_FILE)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]

    def deterministic(record):
        return {k: v for k, v in record.items() if not k.startswith(("perf/", "mem/"))}

    assert [deterministic(r) for r in resumed[2:]] == [deterministic(r) for r in full[2:]]


def test_resume_true_continues_in_the_same_run_dir(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=3", "trainer.save_every=2"), tmp_path)
    # A crash after the step-3 checkpoint left a line for step 4: the resumed run logs step 4 again, once.
    with (tmp_path / METRICS_FILE).open("a") as file:
        file.write(json.dumps({"step": 4, "partial": True}) + "\n")
    train(make_cfg("trainer.max_steps=5", "trainer.save_every=2", "trainer.resume=true"), tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert not any("partial" in r for r in records)


class HalfDead:
    """Dead on prompts of even target (0 for every rollout); elsewhere the parity of the episode's length."""

    def __call__(self, episode) -> float:
        return 0.0 if episode.prompt.meta["target"] % 2 == 0 else float(episode.num_tokens % 2)


def test_dynamic_sampling_trains_only_live_groups(make_cfg, tmp_path):
    """Half the prompts give a dead group (and a weight-0 constraint varies on all of them, which is no signal):
    the trained batches hold live groups only, while the generated ones held dead groups."""
    from omegaconf import OmegaConf

    cfg = make_cfg("algo=gdpo", "algo.dynamic_sampling=true", "algo.max_gen_batches=4", "trainer.max_steps=3",
                   "rewards.channels.safety.weight=0")
    OmegaConf.update(cfg, "rewards.channels.correctness.fn", {"_target_": "test_train.HalfDead"}, merge=False)
    OmegaConf.update(cfg, "rewards.channels.efficiency.fn", {"_target_": "test_train.Constant"}, merge=False)
    records = [train(cfg, tmp_path)] and read_metrics(tmp_path / METRICS_FILE)
    for record in records:
        assert 1 <= record["dapo/gen_batches"] <= 4
        assert record["dapo/rollouts_generated"] == record["dapo/gen_batches"] * 2 * 4
        assert record["groups/dead_frac"] == 0.0 or record["dapo/gen_batches"] == 4
    assert max(r["groups/dead_frac_raw"] for r in records) >= 0.5  # the filter had dead groups to drop


def test_zero2_step_on_cpu(make_cfg, tmp_path):
    """A DeepSpeed ZeRO-2 run on CPU (gloo).  The first run on a machine compiles a C++ op (~30 s)."""
    cfg = make_cfg("deepspeed=zero2", "algo=grpo", "trainer.save_every=2")
    before = initial_weights(cfg)
    final = train(cfg, tmp_path)
    assert math.isfinite(final["loss/policy"])
    ckpt = latest_checkpoint(tmp_path)
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "policy" / "model.safetensors").exists()
    after = load_causal_lm(str(ckpt / "policy"), cfg.model, torch.device("cpu")).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


class Constant:
    """A reward channel that never varies: every group it scores alone is dead."""

    def __call__(self, episode) -> float:
        return 1.0


def test_dynamic_sampling_skips_the_update_when_no_group_is_live(make_cfg, tmp_path):
    from omegaconf import OmegaConf

    cfg = make_cfg("algo=dapo", "algo.max_gen_batches=2", "algo.overlong_buffer=0", "trainer.save_every=2")
    for name in ("correctness", "efficiency", "safety"):
        OmegaConf.update(cfg, f"rewards.channels.{name}.fn", {"_target_": "test_train.Constant"}, merge=False)
    before = initial_weights(cfg)
    train(cfg, tmp_path)
    for record in read_metrics(tmp_path / METRICS_FILE):
        assert record["dapo/gen_batches"] == 2 and record["dapo/skipped_update"] == 1.0
        assert record["groups/dead_frac_raw"] == 1.0 and record["groups/dead_frac"] is None
        assert record["loss/policy"] is None and record["entropy"] is None
    after = load_causal_lm(str(latest_checkpoint(tmp_path) / "policy"), cfg.model, torch.device("cpu")).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "weights moved without a live group"


class FailsLater:
    """Scores 0 for the first 3 * 2 * 4 rollouts (three steps), then raises."""

    calls = 0

    def __call__(self, episode) -> float:
        FailsLater.calls += 1
        if FailsLater.calls > 24:
            raise RuntimeError("grader crashed")
        return 0.0


def test_a_failing_channel_stops_the_run_after_a_checkpoint(make_cfg, tmp_path):
    from omegaconf import OmegaConf

    from mrl.rewards.channels import RewardError

    FailsLater.calls = 0
    cfg = make_cfg("trainer.max_steps=6", "trainer.save_every=100")
    OmegaConf.update(cfg, "rewards.channels.correctness.fn", {"_target_": "test_train.FailsLater"})
    with pytest.raises(RewardError, match="'correctness' raised RuntimeError: grader crashed"):
        train(cfg, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_000003"
    assert json.loads((checkpoint / "state.json").read_text()) == {"step": 3, "prompt_position": 6}


def test_on_error_drop_counts_and_goes_on(make_cfg, tmp_path):
    from omegaconf import OmegaConf

    FailsLater.calls = 0
    cfg = make_cfg("trainer.max_steps=5", "rewards.on_error=drop")
    OmegaConf.update(cfg, "rewards.channels.correctness.fn", {"_target_": "test_train.FailsLater"})
    final = train(cfg, tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["rewards/failed_frac"] for r in records] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert final["step"] == 5


def test_a_new_run_never_appends_to_an_existing_run_dir(make_cfg, tmp_path):
    from mrl.core.config import UserError

    train(make_cfg(), tmp_path)
    before = (tmp_path / METRICS_FILE).read_text()
    with pytest.raises(UserError, match="already holds a run"):
        train(make_cfg(), tmp_path)
    assert (tmp_path / METRICS_FILE).read_text() == before
