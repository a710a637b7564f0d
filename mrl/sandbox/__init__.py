"""Run model-generated Python in an OS sandbox and grade it against unit tests outside it (for reward channels).

`run_tests(code, tests)` returns one `TestOutcome` per test and an overall status, so a channel can use
`result.pass_rate` or `result.error_rate` (a "bug ratio").  Nothing the code does makes `run_tests` raise; bad
arguments raise `ValueError`, and a sandbox that cannot start raises `SandboxUnavailable` (one line saying why).

The package, by side of the boundary:
  child.py        the program that runs inside the sandbox (untrusted side: stdlib only, passed with `python -c`)
  wire.py         the request it reads and the result lines it writes, read here as claims
  launcher.py     bubblewrap's command line, the process, its pipes and limits
  expressions.py  a test as an expression: its probes cut out and evaluated on the returned plain values
                  (stdlib only); run as a script, it is the grading subprocess
  grade_processes.py
                  the trusted grading subprocesses that run expressions.py under a time limit

Grading happens outside the sandbox; the sandbox only runs the program and returns plain data.
  * A test is an expression (`f(2) == 4`, `abs(f(0.5) - 1) < 1e-6`, `f('abc').startswith('c')`) or an assert
    statement.  Its *probes* are its calls of, and names from, the program (`f(2)`, `f('abc')`): only their source
    goes to the sandbox, which sends back each one's value as tagged JSON, plain data of exact builtin types only (an
    object with its own `__eq__`, a subclass of str or int, fails that test with `NotPlainData`; a value over
    `max_value_bytes` with `ValueTooLarge`).  Everything around a probe, methods of builtin types included
    (`.startswith`, `.count`, `.keys`; see expressions.METHODS), `set(...)`, `sorted(...)` and the comparison, is
    evaluated outside, on the values rebuilt from builtins; a test that needs more (a lambda or comprehension around
    the program's values) fails with `UnsupportedTest` rather than run anywhere.
  * That evaluation runs in a trusted grading subprocess (`python -I -S`, no code of the program) with a time limit
    per test (grade_processes.GRADE_SECONDS) and for all of a program's tests (wall_seconds): a value built to stall it
    (keys that share one hash, a quadratic comparison) makes that test fail with `GradeTimeout`, never the trainer
    wait.  Sets and dicts with more than a few distinct keys of one hash are refused outright (`NotPlainData`).
  * A test `{"stdin": ..., "stdout": ...}` runs the program as `__main__` with that stdin; the sandbox returns what
    it wrote to `sys.stdout`, compared here line by line (trailing whitespace and blank lines ignored).
The result channel is not hidden (code in a process can always reach what its harness holds: frames, gc,
/proc/self/fd); forging it is worthless instead.  Everything the sandbox sends is a claim of the program, validated
outside, and expected values never enter the sandbox, so code that takes over the harness can only claim a plain
value for a probe, which is what returning that value does.  (A test that passes its expected value into the
program, `check(f(2), 4)`, shows it to the program: write `f(2) == 4`.)

The boundary is bubblewrap (`sandbox="bwrap"`, the default; `apt-get install bubblewrap`): the interpreter runs
as `python -I -S` (stdlib only) in new user, PID, network, IPC, UTS, mount and cgroup namespaces, as uid/gid 65534
with no capabilities and no further user namespaces (`--disable-userns`), `--new-session`, `--die-with-parent`,
`--clearenv`.  Its filesystem: the interpreter, its standard library and the shared libraries (`/usr/lib*`)
read-only; a /proc of its own PID namespace, read-only (uid 65534 inside is the trainer's uid outside, so as root
a writable /proc/sys would be the host's kernel settings); a minimal /dev, read-only, with a /dev/shm of 1 MiB; a
private /tmp (cwd, HOME, TMPDIR) of 32 MiB; the root read-only.  The writable mounts together stay within half of
`memory_mb`.  No `/bin/sh`, no host `/tmp`, no repo, no data.  Killing it at the wall-clock limit (or after it
exits) ends its PID namespace, so no child outlives the call.  Where bwrap cannot start, `check_sandbox` says so.

`sandbox="process"` (`rewards.sandbox=process`) is the child process without namespaces: NOT safe for untrusted
code.  As root its code can undo the Python guards (`del sys.modules["posix"]`) and then write files, signal the
trainer, read `/proc/<trainer>/environ` or leave a `setsid` child behind.

In both modes, inside the child: rlimits RLIMIT_CPU (soft = ceil(cpu_seconds), hard one second later),
RLIMIT_AS (memory_mb), RLIMIT_FSIZE (1 MiB per file), RLIMIT_NOFILE (16), RLIMIT_CORE (0), RLIMIT_NPROC (0; not
enforced for root's uid, which the bwrap sandbox maps to when the trainer is root); a wall-clock SIGKILL of the
whole process group; stdin at /dev/null; and Python-level guards kept as defence in depth (sockets, writes outside
the cwd, fork/exec/kill raise PermissionError; ctypes cannot be imported).

Not defended: the kernel itself (a kernel exploit escapes any namespace), and load on the machine during the
wall-clock limit (no cgroup: CPU of several processes, their memory up to memory_mb each, and SysV shared memory
of its own IPC namespace, which code that undoes the guards can reach through ctypes until the sandbox ends).
POSIX only (uses `resource`); bwrap needs Linux with user namespaces (root, or unprivileged ones enabled).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

from mrl.sandbox import launcher
from mrl.sandbox.expressions import MATH, SAFE_FUNCS, Bad, Expr, grade, parse_test
from mrl.sandbox.launcher import CHILD, SANDBOXES, check_sandbox, sandbox_name
from mrl.sandbox.results import STATUSES, SandboxLimits, SandboxResult, SandboxUnavailable, TestOutcome

__all__ = ["SandboxLimits", "TestOutcome", "SandboxResult", "SandboxUnavailable", "run_tests", "run_tests_many",
           "check_sandbox", "sandbox_name", "test_error", "passes_if_every_probe_returns", "SANDBOXES", "SAFE_FUNCS",
           "MATH", "STATUSES", "CHILD"]


def test_error(test: str | dict) -> str | None:
    """None when the trainer can grade `test`, else the error each of its runs would fail with: "SyntaxError" or
    "UnsupportedTest" (for a task to refuse such a test when it loads, rather than score 0 on it)."""
    parsed = parse_test(test)
    return parsed.error if isinstance(parsed, Bad) else None


test_error.__test__ = False  # not a pytest test


def passes_if_every_probe_returns(test: str, value: object) -> bool:
    """Whether the expression test `test` would pass if every call into the program returned `value` (graded here,
    in process: `value` is the caller's, nothing runs): `passes_if_every_probe_returns("f([]) == None", None)` ->
    True.  For a task to find the tests a trivial answer (a `pass` body) passes; False for an I/O test or one the
    trainer cannot grade."""
    parsed = parse_test(test)
    return isinstance(parsed, Expr) and grade(parsed, [("v", value)] * len(parsed.probes))[0]


def run_tests(code: str, tests: list, limits: SandboxLimits = SandboxLimits(),
              sandbox: str = "bwrap") -> SandboxResult:
    """Run `code` in a sandboxed child process and grade it on `tests` outside it (see the module docstring).

    A test passes when it evaluates truthy on the program's plain values (or, an I/O test, when the program's
    stdout matches); one that raises fails with the exception class name as error. If the child dies or runs out
    of time, every test not yet answered fails with the status as error. Bad arguments raise ValueError; a sandbox
    that cannot start raises SandboxUnavailable; failing to start a process at all (OSError) propagates.
    """
    _validate(code, tests, limits)
    sandbox = sandbox_name(sandbox)
    launcher.check_runs(sandbox)
    return launcher.run(code, list(tests), limits, sandbox)


def run_tests_many(items: list[tuple[str, list]], limits: SandboxLimits = SandboxLimits(),
                   max_workers: int = 2, sandbox: str = "bwrap") -> list[SandboxResult]:
    """`run_tests` for each (code, tests) item, each in its own sandbox, `max_workers` at a time; results in order."""
    if not isinstance(items, (list, tuple)):
        raise ValueError("items must be a list of (code, tests) tuples")
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError("each item must be a (code, tests) tuple")
        _validate(item[0], item[1], limits)
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    sandbox = sandbox_name(sandbox)
    if not items:
        return []
    launcher.check_runs(sandbox)  # once, here, rather than in each thread
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="mrl-sandbox") as pool:
        return list(pool.map(lambda item: launcher.run(item[0], list(item[1]), limits, sandbox), items))


def _validate(code: object, tests: object, limits: object) -> None:
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(tests, (list, tuple)) or not all(
            isinstance(t, str) or (isinstance(t, dict) and set(t) == {"stdin", "stdout"}
                                   and all(isinstance(v, str) for v in t.values())) for t in tests):
        raise ValueError('tests must be a list of str (Python expressions) or {"stdin": str, "stdout": str} dicts')
    if not isinstance(limits, SandboxLimits):
        raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    for name in ("cpu_seconds", "wall_seconds", "memory_mb", "max_output_bytes", "max_value_bytes"):
        value = getattr(limits, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f"SandboxLimits.{name} must be a positive finite number, got {value!r}")
