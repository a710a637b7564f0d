"""The config stops at the door: `start_run` builds the run's settings from `cfg` once (CollectSettings, AlgoSettings,
HeldOutSettings, Schedule; `start_sft`: SftSettings, HeldOutSettings), and a step's phases read those, never the
config."""

from __future__ import annotations

import pytest
from conftest import compose_config
from omegaconf import DictConfig, ListConfig
from test_sft import compose_sft

from mrl.generation.rollout import Sampling
from mrl.runs.rundir import StopSignals
from mrl.train.collect import CollectSettings
from mrl.train.evaluate import HeldOutSettings
from mrl.train.loop import Schedule, start_run, train_step
from mrl.train.sft import SftSettings, sft_step, start_sft
from mrl.train.update import AlgoSettings

KNOWN = ("algo=ppo", "trainer.temperature=0.7", "trainer.top_p=0.9", "trainer.top_k=5", "trainer.max_new_tokens=12",
         "trainer.prompts_per_step=3", "trainer.group_size=2", "algo.epochs=2", "trainer.num_mini_batches=4",
         "trainer.micro_batch_size=3", "algo.clip_low=0.1", "algo.clip_high=0.3", "algo.entropy_coef=0.01",
         "algo.kl_coef=0.05", "algo.kl_mode=reward", "algo.vf_coef=0.4", "algo.value_clip=0.25", "algo.adv_eps=1e-5",
         "algo.gamma=0.99", "algo.lam=0.9", "algo.whiten_advantages=false", "algo.loss_agg=token_mean",
         "algo.gdpo_batch_norm=false", "algo.gd2po_tau=0.5", "algo.dynamic_sampling=true", "algo.max_gen_batches=3",
         "rewards.on_error=drop", "rewards.pass_channel=correctness", "trainer.eval_prompts=5",
         "trainer.eval_samples=4", "trainer.eval_batch_tokens=999", "trainer.seed=7", "trainer.max_steps=9",
         "trainer.save_every=3", "trainer.eval_every=2", "trainer.eval_at_start=false", "logger.samples_every=4")


def test_the_settings_hold_the_configs_values():
    cfg = compose_config(*KNOWN)
    sampling = Sampling.of(cfg.trainer)
    assert sampling == Sampling(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, greedy=False)
    algo = AlgoSettings.of(cfg, sampling)
    assert algo == AlgoSettings(epochs=2, num_mini_batches=4, micro_batch_size=3, loss_agg="token_mean", clip_low=0.1,
                                clip_high=0.3, entropy_coef=0.01, kl_coef=0.05, kl_mode="reward", vf_coef=0.4,
                                value_clip=0.25, adv_eps=1e-5, gdpo_batch_norm=False, gamma=0.99, lam=0.9,
                                whiten_advantages=False, gd2po_tau=0.5, sampling=sampling)
    assert not algo.single_update  # two epochs, four mini-batches, KL in the reward: the old pass is needed
    protocol, estimator = object(), object()  # held as given
    assert CollectSettings.of(cfg, sampling, protocol, estimator) == CollectSettings(
        prompts_per_step=3, group_size=2, sampling=sampling, protocol=protocol, estimator=estimator,
        dynamic_sampling=True, max_gen_batches=3, on_error="drop")
    assert HeldOutSettings.of(cfg, sampling) == HeldOutSettings(prompts=5, samples=4, batch_tokens=999, seed=7,
                                                                sampling=sampling, pass_channel="correctness")
    assert Schedule.of(cfg) == Schedule(max_steps=9, save_every=3, eval_every=2, eval_at_start=False, samples_every=4)


@pytest.mark.parametrize("one_update, kl_mode, single", [(True, "loss", True), (True, "reward", False),
                                                         (False, "loss", False)])
def test_a_single_update_is_one_epoch_of_one_mini_batch_without_kl_in_the_reward(one_update, kl_mode, single):
    cfg = compose_config(*KNOWN, f"algo.epochs={1 if one_update else 2}",
                         f"trainer.num_mini_batches={1 if one_update else 4}", f"algo.kl_mode={kl_mode}")
    assert AlgoSettings.of(cfg, Sampling.of(cfg.trainer)).single_update is single


class ReadAfterTheDoor(BaseException):
    pass


@pytest.fixture
def no_config_after(monkeypatch):
    """From the call on, any read of any config node fails the test (a BaseException: no `except Exception` on
    the way can swallow it)."""
    def closed(*args, **kwargs):
        raise ReadAfterTheDoor(f"the config was read after the door: {args[1:]}")

    def close() -> None:
        for cls in (DictConfig, ListConfig):
            for name in ("__getattr__", "__getitem__", "get", "__contains__", "__iter__", "items", "keys"):
                if hasattr(cls, name):
                    monkeypatch.setattr(cls, name, closed)
    return close


@pytest.mark.parametrize("algo", ["gdpo_dapo", "ppo"])
def test_a_step_runs_on_the_built_run_with_the_config_closed(algo, tmp_path, no_config_after):
    """Every phase of a step (collect, score, advantages, update, metrics, the held-out evaluation, the logs and the
    checkpoint) runs with every read of the config failing: what they use was built at the door."""
    cfg = compose_config(f"algo={algo}", "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_prompts=2",
                         "logger.samples_every=1")
    run = start_run(cfg, tmp_path)
    no_config_after()
    with pytest.raises(ReadAfterTheDoor, match="after the door"):
        cfg.trainer.temperature  # noqa: B018  (the closing holds)
    stop = StopSignals()
    try:
        metrics = train_step(run, 1, stop)
    finally:
        stop.restore()
        run.close()
    assert metrics["step"] == 1 and "perf/eval_s" in metrics and metrics["loss/total"] is not None
    assert (tmp_path / "checkpoints" / "step_000001").is_dir() and (tmp_path / "samples.jsonl").exists()


def test_sfts_settings_hold_the_configs_values():
    cfg = compose_sft("sft.batch_size=6", "sft.micro_batch_size=3", "sft.lr=0.002", "sft.warmup_steps=5",
                      "sft.eval_every=7", "sft.save_every=8", "trainer.eval_at_start=false")
    assert SftSettings.of(cfg) == SftSettings(batch_size=6, micro_batch_size=3, lr=0.002, warmup_steps=5,
                                              eval_every=7, save_every=8, eval_at_start=False)


def test_an_sft_step_and_its_evaluation_run_with_the_config_closed(tmp_path, no_config_after):
    run = start_sft(compose_sft(), tmp_path)
    no_config_after()
    try:
        metrics = {**sft_step(run, 1), **run.evaluate(1)}
    finally:
        run.close()
    assert metrics["step"] == 1 and metrics["sft/loss"] > 0 and "perf/eval_s" in metrics
    assert run.state == {"step": 1, "prompt_position": 4}  # sft.batch_size=4 demonstrations consumed
