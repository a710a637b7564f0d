"""mrl.sandbox: generated code runs in a limited, sandboxed child process and is graded here on plain data; hostile
code fails without side effects.  Escapes and reward fakes have their own file, test_sandbox_escapes.py."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path

import pytest

from mrl.sandbox import SandboxLimits, SandboxResult, TestOutcome, run_tests, run_tests_many

LIMITS = SandboxLimits(cpu_seconds=1.0, wall_seconds=2.0, memory_mb=200, max_output_bytes=1000)
ADD3 = "def f(x):\n    return x + 3\n"


def _escape_path() -> Path:
    return Path(tempfile.gettempdir()) / f"mrl_sandbox_escape_{secrets.token_hex(8)}"


def _child_pids() -> list[int]:
    try:
        import psutil
    except ImportError:  # Linux fallback: direct children from /proc
        pids = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == (
                        os.getpid()):
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
        return pids
    return [p.pid for p in psutil.Process().children(recursive=True)]


def test_correct_code_passes_all_tests():
    res = run_tests(ADD3, ["f(1) == 4", "f(-3) == 0", "f(10) == 13"], LIMITS)
    assert res.status == "ok"
    assert res.outcomes == [TestOutcome(True, None)] * 3
    assert res.pass_rate == 1.0 and res.error_rate == 0.0


def test_wrong_code_partial_pass_rate_and_errors():
    code = "def f(x):\n    return x * 2\n"  # right for f(2) == 4 only
    res = run_tests(code, ["f(2) == 4", "f(3) == 7", "f(0) == 1"], LIMITS)
    assert [o.passed for o in res.outcomes] == [True, False, False]
    assert res.pass_rate == pytest.approx(1 / 3) and res.error_rate == 0.0

    # 'a' * 2 + 1 raises TypeError; g is undefined -> NameError; a broken test expression -> SyntaxError.
    res = run_tests(code, ["f(2) == 4", "f('a') + 1", "g(1)", "f(1) ==", "f(1) == 3"], LIMITS)
    assert res.status == "ok"
    assert [o.error for o in res.outcomes] == [None, "TypeError", "NameError", "SyntaxError", None]
    assert res.pass_rate == pytest.approx(1 / 5) and res.error_rate == pytest.approx(3 / 5)


def test_syntax_error():
    res = run_tests("def f(x) return x", ["f(1) == 1", "True"], LIMITS)
    assert res.status == "syntax_error"
    assert res.outcomes == [TestOutcome(False, "SyntaxError")] * 2
    assert res.pass_rate == 0.0 and res.error_rate == 1.0


def test_exception_at_load_fails_every_test():
    res = run_tests("raise ValueError('boom')", ["True", "True"], LIMITS)
    assert res.status == "ok" and res.outcomes == [TestOutcome(False, "ValueError")] * 2
    res = run_tests("import sys\nsys.exit(0)", ["True"], LIMITS)
    assert res.outcomes == [TestOutcome(False, "SystemExit")]
    res = run_tests("import os\nos._exit(0)", ["True"], LIMITS)  # dies before reporting anything
    assert res.status == "crashed" and res.outcomes == [TestOutcome(False, "crashed")]


@pytest.mark.parametrize("code", ["while True:\n    pass\n", "import time\ntime.sleep(60)\n"], ids=["cpu", "sleep"])
def test_infinite_loop_is_stopped(code):
    start = time.monotonic()
    res = run_tests(code, ["True", "True"], LIMITS)
    assert time.monotonic() - start < LIMITS.wall_seconds + 2
    assert res.status == "timeout"
    assert res.outcomes == [TestOutcome(False, "timeout")] * 2 and res.pass_rate == 0.0


def test_partial_results_survive_a_timeout():
    code = ADD3 + "def spin():\n    while True:\n        pass\n"
    res = run_tests(code, ["f(1) == 4", "spin()", "f(2) == 5"], LIMITS)
    assert res.status == "timeout"
    assert res.outcomes == [TestOutcome(True, None), TestOutcome(False, "timeout"), TestOutcome(False, "timeout")]
    assert res.pass_rate == pytest.approx(1 / 3)


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = [0] * 10**10",
                                  "x = []\nwhile True:\n    x.append(' ' * 10**6)\n",
                                  "def f(x):\n    return len(bytearray(10**10)) > 0\n"])
def test_memory_bomb_fails(code):
    start = time.monotonic()
    res = run_tests(code, ["f(1)" if "def f" in code else "True"], LIMITS)
    assert time.monotonic() - start < LIMITS.wall_seconds + 2
    assert res.status in ("memory", "crashed")
    assert not res.outcomes[0].passed and res.outcomes[0].error in ("MemoryError", "memory", "crashed")
    assert res.pass_rate == 0.0


@pytest.mark.parametrize("code,test", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n", "True"),
    ("import socket\ndef f():\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    return True\n", "f()"),
    ("import socket\ndef f():\n    s = socket.socket()\n    s.connect(('127.0.0.1', 9))\n    return True\n", "f()"),
    ("import _socket\ndef f():\n    return _socket.socket() is not None\n", "f()"),
    ("import urllib.request\ndef f():\n    return urllib.request.urlopen('http://127.0.0.1:9', timeout=1)\n", "f()"),
], ids=["module_level", "in_function", "socket_connect", "raw_socket", "urllib"])
def test_network_is_blocked(code, test):
    res = run_tests(code, [test], LIMITS)
    assert res.pass_rate == 0.0 and res.outcomes[0].error is not None


def test_writing_outside_the_sandbox_fails_and_inside_works():
    # Under bwrap, /tmp is the sandbox's own tmpfs (its cwd): a write there succeeds but never reaches the host.
    # The Python guards refuse the rest.
    target = _escape_path()
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import io\nio.FileIO({str(target)!r}, 'w')",
        f"import os\nos.symlink({tempfile.gettempdir()!r}, 'link')\nopen('link/{target.name}', 'w')",
        f"import os\nos.chdir('/')\nopen({str(target.relative_to('/'))!r}, 'w')",
    ]
    for code in attempts:
        res = run_tests(code, ["True"], LIMITS)
        assert not target.exists(), code
        assert res.outcomes[0].error in ("PermissionError", None) and res.status == "ok", (code, res)
        res = run_tests(code, ["True"], LIMITS, sandbox="process")
        assert res.outcomes == [TestOutcome(False, "PermissionError")], code
        assert not target.exists()

    victim = _escape_path()
    victim.write_text("keep me")
    try:
        res = run_tests(f"import os\nos.remove({str(victim)!r})", ["True"], LIMITS)
        assert res.outcomes[0].error in ("PermissionError", "FileNotFoundError") and victim.read_text() == "keep me"
        res = run_tests(f"import os\nos.remove({str(victim)!r})", ["True"], LIMITS, sandbox="process")
        assert res.outcomes == [TestOutcome(False, "PermissionError")] and victim.read_text() == "keep me"
    finally:
        victim.unlink()

    inside = "import os\nwith open('out.txt', 'w') as fh:\n    fh.write('hello')\nos.makedirs('a/b')\n"
    res = run_tests(inside, ["open('out.txt').read() == 'hello'", "os.path.isdir('a/b')"], LIMITS)
    assert res.status == "ok" and res.pass_rate == 1.0


def test_no_processes_or_signals():
    target = _escape_path()
    attempts = [
        f"import os\nrc = os.system('touch {target}')\n",
        f"import subprocess\nsubprocess.run(['touch', {str(target)!r}])\n",
        f"import os\nos.popen('touch {target}').read()\n",
        f"import os\nos.execv('/usr/bin/touch', ['touch', {str(target)!r}])\n",
        "import os\npid = os.fork()\n",
        "import os\nos.kill(os.getppid(), 0)\n",  # signal 0: harmless even if the guard were missing
    ]
    for code in attempts:
        res = run_tests(code, ["True"], LIMITS)
        assert res.outcomes == [TestOutcome(False, "PermissionError")], code
        assert not target.exists()


def test_output_is_captured_and_capped():
    res = run_tests("import sys\nprint('x' * 5000)\nprint('oops', file=sys.stderr)\n", ["True"], LIMITS)
    assert res.status == "ok" and res.pass_rate == 1.0
    assert res.stdout == "x" * LIMITS.max_output_bytes and res.stderr == "oops\n"


def test_caller_survives_and_no_children_are_left():
    before = set(_child_pids())  # processes other tests started in this runner (none are the sandbox's)
    hostile = ["while True:\n    pass\n", "x = bytearray(10**10)", "import os\nos._exit(1)",
               "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"]
    results = run_tests_many([(code, ["True"]) for code in hostile], LIMITS)
    assert all(r.pass_rate == 0.0 for r in results)
    assert results[0].status == "timeout"
    assert run_tests(ADD3, ["f(1) == 4"], LIMITS).pass_rate == 1.0
    assert set(_child_pids()) - before == set()


def test_run_tests_many_keeps_order():
    items = [(ADD3, ["f(1) == 4", "f(1) == 5"]), ("def f(x):\n    return x + 4\n", ["f(1) == 4", "f(1) == 5"]),
             ("def f(x) return", ["f(1) == 4"]), (ADD3, ["f(0) == 3"])]
    results = run_tests_many(items, LIMITS, max_workers=2)
    assert all(isinstance(r, SandboxResult) for r in results)
    assert [[o.passed for o in r.outcomes] for r in results] == [[True, False], [False, True], [False], [True]]
    assert [r.status for r in results] == ["ok", "ok", "syntax_error", "ok"]
    assert run_tests_many([], LIMITS) == []


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError):
        run_tests(ADD3, "f(1) == 4", LIMITS)
    with pytest.raises(ValueError):
        run_tests(ADD3, ["f(1) == 4", 3], LIMITS)
    with pytest.raises(ValueError):
        run_tests(b"def f(): pass", ["True"], LIMITS)
    with pytest.raises(ValueError):
        run_tests(ADD3, ["True"], SandboxLimits(wall_seconds=0))
    with pytest.raises(ValueError):
        run_tests_many([(ADD3, "True")], LIMITS)
    assert run_tests(ADD3, [], LIMITS).pass_rate == 0.0


# ----------------------------------------------------------------------------------- grading in the trainer

def test_values_come_back_as_plain_data_and_compare_like_python():
    code = ("def f(x):\n    return {'t': (x, [x, 'a']), 's': {x}, 'b': b'\\x00', 'n': None, 'z': 1 + 2j}\n"
            "def g(x):\n    return [x / 2, float('nan'), float('inf'), -0.0, True]\n")
    tests = [
        "f(1) == {'t': (1, [1, 'a']), 's': {1}, 'b': b'\\x00', 'n': None, 'z': 1 + 2j}",
        "f(1)['t'] == [1, [1, 'a']]",  # a tuple is not a list, here as in Python
        "g(3)[0] == 1.5 and g(3)[1] != g(3)[1] and g(3)[2] > 1e308",
        "g(2)[4] is True and g(2)[4] == 1",  # bool stays bool
        "len(f(2)) == 5 and sorted(f(2)) == ['b', 'n', 's', 't', 'z']",
        "math.isclose(g(0.2)[0], 0.1) and abs(g(1)[0] - 0.5) < 1e-9",
        "not g(1)[1] == 0",
    ]
    res = run_tests(code, tests, LIMITS)
    assert [o.passed for o in res.outcomes] == [True, False, True, True, True, True, True], res.outcomes
    assert res.error_rate == 0.0


def test_assert_statements_and_test_forms():
    code = "def is_even(n):\n    return n % 2 == 0\nLIMIT = 10\n"
    tests = ["assert is_even(4)", "assert not is_even(3), 'odd'", "is_even(3)", "LIMIT == 10", "is_even(2) is True",
             "[is_even(i) for i in range(3)] == [True, False, True]",  # a comprehension: unsupported
             "'ab'.upper() == 'AB'",  # the test's own logic, nothing of the program: not sent to the sandbox
             "assert is_even(2)\nassert is_even(4)", "True", "1 / 0"]
    res = run_tests(code, tests, LIMITS)
    assert [(o.passed, o.error) for o in res.outcomes] == [
        (True, None), (True, None), (False, None), (True, None), (True, None), (False, "UnsupportedTest"),
        (False, "UnsupportedTest"), (False, "SyntaxError"), (True, None), (False, "ZeroDivisionError")]


@pytest.mark.parametrize("body,error", [
    ("class A:\n    pass\n\ndef f(x):\n    return A()\n", "NotPlainData"),
    ("class I(int):\n    pass\n\ndef f(x):\n    return I(4)\n", "NotPlainData"),
    ("def f(x):\n    return [1, [2, (3, {4: print})]]\n", "NotPlainData"),
    ("def f(x):\n    a = []\n    a.append(a)\n    return a\n", "NotPlainData"),  # recursive: too deep
    ("def f(x):\n    return 'x' * 2_000_000\n", "ValueTooLarge"),
    ("def f(x):\n    return x.missing\n", "AttributeError"),
])
def test_a_value_that_is_not_plain_data_fails_the_test(body, error):
    res = run_tests(body, ["f(2) == 4", "f(2) != 4"], LIMITS)
    assert res.status == "ok"
    assert res.outcomes == [TestOutcome(False, error)] * 2


def test_grading_cannot_be_blown_up_by_the_programs_values():
    # Values the program controls reach the trainer's arithmetic: sizes stay bounded there.
    code = "def f(x):\n    return 10 ** 12\n"
    res = run_tests(code, ["'x' * f(1) == 'x'", "2 ** f(1) > 0", "len(range(f(1))) > 0", "sum([[1]], []) == [1]"],
                    LIMITS)
    assert [o.error for o in res.outcomes] == ["ValueError", "ValueError", "ValueError", "TypeError"]


def test_stdin_stdout_tests_compare_the_output_here():
    code = "import sys\na, b = map(int, input().split())\nprint(a + b)\nprint()\n"
    tests = [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "5 5", "stdout": "10  \n\n"},
             {"stdin": "1 1", "stdout": "3"}, {"stdin": "", "stdout": ""}]
    res = run_tests(code, tests, LIMITS)
    assert res.status == "ok"
    assert [(o.passed, o.error) for o in res.outcomes] == [(True, None), (True, None), (False, None),
                                                           (False, "EOFError")]
    exits = "import sys\nprint(sys.stdin.buffer.read().decode().upper(), end='')\nexit(0)\n"
    assert run_tests(exits, [{"stdin": "ab", "stdout": "AB"}], LIMITS).pass_rate == 1.0
    res = run_tests("import sys\nsys.exit(3)", [{"stdin": "", "stdout": ""}], LIMITS)
    assert res.outcomes == [TestOutcome(False, "SystemExit")]
    # Mixed with expressions: the program runs once for the probes and once per I/O test.
    mixed = "def f(x):\n    return x * 2\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    res = run_tests(mixed, ["f(2) == 4", {"stdin": "21", "stdout": "42"}], LIMITS)
    assert res.pass_rate == 1.0 and res.stdout == ""


def _claims(raw: bytes, n_probes: int, n_io: int = 0):
    """The sandbox's result lines as the grader sees them: parsed claims, their values rebuilt from builtins."""
    from mrl.sandbox import expressions, wire

    reply = wire.parse(raw, n_probes, n_io)
    probes = {}
    for k, (kind, value) in reply.probes.items():
        try:
            probes[k] = (kind, expressions.decode(value) if kind == "v" else value)
        except expressions.NotPlain:
            probes[k] = ("e", "NotPlainData")
    return reply, probes


def test_result_lines_are_validated_claims():
    raw = b"\n".join([
        b'{"ev":"loaded"}', b'{"ev":"load_error","e":"X"}',  # the first header counts
        b'{"p":0,"v":{"tuple":[1,2]}}', b'{"p":0,"v":5}',  # the first answer for a probe counts
        b'{"p":1,"v":{"__eq__":true}}', b'{"p":2,"v":NaN}', b'{"p":3,"v":{"set":[[1]]}}',  # not plain data
        b'{"p":9,"v":1}', b'{"p":true,"v":1}', b'not json', b'[1]', b'{"io":0,"out":5}',
        b'{"io":0,"out":"ok","e":1}',
    ])
    reply, probes = _claims(raw, n_probes=4, n_io=1)
    assert reply.header == "loaded"
    assert probes == {0: ("v", (1, 2)), 1: ("e", "NotPlainData"), 3: ("e", "NotPlainData")}
    assert reply.io == {0: ("ok", None)}
    # An error name is echoed in the grader's verdict lines: it is cut down to what a name holds.
    reply, probes = _claims(b'{"ev":"loaded"}\n{"p":0,"e":"Bad\\n1 ok"}', n_probes=1)
    assert probes == {0: ("e", "Bad1ok")}

    # Ints that all hash alike would make building the set quadratic: refused, and quickly.
    colliding = [i * (2**61 - 1) for i in range(50_000)]
    start = time.monotonic()
    _, probes = _claims(json.dumps({"p": 0, "v": {"set": colliding}}).encode(), n_probes=1)
    assert probes == {0: ("e", "NotPlainData")} and time.monotonic() - start < 2
    spread = list(range(50_000))
    assert _claims(json.dumps({"p": 0, "v": {"set": spread}}).encode(), 1)[1] == {0: ("v", set(spread))}


def test_process_sandbox_runs_and_grades_the_same_way():
    res = run_tests(ADD3, ["f(1) == 4", "f(1) == 5", "g(1)"], LIMITS, sandbox="process")
    assert [(o.passed, o.error) for o in res.outcomes] == [(True, None), (False, None), (False, "NameError")]
    with pytest.raises(ValueError):
        run_tests(ADD3, ["True"], LIMITS, sandbox="docker")


def test_missing_bwrap_refuses_in_one_line(monkeypatch):
    from mrl.core.config import UserError
    from mrl.sandbox import SandboxUnavailable, launcher

    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    launcher._bwrap_base.cache_clear()
    launcher.check_runs.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as err:
            run_tests(ADD3, ["f(1) == 4"], LIMITS)
        assert isinstance(err.value, UserError) and "\n" not in str(err.value)
        assert "apt-get install bubblewrap" in str(err.value) and "rewards.sandbox=process" in str(err.value)
        assert run_tests(ADD3, ["f(1) == 4"], LIMITS, sandbox="process").pass_rate == 1.0
    finally:
        launcher._bwrap_base.cache_clear()
        launcher.check_runs.cache_clear()


def test_large_ints_come_back_as_hex_text_and_forged_ones_are_refused():
    import math

    # 2000! has 5,736 digits (over the int-str limit of 4,300): it comes back whole and compares here.
    code = "import math\ndef f(n):\n    return math.factorial(n)\ndef g(n):\n    return 1 << n\n"
    res = run_tests(code, [f"f(2000) % 1000000007 == {math.factorial(2000) % 1_000_000_007}",
                           "f(2000) // 10 ** 5735 == 3", "-g(63) == -9223372036854775808", "g(62) == 2 ** 62",
                           "g(9_000_000) > 0"], LIMITS)
    assert [(o.passed, o.error) for o in res.outcomes] == [(True, None)] * 4 + [(False, "ValueTooLarge")]
    # On the wire: {"int": lowercase hex}; an int body, a 0x prefix or underscores are not plain data.
    raw = b'{"ev":"loaded"}\n{"p":0,"v":{"int":"-ff"}}\n{"p":1,"v":{"int":255}}\n{"p":2,"v":{"int":"0xff"}}\n' \
          b'{"p":3,"v":{"int":"f_f"}}'
    assert _claims(raw, n_probes=4)[1] == {0: ("v", -255), 1: ("e", "NotPlainData"), 2: ("e", "NotPlainData"),
                                           3: ("e", "NotPlainData")}


def test_test_error_and_passes_if_every_probe_returns():
    from mrl.sandbox import passes_if_every_probe_returns, test_error

    assert [test_error(t) for t in ["f(1) == 2", "assert f(1)", "[f(i) for i in x]", "f(", {"stdin": "", "stdout": ""}]
            ] == [None, None, "UnsupportedTest", "SyntaxError", None]
    assert [passes_if_every_probe_returns(t, None) for t in ["f([]) == None", "not f(2)", "f(2) == 0", "len(f(1)) == 0",
                                                             "f(", {"stdin": "", "stdout": ""}]] == [
        True, True, False, False, False, False]
