"""The grading subprocesses: what the program returned is graded outside the trainer, under a time limit.

A value the program controls can make a comparison slow (keys built to share one hash make `set(f(x)) == {...}`
quadratic: 40,000 of them took half a minute) and C code holding the GIL cannot be interrupted in-process.  So
`grade_many` sends the tests and the probes' raw values to a trusted child (`python -I -S`, mrl.sandbox.expressions run
as a script, no code of the program), reads one verdict per test, and a test it has not answered within
`seconds` scores 0 with error "GradeTimeout": that child is killed and a fresh one grades the rest.  Children are
kept between calls (one per concurrent caller), so a run pays their ~20 ms start-up once.
"""

from __future__ import annotations

import marshal
import os
import selectors
import subprocess
import threading
import time
from pathlib import Path

SOURCE = (Path(__file__).with_name("expressions.py")).read_text()
GRADE_SECONDS = 1.0  # one test's grading; honest tests take microseconds
TIMEOUT = "GradeTimeout"
FAILED = "GradeFailed"  # the grading child died (or sent nonsense): that test fails, a fresh child grades the rest


class _Child:
    def __init__(self, interpreter: str):
        self.proc = subprocess.Popen([interpreter, "-I", "-S", "-c", SOURCE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True, env={})
        self.buffer = b""

    def send(self, jobs: list) -> None:
        data = marshal.dumps(jobs)
        self.proc.stdin.write(len(data).to_bytes(4, "big") + data)
        self.proc.stdin.flush()

    def line(self, deadline: float) -> bytes | None:
        """The next verdict line, or None when the deadline passes or the child ends first."""
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


_IDLE: list[_Child] = []
_LOCK = threading.Lock()


def _take(interpreter: str) -> _Child:
    with _LOCK:
        while _IDLE:
            child = _IDLE.pop()
            if child.proc.poll() is None:
                return child
    return _Child(interpreter)


def _give(child: _Child) -> None:
    with _LOCK:
        _IDLE.append(child)


def grade_many(jobs: list[tuple[str, list]], interpreter: str, seconds: float = GRADE_SECONDS,
               budget: float = 10.0) -> list[tuple[bool, str | None]]:
    """(passed, error) for each (expression test's source, its probes' results as sent: ("v", tagged JSON) |
    ("e", name)).  Each test gets `seconds`; all of them together `budget` (then the rest fail with GradeTimeout)."""
    verdicts: list = [None] * len(jobs)
    for i, job in enumerate(jobs):
        try:
            marshal.dumps(job)
        except ValueError:  # nested past marshal's depth: not plain data
            verdicts[i] = (False, "NotPlainData")
    todo = [i for i, v in enumerate(verdicts) if v is None]
    end = time.monotonic() + budget
    while todo:
        if time.monotonic() >= end:
            for i in todo:
                verdicts[i] = (False, TIMEOUT)
            break
        child = _take(interpreter)
        try:
            child.send([jobs[i] for i in todo])
        except OSError:  # it died before reading: that test fails, so that every round makes progress
            child.kill()
            verdicts[todo.pop(0)] = (False, FAILED)
            continue
        while todo:
            line = child.line(min(time.monotonic() + seconds, end))
            verdict = _verdict(line)
            if verdict is None:
                verdict = (False, TIMEOUT if child.proc.poll() is None else FAILED)
                child.kill()
                verdicts[todo.pop(0)] = verdict
                break
            verdicts[todo.pop(0)] = verdict
        else:
            _give(child)
    return verdicts


def _verdict(line: bytes | None) -> tuple[bool, str | None] | None:
    if line is None:
        return None
    passed, _, error = line.decode("ascii", "replace").partition(" ")
    if passed not in ("0", "1") or not error:
        return None
    return passed == "1", None if error == "-" else error
