"""Issue 22's findings against the sandbox, with our own payloads, as the trainer (root in CI) meets them: each is
tried after undoing the Python guards (test_sandbox_escapes.UNDO), so that only bubblewrap and the grader stand.

- the host's kernel settings (/proc/sys), /proc/sysrq-trigger, /dev and / cannot be written; /dev/shm and /tmp are
  size-limited within memory_mb;
- grading cannot be stalled: colliding hashes are refused at once, a quadratic comparison is cut off by the grading
  subprocess's time limit (that test scores 0, the others are graded), and the caller never waits past the limits;
- a method call on a returned value runs outside the sandbox, on the builtin value: a str subclass whose startswith
  returns True scores 0, through run_tests and through the code reward channel.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import has_bwrap
from test_sandbox_escapes import UNDO

from mrl.core.episode import Episode, Prompt
from mrl.envs.code import TINY_WRAP, PassRate
from mrl.sandbox import SandboxLimits, TestOutcome, run_tests
from mrl.sandbox.launcher import tmpfs_sizes

LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=4.0, memory_mb=256, max_output_bytes=1 << 20)
needs_bwrap = pytest.mark.skipif(not has_bwrap(), reason="bubblewrap is not installed (apt-get install bubblewrap)")

# Each attempt prints `name: WROTE` or `name: <errno name>`; the program ends with f() so that it surely ran.
ATTEMPTS = UNDO + '''
import errno, os
def attempt(name, path, data=b"1", times=1):
    try:
        if path.endswith("/"):
            for i in range(times):
                with open(path + "f%d" % i, "wb") as out:
                    out.write(data)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT)
            os.write(fd, data)
            os.close(fd)
        print(name + ": WROTE")
    except OSError as e:
        print(name + ": " + errno.errorcode.get(e.errno, str(e.errno)))
'''
SETTINGS = ["fs/lease-break-time", "kernel/core_pattern", "kernel/hostname"]  # readable, and written as they are


def _attempts(lines: list[str]) -> dict[str, str]:
    res = run_tests(ATTEMPTS + "\n".join(lines) + "\ndef f():\n    return 1\n", ["f() == 1"], LIMITS)
    assert res.outcomes == [TestOutcome(True, None)], res
    return dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)


@needs_bwrap
def test_proc_sys_and_sysrq_cannot_be_written():
    before = {s: Path("/proc/sys", s).read_text() for s in SETTINGS}
    # Each is written its own value (drop_caches an invalid one), so that a failure here changes nothing on the host.
    got = _attempts([f"attempt({s!r}, '/proc/sys/{s}', {before[s].encode()!r})" for s in SETTINGS]
                    + ["attempt('drop_caches', '/proc/sys/vm/drop_caches', b'0')",
                       "attempt('sysrq', '/proc/sysrq-trigger', b'')", "attempt('self', '/proc/self/comm', b'x')"])
    assert set(got) == set(SETTINGS) | {"drop_caches", "sysrq", "self"}
    assert set(got.values()) <= {"EROFS", "ENOENT"} and got["drop_caches"] == "EROFS", got
    assert {s: Path("/proc/sys", s).read_text() for s in SETTINGS} == before


@needs_bwrap
def test_dev_and_root_are_read_only_and_the_writable_mounts_are_small():
    tmp, shm = tmpfs_sizes(LIMITS.memory_mb)
    assert tmp + shm <= LIMITS.memory_mb << 19  # within half of memory_mb
    got = _attempts([
        "attempt('dev', '/dev/mrl_x')", "attempt('root', '/mrl_x')", "attempt('etc', '/etc/mrl_x')",
        "attempt('null', '/dev/null')",  # a device node stays writable: writing it stores nothing
        # 400 MiB asked of /dev/shm and /tmp, in files under RLIMIT_FSIZE's 1 MiB: the mount's size stops it.
        "attempt('shm', '/dev/shm/', b'x' * (1 << 19), times=800)",
        "attempt('tmp', '/tmp/', b'x' * (1 << 19), times=800)",
        "attempt('tmp_small', '/tmp/small')"])
    assert got == {"dev": "EROFS", "root": "EROFS", "etc": "EROFS", "null": "WROTE", "shm": "ENOSPC", "tmp": "ENOSPC",
                   "tmp_small": "ENOSPC"}, got


@pytest.mark.parametrize("memory_mb", [1, 16, 256, 4096])
def test_tmpfs_sizes_stay_within_memory_mb(memory_mb):
    tmp, shm = tmpfs_sizes(memory_mb)
    assert 0 < shm <= 1 << 20 and 0 < tmp <= 32 << 20 and tmp + shm <= max(memory_mb << 19, 8192)


# ---- grading that cannot be stalled -------------------------------------------------------------------------------

COLLIDING = UNDO + "M = 2 ** 61 - 1\ndef f():\n    return [i * M for i in range(40_000)]\n"
# An 8-Mbit int over a 4-Mbit one: CPython's long division is quadratic (most of a minute); small ones for the rest.
HUGE = UNDO + "def f(x):\n    return {1: 1 << 8_000_000, 2: (1 << 4_000_000) - 1}.get(x, x)\n"


@pytest.mark.parametrize("sandbox", ["bwrap", "process"])
def test_hash_flooding_fails_fast(sandbox):
    if sandbox == "bwrap" and not has_bwrap():
        pytest.skip("bubblewrap is not installed")
    start = time.monotonic()
    res = run_tests(COLLIDING, ["set(f()) == {0}", "len(f()) == 40_000", "len({1: f()}) == 1"],
                    SandboxLimits(wall_seconds=10, max_value_bytes=4 << 20), sandbox=sandbox)
    assert time.monotonic() - start < 8
    assert [(o.passed, o.error) for o in res.outcomes] == [(False, "ValueError"), (True, None), (True, None)], res


@pytest.mark.parametrize("sandbox", ["bwrap", "process"])
def test_a_stalled_comparison_scores_zero_and_the_rest_is_graded(sandbox):
    if sandbox == "bwrap" and not has_bwrap():
        pytest.skip("bubblewrap is not installed")
    start = time.monotonic()
    res = run_tests(HUGE, ["f(1) // f(2) == 1", "f(0) == 0", "f(3) % 2 == 1"],
                    SandboxLimits(wall_seconds=10, max_value_bytes=4 << 20), sandbox=sandbox)
    assert time.monotonic() - start < 10
    assert [(o.passed, o.error) for o in res.outcomes] == [(False, "GradeTimeout"), (True, None), (True, None)], res


def test_the_grading_budget_bounds_all_tests_of_a_program():
    from mrl.sandbox import grade_processes

    # Ten stalls of a second each would be ten seconds: the budget ends them after two.
    job = ("f(1) // f(2) == 1", [("v", {"int": "1" + "0" * 2_000_000}), ("v", {"int": "f" * 1_000_000})])
    start = time.monotonic()
    verdicts = grade_processes.grade_many([job] * 10, grader_interpreter(), seconds=1.0, budget=2.0)
    assert time.monotonic() - start < 4
    assert verdicts == [(False, "GradeTimeout")] * 10


def grader_interpreter() -> str:
    from mrl.sandbox.launcher import _interpreter

    return _interpreter()


# ---- the test's expression runs outside the sandbox ----------------------------------------------------------------

LYING_STR = ("class S(str):\n    def startswith(self, *a):\n        return True\n"
             "    def __len__(self):\n        return 3\n")


@pytest.mark.parametrize("sandbox", ["bwrap", "process"])
def test_methods_of_returned_values_run_outside(sandbox):
    if sandbox == "bwrap" and not has_bwrap():
        pytest.skip("bubblewrap is not installed")
    lying = UNDO + LYING_STR + "def f(x):\n    return S(x[::-1])\n"
    honest = "def f(x):\n    return x[::-1]\n"
    tests = ["f('abc').startswith('cba')", "f('abc').upper() == 'CBA'", "len(f('abcd')) == 4",
             "sorted(set(f('aab'))) == ['a', 'b']", "f('a b').split() == ['b', 'a']"]
    assert run_tests(honest, tests, LIMITS, sandbox=sandbox).pass_rate == 1.0
    res = run_tests(lying, tests, LIMITS, sandbox=sandbox)
    assert [(o.passed, o.error) for o in res.outcomes] == [(False, "NotPlainData")] * 5, res
    # A method no builtin type offers is the program's own: the whole call is evaluated in the sandbox.
    api = "class Solution:\n    def twoSum(self, xs, t):\n        return [0, 1]\n"
    assert run_tests(api, ["Solution().twoSum([1, 2], 3) == [0, 1]"], LIMITS, sandbox=sandbox).pass_rate == 1.0


def test_a_lying_str_scores_zero_through_the_code_channel():
    prompt = Prompt("reverse", meta={"tests": ["f('abc').startswith('cba')", "f('xy').endswith('x')"],
                                     "wrap": TINY_WRAP})
    channel = PassRate(cpu_seconds=1.0, wall_seconds=3.0, memory_mb=254,
                       sandbox="bwrap" if has_bwrap() else "process")
    fake = "type('S', (str,), {'startswith': lambda s, *a: True, 'endswith': lambda s, *a: True})(x)"
    episodes = [Episode(prompt=prompt, completion=c, completion_ids=[], num_tokens=3, truncated=False,
                        max_new_tokens=10) for c in (fake, "x[::-1]")]
    assert channel(episodes) == [0.0, 1.0]


# ---- issue 30: the program cannot reach into another process, and the namespace dies with the call --------------

REACH = UNDO + """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, result):
    print(name + ": " + ("DONE" if result != -1 else errno.errorcode.get(ctypes.get_errno(), "?")))
tried("ptrace_attach_init", libc.ptrace(16, 1, 0, 0))  # PTRACE_ATTACH to bwrap's PID 1 (same uid, no filter before)
tried("ptrace_traceme", libc.ptrace(0, 0, 0, 0))
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
tried("process_vm_readv_init", libc.process_vm_readv(1, iov, 1, iov, 1, 0))
tried("x32_getpid", libc.syscall(0x40000000 + 39))  # another ABI of the same kernel
tried("getpid", libc.syscall(39) if os.uname().machine == "x86_64" else os.getpid())
def f():
    return 1
"""


@needs_bwrap
def test_the_program_cannot_ptrace_or_read_another_process():
    """The probe's first step: ptrace-attach the sandbox's PID 1 and clear its parent-death signal.  Before the
    seccomp filter the attach succeeded (`ptrace_attach_init: DONE`)."""
    res = run_tests(REACH, ["f() == 1"], LIMITS)
    assert res.outcomes == [TestOutcome(True, None)], res
    said = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert said == {"ptrace_attach_init": "EPERM", "ptrace_traceme": "EPERM", "process_vm_readv_init": "EPERM",
                    "x32_getpid": "EPERM", "getpid": "DONE"}, said


@needs_bwrap
def test_the_namespace_dies_with_the_call_even_when_its_init_ignores_its_parent(monkeypatch):
    """The probe's result (its init's parent-death signal cleared, so killing bwrap left the namespace running,
    adopted by host PID 1, forking fresh children past RLIMIT_CPU) made without ptrace: bwrap started without
    --die-with-parent.  run_tests returns only once every process of the call is gone: checked at once, no sleep."""
    import secrets

    from test_sandbox_escapes import _alive

    from mrl.sandbox import launcher

    base = launcher._bwrap_base

    def without_pdeathsig(memory_mb: float = 256):
        return tuple(a for a in base(memory_mb) if a != "--die-with-parent")

    monkeypatch.setattr(launcher, "_bwrap_base", without_pdeathsig)
    token = f"mrl-forker-{secrets.token_hex(6)}"
    forker = "import os, time\\nwhile True:\\n    if os.fork() == 0:\\n        time.sleep(0.05)\\n" \
             "        os._exit(0)\\n    time.sleep(0.01)"
    code = UNDO + "\n".join([
        "import os, sys, time", "if os.fork() == 0:", "    os.setsid()",
        f"    os.execv(sys.executable, [sys.executable, '-S', '-c', '{forker}', {token!r}])",
        "time.sleep(30)"])
    start = time.monotonic()
    res = run_tests(code, ["True"], SandboxLimits(cpu_seconds=1, wall_seconds=1.5))
    assert res.status == "timeout" and time.monotonic() - start < 5
    assert _alive(token) == []
