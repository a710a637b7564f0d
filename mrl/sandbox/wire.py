"""The wire between the trainer and the sandbox's child: the request it reads, and the result lines it writes.

Request (stdin, marshal): {"code", "probes": [source], "io": [stdin], "load": bool, "limits": {...}}.  Results (a
pipe's fd, one JSON line each): see mrl.sandbox.child.  `parse` reads them as claims: malformed lines, bad indices
and repeats are ignored, a probe's first well-formed answer counts.  Values stay as the tagged JSON they came as:
`json.loads` builds only lists and str-keyed dicts here (str hashes are randomised per process, so they cannot be
made to collide), and mrl.sandbox.expressions rebuilds them into sets and dicts in the grading subprocess, not here.
"""

from __future__ import annotations

import json
import marshal
import re
from dataclasses import dataclass, field


def request(code: str, probes: list[str], stdins: list[str], load: bool, limits: dict) -> bytes:
    return marshal.dumps({"code": code, "probes": probes, "io": stdins, "load": load, "limits": limits})


@dataclass
class Reply:
    header: str | None = None  # loaded | load_error | syntax_error
    load_error: str | None = None
    probes: dict = field(default_factory=dict)  # k -> ("v", tagged JSON) | ("e", name)
    io: dict = field(default_factory=dict)  # j -> (stdout, error name | None)


class _Constant(Exception):
    pass


def _name(claim) -> str:
    """An exception's name as the child claims it, reduced to what a name holds (it is echoed in verdict lines)."""
    return "".join(re.findall(r"[A-Za-z0-9_.]", claim[:100])) or "Exception"


def _reject_constant(name: str):
    raise _Constant(name)  # NaN / Infinity tokens: the encoder writes {"float": "nan"} instead


def parse(raw: bytes, n_probes: int, n_io: int) -> Reply:
    """Result lines -> the sandbox's claims."""
    reply = Reply()
    for line in raw.split(b"\n"):
        try:
            msg = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError, _Constant):
            continue
        if type(msg) is not dict:
            continue
        ev, k, j = msg.get("ev"), msg.get("p"), msg.get("io")
        if reply.header is None and ev in ("loaded", "syntax_error", "load_error"):
            reply.header = ev
            if ev == "load_error":
                reply.load_error = _name(msg["e"]) if type(msg.get("e")) is str else "Exception"
        elif type(k) is int and 0 <= k < n_probes and k not in reply.probes:
            if type(msg.get("e")) is str:
                reply.probes[k] = ("e", _name(msg["e"]))
            elif "v" in msg:
                reply.probes[k] = ("v", msg["v"])
        elif type(j) is int and 0 <= j < n_io and j not in reply.io and type(msg.get("out")) is str:
            err = msg.get("e")
            reply.io[j] = (msg["out"], _name(err) if type(err) is str else None)
    return reply
