"""Issue 59 (the fifth probe), trust: a run dir's config is judged on what will be built, a resume obeys only what
the run wrote, and nothing is written through a link planted in a run dir.  Each payload is checked twice: with
trust it does what it says (the file is written, the channel built outside the sandbox), so the refusal without
trust is what stops it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import compose_config
from omegaconf import OmegaConf

from mrl.core.config import UserError
from mrl.envs.task import build_task
from mrl.rewards.channels import build_reward_set
from mrl.runs.trust import run_config


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def saved_run(tmp_path: Path, change, *overrides: str, raw: str = "") -> Path:
    """A run dir whose .hydra/config.yaml is the composed config (`overrides`) changed by `change(container)`, with
    the value __RAW__ written as `raw` (a string OmegaConf would not create)."""
    config = OmegaConf.to_container(compose_config(*overrides))
    change(config)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.create(config)).replace("__RAW__", json.dumps(raw))
    (run / ".hydra" / "config.yaml").write_text(text)
    return run


# ---- resolvers: the config resolved is what is judged --------------------------------------------------------------

def writer(victim: Path) -> str:
    """The probe's value: no `_target_` key in the file, one after oc.decode and oc.create resolve it."""
    node = f"{{_target_: pathlib.Path.write_text, _args_: [{{_target_: pathlib.Path, _args_: [{victim}]}}, pwned]}}"
    return "${oc.create:${oc.decode:'" + node + "'}}"


def test_a_target_made_by_oc_create_is_refused_and_writes_nothing(tmp_path):
    victim = tmp_path / "victim.pth"
    run = saved_run(tmp_path, lambda c: c["rewards"]["task"].update(seed=writer(victim)))
    with pytest.raises(UserError) as err:
        build_task(run_config(run))
    assert "rewards.task.seed" in one_line(err) and "resolver 'oc.create'" in str(err.value)
    assert "--trust-config" in str(err.value) and not victim.exists()
    build_task(run_config(run, trust_config=True))  # the control: trusted, building the task runs the payload
    assert victim.read_text() == "pwned"


@pytest.mark.parametrize("value, said", [
    ("${oc.env:HOME}", "calls the resolver 'oc.env'"),
    ("${oc.decode:'7'}", "calls the resolver 'oc.decode'"),
    ("${ oc.create:{a: 1}}", "calls the resolver 'oc.create'"),
    ("${now:%H}", "calls the resolver 'now'"),
    ("7${trainer.seed}", "an interpolation inside a longer value"),
    ("${trainer}", "an interpolation of a mapping or list"),
    ("${no.such.key}", "an interpolation that does not resolve"),
    ("${oc.create:", "is not a config mrl can read (GrammarParseError"),  # OmegaConf's own check, on loading
])
def test_a_foreign_config_interpolates_single_values_with_mrls_resolvers_only(tmp_path, value, said):
    run = saved_run(tmp_path, lambda c: c["rewards"]["task"].update(seed="__RAW__"), raw=value)
    with pytest.raises(UserError) as err:
        run_config(run)
    assert said in one_line(err) and ("rewards.task.seed" in str(err.value) or "GrammarParseError" in said)


def test_references_to_mappings_cannot_multiply_a_config(tmp_path):
    """Ten levels of {x: ${a}, y: ${a}} resolve to 2**10 copies of the first: refused before anything resolves."""
    def nest(config):
        config["rewards"]["task"]["bomb0"] = list(range(1000))
        for level in range(1, 11):
            config["rewards"]["task"][f"bomb{level}"] = {"x": f"${{rewards.task.bomb{level - 1}}}",
                                                         "y": f"${{rewards.task.bomb{level - 1}}}"}

    run = saved_run(tmp_path, nest)
    with pytest.raises(UserError) as err:
        run_config(run)
    assert "rewards.task.bomb1.x to an interpolation of a mapping or list" in one_line(err)


def test_the_shipped_interpolations_still_pass(tmp_path):
    """conf/rewards/*.yaml interpolate ${trainer.seed}, ${rewards.sandbox} and mrl.worst_token_cost: a run saved with
    them passes, and its values are what the run had."""
    run = saved_run(tmp_path, lambda c: None, "rewards=code", "trainer.seed=5")
    text = (run / ".hydra" / "config.yaml").read_text()
    assert "${trainer.seed}" in text and "${rewards.sandbox}" in text
    cfg = run_config(run)
    assert cfg.rewards.task.seed == 5 and cfg.rewards.channels.pass_rate.fn.sandbox == "bwrap"
    run = saved_run(tmp_path, lambda c: None)  # agent_triple: gated_value is ${mrl.worst_token_cost:...}
    assert "mrl.worst_token_cost" in (run / ".hydra" / "config.yaml").read_text()
    assert run_config(run).rewards.channels.efficiency.gated_value == -25  # 10 generated + 3 turns x 5 observed


# ---- every argument: _args_ and keywords bound to the class, the sandbox however it is passed ----------------------

def positional(config, sandbox: str) -> None:
    config["rewards"]["channels"]["pass_rate"]["fn"] = {"_target_": "mrl.envs.code.PassRate",
                                                        "_args_": [1.0, 3.0, 256, 2, sandbox]}


def test_the_sandbox_given_by_position_is_refused(tmp_path):
    run = saved_run(tmp_path, lambda c: positional(c, "process"), "rewards=code")
    with pytest.raises(UserError) as err:
        run_config(run)
    assert "rewards.channels.pass_rate.fn's sandbox=process" in one_line(err)
    cfg = run_config(run, trust_config=True)  # the control: built, it runs generated code outside the sandbox
    assert build_reward_set(cfg.rewards, cfg.algo).specs[0].fn.runs.sandbox == "process"
    run_config(saved_run(tmp_path, lambda c: positional(c, "bwrap"), "rewards=code"))  # bwrap by position: fine


@pytest.mark.parametrize("change, said", [
    (lambda c: c["rewards"]["channels"]["pass_rate"]["fn"].update(shell="rm -rf /"),
     "calls mrl.envs.code.PassRate at rewards.channels.pass_rate.fn with arguments it does not take"),
    (lambda c: c["rewards"]["channels"]["pass_rate"]["fn"].update(_partial_=True),
     "calls mrl.envs.code.PassRate at rewards.channels.pass_rate.fn with arguments it does not take"),
    (lambda c: c["rewards"]["task"].update(_args_=[1, 2, 3]),
     "calls mrl.envs.code.CodeTask at rewards.task with arguments it does not take"),
    (lambda c: c["rewards"]["task"].update(_args_="seed"), "sets rewards.task._args_ to a str, not a list"),
    (lambda c: c["rewards"]["channels"]["pass_rate"]["fn"].update(_args_=[1.0, 3.0, 256, 2, "bwrap", "x"]),
     "with arguments it does not take"),
])
def test_every_keyword_and_argument_is_one_the_class_takes(tmp_path, change, said):
    run = saved_run(tmp_path, change, "rewards=code")
    with pytest.raises(UserError) as err:
        run_config(run)
    assert said in one_line(err)


@pytest.mark.parametrize("target", [["x"], {"a": 1}, 7, None])
def test_a_target_that_is_not_a_string_is_one_line_even_with_trust(tmp_path, target):
    run = saved_run(tmp_path, lambda c: c["rewards"]["task"].update(_target_=target))
    for trust in (False, True):
        with pytest.raises(UserError) as err:
            run_config(run, trust_config=trust)
        assert "names a _target_ that is not a string" in one_line(err) and "at rewards.task" in str(err.value)


def test_the_cli_refuses_the_probe_payload_in_one_line(tmp_path):
    """`mrl eval RUN_DIR`: the refusal comes before the checkpoint is looked for, exit 2, and nothing written."""
    from typer.testing import CliRunner

    from mrl.cli import app

    victim = tmp_path / "victim.pth"
    run = saved_run(tmp_path, lambda c: c["rewards"]["task"].update(seed=writer(victim)))
    result = CliRunner().invoke(app, ["eval", str(run), "--prompts", "1", "--samples", "0"])
    assert result.exit_code == 2 and "resolver 'oc.create'" in result.output, result.output
    assert not victim.exists() and not (run / "eval.json").exists()
    assert os.listdir(run) == [".hydra"]


# ---- resume: what it re-reads from the run dir is checked as a foreign config is ------------------------------------

def resumable(tmp_path: Path, saved: list[str], config_dir: str | None = None) -> Path:
    """A run dir's .hydra/ as Hydra writes it: the task overrides, and hydra.yaml's config sources."""
    import yaml

    run = tmp_path / "resumed"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(saved))
    sources = [{"path": config_dir, "schema": "file", "provider": "command-line"}] if config_dir else []
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"config_sources": sources}}}))
    return run


@pytest.mark.parametrize("planted, said", [
    ("+hydra.callbacks.pwn._target_=pathlib.Path.touch", "sets Hydra's own config"),
    ("hydra.job.chdir=true", "sets Hydra's own config"),
    ("hydra/launcher=basic", "sets Hydra's own config"),
    ("model@hydra.job=tiny", "sets Hydra's own config"),
    ("rewards.channels.correctness.fn._target_=pathlib.Path.touch", "names code to build"),
    ("rewards.channels.pass_rate.fn._args_=[1.0,3.0,256,2,process]", "names code to build"),
    ("+rewards.task.x={_target_: pathlib.Path.touch, self: /tmp/x}", "names code to build"),
    ("rewards.sandbox=process", "runs generated code outside the sandbox"),
    ("rewards.channels.pass_rate.fn.sandbox=process", "runs generated code outside the sandbox"),
    ("rewards.task.seed='${oc.create:{a: 1}}'", "interpolates"),
    ("rewards.task.seed=${oc.create:{a: 1}}", "does not parse as an override"),
    ("rewards.task.seed=[1,'${oc.env:HOME}']", "interpolates"),
])
def test_a_resume_refuses_what_it_did_not_write_unless_given_again_or_trusted(tmp_path, planted, said):
    from mrl.overrides import expand_resume

    run = resumable(tmp_path, ["algo=grpo", planted])
    with pytest.raises(UserError) as err:
        expand_resume(["--resume", str(run)])
    assert f"holds {planted[:120]!r}, which {said}" in one_line(err) and "--trust-config" in str(err.value)
    assert planted in expand_resume(["--resume", str(run), "--trust-config"])  # trusted: re-read, flag taken out
    assert "--trust-config" not in expand_resume(["--resume", str(run), "--trust-config"])
    expand_resume(["--resume", str(run), planted])  # given again on the command line: the user's own


def test_a_resume_rereads_plain_settings_and_a_recorded_config_dir_only_when_told(tmp_path):
    from mrl.overrides import expand_resume

    plain = ["algo=grpo", "trainer.seed=3", "rewards.sandbox=bwrap", "~rewards.channels.safety", "algo=gdpo,grpo"]
    run = resumable(tmp_path, plain, config_dir="/tmp/elsewhere")
    with pytest.raises(UserError) as err:
        expand_resume(["--resume", str(run)])
    assert "names the config dir /tmp/elsewhere" in one_line(err) and "--config-dir /tmp/elsewhere" in str(err.value)
    assert expand_resume(["--resume", str(run), "-cd", "mine"])[:len(plain)] == plain
    assert expand_resume(["--resume", str(run), "--trust-config"])[:2] == ["--config-dir", "/tmp/elsewhere"]
