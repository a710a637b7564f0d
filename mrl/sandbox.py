"""Run model-generated Python in an OS sandbox and grade it against unit tests in the trainer (for reward channels).

`run_tests(code, tests)` returns one `TestOutcome` per test and an overall status, so a channel can use
`result.pass_rate` or `result.error_rate` (a "bug ratio"). Nothing the code does makes `run_tests` raise; bad
arguments raise `ValueError`, and a sandbox that cannot start raises `SandboxUnavailable` (one line saying why).

Grading happens here, in the trusted process; the sandbox only runs the program and returns plain data.
  * A test is an expression (`f(2) == 4`, `abs(f(0.5) - 1) < 1e-6`, `not is_prime(8)`) or an assert statement
    (`assert f(2) == 4, "msg"`). The trainer parses it with `ast` and cuts out its *probes*: the parts that need the
    program (calls of, and attributes or names from, the program: `f(2)`). Only the probes' source text goes to the
    sandbox, which evaluates each one after running the program and sends back its value as JSON, plain data only
    (None, bool, int, float, str, bytes, complex, and lists, tuples, dicts, sets of those, of these exact types:
    an object with its own `__eq__` or a subclass of int fails that test with `NotPlainData`; an int of 64 bits or
    more travels as hex text, which is linear to write and read and free of Python's 4,300-digit int-str limit, so
    an honest `math.factorial(2000)` comes back whole, and `max_value_bytes` caps its size). The trainer rebuilds
    the value from builtins and evaluates the rest of the test itself: literals, operators, comparisons, indexing
    and a few pure builtins (`len`, `sorted`, `math.isclose`, ...; `SAFE_FUNCS`). A test that needs more (a lambda or
    comprehension around the program's values) fails with `UnsupportedTest` rather than run outside the trainer.
  * A test `{"stdin": ..., "stdout": ...}` runs the program as `__main__` with that stdin (from `sys.stdin`); the
    sandbox returns what it wrote to `sys.stdout`, and the trainer compares it line by line (trailing whitespace
    and blank lines ignored).
The result channel, and why it is not hidden: code in a process can always reach what its harness holds (frames,
gc, /proc/self/fd), so instead of hiding the channel we made forging it worthless. Everything the sandbox sends is
taken as the program's claims and validated here (JSON lines on a pipe; a probe's first well-formed answer counts;
values rebuilt from builtins; sizes and hash collisions capped). Expected values, comparisons and grading never
enter the sandbox, so code that takes over the harness, rewrites its frames, patches `builtins.eval` or writes its
own lines on the result fd can only claim a plain value for a probe, which is what returning that value does:
passing still takes the right answer to each probe's input. (A test that passes its expected value into the
program, `check(f(2), 4)`, shows it to the program: write `f(2) == 4`.)

The boundary is bubblewrap (`sandbox="bwrap"`, the default; `apt-get install bubblewrap`): the interpreter runs
as `python -I -S` (stdlib only) in new user, PID, network, IPC, UTS, mount and cgroup namespaces, as uid/gid 65534
with no capabilities and no further user namespaces (`--disable-userns`), `--new-session`, `--die-with-parent`,
`--clearenv`. Its filesystem is a read-only view of the interpreter, its standard library and the shared libraries
(`/usr/lib*`), a fresh `/proc` of its own PID namespace, a minimal `/dev`, and a private tmpfs (32 MiB) as
cwd/HOME/TMPDIR; no `/bin/sh`, no host `/tmp`, no repo, no data. Killing it at the wall-clock limit (or after it
exits) ends its PID namespace, so no child outlives the call. Where bwrap cannot start, `check_sandbox` says so.

`sandbox="process"` (`rewards.sandbox=process`) is the old child process without namespaces: NOT safe for
untrusted code. As root its code can undo the Python guards (`del sys.modules["posix"]`) and then write files,
signal the trainer, read `/proc/<trainer>/environ` or leave a `setsid` child behind.

In both modes, inside the child: rlimits RLIMIT_CPU (soft = ceil(cpu_seconds), hard one second later),
RLIMIT_AS (memory_mb), RLIMIT_FSIZE (1 MiB per file), RLIMIT_NOFILE (16), RLIMIT_CORE (0), RLIMIT_NPROC (0; not
enforced for root's uid, which the bwrap sandbox maps to when the trainer is root); a wall-clock SIGKILL of the
whole process group; stdin at /dev/null; and Python-level guards kept as defence in depth (sockets, writes outside
the cwd, fork/exec/kill raise PermissionError; ctypes cannot be imported).

Not defended: the kernel itself (a kernel exploit escapes any namespace), and load on the machine during the
wall-clock limit (no cgroup: CPU of several processes, their memory up to memory_mb each, the tmpfs).
POSIX only (uses `resource`); bwrap needs Linux with user namespaces (root, or unprivileged ones enabled).
"""

from __future__ import annotations

import ast
import functools
import json
import marshal
import math
import operator
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mrl.config import Sandbox, UserError

__all__ = ["SandboxLimits", "TestOutcome", "SandboxResult", "SandboxUnavailable", "run_tests", "run_tests_many",
           "check_sandbox", "sandbox_name", "test_error", "passes_if_every_probe_returns", "SANDBOXES", "SAFE_FUNCS",
           "MATH", "RUNNER"]

SANDBOXES = tuple(s.value for s in Sandbox)
FILE_SIZE_LIMIT = 1 << 20  # RLIMIT_FSIZE for files the code writes inside its directory
OPEN_FILES_LIMIT = 16  # RLIMIT_NOFILE
TMPFS_BYTES = 32 << 20  # size of the bwrap sandbox's private /tmp
SANDBOX_ID = 65534  # uid and gid inside the bwrap sandbox ("nobody")
STATUSES = ("ok", "timeout", "memory", "crashed", "syntax_error")
INSTALL_HINT = "apt-get install bubblewrap"


class SandboxUnavailable(UserError):
    """The sandbox asked for cannot run here (bwrap missing, or namespaces refused by the kernel or container)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 2.0  # RLIMIT_CPU (rounded up to whole seconds, at least 1)
    wall_seconds: float = 5.0  # the whole process group is killed after this
    memory_mb: int = 256  # RLIMIT_AS (address space)
    max_output_bytes: int = 65536  # stdout/stderr are each captured up to this; the rest is drained and dropped
    max_value_bytes: int = 1 << 20  # a probe's value (as JSON) or an I/O test's stdout larger than this fails the test


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


# ------------------------------------------------------------------------ tests: parsed and graded in the trainer

MAX_ITEMS = 10**6  # a sequence the trainer builds while grading (repetition, range) may not be longer than this
MAX_DEPTH = 100  # nesting of a plain value
HEX_INT = re.compile(r"-?[0-9a-f]+")  # an int of 64+ bits comes back as {"int": hex}; int(x, 16) alone takes "0x_1"


def _range(*args):
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise ValueError(f"range longer than {MAX_ITEMS} in a test")
    return r


def _sum(iterable, start=0):
    if type(start) not in (int, float):  # sum(lists, []) is quadratic
        raise TypeError("sum() in a test takes numbers only")
    return sum(iterable, start)


# Builtins a test may call on the program's values; none runs code of the program, none can blow up in size.
SAFE_FUNCS = {f.__name__.lstrip("_"): f for f in (
    abs, all, any, bool, chr, dict, divmod, enumerate, float, frozenset, int, isinstance, len, list, max, min, ord,
    _range, repr, reversed, round, set, sorted, str, _sum, tuple, type, zip)}
MATH = {name: getattr(math, name) for name in (
    "isclose", "isnan", "isinf", "isfinite", "sqrt", "floor", "ceil", "fabs", "trunc", "log", "log2", "log10", "exp",
    "gcd", "pi", "e", "tau", "inf", "nan")}
SEQUENCES = (str, bytes, list, tuple)


def _mul(a, b):
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, SEQUENCES) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
            raise ValueError(f"a sequence longer than {MAX_ITEMS} in a test")
    return a * b


def _mod(a, b):
    if isinstance(a, (str, bytes)):  # "%*d" % (10**9, 1) would be a gigabyte
        raise TypeError("string formatting with % is not supported in tests")
    return a % b


def _pow(a, b):
    if not all(type(x) in (int, float, bool) for x in (a, b)):
        raise TypeError("** in a test takes numbers only")
    if isinstance(b, int) and isinstance(a, int) and (abs(b) > 10_000 or a.bit_length() * abs(b) > 10**6):
        raise ValueError("** in a test: result too large")
    return a ** b


BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: _mod, ast.Pow: _pow, ast.BitAnd: operator.and_,
          ast.BitOr: operator.or_, ast.BitXor: operator.xor}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class _Unsupported(Exception):
    pass


class _ProbeFailed(Exception):
    """A probe the test needs raised in the sandbox (or returned something that is not plain data)."""


@dataclass(frozen=True)
class _Expr:
    node: ast.expr
    probes: tuple  # the ast nodes evaluated in the sandbox, in evaluation order
    sources: tuple  # their source text


@dataclass(frozen=True)
class _IO:
    stdin: str
    stdout: str


@dataclass(frozen=True)
class _Bad:
    error: str  # SyntaxError | UnsupportedTest


def _is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math" and (
        node.attr in MATH)


def _plan(node: ast.AST, probes: list) -> None:
    """Check that the trainer can evaluate `node` once its probes are known, and collect the probes."""
    if isinstance(node, ast.Constant):
        return
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        children = node.elts
    elif isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _Unsupported
        children = node.keys + node.values
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        children = [node.operand]
    elif isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
        children = [node.left, node.right]
    elif isinstance(node, ast.BoolOp):
        children = node.values
    elif isinstance(node, ast.Compare):
        children = [node.left, *node.comparators]
    elif isinstance(node, ast.IfExp):
        children = [node.test, node.body, node.orelse]
    elif isinstance(node, ast.Subscript):
        children = [node.value, node.slice]
    elif isinstance(node, ast.Slice):
        children = [c for c in (node.lower, node.upper, node.step) if c is not None]
    elif isinstance(node, ast.Call) and ((isinstance(node.func, ast.Name) and node.func.id in SAFE_FUNCS)
                                         or (_is_math(node.func) and callable(MATH[node.func.attr]))):
        if any(k.arg is None for k in node.keywords):
            raise _Unsupported
        children = node.args + [k.value for k in node.keywords]
    elif _is_math(node) or (isinstance(node, ast.Name) and node.id in SAFE_FUNCS):
        return
    elif isinstance(node, (ast.Call, ast.Attribute, ast.Name)):
        # The program's part: evaluated in the sandbox, its value comes back as plain data.  A call's arguments go
        # with it (they are the program's input).  Something that names nothing of the program would be the test's
        # own logic (`"ab".upper()`): the trainer does not hand that to the sandbox.
        if not any(isinstance(n, ast.Name) and n.id not in SAFE_FUNCS and n.id != "math" for n in ast.walk(node)):
            raise _Unsupported
        probes.append(node)
        return
    else:
        raise _Unsupported
    for child in children:
        if isinstance(child, ast.Starred):
            raise _Unsupported
        _plan(child, probes)


@functools.lru_cache(maxsize=16384)
def _parse_source(source: str) -> _Expr | _Bad:
    source = source.strip()
    try:
        node = ast.parse(source, "<test>", mode="eval").body
    except SyntaxError:
        try:
            body = ast.parse(source, "<test>", mode="exec").body
        except (SyntaxError, ValueError):
            return _Bad("SyntaxError")
        if len(body) != 1 or not isinstance(body[0], ast.Assert):
            return _Bad("SyntaxError")
        node = body[0].test
    except (ValueError, RecursionError, MemoryError):  # NUL bytes, absurd nesting
        return _Bad("SyntaxError")
    probes: list = []
    try:
        _plan(node, probes)
        return _Expr(node, tuple(probes), tuple(ast.unparse(p) for p in probes))
    except (_Unsupported, RecursionError):
        return _Bad("UnsupportedTest")


def test_error(test: str | dict) -> str | None:
    """None when the trainer can grade `test`, else the error each of its runs would fail with: "SyntaxError" or
    "UnsupportedTest" (for a task to refuse such a test when it loads, rather than score 0 on it)."""
    parsed = _parse_test(test)
    return parsed.error if isinstance(parsed, _Bad) else None


test_error.__test__ = False  # not a pytest test


def passes_if_every_probe_returns(test: str, value: object) -> bool:
    """Whether the expression test `test` would pass if every call into the program returned `value` (graded here,
    nothing runs): `passes_if_every_probe_returns("f([]) == None", None)` -> True.  For a task to find the tests a
    trivial answer (a `pass` body) passes; False for an I/O test or one the trainer cannot grade."""
    parsed = _parse_test(test)
    return isinstance(parsed, _Expr) and _grade(parsed, [("v", value)] * len(parsed.probes)).passed


def _parse_test(test: str | dict) -> _Expr | _IO | _Bad:
    if isinstance(test, dict):
        return _IO(test["stdin"], test["stdout"])
    return _parse_source(test)


def _evaluate(node: ast.AST, values: dict):
    """Evaluate a planned test expression; `values` maps id(probe node) -> ("v", value) | ("e", error name)."""
    found = values.get(id(node))
    if found is not None:
        kind, value = found
        if kind == "e":
            raise _ProbeFailed(value)
        return value
    ev = functools.partial(_evaluate, values=values)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [ev(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(ev(e) for e in node.elts)
    if isinstance(node, ast.Set):
        return {ev(e) for e in node.elts}
    if isinstance(node, ast.Dict):
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp):
        return BINOPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        for value_node in node.values:
            value = ev(value_node)
            if bool(value) != is_and:
                return value
        return value
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Subscript):
        return ev(node.value)[ev(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if c is None else ev(c) for c in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        func = MATH[node.func.attr] if isinstance(node.func, ast.Attribute) else SAFE_FUNCS[node.func.id]
        return func(*(ev(a) for a in node.args), **{k.arg: ev(k.value) for k in node.keywords})
    if isinstance(node, ast.Attribute):
        return MATH[node.attr]
    if isinstance(node, ast.Name):
        return SAFE_FUNCS[node.id]
    raise AssertionError(f"unplanned node {type(node).__name__}")  # _plan admits nothing else


def _grade(test: _Expr, results: list) -> TestOutcome:
    values = {id(node): result for node, result in zip(test.probes, results)}
    try:
        return TestOutcome(bool(_evaluate(test.node, values)), None)
    except _ProbeFailed as failed:
        return TestOutcome(False, str(failed))
    except Exception as exc:  # the test itself raised on plain data: TypeError, ZeroDivisionError, RecursionError...
        return TestOutcome(False, type(exc).__name__)


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


# ------------------------------------------------------- plain data: encoded in the sandbox, decoded in the trainer

class _NotPlain(Exception):
    pass


def _reject_constant(name: str):
    raise _NotPlain(name)  # NaN / Infinity tokens: the encoder writes {"float": "nan"} instead


def _hashed(keys: list) -> list:
    """Refuse keys built to collide: ints, floats and tuples hash the same in every process, and a set of 50,000
    equal-hash keys would take the trainer minutes to build.  (Only equal full hashes make long probe chains.)"""
    if len(keys) > 1000 and len({hash(k) for k in keys}) < len(keys) // 2:
        raise _NotPlain("keys with colliding hashes")
    return keys


def _decode(x, depth: int = 0):
    """The sandbox's JSON -> a value built only from builtins; anything unexpected raises _NotPlain."""
    if depth > MAX_DEPTH:
        raise _NotPlain("too deep")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_decode(v, depth + 1) for v in x]
    if type(x) is dict and len(x) == 1:
        (tag, body), = x.items()
        try:
            if tag in ("tuple", "set", "frozenset") and type(body) is list:
                items = [_decode(v, depth + 1) for v in body]
                return tuple(items) if tag == "tuple" else {"set": set, "frozenset": frozenset}[tag](_hashed(items))
            if tag == "dict" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
                keys = _hashed([_decode(k, depth + 1) for k, _ in body])
                return dict(zip(keys, (_decode(v, depth + 1) for _, v in body)))
            if tag == "bytes" and type(body) is str:
                return bytes.fromhex(body)
            if tag == "int" and type(body) is str and HEX_INT.fullmatch(body):
                return int(body, 16)  # base 16 is linear and exempt from the int-str limit; the result cap bounds it
            if tag == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if tag == "complex" and type(body) is list and len(body) == 2:
                re, im = (_decode(v, depth + 1) for v in body)
                if type(re) is float and type(im) is float:
                    return complex(re, im)
        except (TypeError, ValueError) as exc:  # an unhashable set element or dict key, bad hex
            raise _NotPlain(str(exc)) from None
    raise _NotPlain(f"not plain data: {type(x).__name__}")


# --------------------------------------------------------------------------- the child program (untrusted side)

# Run as `python -I -S -c RUNNER <result fd>`. It reads {"code", "probes", "io", "load", "limits"} from stdin
# (marshal: the same interpreter writes it, and only the untrusted side parses it), then writes one JSON line per
# event to the result fd:
#   {"ev": "syntax_error"} | {"ev": "load_error", "e": name} | {"ev": "loaded"}
#   {"p": k, "v": value} | {"p": k, "e": name}          probe k's value (tagged JSON, see `enc`) or exception name
#   {"io": j, "out": stdout, "e": name | null}          I/O run j
#   {"ev": "done"}
# Nothing here is trusted: the trainer validates every line, and nothing here knows what a right answer is.
RUNNER = r'''
import sys

def _main():
    import builtins, io, _io, marshal, os, posix, resource, signal, socket, _socket, subprocess, _posixsubprocess
    from _json import encode_basestring_ascii as qstr  # not `json`: its import (and re's) is a third of start-up

    rfd = int(sys.argv[1])
    data = marshal.loads(sys.stdin.buffer.read())
    code, probes, runs, lim = data["code"], data["probes"], data["io"], data["limits"]
    max_value = int(lim["value"])
    write, exit_now, _type, _repr, _len = os.write, os._exit, type, repr, len
    int_repr, int_format, bit_length, float_repr = int.__repr__, int.__format__, int.bit_length, float.__repr__

    def ename(exc):
        try:
            name = type(exc).__name__
            name = "".join(c for c in str(name) if c.isascii() and (c.isalnum() or c in "_."))[:100]
        except BaseException:
            name = ""
        return name or "Exception"

    def emit(text):
        try:
            write(rfd, (text + "\n").encode("ascii"))
        except BaseException:
            pass

    if lim["netns"]:  # process mode: a private network namespace where the kernel allows it (best effort)
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

    # ---- Python-level guards (defence in depth only; the boundary is the OS sandbox) ----
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
    builtins.exit = builtins.quit = sys.exit  # `site` (not loaded under -S) would define them

    # ---- plain data -> tagged JSON: exact builtin types only, so no code of the program runs here ----
    class NotPlain(Exception):
        pass

    class TooLarge(Exception):
        pass

    def enc(v, out, depth):
        t = _type(v)
        if depth > 100:
            raise NotPlain()
        if v is None:
            out.append("null")
        elif t is bool:
            out.append("true" if v else "false")
        elif t is int:
            bits = bit_length(v)
            if bits < 64:
                out.append(int_repr(v))
            elif bits // 4 > max_value:  # before formatting it: the hex text alone would be over the cap
                raise TooLarge()
            else:  # hex: linear time and free of the int-str limit (math.factorial(2000) has 5,736 digits)
                out.append('{"int":"%s"}' % int_format(v, "x"))
        elif t is float:
            out.append(float_repr(v) if v - v == 0 else '{"float":"%s"}' % float_repr(v))
        elif t is str:
            out.append(qstr(v))
        elif t is list or t is tuple or t is set or t is frozenset:
            out.append("[" if t is list else '{"%s":[' % t.__name__)
            for i, item in enumerate(list(v)):
                if i:
                    out.append(",")
                enc(item, out, depth + 1)
            out.append("]" if t is list else "]}")
        elif t is dict:
            out.append('{"dict":[')
            for i, (key, item) in enumerate(list(v.items())):
                out.append(",[" if i else "[")
                enc(key, out, depth + 1)
                out.append(",")
                enc(item, out, depth + 1)
                out.append("]")
            out.append("]}")
        elif t is bytes:
            out.append('{"bytes":"%s"}' % v.hex())
        elif t is complex:
            out.append('{"complex":[')
            enc(v.real, out, depth + 1)
            out.append(",")
            enc(v.imag, out, depth + 1)
            out.append("]}")
        else:
            raise NotPlain()
        if _len(out) > max_value:  # pieces are at least one character each
            raise TooLarge()

    def encode(v):
        out = []
        enc(v, out, 0)
        text = "".join(out)
        if _len(text) > max_value:
            raise TooLarge()
        return text

    # ---- run the code, then the probes, then the I/O runs ----
    try:
        compiled = compile(code, "<solution>", "exec")
    except (SyntaxError, ValueError):
        emit('{"ev":"syntax_error"}')
        exit_now(0)
    except BaseException as exc:
        emit('{"ev":"load_error","e":"%s"}' % ename(exc))
        exit_now(0)
    if data["load"]:
        namespace = {"__name__": "__solution__", "__builtins__": builtins}
        try:
            exec(compiled, namespace)
            loaded = True
        except BaseException as exc:
            loaded = False
            emit('{"ev":"load_error","e":"%s"}' % ename(exc))
        if loaded:
            emit('{"ev":"loaded"}')
            for k, source in enumerate(probes):
                try:
                    value = eval(compile(source, "<test>", "eval"), namespace)
                except BaseException as exc:
                    emit('{"p":%d,"e":"%s"}' % (k, ename(exc)))
                    continue
                try:
                    emit('{"p":%d,"v":%s}' % (k, encode(value)))
                except TooLarge:
                    emit('{"p":%d,"e":"ValueTooLarge"}' % k)
                except BaseException:
                    emit('{"p":%d,"e":"NotPlainData"}' % k)
    for j, stdin in enumerate(runs):
        class Keep(io.BytesIO):
            def close(self):
                pass
        buf = Keep()
        saved = sys.stdin, sys.stdout
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8")), encoding="utf-8")
        sys.stdout = wrapper = io.TextIOWrapper(buf, encoding="utf-8", errors="replace")
        err = "null"
        try:
            exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as exc:
            if exc.code not in (None, 0):
                err = '"SystemExit"'
        except BaseException as exc:
            err = '"%s"' % ename(exc)
        try:
            wrapper.flush()
        except BaseException:
            pass
        sys.stdin, sys.stdout = saved
        out = qstr(buf.getvalue()[:max_value + 1].decode("utf-8", "replace"))
        if _len(out) > max_value:
            out, err = '""', '"ValueTooLarge"'
        emit('{"io":%d,"out":%s,"e":%s}' % (j, out, err))
    emit('{"ev":"done"}')
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    exit_now(0)

_main()
'''


# ----------------------------------------------------------------------------------------------- the launchers

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


@functools.lru_cache(maxsize=1)
def _bwrap_base() -> tuple[str, ...]:
    """The bwrap command line up to the interpreter; raises SandboxUnavailable where bwrap is not installed."""
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
    args += _python_mounts()
    args += ["--proc", "/proc", "--dev", "/dev"]
    if "--size" in helptext:
        args += ["--size", str(TMPFS_BYTES)]
    args += ["--tmpfs", "/tmp", "--chdir", "/tmp", "--"]
    return tuple(args)


def check_sandbox(sandbox: str = "bwrap") -> None:
    """Raise SandboxUnavailable (one line: why, and the fix) unless `sandbox` (a name, or the config's enum) can run
    a program here; ValueError for an unknown name."""
    _check_runs(sandbox_name(sandbox))


@functools.lru_cache(maxsize=None)
def _check_runs(sandbox: str) -> None:
    """check_sandbox's test of a valid name; cached, so that a run pays for it once."""
    if sandbox == "process":
        return
    _bwrap_base()
    result = _run("print(6 * 7)", [], SandboxLimits(wall_seconds=30), "bwrap")
    if result.status != "ok" or result.stdout != "42\n":
        reason = (result.stderr.strip().splitlines() or [f"status {result.status}"])[-1]
        raise SandboxUnavailable(
            f"bubblewrap cannot start the code sandbox here ({reason}); it needs user namespaces: run as root, "
            "enable unprivileged ones (sysctl kernel.unprivileged_userns_clone=1) or allow them in the container "
            "(or set rewards.sandbox=process: unsafe for untrusted code)")


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


@dataclass
class _Reply:
    header: str | None = None  # loaded | load_error | syntax_error
    load_error: str | None = None
    probes: dict = field(default_factory=dict)  # k -> ("v", value) | ("e", name)
    io: dict = field(default_factory=dict)  # j -> (stdout, error name | None)


def _parse(raw: bytes, n_probes: int, n_io: int) -> _Reply:
    """Result lines -> the sandbox's claims; malformed lines, bad indices and repeats are ignored."""
    reply = _Reply()
    for line in raw.split(b"\n"):
        try:
            msg = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError, _NotPlain):
            continue
        if type(msg) is not dict:
            continue
        ev, k, j = msg.get("ev"), msg.get("p"), msg.get("io")
        if reply.header is None and ev in ("loaded", "syntax_error", "load_error"):
            reply.header = ev
            if ev == "load_error":
                reply.load_error = msg.get("e") if type(msg.get("e")) is str else "Exception"
        elif type(k) is int and 0 <= k < n_probes and k not in reply.probes:
            if type(msg.get("e")) is str:
                reply.probes[k] = ("e", msg["e"])
            elif "v" in msg:
                try:
                    reply.probes[k] = ("v", _decode(msg["v"]))
                except (_NotPlain, RecursionError):
                    reply.probes[k] = ("e", "NotPlainData")
        elif type(j) is int and 0 <= j < n_io and j not in reply.io and type(msg.get("out")) is str:
            err = msg.get("e")
            reply.io[j] = (msg["out"], err if type(err) is str else None)
    return reply


def run_tests(code: str, tests: list, limits: SandboxLimits = SandboxLimits(),
              sandbox: str = "bwrap") -> SandboxResult:
    """Run `code` in a sandboxed child process and grade it on `tests` here (see the module docstring).

    A test passes when it evaluates truthy on the program's plain values (or, an I/O test, when the program's
    stdout matches); one that raises fails with the exception class name as error. If the child dies or runs out
    of time, every test not yet answered fails with the status as error. Bad arguments raise ValueError; a sandbox
    that cannot start raises SandboxUnavailable; failing to start a process at all (OSError) propagates.
    """
    _validate(code, tests, limits)
    sandbox = sandbox_name(sandbox)
    _check_runs(sandbox)
    return _run(code, list(tests), limits, sandbox)


def _run(code: str, tests: list, limits: SandboxLimits, sandbox: str) -> SandboxResult:
    parsed = [_parse_test(t) for t in tests]
    probe_slices, io_indices, sources, stdins = [], [], [], []  # per test: its probes, its stdin's index
    for p in parsed:
        start = len(sources)
        if isinstance(p, _Expr):
            sources.extend(p.sources)
        elif isinstance(p, _IO):
            stdins.append(p.stdin)
        probe_slices.append(slice(start, len(sources)))
        io_indices.append(len(stdins) - 1 if isinstance(p, _IO) else None)
    load = any(isinstance(p, _Expr) for p in parsed) or not stdins
    cpu = max(1, math.ceil(limits.cpu_seconds))
    payload = marshal.dumps({"code": code, "probes": sources, "io": stdins, "load": load, "limits": {
        "cpu": cpu, "mem": int(limits.memory_mb * 1024 * 1024), "fsize": FILE_SIZE_LIMIT, "nofile": OPEN_FILES_LIMIT,
        "value": int(limits.max_value_bytes), "netns": sandbox == "process",
    }})
    cap = int(limits.max_output_bytes)
    result_cap = 4096 + (256 + int(limits.max_value_bytes)) * (len(sources) + len(stdins))

    with tempfile.TemporaryDirectory(prefix="mrl_sandbox_", ignore_cleanup_errors=True) as tmp:
        rfd, wfd = os.pipe()
        if sandbox == "bwrap":
            argv = [*_bwrap_base(), _interpreter(), "-I", "-S", "-c", RUNNER, str(wfd)]
            env, cwd = {}, "/"  # nothing of the trainer's environment, not even in bwrap's own /proc/1/environ
        else:
            argv = [_interpreter(), "-I", "-S", "-c", RUNNER, str(wfd)]
            env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            cwd = tmp
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=cwd, env=env, start_new_session=True, close_fds=True, pass_fds=(wfd,))
        except BaseException:
            os.close(rfd)
            raise
        finally:
            os.close(wfd)
        deadline = time.monotonic() + float(limits.wall_seconds)
        try:
            bufs, timed_out = _pump(proc, rfd, payload, deadline, cap, result_cap)
            if not timed_out:
                timed_out = not _wait_exit(proc.pid, deadline)
        finally:
            # Kill the whole group before reaping the leader, so its id cannot have been reused by then.  Under
            # bwrap this ends the sandbox's PID namespace (--die-with-parent), and with it every process inside.
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
    if sandbox == "bwrap" and rc is not None and 128 < rc < 128 + 65:  # bwrap exits 128 + N when N killed its child
        rc = 128 - rc
    reply = _parse(raw_res, len(sources), len(stdins))
    complete = len(reply.io) == len(stdins) and (
        not load or reply.header in ("load_error", "syntax_error")
        or (reply.header == "loaded" and len(reply.probes) == len(sources)))
    errors = [e for kind, e in reply.probes.values() if kind == "e"] + [e for _, e in reply.io.values()]
    if reply.header == "syntax_error":
        status = "syntax_error"
    elif complete:
        status = "memory" if "MemoryError" in errors + [reply.load_error] else "ok"
    else:
        signum = -rc if rc is not None and rc < 0 else 0
        cpu_used = usage.ru_utime + usage.ru_stime
        if timed_out or signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_used >= cpu - 0.05):
            status = "timeout"
        elif any(s in raw_err for s in (b"MemoryError", b"Cannot allocate memory", b"out of memory")) or (
                "MemoryError" in errors):
            status = "memory"
        else:
            status = "crashed"

    outcomes = []
    for p, probe_slice, io_index in zip(parsed, probe_slices, io_indices):
        if isinstance(p, _Bad):
            outcomes.append(TestOutcome(False, p.error))
        elif status == "syntax_error":
            outcomes.append(TestOutcome(False, "SyntaxError"))
        elif isinstance(p, _IO):
            if io_index in reply.io:
                out, err = reply.io[io_index]
                outcomes.append(TestOutcome(err is None and _same_output(out, p.stdout), err))
            else:
                outcomes.append(TestOutcome(False, status))
        elif reply.header == "load_error":
            outcomes.append(TestOutcome(False, reply.load_error))
        elif reply.header == "loaded" and all(k in reply.probes for k in range(probe_slice.start, probe_slice.stop)):
            outcomes.append(_grade(p, [reply.probes[k] for k in range(probe_slice.start, probe_slice.stop)]))
        else:
            outcomes.append(TestOutcome(False, status))
    return SandboxResult(outcomes=outcomes, status=status, stdout=raw_out.decode("utf-8", "replace"),
                         stderr=raw_err.decode("utf-8", "replace"), returncode=rc)


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
    _check_runs(sandbox)  # once, here, rather than in each thread
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="mrl-sandbox") as pool:
        return list(pool.map(lambda item: _run(item[0], list(item[1]), limits, sandbox), items))
