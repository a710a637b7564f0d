"""Test expressions: a test parsed into probes and evaluated on the plain values the sandbox returned.  Standard
library only.

A test is an expression (`f(2) == 4`, `f('abc').startswith('c')`, `set(f(3)) == {1, 2}`) or an assert statement.
`parse_test` cuts out its *probes*: calls of, and names from, the program (`f(2)`, `f('abc')`, `LIMIT`), which the
sandbox evaluates and returns as tagged JSON (`decode` rebuilds them from builtins only).  Everything around them runs
here, on those values: literals, operators, comparisons, indexing, a few pure builtins (`SAFE_FUNCS`, `MATH`) and the
methods of builtin types that `METHODS` lists (`.startswith`, `.count`, `.keys`, ...): a str subclass whose
`startswith` returns True never gets the chance, since what comes back is a str or a failure.  A method that is not
in `METHODS` (`Solution().twoSum(...)`) is the program's API: the whole call is the probe.

The trainer never runs `grade_wire` itself on what a program returned: mrl.sandbox.grade_processes runs it in a
short-lived trusted subprocess with a time limit (this file, run as a script, is that subprocess: `serve`), because a
value built to collide in hash tables or to make a comparison quadratic would otherwise stall the trainer.  The caps
below (`MAX_ITEMS`, colliding hashes, `**`) make such a value fail quickly; the time limit holds for what they miss.
"""

from __future__ import annotations

import ast
import builtins
import functools
import marshal
import math
import operator
import re
import sys
from dataclasses import dataclass

MAX_ITEMS = 10**6  # a sequence the grader builds (repetition, range) may not be longer than this
MAX_DEPTH = 100  # nesting of a plain value
MAX_SAME_HASH = 8  # distinct keys sharing one full hash in a set or dict: honest data has one or two (-1 and -2)
HEX_INT = re.compile(r"-?[0-9a-f]+")  # an int of 64+ bits comes back as {"int": hex}; int(x, 16) alone takes "0x_1"


class NotPlain(Exception):
    pass


def no_floods(keys: list) -> list:
    """`keys`, unless more than MAX_SAME_HASH distinct ones share a full hash: ints, floats and tuples hash the same
    in every process, and a set of 40,000 equal-hash keys takes half a minute to build.  Linear: each key is compared
    only with the few distinct keys of its hash seen so far."""
    buckets: dict[int, list] = {}
    for key in keys:
        bucket = buckets.setdefault(hash(key), [])
        if not any(key is seen or key == seen for seen in bucket):
            bucket.append(key)
            if len(bucket) > MAX_SAME_HASH:
                raise ValueError("keys with colliding hashes")
    return keys


def _range(*args):
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise ValueError(f"range longer than {MAX_ITEMS} in a test")
    return r


def _sum(iterable, start=0):
    if type(start) not in (int, float):  # sum(lists, []) is quadratic
        raise TypeError("sum() in a test takes numbers only")
    return sum(iterable, start)


def _set(iterable=()):
    return set(no_floods(list(iterable)))


def _frozenset(iterable=()):
    return frozenset(no_floods(list(iterable)))


def _dict(iterable=(), **kwargs):
    pairs = list(iterable.items()) if type(iterable) is dict else [tuple(kv) for kv in iterable]
    no_floods([k for k, _ in pairs])
    return dict(pairs, **kwargs)


# Builtins a test may call on the program's values; none runs code of the program, none can blow up in size.
SAFE_FUNCS = {f.__name__.lstrip("_"): f for f in (
    abs, all, any, bool, chr, _dict, divmod, enumerate, float, _frozenset, int, isinstance, len, list, max, min, ord,
    _range, repr, reversed, round, _set, sorted, str, _sum, tuple, type, zip)}
# A builtin's name as a value (`isinstance(f(1), set)`, `type(f(1)) is dict`) is the builtin; called, it is the above.
NAMES = {name: getattr(builtins, name) for name in SAFE_FUNCS}
MATH = {name: getattr(math, name) for name in (
    "isclose", "isnan", "isinf", "isfinite", "sqrt", "floor", "ceil", "fabs", "trunc", "log", "log2", "log10", "exp",
    "gcd", "pi", "e", "tau", "inf", "nan")}
_TEXT = ("startswith", "endswith", "count", "find", "rfind", "index", "rindex", "lower", "upper", "strip", "lstrip",
         "rstrip", "split", "rsplit", "splitlines", "partition", "rpartition", "removeprefix", "removesuffix",
         "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "istitle", "isascii", "title",
         "capitalize", "swapcase", "replace")
# Methods a test may call on a value the program returned, by the value's exact type; none grows its input more than
# a literal argument does.  Another name is the program's own method, evaluated in the sandbox.
METHODS = {
    str: (*_TEXT, "casefold", "isdecimal", "isnumeric", "isidentifier", "isprintable", "encode"),
    bytes: (*_TEXT, "decode", "hex"),
    list: ("count", "index", "copy"),
    tuple: ("count", "index"),
    dict: ("keys", "values", "items", "get", "copy"),
    set: ("issubset", "issuperset", "isdisjoint", "union", "intersection", "difference", "symmetric_difference",
          "copy"),
    frozenset: ("issubset", "issuperset", "isdisjoint", "union", "intersection", "difference",
                "symmetric_difference", "copy"),
    int: ("bit_length", "conjugate"),
    float: ("is_integer", "conjugate", "hex"),
    complex: ("conjugate",),
}
METHOD_NAMES = frozenset(name for names in METHODS.values() for name in names)
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


class ProbeFailed(Exception):
    """A probe the test needs raised in the sandbox (or returned something that is not plain data)."""


@dataclass(frozen=True)
class Expr:
    node: ast.expr
    probes: tuple  # the ast nodes evaluated in the sandbox, in evaluation order
    sources: tuple  # their source text


@dataclass(frozen=True)
class IO:
    stdin: str
    stdout: str


@dataclass(frozen=True)
class Bad:
    error: str  # SyntaxError | UnsupportedTest


def _is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math" and (
        node.attr in MATH)


def _of_program(node: ast.AST) -> bool:
    """Whether `node` names something of the program (a name that is neither a safe builtin nor `math`)."""
    return any(isinstance(n, ast.Name) and n.id not in SAFE_FUNCS and n.id != "math" for n in ast.walk(node))


def _plan(node: ast.AST, probes: list) -> None:
    """Check that the grader can evaluate `node` once its probes are known, and collect the probes."""
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
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in METHOD_NAMES
          and _of_program(node.func.value)):
        # `f('abc').startswith('c')`: the sandbox returns f('abc'), the method of its builtin type runs here.
        if any(k.arg is None for k in node.keywords):
            raise _Unsupported
        children = [node.func.value, *node.args, *(k.value for k in node.keywords)]
    elif _is_math(node) or (isinstance(node, ast.Name) and node.id in SAFE_FUNCS):
        return
    elif isinstance(node, (ast.Call, ast.Attribute, ast.Name)):
        # The program's part: evaluated in the sandbox, its value comes back as plain data.  A call's arguments go
        # with it (they are the program's input).  Something that names nothing of the program would be the test's
        # own logic (`"ab".upper()`): the trainer does not hand that to the sandbox.
        if not _of_program(node):
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
def parse_source(source: str) -> Expr | Bad:
    source = source.strip()
    try:
        node = ast.parse(source, "<test>", mode="eval").body
    except SyntaxError:
        try:
            body = ast.parse(source, "<test>", mode="exec").body
        except (SyntaxError, ValueError):
            return Bad("SyntaxError")
        if len(body) != 1 or not isinstance(body[0], ast.Assert):
            return Bad("SyntaxError")
        node = body[0].test
    except (ValueError, RecursionError, MemoryError):  # NUL bytes, absurd nesting
        return Bad("SyntaxError")
    probes: list = []
    try:
        _plan(node, probes)
        return Expr(node, tuple(probes), tuple(ast.unparse(p) for p in probes))
    except (_Unsupported, RecursionError):
        return Bad("UnsupportedTest")


def parse_test(test: str | dict) -> Expr | IO | Bad:
    if isinstance(test, dict):
        return IO(test["stdin"], test["stdout"])
    return parse_source(test)


def _method(value, name: str):
    if name not in METHODS.get(type(value), ()):
        raise AttributeError(f"{type(value).__name__} has no method {name} a test may call")
    return getattr(type(value), name).__get__(value)


def _evaluate(node: ast.AST, values: dict):
    """Evaluate a planned test expression; `values` maps id(probe node) -> ("v", value) | ("e", error name)."""
    found = values.get(id(node))
    if found is not None:
        kind, value = found
        if kind == "e":
            raise ProbeFailed(value)
        return value
    ev = functools.partial(_evaluate, values=values)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [ev(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(ev(e) for e in node.elts)
    if isinstance(node, ast.Set):
        return _set(ev(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        keys = no_floods([ev(k) for k in node.keys])
        return dict(zip(keys, (ev(v) for v in node.values)))
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
        if isinstance(node.func, ast.Name):
            func = SAFE_FUNCS[node.func.id]
        elif _is_math(node.func):
            func = MATH[node.func.attr]
        else:
            func = _method(ev(node.func.value), node.func.attr)
        return func(*(ev(a) for a in node.args), **{k.arg: ev(k.value) for k in node.keywords})
    if isinstance(node, ast.Attribute):
        return MATH[node.attr]
    if isinstance(node, ast.Name):
        return NAMES[node.id]
    raise AssertionError(f"unplanned node {type(node).__name__}")  # _plan admits nothing else


def grade(test: Expr, results: list) -> tuple[bool, str | None]:
    """(passed, error) of `test` on its probes' results, ("v", plain value) | ("e", error name) each."""
    values = {id(node): result for node, result in zip(test.probes, results)}
    try:
        return bool(_evaluate(test.node, values)), None
    except ProbeFailed as failed:
        return False, str(failed)
    except Exception as exc:  # the test itself raised on plain data: TypeError, ZeroDivisionError, RecursionError...
        return False, type(exc).__name__


def grade_wire(source: str, results: list) -> tuple[bool, str | None]:
    """`grade` of the expression test `source` on results as they came from the sandbox (values as tagged JSON)."""
    test = parse_source(source)
    if isinstance(test, Bad):
        return False, test.error
    plain = []
    for kind, value in results:
        if kind == "v":
            try:
                value = decode(value)
            except (NotPlain, RecursionError):
                kind, value = "e", "NotPlainData"
        plain.append((kind, value))
    return grade(test, plain)


def same_output(got: str, expected: str) -> bool:
    """An I/O test's verdict: the lines equal once trailing whitespace and trailing blank lines are dropped."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


# ------------------------------------------------------------ plain data: encoded in the sandbox, decoded here

def decode(x, depth: int = 0):
    """The sandbox's tagged JSON (mrl.sandbox.child's `enc`) -> a value built only from builtins; NotPlain else."""
    if depth > MAX_DEPTH:
        raise NotPlain("too deep")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [decode(v, depth + 1) for v in x]
    if type(x) is dict and len(x) == 1:
        (tag, body), = x.items()
        try:
            if tag in ("tuple", "set", "frozenset") and type(body) is list:
                items = [decode(v, depth + 1) for v in body]
                return tuple(items) if tag == "tuple" else {"set": set, "frozenset": frozenset}[tag](no_floods(items))
            if tag == "dict" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
                keys = no_floods([decode(k, depth + 1) for k, _ in body])
                return dict(zip(keys, (decode(v, depth + 1) for _, v in body)))
            if tag == "bytes" and type(body) is str:
                return bytes.fromhex(body)
            if tag == "int" and type(body) is str and HEX_INT.fullmatch(body):
                return int(body, 16)  # base 16 is linear and exempt from the int-str limit; the result cap bounds it
            if tag == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if tag == "complex" and type(body) is list and len(body) == 2:
                re, im = (decode(v, depth + 1) for v in body)
                if type(re) is float and type(im) is float:
                    return complex(re, im)
        except (TypeError, ValueError) as exc:  # an unhashable set element or dict key, colliding keys, bad hex
            raise NotPlain(str(exc)) from None
    raise NotPlain(f"not plain data: {type(x).__name__}")


# ------------------------------------------------------- the grading subprocess (mrl.sandbox.grade_processes)

def serve() -> None:
    """Grade requests from stdin until it closes: each a 4-byte length and a marshalled list of (source, results);
    one line per test, `1` or `0` and the error name or `-`, written as soon as that test is graded."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (GRADER_MEMORY, GRADER_MEMORY))  # a MemoryError fails that test only
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(4):
        for source, results in marshal.loads(stdin.read(int.from_bytes(header, "big"))):
            try:
                passed, error = grade_wire(source, results)
            except BaseException as exc:  # MemoryError while decoding, say: that test fails, the next is graded
                passed, error = False, type(exc).__name__
            stdout.write(b"%d %s\n" % (passed, (error or "-").encode("ascii", "replace")))
            stdout.flush()


GRADER_MEMORY = 4 << 30  # the grading subprocess's address space


if __name__ == "__main__":
    serve()
