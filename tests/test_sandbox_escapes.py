"""Every reward fake and every sandbox escape of issue 10, as the trainer (root in CI) would meet them.

Fakes must score 0 in both sandboxes (grading happens in the trainer; the OS boundary is not what stops them), and
an honest program 1.  Escapes are tried against bubblewrap twice: as written, and after undoing the Python-level
guards (`del sys.modules["posix"]` and re-import), so that only the OS boundary is left.  The process sandbox
(`rewards.sandbox=process`) is shown to fall to the same undo when run as root: that is why it is documented unsafe,
and it proves the undo works, so the bwrap tests are not passing because the guards held.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import has_bwrap

from mrl.core.episode import Episode, Prompt
from mrl.envs.code import TINY_WRAP, BugRatio, PassRate
from mrl.sandbox import SandboxLimits, run_tests

ROOT = Path(__file__).resolve().parent.parent
LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=4.0, memory_mb=256, max_output_bytes=1 << 20)
IS_ROOT = os.geteuid() == 0


needs_bwrap = pytest.mark.skipif(not has_bwrap(), reason="bubblewrap is not installed (apt-get install bubblewrap)")

# Undo the Python guards as the payload does: forget the patched modules and import them afresh.
UNDO = """
import sys, builtins
for _name in [m for m in list(sys.modules) if m.split(".")[0] in (
        "posix", "os", "socket", "_socket", "subprocess", "_posixsubprocess", "signal", "ctypes", "_ctypes", "io",
        "_io", "pathlib", "shutil")]:
    del sys.modules[_name]
import _io, ctypes, os, posix, signal, socket, subprocess
builtins.open = _io.open
"""
PRELUDES = {"as_written": "", "guards_undone": UNDO}


def _host_path(where: str) -> Path:
    base = {"tmp": Path(tempfile.gettempdir()), "repo": ROOT / "tests"}[where]
    return base / f"mrl_escape_{secrets.token_hex(6)}"


def _ok(res) -> bool:
    """The sandboxed program itself ran to the end (so what it tried was really tried)."""
    return res.status == "ok" and res.outcomes[-1].error is None


# ---------------------------------------------------------------------------------------------------- fakes

HONEST = "def f(x):\n    return x * 3\n"
TESTS = ["f(2) == 6", "f(3) == 9", "f(5) == 15"]  # no expected value is 1: True == 1 holds in Python
EQ = "    def __eq__(self, other):\n        return True\n"
ALWAYS_EQ = "class A:\n" + EQ + "    __hash__ = None\n"
FAKES = {
    "eq_always_true": ALWAYS_EQ + "def f(x):\n    return A()\n",
    "int_subclass_eq": "class I(int):\n" + EQ + "\ndef f(x):\n    return I()\n",
    "list_subclass": "class L(list):\n" + EQ + "\ndef f(x):\n    return L()\n",
    "patch_builtins_bool": "import builtins\nbuiltins.bool = lambda *a: True\ndef f(x):\n    return 0\n",
    "patch_builtins_eval": "import builtins\nbuiltins.eval = lambda *a, **k: True\ndef f(x):\n    return 0\n",
    "rewrite_harness_tests": (  # the payload, and the same for any list of str in the caller's frames
        "import sys\nframe = sys._getframe(1)\n"
        "try:\n    frame.f_locals['tests'][:] = ['True'] * len(frame.f_locals['tests'])\nexcept Exception:\n    pass\n"
        "for value in list(frame.f_locals.values()):\n"
        "    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):\n"
        "        value[:] = ['True'] * len(value)\n"
        "def f(x):\n    return 0\n"),
    "rewrite_via_gc": (
        "import gc\nfor obj in gc.get_objects():\n"
        "    if isinstance(obj, list) and obj and all(isinstance(v, str) and '(' in v for v in obj):\n"
        "        obj[:] = ['True'] * len(obj)\n"
        "def f(x):\n    return 0\n"),
    "forge_result_lines": (  # claims on every fd, in the old protocol and the new one, before and after the harness
        "import os\nLINES = b'\\n'.join([b'{\"ev\":\"loaded\"}', b'{\"p\":0,\"v\":{\"__eq__\":true}}', "
        "b'{\"p\":1,\"passed\":true,\"e\":null,\"v\":true}', b'{\"p\":2,\"v\":{\"int\":15}}', "
        "b'{\"i\":0,\"p\":1,\"e\":null}', b'{\"ev\":\"done\"}']) + b'\\n'\n"
        "for fd in range(1, 20):\n    try:\n        os.write(fd, LINES)\n    except OSError:\n        pass\n"
        "def f(x):\n    return None\n"),
    "exit_before_the_tests": "import os\nos._exit(0)\n",
}


@pytest.mark.parametrize("sandbox", ["bwrap", "process"])
@pytest.mark.parametrize("name", sorted(FAKES))
def test_sandbox_fakes_score_zero(name, sandbox):
    if sandbox == "bwrap" and not has_bwrap():
        pytest.skip("bubblewrap is not installed")
    res = run_tests(FAKES[name], TESTS, LIMITS, sandbox=sandbox)
    assert res.pass_rate == 0.0, (name, res)


@pytest.mark.parametrize("sandbox", ["bwrap", "process"])
def test_sandbox_honest_solution_scores_one(sandbox):
    if sandbox == "bwrap" and not has_bwrap():
        pytest.skip("bubblewrap is not installed")
    res = run_tests(HONEST, TESTS + ["assert f(0) == 0", "sorted([f(1), f(-1)]) == [-3, 3]"], LIMITS, sandbox=sandbox)
    assert res.pass_rate == 1.0 and res.error_rate == 0.0 and res.status == "ok"


def test_sandbox_fake_through_the_wrap_template_scores_zero():
    # The built-in task's template, `def f(x): return {completion}`, through the real reward channels.
    prompt = Prompt("x + 3 =", meta={"tests": ["f(4) == 7", "f(0) == 3", "f(3) == 6"], "wrap": TINY_WRAP})
    sandbox = "bwrap" if has_bwrap() else "process"
    channels = dict(cpu_seconds=1.0, wall_seconds=3.0, memory_mb=253, sandbox=sandbox)
    fakes = ["type('A', (), {'__eq__': lambda s, o: True, '__hash__': None})()",
             "type('I', (int,), {'__eq__': lambda s, o: True})(0)",
             "__import__('builtins').__setattr__('bool', lambda *a: True)"]
    episodes = [Episode(prompt=prompt, completion=c, completion_ids=[], num_tokens=3, truncated=False,
                        max_new_tokens=10) for c in fakes + ["x + 3"]]
    assert PassRate(**channels)(episodes) == [0.0, 0.0, 0.0, 1.0]
    assert BugRatio(**channels)(episodes) == [-1.0, -1.0, 0.0, 0.0]  # not plain data counts as a bug


# -------------------------------------------------------------------------------------------------- escapes

def _write_outside(targets: list[Path]) -> str:
    lines = ["import os, subprocess", "def attempt(fn):", "    try:", "        fn()", "    except Exception as e:",
             "        print(type(e).__name__)"]
    for t in targets:
        lines += [f"attempt(lambda: open({str(t)!r}, 'w').write('escaped'))",
                  f"attempt(lambda: os.close(os.open({str(t)!r}, os.O_WRONLY | os.O_CREAT)))"]
    return "\n".join(lines) + "\ndef f():\n    return 1\n"


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_write_outside(prelude):
    stdlib = Path(os.__file__).resolve().parent  # the interpreter's own files are bound read-only
    targets = [_host_path("tmp"), _host_path("repo"), stdlib / f"mrl_escape_{secrets.token_hex(6)}.py"]
    res = run_tests(PRELUDES[prelude] + _write_outside(targets), ["f() == 1"], LIMITS)
    assert _ok(res), res
    for t in targets:
        assert not t.exists(), t


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_shell(prelude):
    target = _host_path("tmp")
    code = PRELUDES[prelude] + "\n".join([
        "import os, subprocess", "def attempt(fn):", "    try:", "        fn()", "    except Exception as e:",
        "        print(type(e).__name__)",
        f"attempt(lambda: subprocess.run(['/bin/sh', '-c', 'echo escaped > {target}']))",
        f"attempt(lambda: os.system('echo escaped > {target}'))",
        "SHELL = os.path.exists('/bin/sh') or os.path.exists('/usr/bin/sh')",
        f"attempt(lambda: os.execv('/bin/sh', ['sh', '-c', 'echo escaped > {target}']))",
        "def f():", "    return SHELL"])
    res = run_tests(code, ["f() == False"], LIMITS)
    assert res.pass_rate == 1.0, res  # there is no shell in the sandbox, and the program went on
    assert not target.exists()


# A stand-in for the trainer: its own session, so that a signal that escaped could not reach pytest or make, and
# its own start, so that a secret can sit in its initial environment (what /proc/<pid>/environ shows).
TRAINER = r"""
import json, os, signal, sys
from mrl.sandbox import SandboxLimits, run_tests
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append("SIGTERM"))
code = sys.argv[1].replace("TRAINER_PID", str(os.getpid()))
res = run_tests(code, ["f() == 1"], SandboxLimits(wall_seconds=4.0, max_output_bytes=1 << 20), sandbox=sys.argv[2])
print(json.dumps({"signals": got, "pass_rate": res.pass_rate, "stdout": res.stdout, "stderr": res.stderr}))
"""
SIGNALS = "\n".join([
    "import os, signal", "def attempt(fn, *args):", "    try:", "        fn(*args)", "    except Exception as e:",
    "        print(type(e).__name__)",
    "for pid in (TRAINER_PID, os.getppid()):",
    "    attempt(os.kill, pid, signal.SIGTERM)",
    "    attempt(os.killpg, pid, signal.SIGTERM)",
    "    attempt(lambda: os.killpg(os.getpgid(pid), signal.SIGTERM))",
    "def f():", "    return 1"])


def _as_trainer(code: str, sandbox: str, **env: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", TRAINER, code, sandbox], capture_output=True, text=True,
                         env=env, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_signal_the_trainer_or_its_group(prelude):
    report = _as_trainer(PRELUDES[prelude] + SIGNALS, "bwrap")
    assert report["signals"] == [], report
    assert report["pass_rate"] == 1.0, report


@pytest.fixture
def listener():
    """A TCP port on the host's loopback, as a local service (or a trainer's RPC port) would be."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def _connections(server: socket.socket) -> int:
    count = 0
    while select.select([server], [], [], 0.2)[0]:
        conn, _ = server.accept()
        conn.close()
        count += 1
    return count


def _connect(port: int) -> str:
    return "\n".join([
        "def connect():", "    try:", "        s = socket.create_connection(('127.0.0.1', %d), timeout=1)" % port,
        "        s.sendall(b'escaped')", "        print('connected')", "    except Exception as e:",
        "        print(type(e).__name__)"])


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_network(prelude, listener):
    port = listener.getsockname()[1]
    code = PRELUDES[prelude] + "import socket\n" + _connect(port) + "\nconnect()\ndef f():\n    return 1\n"
    res = run_tests(code, ["f() == 1"], LIMITS)
    assert _ok(res), res
    assert _connections(listener) == 0 and "connected" not in res.stdout


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_setns_into_the_trainers_network(prelude, listener):
    port = listener.getsockname()[1]
    code = PRELUDES[prelude] + "\n".join([
        "import os, socket", "import ctypes" if prelude == "guards_undone" else "", _connect(port),
        "def enter(path):", "    try:", "        import ctypes",
        "        libc = ctypes.CDLL(None, use_errno=True)", "        fd = os.open(path, os.O_RDONLY)",
        "        if libc.setns(fd, 0x40000000) != 0:", "            raise OSError(ctypes.get_errno(), 'setns')",
        "        print('entered', path)", "        connect()", "    except Exception as e:",
        "        print(type(e).__name__)",
        f"for pid in ({os.getpid()}, os.getppid(), 1):", "    enter('/proc/%d/ns/net' % pid)",
        "def f():", "    return 1"])
    res = run_tests(code, ["f() == 1"], LIMITS)
    assert _ok(res), res
    assert _connections(listener) == 0
    assert "entered" not in res.stdout and "connected" not in res.stdout, res.stdout


ENVIRON = "\n".join([
    "import os", "def read(path):", "    try:", "        with open(path, 'rb') as fh:",
    "            print(path, fh.read().decode('latin-1'))", "    except Exception as e:",
    "        print(path, type(e).__name__)",
    "for pid in ('self', 1, os.getppid(), TRAINER_PID):", "    read('/proc/%s/environ' % pid)",
    "for entry in os.listdir('/proc'):", "    if entry.isdigit():", "        read('/proc/%s/environ' % entry)",
    "print(dict(os.environ))", "def f():", "    return 1"])


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_read_the_trainers_environ(prelude):
    canary = f"mrl-canary-{secrets.token_hex(8)}"
    report = _as_trainer(PRELUDES[prelude] + ENVIRON, "bwrap", MRL_TEST_API_KEY=canary)
    assert report["pass_rate"] == 1.0 and "/proc/self/environ" in report["stdout"], report  # it did look
    assert canary not in report["stdout"] and canary not in report["stderr"]


def _alive(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


@needs_bwrap
@pytest.mark.parametrize("prelude", sorted(PRELUDES))
def test_sandbox_escape_lingering_setsid_child(prelude, tmp_path):
    marker, token = tmp_path / "marker", f"mrl-linger-{secrets.token_hex(6)}"
    late = f"import time; time.sleep(1.5); open({str(marker)!r}, 'w').write('outlived the call')"
    code = PRELUDES[prelude] + "\n".join([
        "import os, sys", "try:", "    if os.fork() == 0:", "        os.setsid()",
        f"        os.execv(sys.executable, [sys.executable, '-S', '-c', {late!r}, {token!r}])",
        "    print('forked')", "except Exception as e:", "    print(type(e).__name__)",
        "def f():", "    return 1"])
    res = run_tests(code, ["f() == 1"], LIMITS)
    assert _ok(res), res
    time.sleep(0.3)
    assert _alive(token) == []
    time.sleep(2.0)
    assert not marker.exists()
    if prelude == "guards_undone":
        assert "forked" in res.stdout  # the child was really started, and died with the sandbox


@needs_bwrap
def test_sandbox_escape_nothing_survives_the_wall_clock_kill():
    # The other path out: the program is still running (and so is its setsid child) when the call gives up on it.
    token = f"mrl-linger-{secrets.token_hex(6)}"
    code = UNDO + "\n".join([
        "import os, sys, time", "if os.fork() == 0:", "    os.setsid()",
        f"    os.execv(sys.executable, [sys.executable, '-S', '-c', 'import time; time.sleep(30)', {token!r}])",
        "time.sleep(30)"])
    start = time.monotonic()
    res = run_tests(code, ["True"], SandboxLimits(cpu_seconds=1, wall_seconds=1.5))
    assert res.status == "timeout" and time.monotonic() - start < 5
    time.sleep(0.3)
    assert _alive(token) == []


@needs_bwrap
def test_sandbox_view_from_inside():
    # What the program sees: uid 65534 without capabilities, its own PID namespace (bwrap's init and itself) and
    # hostname, no shell, no repo, no host /tmp, /etc reduced to the loader's cache, a writable cwd.
    interpreter_top = Path(os.path.realpath(sys.executable)).parts[1]
    code = UNDO + "\n".join([
        "import os, socket",
        "lines = open('/proc/self/status').read().splitlines()",
        "status = dict(line.split(':\\t', 1) for line in lines if ':\\t' in line)",
        "def view():", "    open('scratch.txt', 'w').write('ok')",
        "    return [os.getuid(), os.getgid(), status['CapEff'].strip(), status['CapBnd'].strip(),",
        "            sorted(p for p in os.listdir('/proc') if p.isdigit()), socket.gethostname(),",
        f"            os.path.exists('/bin/sh'), os.path.exists({str(ROOT)!r}), set(os.listdir('/')),",
        "            os.listdir('/etc'), sorted(os.listdir('/tmp')), os.getcwd()]"])
    top = {"tmp", "dev", "proc", "etc", "usr", "lib", "lib64", "lib32", "libx32", interpreter_top}
    no_caps = "0000000000000000"
    res = run_tests(code, [f"view()[:8] == [65534, 65534, {no_caps!r}, {no_caps!r}, ['1', '2'], 'sandbox', False, "
                           "False]", f"view()[8] <= {top!r}",
                           "view()[9:] == [['ld.so.cache'], ['scratch.txt'], '/tmp']"], LIMITS)
    assert res.pass_rate == 1.0, res


# ------------------------------------------------------------------------- the process sandbox is not a boundary

@pytest.mark.skipif(not IS_ROOT, reason="the undo matters as root: RLIMIT_NPROC and file permissions stop others")
def test_sandbox_process_mode_falls_to_the_undo_as_root():
    # Why rewards.sandbox=process is documented unsafe, and proof that UNDO really removes the Python guards (so the
    # bwrap tests above hold because of the OS boundary).
    target = _host_path("tmp")
    try:
        code = UNDO + f"open({str(target)!r}, 'w').write('escaped')\ndef f():\n    return 1\n"
        assert run_tests(code, ["f() == 1"], LIMITS, sandbox="process").pass_rate == 1.0 and target.exists()
    finally:
        target.unlink(missing_ok=True)
    canary = f"mrl-canary-{secrets.token_hex(8)}"
    assert canary in _as_trainer(ENVIRON, "process", MRL_TEST_API_KEY=canary)["stdout"]  # even with the guards
    assert _as_trainer(UNDO + SIGNALS, "process")["signals"] != []
