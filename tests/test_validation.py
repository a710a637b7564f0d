"""Every bad value gets one clear error before anything is written (mrl/train/validation.py).

Most cases go through the Python API (`validate`, `train`), which runs the same checks as the CLI's preflight; a few
go through `mrl train` in a subprocess, where the run dir and `.hydra/` are Hydra's to write."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ALGOS, REWARDS, compose_config
from omegaconf import OmegaConf

from mrl.core.config import UserError
from mrl.rewards.channels import build_reward_set, configured_channels
from mrl.train.evaluate import run_config
from mrl.train.loop import train
from mrl.train.validation import check_yaml_syntax, validate

MRL = [sys.executable, "-m", "mrl.cli"]
TINY = ["trainer.max_steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2", "logger=none"]

# override(s) -> fragments the one-line error must hold: the key with its bad value, and the rule or the fix.
BAD_VALUES = {
    "trainer.lr=-1e-4": ["trainer.lr=-0.0001", "> 0", "3e-4"],
    "trainer.lr=nan": ["trainer.lr=nan", "finite"],
    "trainer.lr=inf": ["trainer.lr=inf", "finite"],
    "trainer.temperature=0": ["trainer.temperature=0", "> 0", "1.0 samples"],
    "trainer.top_p=0": ["trainer.top_p=0", "> 0 and <= 1"],
    "trainer.top_p=1.5": ["trainer.top_p=1.5", "<= 1"],
    "trainer.top_k=-1": ["trainer.top_k=-1", ">= 0", "0 turns"],
    "trainer.max_new_tokens=0": ["trainer.max_new_tokens=0", ">= 1"],
    "trainer.seed=-1": ["trainer.seed=-1", ">= 0"],
    "trainer.save_every=0": ["trainer.save_every=0", ">= 1"],
    "trainer.grad_clip=0": ["trainer.grad_clip=0", "> 0"],
    "trainer.num_mini_batches=0": ["trainer.num_mini_batches=0", ">= 1"],
    "trainer.group_size=1": ["trainer.group_size=1", "group_size >= 2"],
    "algo=ppo trainer.group_size=0": ["trainer.group_size=0", ">= 1"],
    "algo.clip_low=-1": ["algo.clip_low=-1", ">= 0 and < 1", "0.2"],
    "algo.clip_low=1": ["algo.clip_low=1", "< 1"],
    "algo.clip_high=-0.1": ["algo.clip_high=-0.1", ">= 0", "0.28"],
    "algo.kl_coef=-0.1": ["algo.kl_coef=-0.1", ">= 0", "0 turns the KL term off"],
    "algo.epochs=0": ["algo.epochs=0", ">= 1"],
    "algo.gamma=1.5": ["algo.gamma=1.5", "<= 1"],
    "algo.adv_eps=0": ["algo.adv_eps=0", "> 0"],
    "algo=ppo algo.critic_lr=-1": ["algo.critic_lr=-1", "> 0"],
    "algo.kl_coef=0.1 algo.kl_mode=reward": ["algo.kl_mode=reward", "algo.kl_mode=loss"],
    "algo.critic=head": ["algo.critic=head", "critic=null"],
    "data.eval_fraction=1": ["data.eval_fraction=1", "< 1", "0.1 holds out 10%"],
    "rewards.on_error=ignore": ["rewards.on_error='ignore'", "raise, drop"],
    "model.dtype=fp16": ["model.dtype='fp16'", "float32, bfloat16, float16"],
    "logger.backend=tensorboard": ["logger.backend='tensorboard'", "wandb, none"],
    "logger.mode=live": ["logger.mode='live'", "offline, online, disabled"],
    "logger.log_every=0": ["logger.log_every=0", ">= 1"],
    "rollout.engine=sglang": ["rollout.engine='sglang'", "choose one of hf", "ROLLOUT_ENGINES"],
    "algo.advantage=reinforce": ["algo.advantage='reinforce'", "choose one of grpo, gdpo, gae", "ESTIMATORS"],
    "algo.loss_agg=tokenmean": ["algo.loss_agg='tokenmean'", "choose one of seq_mean, token_mean", "AGGREGATIONS"],
    "model.tool_format=json": ["model.tool_format='json'", "choose one of auto, words, chat", "PROTOCOLS"],
    "trainer.device=gpu": ["trainer.device='gpu'", "auto", "cpu"],
    "rewards.channels.efficiency.weight=nan": ["rewards.channels.efficiency.weight=nan", "finite"],
    "rewards.channels.correctness.enforce=veto": ["rewards.channels.correctness.enforce", "kind=constraint"],
    "rewards.channels.efficiency.condition_on=nope": ["efficiency.condition_on='nope'", "choose one of"],
    "algo=grpo_weighted rewards=code": ["algo.weights", "efficiency, safety, which rewards=code does not have",
                                        "no weight for bug_ratio, length, pass_rate", "algo=grpo"],
    "algo.weights={correctness:1,efficiency:nan,safety:1}": ["algo.weights.efficiency=nan", "finite"],
    "model.name_or_path=/no/such/model": ["model.name_or_path='/no/such/model'", "no such directory"],
    "data.path=/no/such/data.jsonl": ["/no/such/data.jsonl", "does not exist"],
    "model.lora.r=-1": ["model.lora.r=-1", ">= 0", "0 turns LoRA off"],
    "model.lora.r=4 model.lora.alpha=0": ["model.lora.alpha=0.0", "> 0", "alpha / r"],
    "model.lora.r=4 model.lora.dropout=1.0": ["model.lora.dropout=1.0", ">= 0 and < 1"],
    "model.lora.r=4 model.lora.dropout=-0.1": ["model.lora.dropout=-0.1", ">= 0 and < 1"],
    "model.lora.r=4 model.lora.target_modules=[]": ["model.lora.target_modules=[]", "all-linear"],
    "model.lora.r=4 model.lora.target_modules=[q_proj,v_prj]": [
        "model.lora.target_modules: v_prj matches no linear layer of builtin:tiny",
        "its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj", "all-linear"],
    "model.lora.r=4 model.lora.target_modules=lm_head": ["lm_head matches no linear layer", "the output layer"],
}


def one_line(err: UserError) -> str:
    message = str(err)
    assert "\n" not in message and len(message) < 500, message
    return message


@pytest.mark.parametrize("overrides", list(BAD_VALUES))
def test_a_bad_value_is_one_error_naming_the_key_and_the_fix(overrides, tmp_path):
    cfg = compose_config(*overrides.split())
    with pytest.raises(UserError) as err:
        validate(cfg)
    message = one_line(err.value)
    for fragment in BAD_VALUES[overrides]:
        assert fragment in message, (fragment, message)
    # train() checks first, so a refused run writes nothing: not even its run dir.
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=re.escape(message)):
        train(cfg, run_dir)
    assert not run_dir.exists()


def test_a_misspelt_channel_in_a_users_rewards_yaml_is_named():
    # What Hydra makes of `channels: {effciency: {weight: 2}}` in a rewards YAML that extends agent_triple (the
    # command line cannot add a channel: Hydra refuses `+rewards.channels.x=...` itself).
    cfg = compose_config()
    OmegaConf.set_struct(cfg, False)  # as while Hydra merges the YAML files
    cfg = OmegaConf.merge(cfg, {"rewards": {"channels": {"effciency": {"weight": 2}}}})
    with pytest.raises(UserError) as err:
        validate(cfg)
    message = one_line(err.value)
    assert "rewards.channels.effciency has no fn" in message and "correctness, efficiency, safety" in message
    assert "_target_" in message


def test_the_default_config_and_every_preset_pass():
    for algo in ALGOS:
        validate(compose_config(f"algo={algo}"))


@pytest.mark.parametrize("rewards", REWARDS)
@pytest.mark.parametrize("algo", ALGOS)
def test_every_preset_composes_with_every_rewards_or_refuses_naming_the_channel(algo, rewards):
    """A preset that shapes channels by name applies where the channel exists (gdpo_conditioned: a structural
    choice per channel); one whose weights only mean something as a whole refuses (grpo_weighted's are tuned to
    agent_triple's scales)."""
    cfg = compose_config(f"algo={algo}", f"rewards={rewards}")
    if algo == "grpo_weighted" and rewards not in ("agent_triple",):
        with pytest.raises(UserError) as err:
            validate(cfg)
        message = one_line(err.value)
        # all of grpo_weighted's channels, and one more
        extra = {"bfcl_agent": "turns", "bfcl_gen": "turns", "agent_triple_judged": "judge"}
        if rewards in extra:
            assert f"algo=grpo_weighted gives no weight for {extra[rewards]}" in message
        else:
            assert "which rewards=" in message and "efficiency" in message
        return
    validate(cfg)
    channels, left_out = configured_channels(cfg.rewards, cfg.algo)
    assert set(channels) | set(left_out) == set(cfg.rewards.channels)
    assert set(left_out) <= set(cfg.algo.shapes)


def test_gdpo_conditioned_applies_where_the_channels_exist():
    triple = build_reward_set(*_parts(compose_config("algo=gdpo_conditioned", "rewards=agent_triple")))
    assert triple.specs[1].condition_on == "correctness" and triple.specs[2].enforce == "veto"
    math = build_reward_set(*_parts(compose_config("algo=gdpo_conditioned", "rewards=math_length")))
    assert math.names == ["correctness", "length"]
    assert all(s.condition_on is None and s.enforce is None for s in math.specs)
    # The same as plain gdpo on these rewards.
    plain = build_reward_set(*_parts(compose_config("algo=gdpo", "rewards=math_length")))
    assert [(s.name, s.weight, s.kind) for s in math.specs] == [(s.name, s.weight, s.kind) for s in plain.specs]


def _parts(cfg):
    return cfg.rewards, cfg.algo


@pytest.mark.parametrize("rewards", ["math_length", "code", "tool_call"])
def test_the_default_algo_trains_on_every_task(rewards, make_cfg, tmp_path):
    metrics = train(make_cfg(f"rewards={rewards}", "trainer.max_steps=1", "trainer.group_size=2"), tmp_path)
    assert metrics["step"] == 1 and metrics["loss/total"] is not None


def test_yaml_syntax_errors_are_file_line_and_message(tmp_path):
    (tmp_path / "rewards").mkdir()
    bad = tmp_path / "rewards" / "bad.yaml"
    bad.write_text("defaults: [agent_triple, _self_]\nname: bad\nchannels:\n  correctness:\n    weight: [1\n")
    with pytest.raises(UserError) as err:
        check_yaml_syntax([str(tmp_path)])
    assert one_line(err.value).startswith(f"{bad}:6: expected ',' or ']'")
    bad.write_text("name: a\nname: b\n")  # Hydra's loader refuses duplicate keys too
    with pytest.raises(UserError, match=rf"^{bad}:2: .*duplicate"):
        check_yaml_syntax([str(tmp_path)])
    bad.write_text("name: fine\n")
    check_yaml_syntax([str(tmp_path)])


def test_eval_reads_the_config_the_run_trained_with(tmp_path):
    """A run trained with --config-dir cannot be composed again from conf/: eval reads .hydra/config.yaml."""
    cfg = compose_config("algo=gdpo_conditioned", "rewards=math_length")
    saved = OmegaConf.to_container(cfg)
    saved["rewards"]["channels"]["mine"] = {"fn": {"_target_": "mrl.envs.math_length.AnswerCorrect"}}
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- rewards=my_rewards_from_a_config_dir\n")
    loaded = run_config(tmp_path)
    assert build_reward_set(loaded.rewards, loaded.algo).names == ["correctness", "length", "mine"]
    assert loaded.algo.advantage == "gdpo" and loaded.algo.critic_lr == cfg.algo.critic_lr


# --- through the CLI: Hydra would create the run dir and write .hydra/ before the task function runs.

def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mrl: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def snapshot(directory: Path) -> dict[Path, str | None]:
    return {p: p.read_text() if p.is_file() else None for p in directory.rglob("*")}


def test_cli_refuses_a_bad_value_without_touching_an_existing_run_dir(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text(f"# the earlier run's {name}\n")
    before = snapshot(run)
    result = mrl("train", *TINY, "trainer.lr=-1e-4", f"hydra.run.dir={run}", cwd=tmp_path)
    assert_one_line_error(result, "trainer.lr=-0.0001", "> 0")
    assert snapshot(run) == before  # no .hydra/ rewritten, no mrl.log

    fresh = tmp_path / "fresh"
    result = mrl("train", *TINY, "rewards.on_error=ignore", f"hydra.run.dir={fresh}", cwd=tmp_path)
    assert_one_line_error(result, "rewards.on_error='ignore'", "raise, drop")
    assert not fresh.exists() and not (tmp_path / "outputs").exists()


def test_cli_reduces_a_yaml_syntax_error_in_a_config_dir_to_file_and_line(tmp_path):
    (tmp_path / "conf" / "rewards").mkdir(parents=True)
    (tmp_path / "conf" / "rewards" / "mine.yaml").write_text(
        "defaults: [agent_triple, _self_]\nname: mine\nchannels:\n  correctness:\n    weight: [1\n")
    result = mrl("train", "--config-dir", "conf", "rewards=mine", *TINY, f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path)
    assert_one_line_error(result, "conf/rewards/mine.yaml:6: expected ',' or ']'")
    assert not (tmp_path / "run").exists()


def test_cli_multirun_checks_every_job_before_the_sweep_dir_exists(tmp_path):
    sweep = tmp_path / "sweep"
    result = mrl("train", "-m", *TINY, "trainer.lr=1e-4,-1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert_one_line_error(result, "job #1", "trainer.lr=-1.0", "> 0")
    assert not sweep.exists()


def test_cli_multirun_rerun_over_a_finished_sweep_is_refused_before_anything_is_written(tmp_path):
    sweep = tmp_path / "sweep"
    first = mrl("train", "-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() if p.is_file() else None for p in sweep.rglob("*")}
    again = mrl("train", "-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert_one_line_error(again, "job #0", "already holds a run", "trainer.resume=true")
    assert {p: p.read_bytes() if p.is_file() else None for p in sweep.rglob("*")} == before  # nothing touched
