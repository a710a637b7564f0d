"""Issue 22: run dirs that cannot be pointed elsewhere, checkpoints verified wherever they are read, and bad inputs
refused in one line before anything is written.  Checkpoints here are sealed by hand (no training): what is tested
is what reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from typer.testing import CliRunner

from mrl.cli import app
from mrl.core.config import UserError
from mrl.core.episode import Episode, Prompt
from mrl.envs.code import is_empty
from mrl.runs.export import export
from mrl.runs.rundir import (
    LATEST,
    LOCK_FILE,
    MANIFEST,
    RunDirLock,
    atomic_write_text,
    check_compatible,
    checkpoint_problem,
    resolve_resume,
    run_identity,
    seal_checkpoint,
)
from mrl.runs.tracking import MetricsFile, read_metrics
from mrl.runs.trust import run_config
from mrl.train.evaluate import check_counts
from mrl.train.validation import validate

MRL = [sys.executable, "-m", "mrl"]


def _checkpoint(run: Path, step: int, identity: dict | None = None) -> Path:
    path = run / "checkpoints" / f"step_{step:06d}"
    (path / "policy").mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step, "prompt_position": 0}))
    (path / "policy" / "config.json").write_text("{}")
    seal_checkpoint(path, identity or {})
    (run / "checkpoints" / LATEST).write_text(path.name)
    return path


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


# ---- checkpoints/latest and every checkpoint path stay inside the run dir ------------------------------------------

def test_latest_naming_another_run_is_refused(tmp_path):
    other = tmp_path / "other"
    _checkpoint(other, 2)
    run = tmp_path / "run"
    _checkpoint(run, 1)
    (run / "checkpoints" / LATEST).write_text("../../other/checkpoints/step_000002")
    with pytest.raises(UserError) as err:
        resolve_resume(True, run)
    assert "not a checkpoint of this run dir" in _one_line(err)
    # A step dir that is a link to another run's checkpoint is no checkpoint of this one.
    (run / "checkpoints" / LATEST).write_text("step_000001")
    os.symlink(other / "checkpoints" / "step_000002", run / "checkpoints" / "step_000003")
    assert resolve_resume(True, run).name == "step_000001"
    (run / "checkpoints" / LATEST).write_text("step_000003")
    with pytest.raises(UserError):
        resolve_resume(True, run)


def test_a_checkpoints_dir_that_is_a_link_is_refused(tmp_path):
    other = tmp_path / "other"
    _checkpoint(other, 2)
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(other / "checkpoints", run / "checkpoints")
    with pytest.raises(UserError) as err:
        resolve_resume(True, run)
    assert "is a symlink" in _one_line(err)


def test_manifests_with_wrong_types_links_or_escapes_fall_back_to_the_intact_previous(tmp_path):
    run = tmp_path / "run"
    older = _checkpoint(run, 1)
    newest = _checkpoint(run, 2)
    manifest = json.loads((newest / MANIFEST).read_text())
    for files, why in [({"state.json": {"bytes": "12", "sha256": 1}}, "wrong types"),
                       (["state.json"], "wrong types"),
                       ({**manifest["files"], "../../x": {"bytes": 1, "sha256": "0"}}, "outside the checkpoint")]:
        (newest / MANIFEST).write_text(json.dumps({**manifest, "files": files}))
        assert why in checkpoint_problem(newest)
        assert resolve_resume(True, run) == older  # with a warning naming the skipped one
    (newest / MANIFEST).write_text(json.dumps({**manifest, "run": ["algo"]}))
    assert "wrong types" in checkpoint_problem(newest)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    os.symlink("/etc/hostname", newest / "policy" / "extra")
    assert "symlink" in checkpoint_problem(newest)


def test_a_resume_with_another_model_shape_is_refused_naming_it(tmp_path):
    cfg = compose_config()
    checkpoint = _checkpoint(tmp_path / "run", 1, run_identity(cfg))
    check_compatible(checkpoint, cfg)
    for override, key in [("model.tiny.hidden_size=32", "model.tiny.hidden_size"),
                          ("model.tiny.vocab_size=40", "model.tiny.vocab_size"), ("model.lora.r=4", "model.lora.r")]:
        with pytest.raises(UserError) as err:
            check_compatible(checkpoint, compose_config(override))
        assert f"{key}=" in _one_line(err) and "model" in str(err.value)


# ---- files of a run dir are not followed through symlinks ---------------------------------------------------------

def test_lock_metrics_eval_files_refuse_symlinks(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / LOCK_FILE)
    with pytest.raises(UserError) as err:
        RunDirLock(run).acquire()
    assert "is a symlink" in _one_line(err)
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(UserError):
        MetricsFile(run)
    os.symlink(target, run / "eval.json")
    with pytest.raises(UserError):
        atomic_write_text(run / "eval.json", "{}")
    os.symlink(target, run / f".eval.jsonl.tmp{os.getpid()}")  # a planted temp name: the link goes, not its target
    atomic_write_text(run / "eval.jsonl", "{}\n")
    assert target.read_text() == "keep" and (run / "eval.jsonl").read_text() == "{}\n"


def test_export_verifies_checksums_and_refuses_links(tmp_path):
    run = tmp_path / "run"
    older = _checkpoint(run, 1)
    newest = _checkpoint(run, 2)
    (newest / "policy" / "config.json").write_text("[]")  # same size, another sha256
    with pytest.raises(UserError) as err:
        export(newest, tmp_path / "out")
    assert "sha256" in _one_line(err)
    out, what = export(run, tmp_path / "out")  # the run dir: the newest intact checkpoint, as a resume picks
    assert older.name in what and (out / "config.json").read_text() == "{}"
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(UserError) as err:
        export(run, tmp_path / "link")
    assert "symlink" in _one_line(err)


# ---- a run dir is as trusted as its config ------------------------------------------------------------------------

def _saved_config(run: Path, text: str) -> None:
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    (run / ".hydra" / "config.yaml").write_text(text)


def test_run_config_broken_or_foreign_targets(tmp_path):
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    for broken in ["algo: [unclosed", "- a list\n", "trainer:\n  seed: not-a-number\n"]:
        _saved_config(run, broken)
        with pytest.raises(UserError) as err:
            run_config(run)
        assert "config.yaml is not a config mrl can read" in _one_line(err)
    cfg = compose_config()
    cfg.rewards.task._target_ = "builtins.open"
    _saved_config(run, OmegaConf.to_yaml(cfg))
    with pytest.raises(UserError) as err:
        run_config(run)
    assert "'builtins.open'" in _one_line(err) and "--trust-config" in str(err.value)
    assert run_config(run, trust_config=True).rewards.task._target_ == "builtins.open"
    _saved_config(run, OmegaConf.to_yaml(compose_config()))
    assert run_config(run).rewards.name == cfg.rewards.name


SHELL = "import os; os.system('touch /tmp/owned')"


@pytest.mark.parametrize("change, said", [
    # Hydra follows attribute paths from any `mrl.` prefix: these ran code as root before the allow-list.
    (lambda c: c["rewards"]["task"].update({"hook": {"_target_": "mrl.sandbox.run_tests", "code": SHELL,
                                                     "sandbox": "process"}}),
     "names _target_ 'mrl.sandbox.run_tests' at rewards.task.hook, where a run's config names no code"),
    (lambda c: c["rewards"]["task"].update({"path": {"_target_": "mrl.runs.rundir.Path", "_args_": ["/tmp/owned"]}}),
     "names _target_ 'mrl.runs.rundir.Path' at rewards.task.path, where a run's config names no code"),
    (lambda c: c["rewards"]["task"].update({"_target_": "mrl.runs.rundir.atomic_write_text", "text": SHELL}),
     "names _target_ 'mrl.runs.rundir.atomic_write_text' at rewards.task, not one of mrl's own tasks and channels"),
    (lambda c: c["rewards"]["task"].update({"_target_": "mrl.envs.code.os.system"}),
     "names _target_ 'mrl.envs.code.os.system' at rewards.task, not one of mrl's own tasks"),
    (lambda c: c["model"].update({"chat_template_kwargs": {"x": {"_target_": "mrl.envs.code.CodeTask"}}}),
     "names _target_ 'mrl.envs.code.CodeTask' at model.chat_template_kwargs.x, where a run's config names no"),
    (lambda c: c["rewards"].update({"sandbox": "process"}),
     "sets rewards.sandbox=process: the checkpoint's code would run outside the sandbox"),
])
def test_a_run_dir_from_elsewhere_names_only_mrls_own_tasks_and_channels(tmp_path, change, said):
    """The probe's payloads: without --trust-config each is one line naming the key; nothing is built."""
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    cfg = OmegaConf.to_container(compose_config("rewards=code"))
    change(cfg)
    _saved_config(run, OmegaConf.to_yaml(OmegaConf.create(cfg)))
    with pytest.raises(UserError) as err:
        run_config(run)
    assert said in _one_line(err) and "--trust-config" in str(err.value)
    assert not Path("/tmp/owned").exists()


def test_every_shipped_rewards_config_passes_the_allow_list(tmp_path):
    from omegaconf import OmegaConf

    from mrl.core.config import CONF_DIR

    for path in sorted((CONF_DIR / "rewards").glob("*.yaml")):
        run = tmp_path / path.stem
        _saved_config(run, OmegaConf.to_yaml(compose_config(f"rewards={path.stem}", shrink=False)))
        assert run_config(run).rewards.name == path.stem


# ---- bad inputs: one line, non-zero, nothing written --------------------------------------------------------------

@pytest.mark.parametrize("line,why", [
    ('[1, 2]', "not an object"), ('{"step": "3"}', "not an int"), ('{"step": 1, "reward/a/mean": "x"}', "not a number"),
])
def test_metrics_lines_of_wrong_shape_name_the_line(tmp_path, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n' + line + "\n" + '{"step": 2}\n')
    with pytest.raises(UserError) as err:
        read_metrics(path)
    assert f"{path}:2: " in _one_line(err) and why in str(err.value)


def test_report_draws_a_run_whose_metrics_name_a_pass_at_k_that_is_no_number(tmp_path):
    from mrl.runs.report import Run, eval_panels

    run = Run("a", tmp_path, [{"step": 0, "eval/pass@abc": 1.0, "eval/pass@2": 0.5, "eval/pass@1": 0.25,
                               "eval/pass@" + "9" * 5000: 1.0}])
    assert eval_panels([run]) == [("held-out: pass@k", ["eval/pass@1", "eval/pass@2"])]  # was int('abc')
    (tmp_path / "metrics.jsonl").write_text(json.dumps(run.records[0]) + "\n")
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("args", [["--smooth", "0"], ["--last", "0"]])
def test_report_refuses_zero_windows(tmp_path, args):
    result = CliRunner().invoke(app, ["report", str(tmp_path), *args])
    assert result.exit_code == 2 and "at least 1" in result.output and not list(tmp_path.iterdir())


def test_eval_refuses_zero_prompts():
    with pytest.raises(UserError) as err:
        check_counts(0, 4)
    assert "--prompts 0" in _one_line(err)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_run_dir_on_a_file_or_unwritable_place_is_one_line(tmp_path, where):
    path = {"file": tmp_path / "a_file", "proc": Path("/proc/self/mrl_run")}[where]
    if where == "file":
        path.write_text("x")
    with pytest.raises(UserError) as err:
        RunDirLock(path).acquire()
    assert str(path) in _one_line(err)


def _dataset(tmp_path: Path, lines: list) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


@pytest.mark.parametrize("records,why", [
    ([], "no train prompts"),
    ([{"question": "2+2"}], "missing the text field 'prompt'"),
    ([{"prompt": "f?", "target": 1, "tests": "f(0) == 3"}], "`tests` must be a list"),
    ([{"prompt": "x" * 200_000, "target": 1}], "cannot fit the model's context"),
])
def test_dataset_errors_are_found_by_the_preflight(tmp_path, records, why):
    cfg = compose_config(f"data.path={_dataset(tmp_path, records * 3)}", "data.eval_fraction=0")
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert why in _one_line(err)


def test_max_new_tokens_is_bounded_by_the_context():
    with pytest.raises(UserError) as err:
        validate(compose_config("trainer.max_new_tokens=1000000000"))
    assert "context of 64 tokens" in _one_line(err)


def test_a_data_error_leaves_no_run_dir(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([*MRL, "train", f"data.path={_dataset(tmp_path, [])}", f"hydra.run.dir={run}",
                             "logger=none"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no train prompts" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not run.exists()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE_DATA = {
    # The probe's dataset files: each passed the preflight and crashed after the run dir existed, or ran out of memory.
    "invalid utf-8": (b'{"prompt": "add 1 2 =", "target": 3}\n{"prompt": "a\xff", "target": 1}\n',
                      "line 2 is not UTF-8 (byte 0xff at byte offset 50 of the file); save the file as UTF-8"),
    "utf-16": ('{"prompt": "add 1 2 =", "target": 3}\n'.encode("utf-16"),
               "line 1 is not UTF-8 (byte 0xff at byte offset 0 of the file)"),
    "5000 digits": (('{"prompt": "x", "target": ' + "9" * 5000 + "}\n").encode(),
                    "line 1 has a number of 5000 characters (999999999999...), over the 100 allowed"),
    "nested 5000 deep": (('{"prompt": "x", "target": ' + _deep(5000) + "}\n").encode(),
                         "line 1 is nested deeper than 64 levels"),
    "tools 900 deep": ((json.dumps({"prompt": "x", "target": 1, "tools": [{"name": "f", "parameters": {
        "type": "object", "properties": {"a": {}}}}]})[:-3] + ', "deep": ' + _deep(900) + "}]}\n").encode(),
        "line 1 is nested deeper than 64 levels"),
    "tools of 100k properties": ((json.dumps({"prompt": "x", "target": 1, "tools": [{"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100_000)}}}]}) + "\n").encode(),
        "with its turns and tools ('x'...) cannot fit the model's context of 64 tokens"),
    "tool_calls zzz": ((json.dumps({"target": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": "zzz"},
        {"role": "user", "content": "add 1 2 ="}]}) + "\n").encode(),
        "record 0: messages[1].tool_calls = \"zzz\" is not a list of calls of an assistant turn"),
    "no target": (b'{"prompt": "add 1 2 ="}\n', "record 0 is missing the required field 'target'"),
}


@pytest.mark.parametrize("name", HOSTILE_DATA)
def test_a_hostile_dataset_file_is_one_line_naming_the_record_before_the_run(tmp_path, name):
    content, said = HOSTILE_DATA[name]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        validate(compose_config(f"data.path={path}", "data.eval_fraction=0"))
    assert said in _one_line(err)


@pytest.mark.parametrize("rewards, record, said", [
    ("tool_call", {"prompt": "add 3 7 ="}, "record 0 is missing the required field 'call'"),
    ("tool_call", {"prompt": "add 3 7 =", "call": "zzz"}, "record 0: `call` must be {\"name\""),
    ("code", {"prompt": "x + 3 ="}, "record 0 is missing the required field 'tests'"),
    ("math_length", {"prompt": "max 3 7 ="}, "record 0 is missing the required field 'answer'"),
])
def test_the_fields_a_tasks_channels_read_are_required_by_the_preflight(tmp_path, rewards, record, said):
    """Before: a record without `call` stopped the run at its first scoring, 46 s in, after the run dir existed."""
    cfg = compose_config(f"rewards={rewards}", f"data.path={_dataset(tmp_path, [record] * 3)}", "data.eval_fraction=0")
    with pytest.raises(UserError) as err:
        validate(cfg)
    assert said in _one_line(err)


def test_a_utf16_dataset_leaves_no_run_dir(tmp_path):
    run, path = tmp_path / "run", tmp_path / "data.jsonl"
    path.write_bytes(HOSTILE_DATA["utf-16"][0])
    result = subprocess.run([*MRL, "train", f"data.path={path}", f"hydra.run.dir={run}", "logger=none"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "line 1 is not UTF-8" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not run.exists()


def test_a_comment_only_completion_is_empty():
    def episode(completion: str) -> Episode:
        return Episode(prompt=Prompt("x"), completion=completion, completion_ids=[], num_tokens=1, truncated=False,
                       max_new_tokens=4)

    assert is_empty(episode("# TODO\n   # later\n")) and is_empty(episode("```python\n# nothing\n```"))
    assert not is_empty(episode("x + 3  # the answer"))
