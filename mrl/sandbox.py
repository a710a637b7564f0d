"""Run model-generated Python against unit tests in a separate, resource-limited process (for reward channels).

`run_tests(code, tests)` executes `code` in a fresh child interpreter, evaluates each test expression in the code's
namespace and returns one `TestOutcome` per test plus an overall status, so a reward channel can use
`result.pass_rate` (pass rate on unit tests) or `result.error_rate` (a "bug ratio"). The generated code never runs
inside the trainer process, and nothing it does makes `run_tests` raise; only bad arguments raise `ValueError`.

What this is, honestly: defence in depth for reward computation on a training box, NOT a security boundary against
a determined adversary. A model that is actively optimised against the reward can learn odd behaviour, and code
running as the trainer's user (often root on GPU boxes) can undo any Python-level guard. For untrusted data or
anything security-relevant, run this inside a kernel-level sandbox (a container without network, nsjail, firejail,
gVisor) as an unprivileged user.

Enforced by the operating system (hold even against code that undoes the Python guards):
  * a separate process: `python -I -S` (isolated mode: no PYTHON* env vars, no user site, no cwd on sys.path; no
    `site`, so only the standard library is importable), in its own session / process group;
  * rlimits set at the top of the runner: RLIMIT_CPU (soft = ceil(cpu_seconds), SIGXCPU; hard one second later,
    SIGKILL), RLIMIT_AS (memory_mb), RLIMIT_FSIZE (1 MiB per file), RLIMIT_NOFILE (16), RLIMIT_CORE (0),
    RLIMIT_NPROC (0; ignored by the kernel for root);
  * a wall-clock limit: after `wall_seconds` the whole process group gets SIGKILL; it is also killed after a normal
    exit, so nothing that stayed in the group survives the call;
  * a fresh, empty temporary directory as cwd, HOME and TMPDIR (deleted afterwards), a minimal environment
    (PATH=/usr/bin:/bin, HOME, TMPDIR, LANG/LC_ALL only), stdin at /dev/null, only the three pipes and a result
    pipe open;
  * best effort: a private, empty network namespace (unshare(CLONE_NEWNET), or CLONE_NEWUSER|CLONE_NEWNET when not
    root). This only works where the kernel/container allows it; otherwise networking is blocked by Python only.

Enforced in Python only (the generated code could undo these, e.g. via `gc` or by restoring saved references):
  * `socket.socket` (and `_socket.socket`), `socket.create_connection`, `socket.create_server`, `socket.fromfd`,
    DNS look-ups, and `connect`/`connect_ex`/`bind`/`listen`/`sendto` raise PermissionError (socketpair stays
    usable, so asyncio event loops work);
  * `open`/`io.open`/`io.FileIO`/`os.open` for writing, and os.mkdir/remove/unlink/rename/replace/rmdir/chmod/
    chown/truncate/utime/link/symlink/mkfifo/mknod, raise PermissionError for real paths outside the sandbox dir;
  * os.system/popen/fork/forkpty/exec*/spawn*/posix_spawn*/kill/killpg/setsid/setpgid, subprocess.Popen and
    `_posixsubprocess.fork_exec` raise PermissionError; `ctypes` cannot be imported.

Known limits: as root the code could raise its own rlimits back (CAP_SYS_RESOURCE), and with the Python guards
undone it could signal or ptrace other processes of the same user, read any file the user can read, write files,
or start a process in a new session that escapes the group kill. Path checks have a time-of-check/time-of-use gap
(symlink races). Disk use in the sandbox dir is bounded only by 1 MiB per file and the wall time. Reward hacks that
stay inside the rules (an object whose `__eq__` always returns True, patching builtins the tests use, writing fake
result lines to the result pipe, which carries a per-run nonce) are not detected here. POSIX only (uses `resource`).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

__all__ = ["SandboxLimits", "TestOutcome", "SandboxResult", "run_tests", "run_tests_many", "RUNNER"]

FILE_SIZE_LIMIT = 1 << 20  # RLIMIT_FSIZE for files the code writes inside its directory
OPEN_FILES_LIMIT = 16  # RLIMIT_NOFILE
STATUSES = ("ok", "timeout", "memory", "crashed", "syntax_error")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0  # RLIMIT_CPU (rounded up to whole seconds, at least 1)
    wall_seconds: float = 5.0  # the whole process group is killed after this
    memory_mb: int = 256  # RLIMIT_AS (address space)
    max_output_bytes: int = 65536  # stdout/stderr are each captured up to this; the rest is drained and dropped


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest test class

    passed: bool
    error: str | None  # exception class name, or "timeout" / "memory" / "crashed" / "syntax_error" for lost tests


@dataclass(frozen=True)
class SandboxResult:
    outcomes: list[TestOutcome]  # one per test, in order
    status: str  # "ok" | "timeout" | "memory" | "crashed" | "syntax_error"
    stdout: str = field(default="", repr=False)  # what the code printed, truncated to max_output_bytes
    stderr: str = field(default="", repr=False)
    returncode: int | None = None  # of the child (negative: killed by that signal)

    @property
    def pass_rate(self) -> float:
        return sum(o.passed for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    @property
    def error_rate(self) -> float:
        """Share of tests that raised (any error, including timeout/memory/crash), for a "bug ratio" channel."""
        return sum(o.error is not None for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


# The child program, run as `python -I -S -c RUNNER <result fd>`. It reads {"nonce", "code", "tests", "limits"} as
# JSON from stdin and writes one line per event to the result fd (flushed by os.write, so partial results survive):
#   {"k": nonce, "ev": "loaded"} | {"k": nonce, "ev": "syntax_error"} | {"k": nonce, "ev": "load_error", "e": name}
#   {"k": nonce, "i": index, "p": 0|1, "e": name|null}   one per test, in order
#   {"k": nonce, "ev": "done"}
# The code's own stdout/stderr go to the ordinary pipes. Result lines are built without json so that code that
# monkeypatches json cannot break the reporting by accident.
RUNNER = r'''
import os, sys

def _main():
    import builtins, io, _io, json, posix, resource, signal, socket, _socket, subprocess, _posixsubprocess

    rfd = int(sys.argv[1])
    data = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    nonce, code, tests, lim = data["nonce"], data["code"], data["tests"], data["limits"]
    write, exit_now = os.write, os._exit

    def ename(exc):
        try:
            name = type(exc).__name__
            name = "".join(c for c in str(name) if c.isascii() and (c.isalnum() or c in "_."))[:100]
        except BaseException:
            name = ""
        return name or "Exception"

    def emit(body):
        try:
            write(rfd, ('{"k":"%s",%s}\n' % (nonce, body)).encode("ascii"))
        except BaseException:
            pass

    # Private network namespace (best effort; needs root or unprivileged user namespaces), then forbid ctypes.
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
    except BaseException:
        pass
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")] + ["ctypes", "_ctypes"]:
        sys.modules[name] = None

    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.dont_write_bytecode = True

    def setlim(which, soft, hard=None):
        hard = soft if hard is None else hard
        try:
            cur_hard = resource.getrlimit(which)[1]
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass

    cpu = int(lim["cpu"])
    setlim(resource.RLIMIT_CPU, cpu, cpu + 1)
    setlim(resource.RLIMIT_AS, int(lim["mem"]))
    setlim(resource.RLIMIT_FSIZE, int(lim["fsize"]))
    setlim(resource.RLIMIT_CORE, 0)
    setlim(resource.RLIMIT_NOFILE, int(lim["nofile"]))
    if hasattr(resource, "RLIMIT_NPROC"):
        setlim(resource.RLIMIT_NPROC, 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too-large writes raise OSError instead of killing us

    # ---- Python-level guards (defence in depth only) ----
    def deny(*args, **kwargs):
        raise PermissionError("blocked by the mrl sandbox")

    realpath, fsdecode, fspath, readlink, sep = os.path.realpath, os.fsdecode, os.fspath, os.readlink, os.sep
    root = realpath(os.getcwd())

    def check(path, dir_fd=None):
        if isinstance(path, int):
            return
        p = fsdecode(fspath(path))
        if dir_fd is not None and not p.startswith(sep):
            p = readlink("/proc/self/fd/%d" % dir_fd) + sep + p
        p = realpath(p)
        if p != root and not p.startswith(root + sep):
            raise PermissionError("writing outside the sandbox directory is blocked: %r" % (p,))

    real_open = _io.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(mode, str) or any(c in mode for c in "wax+"):
            check(file)
        return real_open(file, mode, *args, **kwargs)

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if not isinstance(mode, str) or any(c in mode for c in "wax+"):
                check(file)
            super().__init__(file, mode, *args, **kwargs)

    builtins.open = io.open = _io.open = guarded_open
    io.FileIO = _io.FileIO = GuardedFileIO

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_os_open = posix.open

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags:
            check(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def path_guard(func, npaths):
        def guarded(*args, **kwargs):
            for p in args[:npaths]:
                check(p, kwargs.get("dir_fd"))
            for key in ("path", "src", "dst"):
                if key in kwargs:
                    check(kwargs[key], kwargs.get("dir_fd"))
            for key in ("src_dir_fd", "dst_dir_fd"):
                if kwargs.get(key) is not None:
                    raise PermissionError("blocked by the mrl sandbox")
            return func(*args, **kwargs)
        return guarded

    path_funcs = {"mkdir": 1, "rmdir": 1, "remove": 1, "unlink": 1, "rename": 2, "replace": 2, "link": 2,
                  "symlink": 2, "chmod": 1, "chown": 1, "lchown": 1, "lchmod": 1, "truncate": 1, "utime": 1,
                  "mkfifo": 1, "mknod": 1, "chroot": 1}
    denied = ["system", "popen", "fork", "forkpty", "kill", "killpg", "setsid", "setpgid", "setpgrp",
              "posix_spawn", "posix_spawnp", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
              "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe",
              "pidfd_open"]
    for mod in (os, posix):
        if hasattr(mod, "open"):
            mod.open = guarded_os_open
        for name, npaths in path_funcs.items():
            if hasattr(mod, name):
                setattr(mod, name, path_guard(getattr(mod, name), npaths))
        for name in denied:
            if hasattr(mod, name):
                setattr(mod, name, deny)
    subprocess.Popen = deny
    _posixsubprocess.fork_exec = deny
    if hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal = deny

    base_socket = socket.socket
    for name in ("connect", "connect_ex", "bind", "listen", "sendto"):
        setattr(base_socket, name, deny)

    class NoSocket(base_socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:  # wrapping an existing fd (socketpair) is fine; new sockets are not
                raise PermissionError("network access is blocked by the mrl sandbox")
            super().__init__(family, type, proto, fileno)

    raw_socket = _socket.socket

    class NoRawSocket(raw_socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise PermissionError("network access is blocked by the mrl sandbox")
            raw_socket.__init__(self, family, type, proto, fileno)  # also called for socket.socket instances

    socket.socket = socket.SocketType = NoSocket
    _socket.socket = _socket.SocketType = NoRawSocket
    for name in ("create_connection", "create_server", "fromfd", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
        for mod in (socket, _socket):
            if hasattr(mod, name):
                setattr(mod, name, deny)

    # ---- load the code ----
    try:
        compiled = compile(code, "<solution>", "exec")
    except (SyntaxError, ValueError):
        emit('"ev":"syntax_error"')
        exit_now(0)
    except BaseException as exc:
        emit('"ev":"load_error","e":"%s"' % ename(exc))
        exit_now(0)
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        exec(compiled, namespace)
    except BaseException as exc:
        emit('"ev":"load_error","e":"%s"' % ename(exc))
        exit_now(0)
    emit('"ev":"loaded"')

    # ---- the tests ----
    for i, test in enumerate(tests):
        try:
            passed, err = bool(eval(compile(test, "<test %d>" % i, "eval"), namespace)), "null"
        except BaseException as exc:
            passed, err = False, '"%s"' % ename(exc)
        emit('"i":%d,"p":%d,"e":%s' % (i, 1 if passed else 0, err))
    emit('"ev":"done"')
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    exit_now(0)

_main()
'''


def _validate(code: object, tests: object, limits: object) -> None:
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be a list of str (Python expressions)")
    if not isinstance(limits, SandboxLimits):
        raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    for name in ("cpu_seconds", "wall_seconds", "memory_mb", "max_output_bytes"):
        value = getattr(limits, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f"SandboxLimits.{name} must be a positive finite number, got {value!r}")


def _pump(proc: subprocess.Popen, rfd: int, payload: bytes, deadline: float, cap: int, result_cap: int):
    """Feed stdin and drain stdout/stderr/results until all close or the deadline; keep at most cap bytes each."""
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), rfd: bytearray()}
    caps = {out_fd: cap, err_fd: cap, rfd: result_cap}
    view, pos = memoryview(payload), 0
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bufs, True
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pos += os.write(fd, view[pos:pos + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # the child died or closed stdin: nothing more to send
                        pos = len(payload)
                    if pos >= len(payload):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = caps[fd] - len(bufs[fd])
                if room > 0:
                    bufs[fd] += chunk[:room]
    return bufs, False


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait (without reaping, so the pid/pgid cannot be reused yet) until the child exits; False at the deadline."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _parse(raw: bytes, nonce: str, n_tests: int) -> tuple[str | None, str | None, list[TestOutcome]]:
    """Result lines -> (header event, load error name, outcomes in order); ignores anything malformed."""
    header, load_error, outcomes = None, None, []
    for line in raw.split(b"\n"):
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict) or msg.get("k") != nonce:
            continue
        ev = msg.get("ev")
        if header is None and ev in ("loaded", "syntax_error", "load_error"):
            header = ev
            if ev == "load_error":
                load_error = str(msg.get("e") or "Exception")
        elif header == "loaded" and msg.get("i") == len(outcomes) and len(outcomes) < n_tests:
            err = msg.get("e")
            outcomes.append(TestOutcome(passed=msg.get("p") == 1 and err is None,
                                        error=None if err is None else str(err)))
    return header, load_error, outcomes


def run_tests(code: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Exec `code` in a fresh namespace in a sandboxed child process and evaluate each test expression there.

    A test passes when it evaluates truthy; one that raises fails with the exception class name as error. If the
    child dies or runs out of time, every test not yet reported fails with the status as error. Only bad arguments
    raise (ValueError); failing to start a process at all (OSError) is the machine's problem and propagates.
    """
    _validate(code, tests, limits)
    tests = list(tests)
    if not sys.executable:
        raise RuntimeError("sys.executable is unknown: cannot start the sandbox interpreter")
    cpu = max(1, math.ceil(limits.cpu_seconds))
    nonce = secrets.token_hex(16)
    payload = json.dumps({"nonce": nonce, "code": code, "tests": tests, "limits": {
        "cpu": cpu, "mem": int(limits.memory_mb * 1024 * 1024), "fsize": FILE_SIZE_LIMIT, "nofile": OPEN_FILES_LIMIT,
    }}).encode("utf-8")
    cap = int(limits.max_output_bytes)
    result_cap = 4096 + 256 * (len(tests) + 4)

    with tempfile.TemporaryDirectory(prefix="mrl_sandbox_", ignore_cleanup_errors=True) as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        rfd, wfd = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", RUNNER, str(wfd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=tmp, env=env, start_new_session=True, close_fds=True, pass_fds=(wfd,))
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
        start = time.monotonic()
        deadline = start + float(limits.wall_seconds)
        try:
            bufs, timed_out = _pump(proc, rfd, payload, deadline, cap, result_cap)
            if not timed_out:
                timed_out = not _wait_exit(proc.pid, deadline)
        finally:
            # Kill the whole group before reaping the leader, so its id cannot have been reused by then.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            os.close(rfd)

    raw_out, raw_err, raw_res = (bytes(b) for b in bufs.values())  # stdout, stderr, results (insertion order)
    rc = proc.returncode
    header, load_error, outcomes = _parse(raw_res, nonce, len(tests))
    n = len(tests)

    if header == "syntax_error":
        status, outcomes = "syntax_error", [TestOutcome(False, "SyntaxError") for _ in tests]
    elif header == "load_error":
        status = "memory" if load_error == "MemoryError" else "ok"
        outcomes = [TestOutcome(False, load_error) for _ in tests]
    elif header == "loaded" and len(outcomes) == n:
        status = "memory" if any(o.error == "MemoryError" for o in outcomes) else "ok"
    else:
        cpu_used = usage.ru_utime + usage.ru_stime
        if timed_out or rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu_used >= cpu - 0.05):
            status = "timeout"
        elif any(s in raw_err for s in (b"MemoryError", b"Cannot allocate memory", b"out of memory")) or (
                any(o.error == "MemoryError" for o in outcomes)):
            status = "memory"
        else:
            status = "crashed"
        outcomes = outcomes + [TestOutcome(False, status) for _ in range(n - len(outcomes))]
    return SandboxResult(outcomes=outcomes, status=status, stdout=raw_out.decode("utf-8", "replace"),
                         stderr=raw_err.decode("utf-8", "replace"), returncode=rc)


def run_tests_many(items: list[tuple[str, list[str]]], limits: SandboxLimits = SandboxLimits(),
                   max_workers: int = 2) -> list[SandboxResult]:
    """`run_tests` for each (code, tests) item, each in its own process, `max_workers` at a time; results in order."""
    if not isinstance(items, (list, tuple)):
        raise ValueError("items must be a list of (code, tests) tuples")
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError("each item must be a (code, tests) tuple")
        _validate(item[0], item[1], limits)
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="mrl-sandbox") as pool:
        return list(pool.map(lambda item: run_tests(item[0], item[1], limits), items))
