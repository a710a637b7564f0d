"""Issue 59, item 4: faults end in one line with nothing lost.  The built-in model's every size is priced (or refused as
no model) before the run dir exists; a full or read-only disk under a resume's metrics rewrite, an evaluation's,
a report's or a checkpoint's files is one line naming the path and the fix, and leaves no temp file."""

from __future__ import annotations

import errno
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
from mrl.runs.rundir import LOCK_FILE, DiskFault, atomic_write_text
from mrl.train.evaluate import evaluate
from mrl.train.loop import train
from mrl.train.validation import validate

MRL = [sys.executable, "-m", "mrl.cli"]

# The probe's payloads (each ended in a traceback after the run dir existed) -> the start of the one-line refusal.
TINY_PAYLOADS = {
    "model.tiny.intermediate_size=1000000000": "model.tiny.intermediate_size=1000000000: 384000024576 trained weights "
                                               "(2 layers) need at least 5722.0 GiB",
    "model.tiny.num_hidden_layers=1000000": "model.tiny.num_hidden_layers=1000000: 36864000000 trained weights "
                                            "(1000000 layers) need at least 549.3 GiB",
    "model.tiny.num_attention_heads=1000000000": "model.tiny.num_attention_heads=1000000000: each head's width, "
                                                 "hidden_size / num_attention_heads, must be a whole even number",
    "model.tiny.hidden_size=100000": "model.tiny.hidden_size=100000: ",
    "model.tiny.num_attention_heads=3": "model.tiny.num_attention_heads=3: each head's width",
    "model.tiny.num_key_value_heads=3": "model.tiny.num_key_value_heads=3: must divide num_attention_heads=4",
    "model.tiny.vocab_size=20": "model.tiny.vocab_size=20: the built-in tokenizer has 26 fixed words",
    "model.tiny.max_position_embeddings=0": "model.tiny.max_position_embeddings=0: a size is at least 1",
    # LoRA's rank: r x 2 layers x (64 in + 64 out), one adapted module a layer at least
    "model.lora.r=100000000": "model.lora.r=100000000: 25600000000 trained adapter weights (r x 2 layers x 2 x 64",
}


@pytest.mark.parametrize("payload", list(TINY_PAYLOADS))
def test_every_size_of_the_built_in_model_is_priced_or_refused_in_one_line(payload):
    with pytest.raises(UserError) as caught:
        validate(compose_config(payload))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(TINY_PAYLOADS[payload]), message


def test_a_layer_count_is_priced_by_what_the_layers_hold(monkeypatch):
    """2 layers of 64 wide: q, o 64 x 64; k, v 64 x 32 (2 of 4 heads' 16); gate, up, down 64 x 128: 36864 a layer.
    With 7 MiB to spend, 2 layers (1.1 MiB at 16 bytes a weight) fit and 13 (7.2 MiB) do not."""
    from mrl.modeling import fits

    monkeypatch.setattr(fits, "available_bytes", lambda: 7 << 20)
    validate(compose_config("model.tiny.num_hidden_layers=12"))  # 12 x 36864 x 16 + 32 x 64 x 16 = 6.78 MiB
    with pytest.raises(UserError, match=r"^model.tiny.num_hidden_layers=13: 479232 trained weights \(13 layers\)"):
        validate(compose_config("model.tiny.num_hidden_layers=13"))


def test_mrl_train_refuses_a_built_in_size_beyond_memory_before_the_run_dir(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([*MRL, "train", "model.tiny.intermediate_size=1000000000", f"hydra.run.dir={run}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("mrl: error: model.tiny.intermediate_size=1000000000: ") and "GiB" in lines[0]
    assert not run.exists()


# ---- a full or read-only disk ------------------------------------------------------------------------------------

def fail_writes_to(monkeypatch, name: str, code: int) -> None:
    """os.fsync of any file whose name starts with `name` fails with `code` (what a full disk or a read-only
    remount gives a write in flight); every other file syncs as usual."""
    real = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(name):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if ".tmp" in p.name or ".mrl.probe" in p.name)


@pytest.mark.parametrize("code, says", [(errno.ENOSPC, "no space left on its disk ("),
                                        (errno.EDQUOT, "your disk quota is used up"),
                                        (errno.EROFS, "its filesystem is read-only; write elsewhere")])
def test_an_atomic_write_on_a_full_or_read_only_disk_is_one_line_and_leaves_no_temp(code, says, tmp_path,
                                                                                    monkeypatch):
    path = tmp_path / "eval.json"
    path.write_text("before")
    fail_writes_to(monkeypatch, ".eval.json.tmp", code)
    with pytest.raises(DiskFault) as caught:
        atomic_write_text(path, "after", then="do it again")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot write {path}: {says}") and "do it again" in message
    assert path.read_text() == "before" and temp_files(tmp_path) == []  # the old code: .eval.json.tmpPID left


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A run of the default config stopped after 2 steps, a checkpoint per step (copy it before changing it)."""
    from test_faults import config

    run = tmp_path_factory.mktemp("probe5") / "run"
    cfg = config("trainer.max_steps=2", "trainer.save_every=1")
    train(cfg, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # what `mrl train` writes, for `mrl eval` to read
    return run


def files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != LOCK_FILE}


def test_a_resume_whose_metrics_rewrite_meets_a_full_disk_is_one_line_and_changes_nothing(two_steps, tmp_path,
                                                                                          monkeypatch):
    from test_faults import resume_cfg

    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    before = files(run)
    fail_writes_to(monkeypatch, ".metrics.jsonl.tmp", errno.ENOSPC)
    with pytest.raises(DiskFault) as caught:  # the old code: an OSError traceback, an empty .metrics.jsonl.tmpPID
        train(resume_cfg("trainer.max_steps=3"), run)
    assert str(caught.value).startswith(f"cannot write {run / 'metrics.jsonl'}: no space left on its disk")
    assert str(caught.value).endswith("then continue from the last checkpoint with trainer.resume=true")
    assert files(run) == before and temp_files(run) == []
    monkeypatch.undo()  # space again: the resume goes on
    train(resume_cfg("trainer.max_steps=3"), run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_eval_on_a_read_only_dir_is_refused_before_the_scoring(two_steps, tmp_path, monkeypatch):
    import mrl.train.evaluate

    monkeypatch.setattr(mrl.train.evaluate, "score_held_out", lambda *a, **k: pytest.fail("scored first"))
    read_only = os.statvfs_result((*os.statvfs(tmp_path)[:8], os.ST_RDONLY, 255))  # a read-only mount's flags
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: read_only if Path(p) == two_steps else real_statvfs(p))
    with pytest.raises(DiskFault) as caught:  # the old code: an EROFS traceback at .eval.json.tmp*, after scoring
        evaluate(two_steps, num_prompts=2, samples=0)
    assert str(caught.value).startswith(f"cannot write {two_steps / 'eval.json'}: its filesystem is read-only")
    assert "run mrl eval again (--out DIR writes its files elsewhere)" in str(caught.value)


def test_eval_meeting_a_full_disk_after_the_scoring_is_one_line_and_leaves_no_temp(two_steps, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fail_writes_to(monkeypatch, ".eval.jsonl.tmp", errno.ENOSPC)  # eval.json fits, eval.jsonl does not
    with pytest.raises(DiskFault, match=rf"^cannot write {out / 'eval.jsonl'}: no space left on its disk"):
        evaluate(two_steps, num_prompts=2, samples=0, out=out)
    assert temp_files(out) == [] and sorted(p.name for p in out.iterdir()) == ["eval.json"]


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk with 16 KiB left free (root only; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    (disk / "filler").write_bytes(bytes(shutil.disk_usage(disk).free - (16 << 10)))
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_mrl_train_and_report_on_a_full_disk_are_one_line_and_leave_nothing(full_tmpfs, two_steps, tmp_path):
    run = full_tmpfs / "run"
    result = subprocess.run([*MRL, "train", "logger=none", f"hydra.run.dir={run}"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"mrl: error: cannot write {run}: no space left on its disk (0 MiB free there)")
    assert sorted(p.name for p in full_tmpfs.iterdir()) == ["filler"]  # no run dir, no probe file
    report = subprocess.run([*MRL, "report", str(two_steps), "--out", str(full_tmpfs / "r" / "report.png")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = report.stderr.strip().splitlines()
    assert report.returncode == 2 and len(lines) == 1 and "Traceback" not in report.stderr, report.stderr
    assert lines[0].startswith("mrl: error: cannot write ") and "no space left on its disk" in lines[0]
    assert temp_files(full_tmpfs) == []
