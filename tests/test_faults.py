"""Faults a long run meets, injected: each case checks that no completed step is lost, and that the run resumes, or is
refused in one line with a non-zero exit and nothing written.

In-process cases resume copies of one 3-step run (a checkpoint per step) with configs composed once; the CLI
refusals load no model and take a few seconds each; the cases that kill a training process are slow.
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from omegaconf import OmegaConf, open_dict

from mrl.core.config import UserError
from mrl.rewards.channels import RewardError
from mrl.runs.checkpoint import CheckpointError, latest_checkpoint, rng_state, set_rng_state
from mrl.runs.report import ReportError, make_report
from mrl.runs.rundir import CHECKPOINTS, LOCK_FILE, MANIFEST, Interrupted, RunDirLock, check_run_dir, checkpoint_problem
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

MRL = [sys.executable, "-m", "mrl.cli"]
TINY = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=4", "trainer.max_new_tokens=4",
        "logger=none"]


@functools.cache
def _composed(*groups: str):
    return compose_config("trainer.max_new_tokens=4", *groups)


def config(*overrides: str, groups: tuple[str, ...] = ()):
    """The shrunken default config (conftest.SHRINK, 4 new tokens) with `overrides` of plain keys ("key=value")."""
    return OmegaConf.merge(copy.deepcopy(_composed(*groups)), OmegaConf.from_dotlist(list(overrides)))


def mrl(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=os.environ.copy())


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / METRICS_FILE)]


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file's size, mtime and first bytes (the lock file, which holds a pid, aside)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()[:64])
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mrl: error: ") and expected in lines[0], result.stderr


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory) -> Path:
    """A run of the default config stopped after 3 steps, a checkpoint per step (copy it before changing it)."""
    run = tmp_path_factory.mktemp("faults") / "run"
    train(config("trainer.max_steps=3", "trainer.save_every=1"), run)
    return run


@pytest.fixture
def run(three_steps, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(three_steps, copy)
    return copy


def resume_cfg(*overrides: str, groups: tuple[str, ...] = ()):
    return config("trainer.resume=true", "trainer.save_every=100", *overrides, groups=groups)


# ---- a checkpoint: checksums, fallback, no pickle --------------------------------------------------------------

def test_a_checkpoint_lists_the_checksum_of_every_file_and_holds_no_pickle(three_steps):
    checkpoint = three_steps / CHECKPOINTS / "step_000003"
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == files and "policy/model.safetensors" in files
    assert not (checkpoint / "rng.pt").exists() and json.loads((checkpoint / "rng.json").read_text())["torch"]
    assert manifest["run"]["algo"] == "gdpo_conditioned"
    assert manifest["run"]["rewards.channels"] == ["correctness", "efficiency", "safety"]
    assert checkpoint_problem(checkpoint) is None
    assert not list((three_steps / CHECKPOINTS).glob(".*")), "a temp dir was left behind"


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, problem", [
    (truncate, "policy/model.safetensors", "policy/model.safetensors has"),
    (flip_a_byte, "optimizer.pt", "optimizer.pt does not match its sha256"),
    (lambda path: path.unlink(), "rng.json", "rng.json is missing"),
])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(damage, file, problem, run, capsys):
    damage(run / CHECKPOINTS / "step_000003" / file)
    assert check_run_dir(resume_cfg(), run) == run / CHECKPOINTS / "step_000002"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("mrl: warning: ")
    assert "step_000003" in warning[0] and problem in warning[0] and "using step_000002" in warning[0]


def test_training_goes_on_from_the_previous_checkpoint(run):
    truncate(run / CHECKPOINTS / "step_000003" / "policy" / "model.safetensors")  # the old code: a 22-line traceback
    train(resume_cfg("trainer.max_steps=3"), run)
    assert steps(run) == [1, 2, 3]  # step 3 trained again from step 2, logged once
    assert latest_checkpoint(run).name == "step_000003" and checkpoint_problem(latest_checkpoint(run)) is None


def test_no_intact_checkpoint_is_one_clear_error(run):
    truncate(run / CHECKPOINTS / "step_000003" / "optimizer.pt")
    flip_a_byte(run / CHECKPOINTS / "step_000002" / "policy" / "model.safetensors")
    (run / CHECKPOINTS / "step_000001" / MANIFEST).unlink()
    with pytest.raises(UserError, match="no intact checkpoint in .*step_000003 .*step_000002 .*and 1 more") as caught:
        check_run_dir(resume_cfg(), run)
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="this checkpoint cannot be used: policy/model.safetensors does not match"):
        check_run_dir(config(f"trainer.resume={run / CHECKPOINTS / 'step_000002'}"), run / "elsewhere")


# ---- forged checkpoints: files changed and the manifest sealed again (the checksums then match) -----------------

def forge(checkpoint: Path, change) -> None:
    """Change a checkpoint's files and seal it again, as whoever hands over a run dir can."""
    from mrl.runs.rundir import seal_checkpoint

    identity = json.loads((checkpoint / MANIFEST).read_text())["run"]
    change(checkpoint)
    (checkpoint / MANIFEST).unlink()
    seal_checkpoint(checkpoint, identity)


def broken_header(checkpoint: Path) -> None:
    path = checkpoint / "policy" / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [10 ** 6, 10 ** 6]  # 4 TB said, a few bytes held
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


def absurd_config(checkpoint: Path) -> None:
    path = checkpoint / "policy" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": 10 ** 6}))


@pytest.mark.parametrize("change, problem", [
    (broken_header, "policy/model.safetensors has a broken header (tensor "),
    (lambda c: (c / "policy" / "model.safetensors").write_bytes(b"\xff" * 64),
     "policy/model.safetensors has a broken header (it declares 18446744073709551615 header bytes"),
    (absurd_config, "policy/config.json says num_hidden_layers=1000000, beyond the "),
])
def test_a_forged_checkpoint_is_one_line_from_every_command(change, problem, run):
    """Before: a 90-line traceback from `mrl eval`, "wrote" (rc 0) from `mrl export`, or minutes building a model of a
    million layers; now one line naming the file, from resume, eval and export."""
    from typer.testing import CliRunner

    from mrl.cli import app
    from mrl.runs.export import export
    from mrl.train.evaluate import evaluate

    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config()))  # what `mrl train` writes
    for step in ("step_000001", "step_000002", "step_000003"):
        forge(run / CHECKPOINTS / step, change)
    assert checkpoint_problem(run / CHECKPOINTS / "step_000003").startswith(problem)
    start = time.perf_counter()
    with pytest.raises(UserError, match="no intact checkpoint") as caught:
        check_run_dir(resume_cfg(), run)
    assert problem in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError) as caught:
        evaluate(run, num_prompts=2, samples=0)
    assert problem in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError) as caught:
        export(run / CHECKPOINTS / "step_000003", run / "out")
    assert f"this checkpoint cannot be used: {problem}" in str(caught.value)
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(run / "out")])
    assert result.exit_code != 0 and "wrote" not in result.output and not (run / "out").exists()
    assert time.perf_counter() - start < 30


def test_a_pickled_optimizer_file_is_one_line_on_resume(run):
    class Payload:
        def __reduce__(self):
            return (os.system, ("touch owned",))

    forge(run / CHECKPOINTS / "step_000003", lambda c: torch.save({"optimizer": Payload()}, c / "optimizer.pt"))
    with pytest.raises(UserError) as caught:
        train(resume_cfg("trainer.max_steps=4"), run)
    said = str(caught.value)
    assert "\n" not in said and "optimizer.pt is not a file of plain tensors" in said and "posix.system" in said
    assert not Path("owned").exists()


# ---- metrics.jsonl cut mid-line ----------------------------------------------------------------------------------

def test_a_metrics_line_cut_mid_write_is_dropped_by_report_and_resume(run, capsys):
    with (run / METRICS_FILE).open("a") as file:
        file.write('{"step": 4, "reward/correctness/mean": 0.')  # a full disk, or a kill, mid-line
    assert steps(run) == [1, 2, 3]
    assert "dropped its last line" in capsys.readouterr().err
    png, table = make_report([run])  # the old code: JSONDecodeError
    assert png.exists() and "| 3 |" in table
    train(resume_cfg("trainer.max_steps=4"), run)
    assert steps(run) == [1, 2, 3, 4]
    json.loads((run / METRICS_FILE).read_text().splitlines()[-1])


def test_a_metrics_line_damaged_before_the_last_is_named(run):
    lines = (run / METRICS_FILE).read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / METRICS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=f"{METRICS_FILE}:2: not a JSON record"):
        make_report([run])


# ---- SIGTERM, like Ctrl-C ---------------------------------------------------------------------------------------

class SigtermOnCall:
    """A correctness channel (0.0) that sends SIGTERM to its own process on its `at`-th call."""

    calls, at = 0, 0

    def __call__(self, episode) -> float:
        SigtermOnCall.calls += 1
        if SigtermOnCall.calls == SigtermOnCall.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.0


def test_sigterm_while_generating_checkpoints_the_last_completed_step(run):
    SigtermOnCall.calls, SigtermOnCall.at = 0, 8 + 1  # 8 rollouts a step: the first call of step 5
    cfg = resume_cfg("trainer.max_steps=8")
    OmegaConf.update(cfg, "rewards.channels.correctness.fn", {"_target_": "test_faults.SigtermOnCall"})
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted, match="stopped by SIGTERM") as caught:
        train(cfg, run)
    assert caught.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == handler, "the loop's handler was left installed"
    assert steps(run) == [1, 2, 3, 4]
    assert latest_checkpoint(run).name == "step_000004"  # the old code: killed, step 4 lost
    assert check_run_dir(resume_cfg(), run) == run / CHECKPOINTS / "step_000004"


def test_sigterm_during_the_update_finishes_the_step_first(run, monkeypatch, capfd):
    import mrl.train.loop

    real_update, calls = mrl.train.loop.update, []

    def update(*args, **kwargs):  # the weights are mid-update: the signal must wait
        calls.append(1)
        if len(calls) == 1:  # step 4
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(mrl.train.loop, "update", update)
    with pytest.raises(Interrupted):
        train(resume_cfg("trainer.max_steps=8"), run)
    assert steps(run) == [1, 2, 3, 4]  # step 4 finished, logged and saved, step 5 never began
    assert latest_checkpoint(run).name == "step_000004" and checkpoint_problem(latest_checkpoint(run)) is None
    assert "SIGTERM: stopping after this step" in capfd.readouterr().err  # written by the signal handler


def test_a_crash_after_the_update_saves_no_checkpoint_of_weights_that_moved_on(run, monkeypatch):
    """A crash while step 5 is logged, its update done: saving those weights as step 4's would resume step 5's
    data on weights that already learned from it.  Nothing is saved; step 3's checkpoint stands."""
    import mrl.train.loop

    real_log_step = mrl.train.loop.log_step

    def log_step(run_, step, metrics, collected):
        if step == 5:
            raise OSError(errno.EIO, "metrics.jsonl: input/output error")
        real_log_step(run_, step, metrics, collected)

    monkeypatch.setattr(mrl.train.loop, "log_step", log_step)
    with pytest.raises(OSError, match="input/output error"):
        train(resume_cfg("trainer.max_steps=8"), run)
    assert steps(run) == [1, 2, 3, 4]
    assert latest_checkpoint(run).name == "step_000003"  # the old code: step_000004, holding step 5's weights


# ---- disk full ---------------------------------------------------------------------------------------------------

def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(run, monkeypatch):
    from mrl.modeling.trainable import Trainable

    def no_space(self, directory):
        (directory / "optimizer.pt").write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Trainable, "save_optimizer", no_space)
    with pytest.raises(CheckpointError) as caught:
        train(resume_cfg("trainer.max_steps=4"), run)
    message = str(caught.value)
    assert "\n" not in message and "could not write checkpoint step_000004" in message
    assert "No space left on device" in message and "step_000003 is intact" in message
    assert latest_checkpoint(run).name == "step_000003" and checkpoint_problem(latest_checkpoint(run)) is None
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir()) == ["latest", "step_000001", "step_000002",
                                                                      "step_000003"]
    assert steps(run) == [1, 2, 3, 4]
    assert check_run_dir(resume_cfg(), run) == run / CHECKPOINTS / "step_000003"  # resumable once space is free


# ---- one process per run dir, and no start that clobbers one ----------------------------------------------------

HOLDER = ("import sys, time; from pathlib import Path; from mrl.runs.rundir import RunDirLock; "
          "RunDirLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(600)")


@pytest.fixture
def held(run):
    """Another process holding `run`'s lock, as a trainer in it does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                              env=os.environ.copy())
    assert holder.stdout.readline().strip() == "locked"
    yield holder
    holder.kill()
    holder.wait()


def test_a_second_process_is_refused_while_one_trains(run, held):
    before = snapshot(run)
    with pytest.raises(UserError, match=f"in use by another mrl process \\(pid {held.pid}\\)"):
        train(resume_cfg("trainer.max_steps=6"), run)  # the old code: two resumes interleave and lose steps
    assert snapshot(run) == before
    held.kill()
    held.wait()
    with RunDirLock(run):  # the kernel drops the lock of a process that ended, even by SIGKILL
        pass


def test_resuming_with_another_algorithm_or_reward_set_is_refused_naming_it(run):
    with pytest.raises(UserError, match="trained with algo=gdpo_conditioned, algo.advantage=gdpo, algo.critic=null; "
                                        "this run has algo=ppo, algo.advantage=gae, algo.critic=model"):
        check_run_dir(resume_cfg(groups=("algo=ppo",)), run)
    with pytest.raises(UserError, match=r"trained with rewards.channels=\[correctness,efficiency,safety\]; this run "
                                        r"has rewards.channels=\[correctness,efficiency\]\. Resume with"):
        cfg = resume_cfg()
        with open_dict(cfg.rewards.channels):
            del cfg.rewards.channels["safety"]
        check_run_dir(cfg, run)


@pytest.mark.parametrize("case", ["new run over a run", "locked"])
def test_mrl_train_refuses_before_hydra_writes(case, run, request):
    """The old code overwrote .hydra/ before refusing, and `mrl eval` then scored the checkpoint on the wrong task."""
    hydra_dir = run / ".hydra"
    hydra_dir.mkdir()
    (hydra_dir / "overrides.yaml").write_text("- trainer.max_steps=3\n")  # what `mrl train` wrote for this run
    before = snapshot(run)
    args, expected = {
        "new run over a run": ([], "already holds a run (3 steps in metrics.jsonl)"),
        "locked": (["trainer.resume=true"], "in use by another mrl process"),
    }[case]
    if case == "locked":
        request.getfixturevalue("held")
    result = mrl("train", *TINY, f"hydra.run.dir={run}", *args, cwd=run.parent)
    one_line_error(result, expected)
    assert snapshot(run) == before


# ---- a reward channel that never works -------------------------------------------------------------------------

class AlwaysFails:
    def __call__(self, episode) -> float:
        raise RuntimeError("grader unreachable")


def test_a_channel_failing_on_every_sample_stops_the_run_under_on_error_drop(tmp_path):
    cfg = config("trainer.max_steps=10", "trainer.save_every=100", "rewards.on_error=drop",
                 "rewards.max_failed_steps=2")
    OmegaConf.update(cfg, "rewards.channels.safety.fn", {"_target_": "test_faults.AlwaysFails"})
    with pytest.raises(RewardError, match="'safety' failed on every sample for 2 steps in a row"):
        train(cfg, tmp_path)  # the old code: 10 steps trained on nothing
    assert steps(tmp_path) == [1]
    assert latest_checkpoint(tmp_path).name == "step_000001"


# ---- slow: real processes killed, a real full disk ---------------------------------------------------------------

def wait_for(predicate, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def start(*args: str, cwd: Path, command: list[str] = MRL) -> subprocess.Popen:
    return subprocess.Popen([*command, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())


@pytest.mark.slow
def test_sigterm_to_mrl_train_checkpoints_and_a_second_trainer_is_refused_meanwhile(tmp_path):
    run = tmp_path / "run"
    first = start("train", *TINY, "trainer.max_steps=1000", "trainer.save_every=1000", f"hydra.run.dir={run}",
                  cwd=tmp_path)
    try:
        wait_for(lambda: len(steps(run)) >= 3, first)
        second = mrl("train", *TINY, "trainer.max_steps=1000", "trainer.resume=true", f"hydra.run.dir={run}",
                     cwd=tmp_path)
        one_line_error(second, f"in use by another mrl process (pid {first.pid})")
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mrl: error: stopped by SIGTERM; step_") and "trainer.resume=true" in last, err
    logged = steps(run)
    assert logged == list(range(1, len(logged) + 1))
    assert latest_checkpoint(run).name == f"step_{logged[-1]:06d}"  # the last completed step, not lost

    result = mrl("train", *TINY, f"trainer.max_steps={logged[-1] + 2}", "trainer.resume=true",
                 f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert steps(run) == list(range(1, logged[-1] + 3))


KILLED_MID_SAVE = """
import pathlib, sys, time
import mrl.runs.checkpoint

real, marker = mrl.runs.checkpoint.seal_checkpoint, pathlib.Path(sys.argv[1])  # `mrl train` rewrites sys.argv

def seal(directory, identity):  # step 4's files are written: stop here, before its manifest and rename
    if directory.name.startswith(".step_000004"):
        marker.write_text("writing")
        time.sleep(600)
    real(directory, identity)

mrl.runs.checkpoint.seal_checkpoint = seal
from mrl.cli import app
sys.argv = ["mrl", *sys.argv[2:]]
app()
"""


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "writing"
    script = tmp_path / "killed_mid_save.py"
    script.write_text(KILLED_MID_SAVE)
    trainer = start(str(marker), "train", *TINY, "trainer.max_steps=6", "trainer.save_every=2",
                    f"hydra.run.dir={run}", cwd=tmp_path, command=[sys.executable, str(script)])
    try:
        wait_for(marker.exists, trainer)
        assert list((run / CHECKPOINTS).glob(".step_000004.tmp*/optimizer.pt"))  # mid-write
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
    finally:
        trainer.kill()
    assert latest_checkpoint(run).name == "step_000002" and checkpoint_problem(latest_checkpoint(run)) is None

    result = mrl("train", *TINY, "trainer.max_steps=6", "trainer.save_every=2", "trainer.resume=true",
                 f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert steps(run) == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir()) == [
        "latest", "step_000002", "step_000004", "step_000006"]  # the partial write is gone


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 4 MiB at tmp_path/disk (root only; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_really_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(three_steps, small_tmpfs):
    run = small_tmpfs / "run"
    shutil.copytree(three_steps, run)
    used = shutil.disk_usage(small_tmpfs).used
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_tmpfs).free - 300_000))  # room for logs, not a checkpoint
    assert used < shutil.disk_usage(small_tmpfs).used
    with pytest.raises(CheckpointError, match="could not write checkpoint step_000005 .* step_000003 is intact"):
        train(resume_cfg("trainer.max_steps=5"), run)
    assert latest_checkpoint(run).name == "step_000003" and checkpoint_problem(latest_checkpoint(run)) is None
    assert not list((run / CHECKPOINTS).glob(".*")), "the failed write left its temp dir"
    filler.unlink()
    train(resume_cfg("trainer.max_steps=5"), run)
    assert steps(run) == [1, 2, 3, 4, 5] and latest_checkpoint(run).name == "step_000005"
