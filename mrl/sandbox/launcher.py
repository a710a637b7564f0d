"""Starting the sandbox: bubblewrap's command line, the child process, its pipes and limits, and the result.

`run(code, tests, limits, sandbox)` is `run_tests` without the argument checks: it parses the tests
(mrl.sandbox.expressions), starts mrl/sandbox/child.py as `python -I -S -c <its text>` (inside bwrap, or as a plain
process for `sandbox="process"`), feeds it the request, drains its stdout, stderr and result pipe up to their caps
until the wall-clock limit, kills its whole process group, and grades the claims it made in a grading subprocess
(mrl.sandbox.grade_processes).
"""

from __future__ import annotations

import functools
import json
import math
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mrl.core.config import Sandbox
from mrl.sandbox import expressions, grade_processes, wire
from mrl.sandbox.results import SandboxLimits, SandboxResult, SandboxUnavailable, TestOutcome

SANDBOXES = tuple(s.value for s in Sandbox)
CHILD = Path(__file__).with_name("child.py").read_text()  # passed with -c: nothing of mrl is importable inside
FILE_SIZE_LIMIT = 1 << 20  # RLIMIT_FSIZE for files the code writes inside its directory
OPEN_FILES_LIMIT = 16  # RLIMIT_NOFILE
TMPFS_BYTES = 32 << 20  # the bwrap sandbox's private /tmp, at most (and at most half of memory_mb)
SHM_BYTES = 1 << 20  # /dev/shm (multiprocessing's semaphores live there), at most (and at most memory_mb / 8)
SANDBOX_ID = 65534  # uid and gid inside the bwrap sandbox ("nobody")
INSTALL_HINT = "apt-get install bubblewrap"


def _interpreter() -> str:
    """The base interpreter (not a venv's symlink): what the bwrap sandbox binds and runs."""
    for candidate in (getattr(sys, "_base_executable", None), sys.executable):
        if candidate and os.path.exists(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError("sys.executable is unknown: cannot start the sandbox interpreter")


def _python_mounts() -> list[str]:
    """bwrap arguments for a read-only view of the interpreter, its stdlib and the shared libraries, nothing else."""
    exe = _interpreter()
    # The interpreter's own view (a venv's sysconfig would name the venv's site-packages): its -I -S sys.path and,
    # for a shared build, the directory of libpython.
    probe = "import json, sys, sysconfig; print(json.dumps([sys.path, sysconfig.get_config_var('LIBDIR'), " \
            "sysconfig.get_config_var('Py_ENABLE_SHARED')]))"
    paths, libdir, shared = json.loads(subprocess.run([exe, "-I", "-S", "-c", probe], capture_output=True,
                                                      check=True, env={}, text=True).stdout)
    dirs = []
    for path in ["/usr/lib", "/usr/lib64", "/usr/lib32", *paths, libdir if shared else ""]:
        real = os.path.realpath(path) if path else ""
        if real and os.path.exists(real) and real not in dirs:
            dirs.append(real)
    dirs = [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]
    args = []
    for d in sorted(dirs):
        args += ["--ro-bind", d, d]
    if not any(exe.startswith(d + "/") for d in dirs):
        args += ["--ro-bind", exe, exe]
    for top in ("/lib", "/lib64", "/lib32"):  # merged-/usr systems link these into /usr; others have real dirs
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args




# The seccomp filter bwrap installs on the program (--seccomp).  It fails with EPERM: calls that reach into another
# process (a program that could ptrace the sandbox's PID 1, bwrap's init of the same uid, could clear its
# parent-death signal and keep the namespace alive past the kill); the kernel keyrings, which no namespace bwrap
# makes separates (uid 65534 inside is the trainer's uid outside: it read the trainer's session keyring, left keys
# there and linked root's `_uid.0`; issue 44); and a socket of any family but AF_UNIX (multiprocessing's), since
# AF_VSOCK reaches the VM's host whatever the network namespace.  Every call of another ABI fails too.
# Syscall numbers per architecture (audit arch, then the numbers).
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "keyctl", "add_key", "request_key")
_SOCKETS = ("socket", "socketpair")  # denied unless their first argument (the family) is AF_UNIX
_SYSCALLS = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
                            "keyctl": 250, "add_key": 248, "request_key": 249, "socket": 41, "socketpair": 53}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
                             "keyctl": 219, "add_key": 217, "request_key": 218, "socket": 198, "socketpair": 199}),
}


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes | None:
    """A classic-BPF seccomp program (struct sock_filter[]) that fails _DENIED, and _SOCKETS of a family other than
    AF_UNIX, with EPERM, and every call of another ABI (i386 through int 0x80, x32), or None on an architecture not
    in _SYSCALLS."""
    import platform

    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        return None
    audit_arch, numbers = arch
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    nrs = [numbers[name] for name in _DENIED]
    sockets = [numbers[name] for name in _SOCKETS]
    n = len(nrs) + len(sockets)
    # [arch] [arch == native? else deny] [nr] [nr >= x32 bit? deny] [nr == each denied? deny]
    # [nr == each socket call? to the family check] allow; family: [args[0]] [== AF_UNIX? allow] deny
    body = [(load, 0, 0, 4), (jeq, 0, n + 6, audit_arch), (load, 0, 0, 0), (jge, n + 4, 0, 0x40000000)]
    body += [(jeq, n - i + 3, 0, nr) for i, nr in enumerate(nrs)]
    body += [(jeq, len(sockets) - i, 0, nr) for i, nr in enumerate(sockets)]
    body += [(ret, 0, 0, allow), (load, 0, 0, 16), (jeq, 0, 1, socket.AF_UNIX), (ret, 0, 0, allow),
             (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in body)


def tmpfs_sizes(memory_mb: float) -> tuple[int, int]:
    """(/tmp, /dev/shm) sizes in bytes: the writable mounts together stay within half of `memory_mb`, since what
    they hold is host memory that RLIMIT_AS does not count."""
    memory = int(memory_mb * (1 << 20))
    return max(4096, min(TMPFS_BYTES, memory // 2 - memory // 8)), max(4096, min(SHM_BYTES, memory // 8))


# Files of a fresh /proc that are the host's, not the PID namespace's: its kernel command line, its keys and their
# owners, its kernel's symbols and modules, its scheduler's tasks and timers (issue 44: /proc/cmdline and /proc/keys
# were read from inside).  /dev/null is bound over each, and /proc's mount admits no device node: opening one fails
# with EACCES.
_HOST_PROC = ("cmdline", "keys", "key-users", "kallsyms", "modules", "sched_debug", "timer_list")


@functools.lru_cache(maxsize=8)
def _bwrap_base(memory_mb: float = 256) -> tuple[str, ...]:
    """The bwrap command line up to the interpreter; raises SandboxUnavailable where bwrap is not installed.

    Mounts, in order (bwrap applies them so): the interpreter and its libraries read-only; a /proc of the
    sandbox's own PID namespace without the host's files (_HOST_PROC), read-only, so that /proc/sys and
    /proc/sysrq-trigger cannot be written (uid 65534 inside is the trainer's uid outside: as root, DAC alone would
    let it write the host's kernel settings); a
    minimal /dev (null, zero, full, random, urandom, tty, pts), read-only, with a small /dev/shm; /tmp; then the
    root itself read-only, so that /tmp and /dev/shm, both size-limited, are the only places it can write."""
    exe = shutil.which("bwrap")
    if exe is None:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT} "
            "(or set rewards.sandbox=process to run generated code without an OS sandbox: unsafe for untrusted code)")
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, env={}).stdout
    args = [exe, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID),
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv"]
    if "--disable-userns" in helptext:  # bwrap >= 0.8
        args.append("--disable-userns")
    if os.geteuid() == 0:  # clears the bounding set too (bwrap accepts --cap-drop only when privileged)
        args += ["--cap-drop", "ALL"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8"),
                       ("LC_ALL", "C.UTF-8")):
        args += ["--setenv", key, value]
    if "--size" not in helptext or "--remount-ro" not in helptext:
        raise SandboxUnavailable(
            f"bubblewrap {exe} is too old for the code sandbox (it needs --size and --remount-ro, bwrap >= 0.5): "
            f"upgrade it ({INSTALL_HINT} on a current distribution)")
    tmp, shm = tmpfs_sizes(memory_mb)
    args += _python_mounts()
    args += ["--proc", "/proc"]
    for name in _HOST_PROC:  # a file of the sandbox's own /proc that shows the host: /dev/null over it
        if os.path.exists(f"/proc/{name}"):  # bwrap cannot create a missing file in /proc
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    args += ["--remount-ro", "/proc", "--dev", "/dev", "--size", str(shm), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--size", str(tmp), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
             "--"]
    return tuple(args)


def check_sandbox(sandbox: str = "bwrap") -> None:
    """Raise SandboxUnavailable (one line: why, and the fix) unless `sandbox` (a name, or the config's enum) can run
    a program here; ValueError for an unknown name."""
    check_runs(sandbox_name(sandbox))


@functools.lru_cache(maxsize=None)
def check_runs(sandbox: str) -> None:
    """check_sandbox's test of a valid name; cached, so that a run pays for it once."""
    if sandbox == "process":
        return
    _bwrap_base()
    result = run("print(6 * 7)", [], SandboxLimits(wall_seconds=30), "bwrap")
    if result.status != "ok" or result.stdout != "42\n":
        reason = (result.stderr.strip().splitlines() or [f"status {result.status}"])[-1]
        raise SandboxUnavailable(
            f"bubblewrap cannot start the code sandbox here ({reason}); it needs user namespaces: run as root, "
            "enable unprivileged ones (sysctl kernel.unprivileged_userns_clone=1) or allow them in the container "
            "(or set rewards.sandbox=process: unsafe for untrusted code)")


def sandbox_name(sandbox: object) -> str:
    """The sandbox's name from a name or the config's enum (rewards.sandbox); ValueError for an unknown one."""
    name = getattr(sandbox, "value", sandbox)
    if name not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {SANDBOXES}, got {sandbox!r}")
    return name


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




NAMESPACE_EXIT_SECONDS = 10.0  # how long a killed sandbox may take to be gone (it is at once, but for a loaded host)


def _sandbox_init(info_fd: int, bwrap_pid: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's PID 1 (bwrap's `--info-fd` JSON names its pid outside), or None when bwrap exited
    before it started one.  Taken while bwrap, its parent, still lives, so the pid cannot have been reused."""
    data = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(info_fd, 4096) if ready else b""
            if not chunk:
                break
            data += chunk
            if data.rstrip().endswith(b"}"):
                break
    finally:
        os.close(info_fd)
    try:
        pid = int(json.loads(data)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        parent = None
    if parent != bwrap_pid:  # gone already, and its pid taken by another process
        os.close(pidfd)
        return None
    return pidfd


def _end_namespace(pidfd: int) -> None:
    """Kill the sandbox's PID 1 and return once it has exited, and with it every process of its namespace (the
    kernel reaps them all before the init's exit is reported): verified, not assumed."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        ready, _, _ = select.select([pidfd], [], [], NAMESPACE_EXIT_SECONDS)
    finally:
        os.close(pidfd)
    if not ready:
        raise RuntimeError(f"the sandbox's processes did not exit within {NAMESPACE_EXIT_SECONDS:g} s of SIGKILL")


def run(code: str, tests: list, limits: SandboxLimits, sandbox: str) -> SandboxResult:
    parsed = [expressions.parse_test(t) for t in tests]
    probe_slices, io_indices, sources, stdins = [], [], [], []  # per test: its probes, its stdin's index
    for p in parsed:
        start = len(sources)
        if isinstance(p, expressions.Expr):
            sources.extend(p.sources)
        elif isinstance(p, expressions.IO):
            stdins.append(p.stdin)
        probe_slices.append(slice(start, len(sources)))
        io_indices.append(len(stdins) - 1 if isinstance(p, expressions.IO) else None)
    load = any(isinstance(p, expressions.Expr) for p in parsed) or not stdins
    cpu = max(1, math.ceil(limits.cpu_seconds))
    payload = wire.request(code, sources, stdins, load, {
        "cpu": cpu, "mem": int(limits.memory_mb * 1024 * 1024), "fsize": FILE_SIZE_LIMIT, "nofile": OPEN_FILES_LIMIT,
        "value": int(limits.max_value_bytes), "netns": sandbox == "process"})
    cap = int(limits.max_output_bytes)
    result_cap = 4096 + (256 + int(limits.max_value_bytes)) * (len(sources) + len(stdins))

    with tempfile.TemporaryDirectory(prefix="mrl_sandbox_", ignore_cleanup_errors=True) as tmp:
        rfd, wfd = os.pipe()
        extra: list[int] = []  # bwrap's info and seccomp fds (theirs), closed here once it started
        if sandbox == "bwrap":
            info_r, info_w = os.pipe()
            extra, base = [info_w], list(_bwrap_base(limits.memory_mb))
            base[-1:] = ["--info-fd", str(info_w)]
            program = seccomp_filter()
            if program is not None:
                filter_r, filter_w = os.pipe()  # the program fits a pipe's buffer: written whole, then closed
                os.write(filter_w, program)
                os.close(filter_w)
                extra.append(filter_r)
                base += ["--seccomp", str(filter_r)]
            argv = [*base, "--", _interpreter(), "-I", "-S", "-c", CHILD, str(wfd)]
            env, cwd = {}, "/"  # nothing of the trainer's environment, not even in bwrap's own /proc/1/environ
        else:
            argv = [_interpreter(), "-I", "-S", "-c", CHILD, str(wfd)]
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            cwd = tmp
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, env=env, start_new_session=True, close_fds=True,
                                    pass_fds=(wfd, *extra))
        except BaseException:
            os.close(rfd)
            if sandbox == "bwrap":
                os.close(info_r)
            raise
        finally:
            for fd in (wfd, *extra):
                os.close(fd)
        deadline = time.monotonic() + float(limits.wall_seconds)
        init = _sandbox_init(info_r, proc.pid, deadline) if sandbox == "bwrap" else None
        try:
            bufs, timed_out = _pump(proc, rfd, payload, deadline, cap, result_cap)
            if not timed_out:
                timed_out = not _wait_exit(proc.pid, deadline)
        finally:
            # Kill the whole group before reaping the leader, so its id cannot have been reused by then.  Under
            # bwrap, the sandbox's init is killed through its pidfd too (its parent-death signal is not to be
            # relied on): the kernel then kills every process of its PID namespace, and the pidfd reads as exited
            # only once they are all gone.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if init is not None:
                _end_namespace(init)
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
    if sandbox == "bwrap" and rc is not None and 128 < rc < 128 + 65:  # bwrap exits 128 + N when N killed its child
        rc = 128 - rc
    reply = wire.parse(raw_res, len(sources), len(stdins))
    status = _status(reply, load, len(sources), len(stdins), timed_out, rc, usage, cpu, raw_err)

    outcomes: list[TestOutcome | None] = []
    jobs, waiting = [], []  # expression tests whose probes all came back: graded together, in the grader
    for i, (p, probe_slice, io_index) in enumerate(zip(parsed, probe_slices, io_indices)):
        if isinstance(p, expressions.Bad):
            outcomes.append(TestOutcome(False, p.error))
        elif status == "syntax_error":
            outcomes.append(TestOutcome(False, "SyntaxError"))
        elif isinstance(p, expressions.IO):
            if io_index in reply.io:
                out, err = reply.io[io_index]
                outcomes.append(TestOutcome(err is None and expressions.same_output(out, p.stdout), err))
            else:
                outcomes.append(TestOutcome(False, status))
        elif reply.header == "load_error":
            outcomes.append(TestOutcome(False, reply.load_error))
        elif reply.header == "loaded" and all(k in reply.probes for k in range(probe_slice.start, probe_slice.stop)):
            outcomes.append(None)
            jobs.append((tests[i], [reply.probes[k] for k in range(probe_slice.start, probe_slice.stop)]))
            waiting.append(i)
        else:
            outcomes.append(TestOutcome(False, status))
    if jobs:
        verdicts = grade_processes.grade_many(jobs, _interpreter(), budget=float(limits.wall_seconds))
        for i, (passed, error) in zip(waiting, verdicts):
            outcomes[i] = TestOutcome(passed, error)
    return SandboxResult(outcomes=outcomes, status=status, stdout=raw_out.decode("utf-8", "replace"),
                         stderr=raw_err.decode("utf-8", "replace"), returncode=rc)


def _status(reply: wire.Reply, load: bool, n_probes: int, n_io: int, timed_out: bool, rc: int | None, usage,
            cpu: int, raw_err: bytes) -> str:
    """How the run ended: ok | timeout | memory | crashed | syntax_error."""
    complete = len(reply.io) == n_io and (
        not load or reply.header in ("load_error", "syntax_error")
        or (reply.header == "loaded" and len(reply.probes) == n_probes))
    errors = [e for kind, e in reply.probes.values() if kind == "e"] + [e for _, e in reply.io.values()]
    if reply.header == "syntax_error":
        return "syntax_error"
    if complete:
        return "memory" if "MemoryError" in errors + [reply.load_error] else "ok"
    signum = -rc if rc is not None and rc < 0 else 0
    cpu_used = usage.ru_utime + usage.ru_stime
    if timed_out or signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_used >= cpu - 0.05):
        return "timeout"
    if any(s in raw_err for s in (b"MemoryError", b"Cannot allocate memory", b"out of memory")) or (
            "MemoryError" in errors):
        return "memory"
    return "crashed"
