"""What keeps a run dir usable through faults: one trainer at a time, checkpoints that prove they are whole, and stops
(SIGTERM, Ctrl-C) that lose no completed step.

- A process that trains in a run dir holds `fcntl.flock` on RUN_DIR/.mrl.lock; a second one is refused.  `mrl train`
  takes the lock, and makes the checks below, in a Hydra callback (`RunDirGuard`, registered in conf/train.yaml) that
  runs after the config is composed and before Hydra creates the run dir or writes `.hydra/` into it: a refused start
  changes nothing there.  The lock file's presence means nothing; only a live process's flock does.
- Each checkpoint holds manifest.json: every file's size and sha256, and what the run trained (`run_identity`).  A
  resume verifies the files, skips a damaged checkpoint with a warning for the previous intact one, refuses in one
  line when none is intact, and refuses a config whose algorithm or reward set differs from the checkpoint's.
- SIGTERM (what Slurm and Kubernetes send) and SIGINT stop the loop the same way (`StopSignals`): the last completed
  step is checkpointed and the process exits with 128 + the signal's number.

- A run dir cannot be pointed elsewhere: `checkpoints/latest` must name a `step_N` dir of this run dir's
  checkpoints/, no checkpoint, and no file a manifest lists, may be a symlink or leave the checkpoint, and the lock,
  metrics, eval and export files are opened without following a symlink (O_NOFOLLOW): each is refused in one line.

This module reads and writes files only; it imports neither torch nor the trainer, so `mrl train` refuses a start in
about a second.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from mrl.core import distributed as dist
from mrl.core import safe_json
from mrl.core.config import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"  # checkpoints/latest: the name of the newest checkpoint, replaced atomically after each save
MANIFEST = "manifest.json"
LINEAGE_FILE = "lineage.json"  # a warm start's source (mrl/runs/warm_start.py), read by mrl.runs.report
STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".mrl.lock"


# ---- durable writes --------------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (POSIX: a directory's entries are synced through the dir)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open that refuses, in one line, a symlink where a run dir's file should be: a link planted at .mrl.lock or
    eval.json would have mrl truncate or overwrite whatever it points at."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{path} is a symlink, and mrl writes a run dir's files only in place: remove it "
                            f"(rm {path}) or use another dir") from None
        raise


class DiskFault(UserError):
    """A write that a full or read-only disk refused: one line naming the path and the fix (`disk_faults`);
    the file it would have replaced is unchanged and no temp file is left."""


DISK_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


@contextmanager
def disk_faults(path: Path, then: str = "run the command again"):
    """Turn an OSError of a full disk (ENOSPC, EDQUOT) or a read-only one (EROFS) in the block into a DiskFault naming
    `path` and the fix, `then` saying what to do once it is fixed; other errors pass as they are."""
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FAULTS:
            raise
        raise DiskFault(disk_fault_message(err, path, then)) from None


def disk_fault_message(err: OSError, path: Path | str, then: str = "run the command again") -> str:
    """One line for a full or read-only disk under `path`: what failed, how much is free, the fix."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    if err.errno == errno.EROFS:
        return (f"cannot write {path}: its filesystem is read-only; write elsewhere (a dir on a writable disk), or "
                f"remount it read-write and {then}")
    quota = "your disk quota is used up" if err.errno == errno.EDQUOT else "no space left on its disk"
    return f"cannot write {path}: {quota} ({free}); free space there, then {then}"


def check_writable(path: Path, then: str = "run the command again") -> None:
    """A DiskFault, before any work whose result goes to `path`, where the filesystem it would be created on is
    read-only (statvfs's ST_RDONLY on its nearest existing dir); nothing is created."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    if os.statvfs(where).f_flag & os.ST_RDONLY:
        raise DiskFault(disk_fault_message(OSError(errno.EROFS, os.strerror(errno.EROFS)), path, then))


def atomic_write_text(path: Path, text: str | bytes, then: str = "run the command again") -> None:
    """Replace `path` with `text` (or bytes), all or nothing, even across a power cut: write a temp file, fsync,
    rename.  What mrl writes into a run dir or a report's dir goes through here (or open_nofollow): a symlink at
    `path` is refused (renaming over it would leave its target alone, but say nothing).  A full or read-only disk is
    a DiskFault (`then`: what to do once it is fixed), `path` unchanged, the temp file removed."""
    if path.is_symlink():
        open_nofollow(path, os.O_RDONLY)  # raises the one-line refusal
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if tmp.is_symlink():  # left there to redirect this write: the link goes, its target is not touched
        tmp.unlink()
    mode = "wb" if isinstance(text, bytes) else "w"
    try:
        with disk_faults(path, then):
            with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), mode) as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
    except BaseException:
        if tmp.exists() and not tmp.is_symlink():
            tmp.unlink()
        raise


def atomic_write_jsonl(path: Path, rows: Iterable[Any], then: str = "run the command again") -> None:
    """`atomic_write_text` of `rows` as JSON lines, one a row."""
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows), then)


def own_dir(path: Path) -> Path:
    """`path` made a directory (parents too) that is not a symlink: a planted link would send the files written
    into it elsewhere (report_data/ linked to ~/.ssh)."""
    if path.is_symlink():
        raise UserError(f"{path} is a symlink, and mrl writes its files only into its own dirs: remove it "
                        f"(rm {path}) or write elsewhere")
    with disk_faults(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


# ---- the lock --------------------------------------------------------------------------------------------------

_HELD: dict[Path, list[int]] = {}  # run dir -> [lock fd, depth]: flock is per open file, so this process re-enters


class RunDirLock:
    """`fcntl.flock(LOCK_EX)` on RUN_DIR/.mrl.lock, held until `release` (or the process ends: the kernel drops it,
    even after SIGKILL).  Re-entrant within a process: `mrl train`'s Hydra callback and `train()` both take it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def acquire(self) -> RunDirLock:
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"the run dir {self.run_dir} is a file, not a directory: give hydra.run.dir a directory "
                            "(a new path, or a run dir `mrl train` wrote)")
        new = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.key = self.run_dir.resolve()
            if self.key in _HELD:
                _HELD[self.key][1] += 1
                return self
            _probe_writable(self.key)
            fd = open_nofollow(self.key / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # not inherited by child processes
        except OSError as err:
            if new and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()  # a refused start leaves no run dir
            if err.errno in DISK_FAULTS:
                raise DiskFault(disk_fault_message(err, self.run_dir)) from None
            raise UserError(f"cannot write in the run dir {self.run_dir} ({err.strerror}): give hydra.run.dir a "
                            "writable directory on a local disk") from None
        if os.fstat(fd).st_nlink > 1:  # a hard link to a file elsewhere: truncating it below would empty that file
            os.close(fd)
            raise UserError(f"{self.run_dir / LOCK_FILE} is a hard link to a file elsewhere, and mrl writes a run "
                            f"dir's files only in place: remove it (rm {self.run_dir / LOCK_FILE}) or use another dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(f"cannot lock the run dir {self.run_dir} ({err.strerror}); train in a run dir on a "
                                "local disk (hydra.run.dir=...)") from None
            raise UserError(f"the run dir {self.run_dir} is in use by another mrl process (pid {holder}): wait "
                            "for it to end, or train in another hydra.run.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message a refused process prints
        _HELD[self.key] = [fd, 1]
        return self

    def release(self) -> None:
        held = _HELD.get(getattr(self, "key", None))
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self.key]
            os.ftruncate(held[0], 0)
            os.close(held[0])  # closing the last descriptor of the file releases the flock

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


PROBE_BYTES = 64 << 10  # more than Hydra's .hydra/*.yaml and a step's metrics line: a full disk fails here


def _probe_writable(run_dir: Path) -> None:
    """Raise OSError unless PROBE_BYTES can be written in `run_dir` (a read-only mount or dir refuses it; root's own
    permission checks pass, a read-only filesystem's do not; a full disk, ENOSPC, before Hydra writes `.hydra/`)."""
    probe = run_dir / f".mrl.probe{os.getpid()}"
    fd = open_nofollow(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        left = memoryview(bytes(PROBE_BYTES))
        while left:  # a nearly full disk writes short first, then raises ENOSPC
            left = left[os.write(fd, left):]
    finally:
        os.close(fd)
        os.unlink(probe)


# ---- checkpoint manifests --------------------------------------------------------------------------------------

def _sha256(path: Path, sync: bool = False) -> str:
    """The file's sha256; a FIFO put there since it was checked is not waited on (O_NONBLOCK), and refused."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    with os.fdopen(fd, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
        if sync:
            os.fsync(file.fileno())
    return digest.hexdigest()


def seal_checkpoint(directory: Path, identity: dict[str, Any]) -> None:
    """Write `directory`/manifest.json (each file's size and sha256, and the run's identity) and fsync the whole tree,
    so that once the caller renames `directory` into place, the checkpoint is on disk whole."""
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p, sync=True)}
             for p in sorted(directory.rglob("*")) if p.is_file()}
    with open(directory / MANIFEST, "w") as file:
        json.dump({"format": 1, "run": identity, "files": files}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    for folder in sorted({p.parent for p in directory.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)


def foreign_files_problem(directory: Path) -> str | None:
    """What in `directory` a loader must not open, in a few words, or None: a symlink (a checkpoint holds its own
    files), or anything but a regular file or a directory (a FIFO named *.safetensors hung eval, export and resume in
    open() for ever).  Only looks (lstat): nothing is opened."""
    entries = [directory, *directory.rglob("*")]
    links = [p for p in entries if p.is_symlink()]
    if links:
        return f"{links[0].relative_to(directory.parent)} is a symlink (a checkpoint holds its own files)"
    odd = [p for p in entries if not (stat.S_ISREG(p.lstat().st_mode) or p.is_dir())]
    if odd:
        return f"{odd[0].relative_to(directory.parent)} is not a regular file (a FIFO, socket or device)"
    return None


_CHECKED: dict[Path, tuple[Any, str | None]] = {}  # checkpoint -> (its files' sizes and mtimes, problem)


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from, in a few words, or None when every file matches its manifest entry.
    Hashing a large checkpoint takes seconds, so a result is kept while no file's size or mtime changes."""
    if not checkpoint.is_dir():
        return "missing"
    problem = foreign_files_problem(checkpoint)
    if problem:
        return problem
    stamp = tuple((str(p), info.st_size, info.st_mtime_ns)
                  for p in sorted(checkpoint.rglob("*")) for info in [p.stat()])
    cached = _CHECKED.get(checkpoint)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    problem = _verify(checkpoint)
    _CHECKED[checkpoint] = (stamp, problem)
    return problem


def _verify(checkpoint: Path) -> str | None:
    if not (checkpoint / MANIFEST).exists():
        return f"no {MANIFEST} (written by an mrl older than checksums, or not a checkpoint)"
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__})"
    if not (isinstance(files, dict) and isinstance(manifest.get("run", {}), dict) and all(
            isinstance(e, dict) and type(e.get("bytes")) is int and type(e.get("sha256")) is str
            for e in files.values())):
        return f"{MANIFEST} has wrong types (files: {{name: {{bytes: int, sha256: str}}}}, run: a mapping)"
    if STATE_FILE not in files:
        return f"{MANIFEST} lists no {STATE_FILE}"
    unlisted = [p for p in sorted(checkpoint.rglob("*"))
                if p.is_file() and p.relative_to(checkpoint).as_posix() not in (*files, MANIFEST)]
    if unlisted:  # what a load opens, and what the size bounds count, are the listed files alone
        return f"{unlisted[0].relative_to(checkpoint)} is not listed in {MANIFEST}"
    for name, entry in files.items():
        if name.startswith("/") or ".." in Path(name).parts:
            return f"{MANIFEST} lists {name!r}, outside the checkpoint"
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} of its {entry['bytes']} bytes"
        if _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return weights_problem(checkpoint)


# safetensors dtypes -> bytes per element
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
# config.json keys that size a model's layers: each is at most the weights the files hold, and so is layers * width.
_SIZES = ("num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model", "intermediate_size",
          "n_inner", "ffn_dim", "num_attention_heads", "n_head", "num_key_value_heads", "vocab_size", "head_dim",
          "num_experts", "num_local_experts")


def weights_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint's weights cannot be loaded as they say, in a few words naming the file, or None: a
    safetensors header that is not JSON within bounds or whose tensors do not tile the file, or a config.json
    whose sizes need more weights than the safetensors beside it hold (`num_hidden_layers: 1000000` with a
    megabyte of weights builds for minutes before anything is read).  The checksums bind the files to the manifest,
    not the manifest to an honest trainer: these bound what the files make the loader do."""
    elements: dict[Path, int] = {}
    for path in sorted(checkpoint.rglob("*.safetensors")):
        counted = _safetensors_elements(path)
        if isinstance(counted, str):
            return f"{path.relative_to(checkpoint)} {counted}"
        elements[path.parent] = elements.get(path.parent, 0) + counted
    for config in sorted(checkpoint.rglob("config.json")):
        if config.parent in elements:
            problem = _config_problem(config, elements[config.parent])
            if problem:
                return f"{config.relative_to(checkpoint)} {problem}"
    return None


def _safetensors_elements(path: Path) -> int | str:
    """The tensor elements a safetensors file holds, or what is wrong with its header."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            return f"has a broken header (it declares {length} header bytes in a file of {size})"
        text = file.read(length).decode("utf-8", errors="replace")
    try:
        header = safe_json.loads(text, MAX_HEADER_BYTES, max_depth=4)
    except safe_json.Unreadable as err:
        return f"has a broken header (it {err})"
    if not isinstance(header, dict):
        return "has a broken header (not a JSON object)"
    spans, total = [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        width = _DTYPE_BYTES.get(info.get("dtype")) if isinstance(info, dict) else None
        if not (width and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return f"has a broken header (tensor {str(name)[:60]!r}: no dtype, shape and data_offsets)"
        count = 1
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count * width or offsets[0] < 0:
            return f"has a broken header (tensor {str(name)[:60]!r} of shape {shape} is not its bytes)"
        spans.append(offsets)
        total += count
    spans.sort()
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0) \
            or (spans[-1][1] if spans else 0) != size - 8 - length:
        return "has a broken header (its tensors do not tile the file's data)"
    return total


def _config_problem(config: Path, elements: int) -> str | None:
    try:
        values = safe_json.loads(config.read_text(encoding="utf-8"), 10_000_000)
    except (safe_json.Unreadable, UnicodeDecodeError, OSError) as err:
        return f"is not a readable model config ({str(err)[:80]})"
    if not isinstance(values, dict):
        return "is not a readable model config (not a JSON object)"
    layers = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if type(values.get(k)) is int),
                  1)
    width = next((values[k] for k in ("hidden_size", "n_embd", "d_model") if type(values.get(k)) is int), 1)
    for key in _SIZES:
        value = values.get(key)
        if type(value) is int and not 0 <= value <= elements:
            return f"says {key}={value}, beyond the {elements} weights its safetensors hold"
    if layers * width > elements:
        return (f"says {layers} layers of width {width}, more than the {elements} weights its safetensors hold")
    return None


def step_of(checkpoint: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    return int(match.group(1)) if match else None


def checkpoints_dir(run_dir: Path) -> Path:
    """run_dir/checkpoints, refused in one line when it is a symlink: a run's checkpoints are its own."""
    root = run_dir / CHECKPOINTS
    if root.is_symlink():
        raise UserError(f"{root} is a symlink (to {os.readlink(root)}): a run dir's checkpoints must be its own; "
                        "replace the link with the directory, or resume from that run dir itself")
    return root


def _named_by_latest(run_dir: Path) -> Path | None:
    """The checkpoint dir `checkpoints/latest` names (it may be missing), or None without the pointer.  It must name
    a step_N dir of this run dir's checkpoints/: a pointer edited to lead elsewhere is refused in one line."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    with os.fdopen(open_nofollow(pointer, os.O_RDONLY), "rb") as file:
        name = file.read(256).decode(errors="replace").strip()
    if not re.fullmatch(r"step_\d+", name) or (pointer.parent / name).is_symlink():
        raise UserError(f"{pointer} names {name[:80]!r}, not a checkpoint of this run dir (a step_N dir in "
                        f"{pointer.parent}, not a link): write the name of one of them there, e.g. "
                        f"`echo step_000002 > {pointer}`")
    return pointer.parent / name


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names, if it is there (not verified: see `resolve_resume`)."""
    path = _named_by_latest(run_dir)
    return path if path is not None and (path / STATE_FILE).exists() else None


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints a resume may use, newest first: the one `latest` names, then the older ones.  Checkpoints newer
    than `latest` belong to a trajectory that a resume from an earlier step abandoned; temp dirs (.step_*) are partial
    writes."""
    saved = sorted((p for p in checkpoints_dir(run_dir).glob("step_*") if p.is_dir() and step_of(p) is not None),
                   key=step_of, reverse=True)
    named = _named_by_latest(run_dir)
    newest = step_of(named) if named is not None else None
    if newest is None:
        return saved
    return [named] + [p for p in saved if step_of(p) < newest]


def resolve_resume(resume: Any, run_dir: Path) -> Path | None:
    """`trainer.resume`: false; true (this run dir); a checkpoint dir; or a run dir.  From a run dir, the newest
    intact checkpoint: a damaged one is skipped with a warning.  A checkpoint named by its path must be intact."""
    if resume in (False, None) or str(resume).lower() in ("false", "no", "0", ""):
        return None
    if resume is True or str(resume).lower() in ("true", "yes", "1", "latest"):
        source = run_dir
        if not checkpoint_candidates(source):
            raise UserError(
                f"trainer.resume=true but {run_dir}/{CHECKPOINTS} holds no checkpoint; start the run with "
                "hydra.run.dir=<its run dir> or give trainer.resume=<checkpoint or run dir>"
            )
    else:
        return intact_checkpoint(Path(str(resume)).expanduser(), f"trainer.resume={resume!r}")
    checkpoint, damaged = newest_intact(source)
    if checkpoint is not None:
        return checkpoint
    raise UserError(f"trainer.resume: no intact checkpoint in {source / CHECKPOINTS}: {damaged}; train from scratch in "
                    "another hydra.run.dir")


def intact_checkpoint(path: Path, what: str) -> Path:
    """The checkpoint `path` names: itself when it is a checkpoint dir, which must then be intact, or a run dir's
    newest intact one (a damaged one skipped with a warning).  What resume, `mrl eval` and `mrl export` use;
    `what` is how the user gave it (trainer.resume=..., mrl export DIR) for the one-line refusal."""
    if (path / STATE_FILE).exists() or (path / MANIFEST).exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise UserError(f"{what}: this checkpoint cannot be used: {problem}; give its run dir instead to use "
                            "the newest intact checkpoint there")
        return path
    if not path.is_dir() or not checkpoint_candidates(path):
        raise UserError(f"{what}: neither a checkpoint nor a run dir with checkpoints (no checkpoint in "
                        f"{path / CHECKPOINTS})")
    checkpoint, damaged = newest_intact(path)
    if checkpoint is None:
        raise UserError(f"{what}: no intact checkpoint in {path / CHECKPOINTS}: {damaged}")
    return checkpoint


def newest_intact(run_dir: Path) -> tuple[Path | None, str]:
    """(the newest checkpoint whose files match their checksums, or None; what was skipped as damaged, in words).
    Skipping a damaged checkpoint for an older one is said once, as a warning."""
    damaged = []
    for checkpoint in checkpoint_candidates(run_dir):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            if damaged:
                _warn_once(f"{run_dir / CHECKPOINTS}: skipped {'; '.join(damaged)}; using {checkpoint.name}")
            return checkpoint, ""
        damaged.append(f"{checkpoint.name} ({problem})")
    return None, "; ".join(damaged[:2]) + (f"; and {len(damaged) - 2} more" if len(damaged) > 2 else "")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """`mrl train` resolves the resume twice (before Hydra writes, and in train()): say it once."""
    if message not in _WARNED:
        _WARNED.add(message)
        dist.warn(message)


# ---- what a resume must not change -----------------------------------------------------------------------------

def run_identity(cfg) -> dict[str, Any]:
    """The stage (`mrl train`: rl, `mrl sft`: sft), algorithm and reward set of a run, as config keys: a resume that
    changes any of them is refused."""
    def plain(value):
        return value.value if isinstance(value, Enum) else value

    model = cfg.model
    shape = {"model.name_or_path": model.name_or_path, "model.lora.r": model.lora.r,
             "model.lora.target_modules": plain_data(model.lora.target_modules)}
    if model.get("tiny") is not None:  # the built-in model's architecture and vocabulary are these keys
        shape.update({f"model.tiny.{k}": v for k, v in model.tiny.items() if k != "init_seed"})
    return {
        "stage": cfg.get("stage", "rl"), "algo": cfg.algo.name, "algo.advantage": plain(cfg.algo.advantage),
        "algo.critic": plain(cfg.algo.critic),
        "rewards": cfg.rewards.name, "rewards.channels": list(cfg.rewards.channels), **shape,
        "world_size": dist.world_size(),
    }


def plain_data(value: Any) -> Any:
    """A config value as JSON data (a ListConfig as a list)."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def check_compatible(checkpoint: Path, cfg) -> None:
    recorded = json.loads((checkpoint / MANIFEST).read_text()).get("run") or {}  # a mapping: _verify
    current = run_identity(cfg)
    saved_on, runs_on = recorded.get("world_size", 1), current.pop("world_size")
    if saved_on != runs_on:
        launch = (f"torchrun --nproc_per_node={saved_on} -m mrl train ..." if saved_on > 1
                  else "mrl train ..., without a launcher")
        raise UserError(f"trainer.resume: {checkpoint} was saved by {saved_on} rank(s) and this run has {runs_on}: "
                        f"DeepSpeed's optimizer partitions are per rank; resume on {saved_on} ({launch}), or train "
                        "from scratch in another hydra.run.dir")
    differ = [key for key in current if key in recorded and recorded[key] != current[key]]
    if differ:
        def show(values):
            return ", ".join(f"{k}={_yaml(values[k])}" for k in differ)

        raise UserError(f"trainer.resume: {checkpoint} was trained with {show(recorded)}; this run has "
                        f"{show(current)}. Resume with the checkpoint's algo, rewards and model, or train from "
                        "scratch in another hydra.run.dir")


def _yaml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value)


# ---- the checks before anything is written ---------------------------------------------------------------------

def logged_steps(run_dir: Path) -> int:
    path = run_dir / METRICS_FILE
    return sum(1 for line in path.read_bytes().splitlines() if line.strip()) if path.exists() else 0


# The links W&B itself keeps in RUN_DIR/wandb/: latest-run and the two logs, each replaced by a rename (a link planted
# there is replaced, not written through: wandb.sdk.wandb_init._safe_symlink), and each W&B run's link to its core
# log in ~/.cache (wandb-core), in the run's own dir, which a later start never writes again (a new W&B run dir).
WANDB_LINKS = re.compile(r"wandb/(latest-run|debug\.log|debug-internal\.log|[^/]+/logs/debug-core\.log)")


def planted_problem(run_dir: Path) -> str | None:
    """The first entry of `run_dir` that a write by mrl, Hydra or W&B would follow out of the run dir, in words
    naming it, or None: a symlink anywhere in it (.hydra/config.yaml, mrl.log, held_out/, wandb/: Hydra opens its
    files with open(), W&B and the held-out files write into a dir wherever it leads) but W&B's own (WANDB_LINKS),
    anything but a regular file or a directory (a FIFO at mrl.log blocks the start for ever), or a file with a
    second hard link outside checkpoints/ (appended to, or truncated, in place).  Only looks (lstat)."""
    for root, dirs, files in os.walk(run_dir):  # followlinks=False: a link to a dir is listed, not entered
        for name in sorted(dirs + files):
            path = Path(root) / name
            info = path.lstat()
            where = path.relative_to(run_dir).as_posix()
            if stat.S_ISLNK(info.st_mode):
                if not WANDB_LINKS.fullmatch(where):
                    return f"{path} is a symlink (to {os.readlink(path)[:120]})"
            elif not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                return f"{path} is not a regular file (a FIFO, socket or device)"
            elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1 and not where.startswith(f"{CHECKPOINTS}/"):
                return f"{path} is a hard link ({info.st_nlink} names of one file)"
    return None


def refuse_planted(directory: Path, key: str) -> None:
    """`planted_problem` of a run (or sweep) dir as one line; `key` is the setting that names another dir."""
    problem = planted_problem(directory)
    if problem:
        raise UserError(f"{problem}: mrl, Hydra and W&B write a run dir's files only in place, and this write would "
                        f"land elsewhere; remove it, or use another {key}")


def check_run_dir(cfg, run_dir: Path) -> Path | None:
    """The checkpoint this run resumes from (None: a new run), after refusing, in one line, a start that would lose
    or mix up work: a new run over a run dir that holds one, no intact checkpoint to resume, a changed algorithm or
    reward set, a link planted in the run dir (`planted_problem`).  The caller holds the run dir's lock."""
    refuse_planted(run_dir, "hydra.run.dir")
    resume_from = resolve_resume(cfg.trainer.resume, run_dir)
    if resume_from is not None:
        check_compatible(resume_from, cfg)
        return resume_from
    logged = logged_steps(run_dir)
    if logged and checkpoint_candidates(run_dir):
        raise UserError(f"{run_dir} already holds a run ({logged} steps in {METRICS_FILE}); continue it with "
                        "trainer.resume=true, or start this one in another hydra.run.dir")
    if logged:
        raise UserError(f"{run_dir} already holds a run ({logged} steps in {METRICS_FILE}) that saved no checkpoint, "
                        f"so it cannot be continued: start this one in another hydra.run.dir, or delete "
                        f"{run_dir / METRICS_FILE} to start over there")
    return None


class RunDirGuard(Callback):
    """Hydra calls `on_run_start` after composing the config and before it creates the run dir or writes `.hydra/`
    there: take the run dir's lock and make `check_run_dir`'s checks, or print one line and exit 2.  A sweep's dir is
    locked as a whole (each job's `train()` then locks and checks its own dir)."""

    def __init__(self) -> None:
        self.lock: RunDirLock | None = None

    def on_run_start(self, config, **kwargs) -> None:
        if not dist.is_main():  # rank 0 locked and checked the run dir it gave this rank (mrl.cli)
            return
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))  # ${now:} is cached: Hydra gets the same dir
        self._guard(run_dir, lambda: check_run_dir(config, run_dir))
        dist.announce_run_dir(str(run_dir))

    def on_multirun_start(self, config, **kwargs) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        self._guard(sweep_dir, lambda: refuse_planted(sweep_dir, "hydra.sweep.dir"))

    def on_run_end(self, config, **kwargs) -> None:
        if self.lock is not None:
            self.lock.release()

    on_multirun_end = on_run_end

    def _guard(self, directory: Path, check) -> None:
        try:
            if directory.exists():  # lock, then look: another process may be writing there
                self.lock = RunDirLock(directory).acquire()
                check()
            else:  # a new dir: a refused start must not create it
                check()
                self.lock = RunDirLock(directory).acquire()
        except UserError as err:
            dist.exit_with_error(str(err))


# ---- SIGTERM and SIGINT ----------------------------------------------------------------------------------------

class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT stopped the run (the loop has checkpointed the last completed step).  `agreed`: every rank
    raised it at the same point (StopSignals.check), so they may checkpoint together."""

    def __init__(self, signum: int, agreed: bool = False):
        super().__init__(signum)
        self.signum = signum
        self.agreed = agreed

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGTERM and SIGINT, handled alike while the loop runs.  A signal raises `Interrupted` at once while the weights
    are the last completed step's (generation, scoring), and the loop's handler checkpoints that step; between
    `defer()` and `check()` (the update, its logs, a checkpoint write) it waits for the step to end.  A second signal
    raises at once.  Handlers are installed only from the main thread (Python's rule) and restored by `restore()`.

    Several ranks (`agree`: this rank's pending signal number, 0 for none -> the largest over the ranks): a first
    signal always waits for the step's end, where every rank calls `check()` and all stop together, having saved
    the step.  A rank raising alone would leave the others waiting in a collective (a launcher signals the ranks one
    by one); the cost is that a stop waits for the step in flight to finish."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, agree=None) -> None:
        self.agree = agree
        self.deferring = False
        self.pending: int | None = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if (self.deferring or self.agree is not None) and self.pending is None:
            self.pending = signum
            os.write(2, f"mrl: {signal.Signals(signum).name}: stopping after this step and its checkpoint "
                        "(again to stop at once)\n".encode())
            return
        raise Interrupted(signum)

    def defer(self) -> None:
        self.deferring = True

    def check(self) -> None:
        self.deferring = False
        if self.agree is not None:
            signum = int(self.agree(self.pending or 0))
            if signum:
                raise Interrupted(signum, agreed=True)
        elif self.pending is not None:
            raise Interrupted(self.pending)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def resume_hint(run_dir: Path) -> str:
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f"no step was completed, so {run_dir} holds nothing to resume"
    return f"{checkpoint.name} is saved: continue with trainer.resume=true hydra.run.dir={run_dir}"
