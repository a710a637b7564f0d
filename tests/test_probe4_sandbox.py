"""Issue 44's sandbox findings, with their payloads, as the trainer (root in CI) meets them, the Python guards undone
(test_sandbox_escapes.UNDO) so that only bubblewrap and its seccomp filter stand:

- the kernel keyrings: reading a secret from the trainer's session keyring, leaving a key there, linking root's user
  keyring (`_uid.0`) into the sandbox's own: keyctl, add_key and request_key fail with EPERM;
- sockets of every family but AF_UNIX (AF_VSOCK shares the VM's port space; AF_INET, AF_NETLINK, AF_PACKET) fail with
  EPERM, through socket() and socketpair(); AF_UNIX, which multiprocessing uses, still works;
- /proc files that show the host (its kernel command line, its keys) cannot be opened (EACCES: /dev/null is bound
  over each, and /proc's mount allows no device nodes).
"""

from __future__ import annotations

import ctypes
import os
import platform
import secrets

import pytest
from conftest import has_bwrap
from test_sandbox_escapes import UNDO

from mrl.sandbox import SandboxLimits, TestOutcome, run_tests

LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=4.0, memory_mb=256, max_output_bytes=1 << 20)
needs_bwrap = pytest.mark.skipif(not has_bwrap(), reason="bubblewrap is not installed (apt-get install bubblewrap)")
NR = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250},
      "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219}}.get(platform.machine())
needs_nr = pytest.mark.skipif(NR is None, reason="syscall numbers known for x86_64 and aarch64 only")

# Each attempt prints `name: <result>` (a number, or the errno's name); the program ends with f() so that it ran.
ATTEMPTS = UNDO + '''
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    got = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    print(name + ": " + (str(got) if got >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")))
    return got
def sock(name, family, kind=socket.SOCK_STREAM, pair=False):
    try:
        (socket.socketpair(family, kind) if pair else socket.socket(family, kind)).__class__
        print(name + ": OPENED")
    except OSError as e:
        print(name + ": " + errno.errorcode.get(e.errno, str(e.errno)))
def read(name, path):
    try:
        with open(path, "rb") as file:
            print(name + ": " + repr(file.read(200)))
    except OSError as e:
        print(name + ": " + errno.errorcode.get(e.errno, str(e.errno)))
'''


def _attempts(lines: list[str]) -> dict[str, str]:
    res = run_tests(ATTEMPTS + "\n".join(lines) + "\ndef f():\n    return 1\n", ["f() == 1"], LIMITS)
    assert res.outcomes == [TestOutcome(True, None)], res
    return dict(line.split(": ", 1) for line in res.stdout.splitlines() if ": " in line)


def _add_key(description: bytes, payload: bytes, keyring: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(NR["add_key"]), b"user", description, payload, ctypes.c_size_t(len(payload)),
                        ctypes.c_long(keyring))


@needs_bwrap
@needs_nr
def test_probe4_keyrings_are_out_of_reach():
    secret = secrets.token_hex(8).encode()
    name = f"mrl_probe4_{secrets.token_hex(4)}".encode()
    KEY_SPEC_SESSION, KEY_SPEC_USER = -3, -4  # noqa: N806
    assert _add_key(name, secret, KEY_SPEC_SESSION) > 0 or ctypes.get_errno() != 0
    buf = "ctypes.create_string_buffer(256)"
    got = _attempts([
        f"call('session_id', {NR['keyctl']}, 0, {KEY_SPEC_SESSION}, 0)",  # KEYCTL_GET_KEYRING_ID
        f"b = {buf}; k = call('search', {NR['keyctl']}, 10, {KEY_SPEC_SESSION}, b'user', {name!r}, 0)",
        f"k >= 0 and call('read', {NR['keyctl']}, 11, k, b, 256)",  # KEYCTL_READ
        f"call('plant', {NR['add_key']}, b'user', b'mrl_planted', b'x', 1, {KEY_SPEC_SESSION})",
        f"call('root_user', {NR['keyctl']}, 0, {KEY_SPEC_USER}, 0)",
        f"call('find_uid0', {NR['request_key']}, b'keyring', b'_uid.0', 0, 0)",
        f"call('join', {NR['keyctl']}, 1, 0)"])  # KEYCTL_JOIN_SESSION_KEYRING: a fresh one
    assert got == {k: "EPERM" for k in ("session_id", "search", "plant", "root_user", "find_uid0", "join")}, got


@needs_bwrap
def test_probe4_only_unix_sockets():
    got = _attempts(["sock('vsock', 40)", "sock('inet', socket.AF_INET)", "sock('inet6', socket.AF_INET6)",
                     "sock('netlink', socket.AF_NETLINK, socket.SOCK_RAW)", "sock('packet', 17, socket.SOCK_RAW)",
                     "sock('vsock_pair', 40, pair=True)", "sock('unix', socket.AF_UNIX)",
                     "sock('unix_pair', socket.AF_UNIX, pair=True)"])
    assert got == {"vsock": "EPERM", "inet": "EPERM", "inet6": "EPERM", "netlink": "EPERM", "packet": "EPERM",
                   "vsock_pair": "EPERM", "unix": "OPENED", "unix_pair": "OPENED"}, got


@needs_bwrap
def test_probe4_host_proc_files_cannot_be_read():
    files = [f for f in ("cmdline", "keys", "key-users", "kallsyms", "modules", "sched_debug", "timer_list")
             if os.path.exists(f"/proc/{f}")]
    assert "cmdline" in files and "keys" in files
    got = _attempts([f"read({f!r}, '/proc/{f}')" for f in files])
    assert got == {f: "EACCES" for f in files}, got
