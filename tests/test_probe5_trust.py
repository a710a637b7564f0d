"""Issue 59 (the fifth probe), trust: a run dir's config is judged on what will be built, a resume obeys only what
the run wrote, and nothing is written through a link planted in a run dir.  Each payload is checked twice: with
trust it does what it says (the file is written, the channel built outside the sandbox), so the refusal without
trust is what stops it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


# ---- links: nothing mrl, Hydra or W&B write in a run dir follows one -----------------------------------------------

MRL = [sys.executable, "-m", "mrl"]


def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A one-step run of the default config, checkpointed, with its held-out evaluation (held_out/) and W&B's
    offline files (wandb/, W&B's own links in it): a resume of a copy passes every check below but the planted."""
    root = tmp_path_factory.mktemp("probe5")
    run = root / "run"
    result = mrl("train", "trainer.max_steps=1", "trainer.save_every=1", "trainer.prompts_per_step=2",
                 "trainer.group_size=2", "trainer.eval_every=1", "trainer.eval_prompts=2", f"hydra.run.dir={run}",
                 cwd=root)
    assert result.returncode == 0, result.stderr
    assert (run / "held_out").is_dir() and (run / "wandb" / "latest-run").is_symlink()
    return run


def copy_of(run: Path, where: Path) -> Path:
    shutil.copytree(run, where, symlinks=True)
    return where


def plant(run: Path, name: str, victim: Path) -> Path:
    """`run`/`name` replaced by a symlink to `victim` (a file, or a dir for a dir)."""
    link = run / name
    shutil.rmtree(link) if link.is_dir() and not link.is_symlink() else link.unlink(missing_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


@pytest.mark.parametrize("name", [".hydra/config.yaml", "mrl.log", "held_out", "wandb"])  # the probe's four
def test_a_resume_writes_nothing_through_a_planted_link(trained, tmp_path, name):
    run = copy_of(trained, tmp_path / "run")
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir if name in ("held_out", "wandb") else victim_dir / "bashrc"
    if victim != victim_dir:
        victim.write_text("victim\n")
    link = plant(run, name, victim)
    result = mrl("train", "--resume", str(run), "trainer.max_steps=2", "logger=wandb", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mrl: error:")]
    assert len(lines) == 1 and f"{link} is a symlink (to {victim})" in lines[0], result.stderr
    assert sorted(os.listdir(victim_dir)) == ([] if victim == victim_dir else ["bashrc"])
    assert victim == victim_dir or victim.read_text() == "victim\n"
    assert (run / "metrics.jsonl").read_text() == (trained / "metrics.jsonl").read_text()  # no step was trained


@pytest.mark.parametrize("name", [".hydra", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "samples.jsonl", "wandb_id",
                                  "metrics.jsonl", "held_out/step_000001.jsonl", "wandb/offline-run-*/files"])
def test_every_link_in_a_run_dir_is_refused_before_its_resume_reads_it(trained, tmp_path, name):
    """The same refusal without a process: `expand_resume` looks before it reads .hydra/, and `check_run_dir`
    (RunDirGuard, train(), sft(), each job of a sweep) before anything is written."""
    from mrl.overrides import expand_resume
    from mrl.runs.rundir import check_run_dir

    run = copy_of(trained, tmp_path / "run")
    name = next(run.glob(name)).relative_to(run).as_posix() if "*" in name else name  # W&B's run: one dir
    link = plant(run, name, tmp_path)
    with pytest.raises(UserError) as err:
        expand_resume(["--resume", str(run)])
    assert f"{link} is a symlink (to {tmp_path})" in one_line(err)
    with pytest.raises(UserError) as err:
        check_run_dir(OmegaConf.create({"trainer": {"resume": True}}), run)
    assert f"{link} is a symlink" in one_line(err)


def test_a_new_run_writes_nothing_through_a_link_in_its_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.log"
    victim.write_text("victim\n")
    (run / "mrl.log").symlink_to(victim)
    result = mrl("train", "trainer.max_steps=1", "logger=none", f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 2 and f"{run / 'mrl.log'} is a symlink" in result.stderr, result.stderr
    assert victim.read_text() == "victim\n" and sorted(os.listdir(run)) == [".mrl.lock", "mrl.log"]


def test_hard_links_fifos_and_wandbs_own_links(tmp_path):
    from mrl.runs.rundir import LOCK_FILE, RunDirLock, planted_problem

    run = tmp_path / "run"
    (run / "wandb" / "offline-run-1" / "logs").mkdir(parents=True)
    for own in ("wandb/latest-run", "wandb/debug.log", "wandb/offline-run-1/logs/debug-core.log"):
        (run / own).symlink_to(tmp_path)
    assert planted_problem(run) is None  # W&B's own links: replaced by a rename, or in a W&B run's own dir
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    os.link(victim, run / LOCK_FILE)  # the lock file truncated, then the pid written: into the victim
    with pytest.raises(UserError) as err:
        RunDirLock(run).acquire()
    assert "is a hard link" in one_line(err) and victim.read_text() == "victim\n"
    assert "mrl.lock is a hard link (2 names of one file)" in planted_problem(run)
    (run / LOCK_FILE).unlink()
    os.mkfifo(run / "mrl.log")  # Hydra's log handler would wait on it for ever
    assert planted_problem(run) == f"{run / 'mrl.log'} is not a regular file (a FIFO, socket or device)"
    (run / "mrl.log").unlink()
    (run / "wandb" / "offline-run-1" / "files").symlink_to(tmp_path)
    assert planted_problem(run).startswith(f"{run / 'wandb' / 'offline-run-1' / 'files'} is a symlink")


def test_a_sweep_dir_with_a_planted_link_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "0_gdpo_seed0").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (sweep / "0_gdpo_seed0" / ".hydra").symlink_to(victim)
    result = mrl("train", "-m", "trainer.max_steps=1", "logger=none", "algo=gdpo", f"hydra.sweep.dir={sweep}",
                 cwd=tmp_path)
    assert result.returncode == 2 and f"{sweep / '0_gdpo_seed0' / '.hydra'} is a symlink" in result.stderr, \
        result.stderr
    assert os.listdir(victim) == []


# ---- a chat template from elsewhere: bounded when rendered, never chosen by a foreign config ------------------------

# The probe's template, a little smaller: 1e5 x 3e3 iterations, about half a minute unbounded on this machine.
LOOPS = "{% for i in range(100000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"


@pytest.fixture
def bounded(monkeypatch):
    from mrl.chat import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    return chat_template


def tiny_tokenizer(template: str):
    from mrl.modeling.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(compose_config().model))
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_that_loops_stops_at_the_bound_in_one_line(bounded):
    import time

    tokenizer = tiny_tokenizer(LOOPS)
    started = time.perf_counter()
    with pytest.raises(UserError) as err:
        bounded.render_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - started < 3.0
    assert "rendered one conversation for more than 0.5 s" in one_line(err)
    time.sleep(0.7)  # nothing left pending in this thread once the bound has passed
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert bounded.render_template(tokenizer, [{"role": "user", "content": "hi"}]) == "<user>hi"


def test_the_bound_holds_in_any_thread_and_on_every_render_path(bounded):
    """The rollout engines render in worker threads too; ChatTemplate.render (the chat protocol) and the words
    protocol's prompt both go through render_template."""
    from concurrent.futures import ThreadPoolExecutor

    from mrl.chat.chat_template import ChatTemplate
    from mrl.chat.protocols import WordsProtocol
    from mrl.core.episode import Prompt

    tokenizer = tiny_tokenizer(LOOPS)
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(UserError, match="more than 0.5 s"):
            pool.submit(bounded.render_template, tokenizer, [{"role": "user", "content": "hi"}]).result(timeout=10)
    with pytest.raises(UserError, match="more than 0.5 s"):
        ChatTemplate(tokenizer).render([{"role": "user", "content": "hi"}])
    with pytest.raises(UserError, match="more than 0.5 s"):
        WordsProtocol(tokenizer, use_chat_template=True).prompt_ids(Prompt("hi", {}))


def test_a_template_that_writes_too_much_is_refused(bounded):
    tokenizer = tiny_tokenizer("{{ 'x' * 5000000 }}")
    with pytest.raises(UserError) as err:
        bounded.render_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert "wrote 5000000 characters for one conversation, more than 4194304" in one_line(err)


@pytest.mark.parametrize("key, value", [("use_chat_template", True), ("tool_format", "chat")])
def test_a_foreign_config_does_not_choose_to_render_its_template(tmp_path, key, value):
    run = saved_run(tmp_path, lambda c: c["model"].update({key: value}))
    with pytest.raises(UserError) as err:
        run_config(run)
    assert f"sets model.{key}={str(value).lower()}: scoring would render the checkpoint's chat template" \
        in one_line(err) and "--trust-config" in str(err.value)
    assert run_config(run, trust_config=True).model[key] == value
    assert run_config(run, renders=False).model[key] == value  # mrl export renders no conversation


def test_mrl_eval_of_a_checkpoint_whose_template_loops_ends_in_one_line(trained, tmp_path):
    """The probe: a checkpoint's tokenizer with the looping template, its manifest sealed again; `mrl eval` with the
    template asked for on the command line (the foreign config may not) stops at the bound (5 s), exit 2."""
    import json as json_module
    import time

    from mrl.runs.rundir import MANIFEST, seal_checkpoint

    run = copy_of(trained, tmp_path / "run")
    checkpoint = next((run / "checkpoints").glob("step_*"))
    config_file = checkpoint / "policy" / "tokenizer_config.json"
    config = json_module.loads(config_file.read_text())
    config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    config_file.write_text(json_module.dumps(config))
    identity = json_module.loads((checkpoint / MANIFEST).read_text())["run"]
    (checkpoint / MANIFEST).unlink()
    seal_checkpoint(checkpoint, identity)
    started = time.perf_counter()
    result = mrl("eval", str(run), "model.use_chat_template=true", "--prompts", "1", "--samples", "0", cwd=tmp_path)
    took = time.perf_counter() - started
    assert result.returncode == 2 and "rendered one conversation for more than 5 s" in result.stderr, result.stderr
    assert took < 90, took  # start-up, the model, then the bound: before, still rendering after 120 s
    assert not (run / "eval.json").exists()


def test_the_probes_resume_payloads_write_nothing(trained, tmp_path):
    """Lines added to .hydra/overrides.yaml: a Hydra callback that touches a file, and a channel's `_target_`; each
    ran at `mrl train --resume` (exit 0, the file written).  Now one line, exit 2, nothing written, no step trained."""
    for planted in (["+hydra.callbacks.pwn._target_=pathlib.Path.touch", "+hydra.callbacks.pwn.self={victim}"],
                    ["rewards.channels.safety.fn._target_=pathlib.Path.touch", "+rewards.channels.safety.fn.self="
                     "{victim}"]):
        run = copy_of(trained, tmp_path / f"run{len(os.listdir(tmp_path))}")
        victim = tmp_path / f"victim_{run.name}"
        with open(run / ".hydra" / "overrides.yaml", "a") as saved:
            saved.writelines(f"- {line.format(victim=victim)}\n" for line in planted)
        result = mrl("train", "--resume", str(run), "trainer.max_steps=2", cwd=tmp_path)
        assert result.returncode == 2 and f"holds '{planted[0]}'" in result.stderr, result.stderr
        assert not victim.exists() and (run / "metrics.jsonl").read_text() == (trained / "metrics.jsonl").read_text()


def test_the_reproductions_score_the_runs_they_trained_with_trust(monkeypatch):
    """Their runs render SmolLM2's and Qwen3's chat templates, which `mrl eval` renders only with --trust-config."""
    from mrl.repro import agent

    assert agent.final_args(agent.plan("cpu"), Path("run"))[-1] == "--trust-config"
    monkeypatch.setenv("GPU_MODEL", "qwen3_0_6b")
    gpu = agent.plan("gpu")
    assert gpu.thinking and gpu.thinking_args(Path("run"), True)[-1] == "--trust-config"
