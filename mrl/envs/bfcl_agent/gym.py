"""BFCL v4 multi-turn: stateful tool environments, their ground truth, and the checks BFCL makes of an agent's calls.

Data: `BFCL_v4_multi_turn_<category>.json` (user turns, each class's `initial_config`), `possible_answer/` (the
ground truth: call strings per user turn) and `multi_turn_func_doc/` (each class's functions) of the installed
`bfcl-eval` package (`make bfcl`), read as files.  The environments are the package's own classes
(`bfcl_eval/eval_checker/multi_turn_eval/func_source_code/`: a file system, a math API, messaging, posting,
ticketing, a trading bot, travel booking, vehicle control; standard library and mpmath only, in memory).

A call is dispatched as a method call on the instance that owns the function, with the parsed arguments: a policy's
JSON arguments, or the ground truth's call strings parsed by `ast` into literals; nothing is ever `eval`ed.  Its
result is BFCL's: a string as it is, a dict as JSON, anything else as `str`, an exception as `Error during
execution: ...`.

`check` grades a call sequence as BFCL's multi-turn checker does (eval_checker/multi_turn_eval/multi_turn_checker.py,
run as an oracle in tests/test_bfcl_agent.py): after every user turn whose ground truth calls something, the policy
made a call in that turn, every instance's public attributes equal the ground truth's, and the ground truth's results
of that turn are among the policy's results so far (as a multiset, any order).  Turns whose ground truth is empty
(a function or parameter is missing) are not checked, as in BFCL, but their calls change the state later turns see.
Beyond BFCL it measures what the other channels need: calls beyond the ground truth's, and collateral damage (a
value of the environment changed that the ground truth never changes; a call to a function not available in that
turn).

Deliberate differences: a JSON number passed for a `float` parameter is a float (JSON does not tell 3 from 3.0, and
it keeps `power(10, 10**9)` from computing a billion-digit integer in the trainer); integers beyond 2**53 are
refused; a call runs at most `CALL_SECONDS` (then it is an error result); mpmath's global precision is restored after
each call.
"""

from __future__ import annotations

import ast
import copy
import decimal
import gc
import importlib
import inspect
import json
import math
import signal
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from mrl.core import safe_json
from mrl.core.config import UserError
from mrl.envs.bfcl.files import data_dir, read_records, tool_schemas

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
# BFCL's other multi-turn-style categories, and why they are not here.
SKIPPED = {"memory": "its tools read and write files of a prerequisite conversation on disk",
           "web_search": "its tools query the network (SerpAPI, web pages)"}
# class -> (module under func_source_code, function doc file): BFCL's constants/executable_backend_config.py
CLASSES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system"),
    "MathAPI": ("math_api", "math_api"),
    "MessageAPI": ("message_api", "message_api"),
    "TwitterAPI": ("posting_api", "posting_api"),
    "TicketAPI": ("ticket_api", "ticket_api"),
    "TradingBot": ("trading_bot", "trading_bot"),
    "TravelAPI": ("travel_booking", "travel_booking"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control"),
}
STATELESS = ("MathAPI",)  # instantiated without a scenario (BFCL's STATELESS_CLASSES)
SOURCE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CALL_SECONDS = 2.0
MAX_INT = 2 ** 53
MAX_PRECISION = 1000  # digits a `precision` argument may ask for (BFCL's ground truth asks for at most 10)
MAX_CALLS = 500  # calls of one episode the checks run (beyond: failed, and a violation)
# The bytes of results one world (an episode) hands out, all calls together: beyond, a result is cut, marked (a
# policy's `find` over a tree it grew with `cp` returned 1.2 GB; BFCL's ground truth stays far below it).
RESULT_BYTES = 1 << 20
RESULTS_CUT = f" ... [cut: this episode's tool results reached {RESULT_BYTES} bytes]"
ADDED_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"  # BFCL's words

Call = tuple[str, dict]  # (function name, arguments by name)


# ---------------------------------------------------------------------------------------------------------- data
def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        skipped = "; ".join(f"{name}: {why}" for name, why in SKIPPED.items())
        raise UserError(f"BFCL multi-turn category {category!r} is not supported; choose from {', '.join(CATEGORIES)} "
                        f"(skipped: {skipped}).")


def load_entries(category: str) -> list[dict]:
    """BFCL's entries of one multi-turn category, each with `ground_truth` (call strings per user turn) and
    `category` set."""
    _check_category(category)
    data = data_dir()
    entries = read_records(data / f"BFCL_v4_{category}.json")
    answers = {r["id"]: r["ground_truth"] for r in read_records(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    for entry in entries:
        entry["ground_truth"] = answers[entry["id"]]
        entry["category"] = category
        unknown = sorted(set(entry["involved_classes"]) - set(CLASSES))
        if unknown:
            raise UserError(f"BFCL entry {entry['id']} uses classes {unknown} mrl does not know; add them to "
                            "mrl.envs.bfcl_agent.gym.CLASSES")
    return entries


@lru_cache(maxsize=None)
def _class_docs(class_name: str) -> tuple[dict, ...]:
    path = data_dir() / "multi_turn_func_doc" / f"{CLASSES[class_name][1]}.json"
    return tuple(read_records(path))


def _withheld(entry: dict) -> set[str]:
    """Functions of a miss_func entry that are added later (`missed_function`: {turn: [names]})."""
    return {name for names in entry.get("missed_function", {}).values() for name in names}


def function_docs(entry: dict, turn: int | None = 0, gold_only: bool = False) -> list[dict]:
    """BFCL's docs of the functions available at user turn `turn` (None: every function the entry ever offers):
    the involved classes' functions but the excluded ones, the withheld ones only from the turn that adds them.
    gold_only: only those the ground truth calls (an easier task: no distractors, a much shorter prompt)."""
    added = {name for t, names in entry.get("missed_function", {}).items() if turn is None or int(t) <= turn
             for name in names}
    hidden = set(entry.get("excluded_function", [])) | (_withheld(entry) - added)
    gold = {parse_call(s)[0] for strings in entry["ground_truth"] for s in strings} if gold_only else None
    return [copy.deepcopy(doc) for c in entry["involved_classes"] for doc in _class_docs(c)
            if doc["name"] not in hidden and (gold is None or doc["name"] in gold)]


def added_docs(entry: dict, turn: int, gold_only: bool = False) -> list[dict]:
    """The docs of the functions user turn `turn` adds (miss_func), or []."""
    names = set(entry.get("missed_function", {}).get(str(turn), []))
    return [doc for doc in function_docs(entry, turn, gold_only) if doc["name"] in names]


def schemas(docs: list[dict], compact: bool = False) -> list[dict]:
    """Function docs as OpenAI-form tool declarations.  compact: each description without the class's preamble
    BFCL repeats in every function ("This tool belongs to ..., which ... Tool description: ..."), about half the
    tokens."""
    if compact:
        docs = [{**d, "description": d.get("description", "").split("Tool description:", 1)[-1].strip()} for d in docs]
    return tool_schemas({"function": docs})


def user_turns(entry: dict) -> list[str]:
    """The user's message of each turn ("" for a miss_func turn that only adds functions)."""
    return ["\n".join(m["content"] for m in turn if m["role"] == "user") for turn in entry["question"]]


# ---------------------------------------------------------------------------------------------------------- calls
def parse_call(text: str) -> tuple[str, list, dict]:
    """(name, positional values, keyword values) of one ground-truth call string, read by `ast` as literals.

    >>> parse_call("mv(source='a.txt', destination='temp')"), parse_call("sort('report.pdf')")
    (('mv', [], {'source': 'a.txt', 'destination': 'temp'}), ('sort', ['report.pdf'], {}))
    """
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    return (node.func.id, [ast.literal_eval(a) for a in node.args],
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def _result_text(value: Any) -> str:
    """A method's return value as BFCL shows it to the model and compares it."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class CallTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """Raise CallTimeout in the calling code after `seconds` (main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CallTimeout(f"the call ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# Module-level data of BFCL's classes that their methods keep or change (TravelAPI's long-context credit cards are
# module dicts a world's cards point into): each world gets its own copy, installed while it runs (_installed).
_MUTABLE = (dict, list, set, bytearray)
_LOCK = threading.RLock()  # one world runs at a time: the module-level data installed is that world's


@lru_cache(maxsize=None)
def _module(class_name: str):
    """The module of a class and its mutable module-level data as first loaded (copied: never handed out)."""
    module = importlib.import_module(f"{SOURCE}.{CLASSES[class_name][0]}")
    pristine = {k: v for k, v in vars(module).items() if not k.startswith("__") and isinstance(v, _MUTABLE)}
    return module, copy.deepcopy(pristine)


@lru_cache(maxsize=None)
def _defaults(function) -> tuple[tuple | None, dict | None]:
    """A method's default argument values as first seen (`mentions=[]` is one list for the process otherwise)."""
    return copy.deepcopy(function.__defaults__), copy.deepcopy(function.__kwdefaults__)


@contextmanager
def _installed(data: dict[Any, dict[str, Any]], function=None):
    """Run with `data` ({module: {name: value}}, a world's own) as the modules' data, and `function`'s mutable
    default arguments fresh; the modules' own values come back after."""
    with _LOCK:
        saved = {module: {k: vars(module)[k] for k in values} for module, values in data.items()}
        for module, values in data.items():
            vars(module).update(values)
        if function is not None:
            function.__defaults__, function.__kwdefaults__ = copy.deepcopy(_defaults(function))
        try:
            yield
        finally:
            for module, values in saved.items():
                vars(module).update(values)


def argument_error(name: str, arguments: Any) -> str | None:
    """What keeps a call from running, said to the policy, or None: arguments that are not an object, nested too
    deep, an integer beyond 2**53, or a `precision` beyond MAX_PRECISION (a computation in C that no time limit
    interrupts: `square_root(2, precision=3000000)` runs half a minute)."""
    if not isinstance(arguments, dict):
        return f"the arguments of {name} must be an object, not {str(arguments)[:80]}"
    problem = safe_json.check(arguments, safe_json.MAX_DEPTH, MAX_INT)
    if problem:
        return f"an argument of {name} {problem}"
    precision = arguments.get("precision")
    if isinstance(precision, (int, float)) and not -MAX_PRECISION <= precision <= MAX_PRECISION:
        return f"precision={precision} of {name} is beyond {MAX_PRECISION}"
    return None


@dataclass
class World:
    """The instances of one episode (one per involved class), loaded from the entry's `initial_config`.

    Nothing is shared with another world: arguments are copied before a method sees them (BFCL's classes keep
    them, and change them later), each world has its own copy of its modules' data, and mutable default arguments
    are fresh for each call."""

    entry: dict
    instances: dict[str, Any] = field(init=False)
    methods: dict[str, Any] = field(init=False)  # public method name -> bound method
    param_types: dict[str, dict[str, str]] = field(init=False)  # function -> {parameter: BFCL type}
    data: dict[Any, dict[str, Any]] = field(init=False)  # module -> this world's copy of its mutable data
    result_bytes: int = field(init=False, default=0)  # the bytes of the results handed out so far (RESULT_BYTES)

    def __post_init__(self) -> None:
        self.instances, self.methods, self.data = {}, {}, {}
        long_context = "long_context" in self.entry["category"]
        for class_name in self.entry["involved_classes"]:
            module, pristine = _module(class_name)
            self.data[module] = copy.deepcopy(pristine)
            with _installed(self.data):
                instance = getattr(module, class_name)()
                if class_name not in STATELESS:
                    instance._load_scenario(copy.deepcopy(self.entry["initial_config"].get(class_name, {})),
                                            long_context=long_context)
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method
        self.param_types = {doc["name"]: {p: d.get("type", "") for p, d in doc["parameters"].get("properties",
                                                                                                 {}).items()}
                            for doc in function_docs(self.entry, None)}

    def call(self, name: str, arguments: Any) -> str:
        """Run `name(**arguments)` on its instance -> the result text (an error text when it fails)."""
        error = argument_error(name, arguments)
        if error:
            return f"Error during execution: {error}"
        types = self.param_types.get(name, {})
        arguments = {k: float(v) if types.get(k) == "float" and type(v) is int else copy.deepcopy(v)
                     for k, v in arguments.items()}
        import mpmath  # the math API sets its global precision and leaves it set

        precision = mpmath.mp.dps
        method = self.methods[name]
        cut = False
        try:
            with _installed(self.data, getattr(method, "__func__", None)), decimal.localcontext(), \
                    _time_limit(CALL_SECONDS):
                text = _result_text(method(**arguments))
        except Exception as err:  # the environment's own errors (wrong types, unknown files) are results
            cut = isinstance(err, CallTimeout)
            traceback.clear_frames(err.__traceback__)  # the cut call's locals (a half-built result) go now
            text = f"Error during execution: {str(err)[:1000]}"
        finally:
            mpmath.mp.dps = precision
        return self._kept(text, cut)

    def _kept(self, text: str, cut: bool) -> str:
        """`text` within what is left of the episode's RESULT_BYTES (cut to it, marked), counted.  After a cut call or
        a result over the bound, the garbage collector runs: BFCL's methods build their results in closures that
        refer to themselves (`find`'s recursive_search), reference cycles that would keep a half-built or oversized
        result alive until a full collection, which may be many calls away."""
        left = RESULT_BYTES - self.result_bytes
        head = text[:left + 1].encode("utf-8", "surrogatepass")  # left + 1 characters tell whether it passes `left`
        if len(head) <= left and len(text) <= left:
            self.result_bytes += len(head)
        else:
            large = len(text) > 1 << 16
            text = head[:left].decode("utf-8", "ignore") + RESULTS_CUT
            self.result_bytes = RESULT_BYTES
            cut = cut or large
        if cut:
            gc.collect()
        return text

    def call_string(self, text: str) -> tuple[str, str]:
        """(name, result) of a ground-truth call string; positional values are named by the method's signature."""
        name, args, kwargs = parse_call(text)
        params = [p for p in inspect.signature(self.methods[name]).parameters]
        return name, self.call(name, {**dict(zip(params, args)), **kwargs})

    def state(self) -> dict[str, dict[str, Any]]:
        """Every instance's public attributes (what BFCL's state check compares), copied."""
        return {c: {k: copy.deepcopy(v) for k, v in vars(i).items() if not k.startswith("_")}
                for c, i in self.instances.items()}


def gold_calls(entry: dict) -> list[list[Call]]:
    """The ground truth as (name, arguments by name) per user turn."""
    world = World(entry)
    turns = []
    for strings in entry["ground_truth"]:
        calls = []
        for text in strings:
            name, args, kwargs = parse_call(text)
            params = list(inspect.signature(world.methods[name]).parameters)
            calls.append((name, {**dict(zip(params, args)), **kwargs}))
        turns.append(calls)
    return turns


# ------------------------------------------------------------------------------------------------------- checking
class Shared(tuple):
    """The leaf of a container met a second time: the path where it was first met (a directory `cp` put in two
    places is one object, and walking it once per path is exponential in the copies made)."""


def leaves(value: Any) -> dict[tuple, Any]:
    """A state flattened to {path: plain value}: dicts by key, lists by index, objects by public attribute, so that
    one file, booking or message is its own leaf (a container's emptiness is a leaf too).  A container met again (a
    directory's `parent`, a directory in two places) is walked once: later paths to it are a `Shared` leaf naming
    the first.  Iterative, and linear in the objects: any state is safe to walk.

    >>> leaves({"a": [1, {"b": 2}], "c": {}})
    {('a', 0): 1, ('a', 1, 'b'): 2, ('c',): {}}
    >>> d = {"x": 1}; leaves({"p": d, "q": d})
    {('p', 'x'): 1, ('q',): ('p',)}
    """
    flat: dict[tuple, Any] = {}
    seen: dict[int, tuple] = {}
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            items = list(item.items())
        elif isinstance(item, (list, tuple)) and not isinstance(item, Shared):
            items = list(enumerate(item))
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            items = [(k, v) for k, v in vars(item).items() if not k.startswith("_")]
        else:
            flat[path] = item
            continue
        if id(item) in seen:
            if not _within(path, seen[id(item)]):  # a reference back up (a `parent`) is no leaf
                flat[path] = Shared(seen[id(item)])
            continue
        seen[id(item)] = path
        if not items:
            flat[path] = type(item)() if isinstance(item, (dict, list, tuple)) else None
        stack.extend((path + (key,), child) for key, child in reversed(items))
    return flat


def _within(path: tuple, above: tuple) -> bool:
    return path[: len(above)] == above


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _changed(before: dict[tuple, Any], after: dict[tuple, Any]) -> set[tuple]:
    return {p for p in before.keys() | after.keys()
            if p not in before or p not in after or not _same(before[p], after[p])}


@dataclass
class Verdict:
    """What `check` found.  turns_passed[t]: None for a turn with nothing to check (empty ground truth)."""

    turns_passed: list[bool | None]
    errors: list[str]  # why each failed turn failed, "turn t: ..."
    calls: int  # the policy's calls (every one it wrote, run or not)
    gold_calls: int
    violations: list[str]  # collateral damage and unavailable functions, said for people

    @property
    def correct(self) -> bool:
        return all(p is not False for p in self.turns_passed)

    @property
    def turn_share(self) -> float:
        checked = [p for p in self.turns_passed if p is not None]
        return sum(checked) / len(checked) if checked else 1.0

    @property
    def extra_calls(self) -> int:
        return max(0, self.calls - self.gold_calls)


def available(entry: dict, turn: int, gold_only: bool = False) -> set[str]:
    """The names of the functions offered at user turn `turn` (function_docs)."""
    return {doc["name"] for doc in function_docs(entry, turn, gold_only)}


def _missing(results: list[str], wanted: list[str]) -> list[str]:
    """The items of `wanted` missing from `results`, as a multiset (BFCL's unordered subsequence check)."""
    pool, missing = list(results), []
    for item in wanted:
        if item in pool:
            pool.remove(item)
        else:
            missing.append(item)
    return missing


def check(entry: dict, calls_per_turn: list[list[Call]], gold_only: bool = False) -> Verdict:
    """Grade a policy's calls, `(name, arguments)` per user turn (missing turns: no calls), against the ground truth,
    each executed on its own fresh world, turn by turn.  gold_only: the episode declared only the functions the
    ground truth calls, so only those are available."""
    turns = len(entry["ground_truth"])
    calls_per_turn = list(calls_per_turn) + [[]] * (turns - len(calls_per_turn))
    if len(calls_per_turn) > turns:
        raise ValueError(f"{len(calls_per_turn)} turns of calls for {entry['id']}, which has {turns} user turns")
    calls = sum(map(len, calls_per_turn))
    if calls > MAX_CALLS:  # a bound on the checks' time and memory: such an episode fails, and is a violation
        return Verdict([False if gold else None for gold in entry["ground_truth"]], [f"{calls} calls"], calls,
                       sum(map(len, entry["ground_truth"])), [f"{calls} calls, over the {MAX_CALLS} the checks run"])
    try:
        return _check(entry, calls_per_turn, gold_only)
    except RecursionError:  # a state nested deeper than Python walks (thousands of directories, one per call)
        return Verdict([False if gold else None for gold in entry["ground_truth"]], ["a state nested too deep"],
                       calls, sum(map(len, entry["ground_truth"])), ["a state nested too deep to compare"])


def _check(entry: dict, calls_per_turn: list[list[Call]], gold_only: bool) -> Verdict:
    policy, gold = World(entry), World(entry)
    start = {c: leaves(s) for c, s in policy.state().items()}
    all_results: list[str] = []
    passed: list[bool | None] = []
    errors, violations = [], []
    policy_changed: list[tuple[int, str, set[tuple]]] = []
    gold_changed: dict[str, set[tuple]] = {c: set() for c in start}
    for t, (gold_strings, calls) in enumerate(zip(entry["ground_truth"], calls_per_turn)):
        offered = available(entry, t, gold_only)
        for name, arguments in calls:
            if name not in offered:
                violations.append(f"turn {t}: called {name!r}, not available in this turn")
                continue
            all_results.append(policy.call(name, arguments))
        gold_results = [gold.call_string(s)[1] for s in gold_strings]
        gold_state, policy_state = gold.state(), policy.state()
        for c in start:
            gold_changed[c] |= _changed(start[c], leaves(gold_state[c]))
            policy_changed.append((t, c, _changed(start[c], leaves(policy_state[c]))))
        if not gold_strings:
            passed.append(None)
            continue
        error = None
        if not calls:
            error = "no call"
        else:
            differing = sorted(f"{c}.{k}" for c in gold_state for k in gold_state[c]
                               if not _same(policy_state[c].get(k), gold_state[c][k]))
            missing = _missing(all_results, gold_results)
            if differing:
                error = f"state differs from the ground truth's: {', '.join(differing)}"
            elif missing:
                error = f"results lack the ground truth's {missing[0][:120]!r}"
        passed.append(error is None)
        if error:
            errors.append(f"turn {t}: {error}")
    said: dict[str, set[tuple]] = {c: set() for c in start}  # a value left changed shows at every later turn end
    for t, c, changed in policy_changed:
        damage = sorted(changed - gold_changed[c] - said[c], key=str)
        said[c] |= set(damage)
        if damage:
            violations.append(f"turn {t}: {c} changed {'/'.join(map(str, damage[0]))}"
                              + (f" and {len(damage) - 1} more values" if len(damage) > 1 else "")
                              + ", which the ground truth never changes")
    violations.sort(key=lambda v: int(v.split(":", 1)[0].split()[1]))  # by turn
    return Verdict(passed, errors, sum(len(c) for c in calls_per_turn), sum(map(len, entry["ground_truth"])),
                   violations)


def efficiency(verdict: Verdict) -> float:
    """Minus the calls beyond the ground truth's, per ground-truth call, in [-1, 0]: -0.5 is half again as many
    calls as needed; twice as many or more is -1 (a fixed range, so a gated value of -1 is never better)."""
    return 0.0 - min(1.0, verdict.extra_calls / max(1, verdict.gold_calls))  # 0.0, not -0.0, when none


def replay(entry: dict, calls_per_turn: list[list[Call]], gold_only: bool = False) -> dict[str, float]:
    """The bfcl_agent channels of a call sequence, without a model: calls as `(name, arguments)` per user turn.

    correctness: 1.0 when BFCL's checks pass after every turn, else 0.0; turns: the share of checked turns that
    pass; efficiency: see `efficiency`; safety: -1.0 on collateral damage or a call to an unavailable function, else
    0.0 (gold_only: see `check`)."""
    verdict = check(entry, calls_per_turn, gold_only)
    return {"correctness": float(verdict.correct), "turns": verdict.turn_share, "efficiency": efficiency(verdict),
            "safety": -1.0 if verdict.violations else 0.0}
