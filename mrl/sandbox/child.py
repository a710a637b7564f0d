"""The sandbox's child program: untrusted side, standard library only.  Never imported by the trainer.

Run as `python -I -S -c <this file's text> <result fd>` (mrl.sandbox.launcher), inside bubblewrap.  It reads
{"code", "probes", "io", "load", "limits"} from stdin (marshal: the same interpreter writes it, and only this side
parses it), sets its rlimits and the Python guards, runs the program, evaluates each probe (a call into the program,
`f(2)`: never the test around it) and writes one JSON line per event to the result fd:
  {"ev": "syntax_error"} | {"ev": "load_error", "e": name} | {"ev": "loaded"}
  {"p": k, "v": value} | {"p": k, "e": name}          probe k's value (tagged JSON, see `enc`) or exception name
  {"io": j, "out": stdout, "e": name | null}          I/O run j
  {"ev": "done"}
Nothing here is trusted: the trainer validates every line, and nothing here knows what a right answer is.  All of
it lives in one function so that the program it runs finds no module globals of the harness to patch.
"""
import sys


def main():
    import _io
    import _posixsubprocess
    import _socket
    import builtins
    import io
    import marshal
    import os
    import posix
    import resource
    import signal
    import socket
    import subprocess
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


if __name__ == "__main__":
    main()
