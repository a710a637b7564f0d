"""BFCL v4 single-turn function calling: the benchmark's own records, graded in mrl the way BFCL's AST checker grades.

Data: `bfcl_eval/data/BFCL_v4_<category>.json` and `bfcl_eval/data/possible_answer/BFCL_v4_<category>.json` of the
installed `bfcl-eval` package (`make bfcl`), read as files: importing `bfcl_eval` would pull in every API client it
supports. A ground-truth call is `{name: {argument: [allowed values]}}`; `""` among the allowed values means the
argument may be left out.

`grade` follows `bfcl_eval/eval_checker/ast_eval/ast_checker.py` with Python's type rules, verdict for verdict
(tests/test_bfcl.py runs that checker as an oracle), including its rules that surprise a reader:
- strings compare after dropping the characters ` ,./-_*^`, lowercasing and turning ' into " ("April 1, 2024" equals
  "april 12024"), and so do the strings directly inside a list or a dict, but none nested deeper;
- an int passes for a float argument, but not as an element of a list of floats;
- a value of the first allowed value's type passes the type check even where the doc names another type (BFCL's
  "variable" rule: the answer "10" for an integer argument accepts the string "10"); it is then compared as is;
- element types of a list are checked only against the allowed values that are lists (an optional list skips them);
- parallel calls are matched greedily: each ground-truth call, in order, takes the first unused call that fits it, so
  a call that would fit two of them can leave the second with none (BFCL's verdict, kept);
- `multiple` grades its one call against the named function; the simple categories against the entry's first function.
Deliberate difference: BFCL counts an output that is not a list of `{name: {args}}` as "no call"; here every
`(name, arguments)` pair is a call, so an irrelevance entry passes only with no call at all.
"""

import math
import re
from collections import Counter

from mrl.core.config import UserError
from mrl.envs.bfcl.files import INSTALL, data_dir, read_records

Call = tuple[str, dict]  # (function name as BFCL writes it, arguments)

# BFCL type -> the Python type its checker requires of a value ("any" is checked as a string, as BFCL does).
_PY_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
             "dict": dict, "any": str}
_IGNORED_CHARS = re.compile(r"[ ,./\-_*^]")


# ---------------------------------------------------------------------------------------------------------- data
def _check_category(category: str) -> None:
    if category not in _CHECKS:
        raise UserError(f"BFCL category {category!r} is not supported; choose one of {', '.join(CATEGORIES)} "
                        "(Java/JavaScript, multi-turn, memory and web_search are not graded here).")


def load_entries(category: str) -> list[dict]:
    """BFCL's records of one category, each with `ground_truth` joined in (`[]` for irrelevance) and `category` set.

    >>> load_entries("simple_python")[0]["ground_truth"]
    [{'calculate_triangle_area': {'base': [10], 'height': [5], 'unit': ['units', '']}}]
    """
    _check_category(category)
    data = data_dir()
    entries = read_records(data / f"BFCL_v4_{category}.json")
    answers = {}
    if _CHECKS[category] is not _check_irrelevance:
        records = read_records(data / "possible_answer" / f"BFCL_v4_{category}.json")
        answers = {record["id"]: record["ground_truth"] for record in records}
    for entry in entries:
        if answers and entry["id"] not in answers:
            raise UserError(f"BFCL entry {entry['id']} has no possible answer: reinstall the data; {INSTALL}.")
        entry["ground_truth"] = answers.get(entry["id"], [])
        entry["category"] = category
    return entries


def messages(entry: dict) -> list[dict]:
    """The single-turn conversation: the first turn's messages, system messages included.

    >>> messages({"question": [[{"role": "user", "content": "Area of a 10 x 5 triangle?"}]]})
    [{'role': 'user', 'content': 'Area of a 10 x 5 triangle?'}]
    """
    return [dict(message) for message in entry["question"][0]]


# ------------------------------------------------------------------------------------------------------- grading
def _normalize(value):
    """BFCL's string standardization; other values unchanged.  _normalize("April 1, 2024") == "april12024"."""
    return _IGNORED_CHARS.sub("", value).lower().replace("'", '"') if type(value) is str else value


def _answer_type(allowed: list) -> type | None:
    """The type of the first allowed value that is not the "may be omitted" marker; None when there is none."""
    return next((type(value) for value in allowed if value != ""), None)


def _python_types(schema: dict) -> tuple[type, type | None]:
    """(the Python type BFCL requires of a value, that of its elements for an array/tuple, else None)."""
    kinds = [schema.get("type")] + ([schema.get("items", {}).get("type")] if schema.get("type") in ("array", "tuple")
                                    else [])
    unknown = [kind for kind in kinds if kind not in _PY_TYPES]
    if unknown:
        raise ValueError(f"BFCL type {unknown[0]!r} (in {schema}) is not one of {sorted(_PY_TYPES)}: only Python "
                         "categories are graded, and an array needs items with a type.")
    return _PY_TYPES[kinds[0]], _PY_TYPES[kinds[1]] if len(kinds) > 1 else None


def _elements_typed(value: list, answer, element_type: type) -> bool:
    """Each element has the doc's element type or that of the answer's first element (BFCL: one level deep)."""
    if type(answer) is not list:
        return True  # BFCL checks elements only against answers that are lists ("" for an optional list passes)
    answer_type = _answer_type(answer)
    return all(type(item) is element_type or (answer_type is not None and type(item) is answer_type) for item in value)


def _type_error(value, kind: str, types: tuple[type, type | None], allowed: list) -> tuple[str | None, bool]:
    """(why the value's type is wrong or None, whether it is compared as a "variable": as is, not normalized)."""
    (expected, element_type), answer_type = types, _answer_type(allowed)
    if type(value) is expected:
        if element_type is not None and not any(_elements_typed(value, answer, element_type) for answer in allowed):
            return f"elements of {value!r} are not all {element_type.__name__}", False
        return None, answer_type is not None and answer_type is not expected
    if answer_type is not None and type(value) is answer_type:
        return None, True
    return f"expected {kind}, got {type(value).__name__} {value!r}", False


def _dict_fits(value: dict, answer) -> bool:
    """A dict argument against one allowed dict `{key: [allowed values]}`: top-level strings normalized."""
    if type(answer) is not dict:
        return False
    known = all(key in answer and _normalize(item) in [_normalize(choice) for choice in answer[key]]
                for key, item in value.items())
    return known and all(key in value or "" in choices for key, choices in answer.items())


def _dicts_fit(value: list, answer) -> bool:
    """A list of dicts against one allowed list of dicts, position by position ("" allows the empty list)."""
    if type(answer) not in (list, str) or len(value) != len(answer):
        return False
    return all(type(item) is dict and _dict_fits(item, choice) for item, choice in zip(value, answer))


def _value_fits(value, expected: type, element_type: type | None, allowed: list) -> bool:
    if expected is dict:
        return any(_dict_fits(value, answer) for answer in allowed)
    if expected is list and element_type is dict:
        return any(_dicts_fit(value, answer) for answer in allowed)
    if expected is str:
        return _normalize(value) in [_normalize(answer) for answer in allowed if type(answer) is str]
    if expected is list:
        return [_normalize(item) for item in value] in [[_normalize(a) for a in answer] for answer in allowed
                                                        if type(answer) in (list, str)]
    return value in allowed


def _argument_error(value, schema: dict, allowed: list) -> str | None:
    """Why one argument's value fails BFCL's type and value checks, or None.

    >>> _argument_error(5, {"type": "float"}, [5.0]), _argument_error(5.0, {"type": "integer"}, [5])
    (None, 'expected integer, got float 5.0')
    """
    types = _python_types(schema)
    if schema["type"] == "tuple" and type(value) is tuple:
        value = list(value)
    if schema["type"] == "float" and type(value) is int:
        value = float(value)  # Python promotes int to float; BFCL does too, at the top level only
    error, as_variable = _type_error(value, schema["type"], types, allowed)
    if error:
        return error
    fits = value in allowed if as_variable else _value_fits(value, *types, allowed)
    return None if fits else f"{value!r} is not one of {allowed!r}"


def _call_error(doc: dict, call: Call, answer: dict) -> str | None:
    """Why one call fails one ground-truth call `{name: {arg: allowed}}` under the function's doc, or None."""
    name, arguments = call
    (_, allowed), = answer.items()
    if name != doc["name"]:
        return f"called {name!r}, expected {doc['name']!r}"
    if type(arguments) is not dict:
        return f"{name}: arguments {arguments!r} are not a JSON object"
    properties = doc["parameters"].get("properties", {})
    missing = [param for param in doc["parameters"].get("required", []) if param not in arguments]
    if missing:
        return f"{name}: required argument {missing[0]!r} missing"
    for param, value in arguments.items():
        if param not in properties or param not in allowed:
            return f"{name}: unexpected argument {param!r}"
        error = _argument_error(value, properties[param], allowed[param])
        if error:
            return f"{name}: argument {param!r}: {error}"
    left_out = [param for param, choices in allowed.items() if param not in arguments and "" not in choices]
    return f"{name}: argument {left_out[0]!r} missing (the answer needs it)" if left_out else None


def _doc(entry: dict, name: str) -> dict:
    doc = next((doc for doc in entry["function"] if doc["name"] == name), None)
    if doc is None:
        raise ValueError(f"BFCL entry {entry.get('id')}: the ground truth calls {name!r}, which the entry's functions "
                         "do not declare; the data is corrupt, reinstall bfcl-eval.")
    return doc


def _count_error(calls: list[Call], expected: int) -> str | None:
    return None if len(calls) == expected else f"expected {expected} call(s), got {len(calls)}"


def _check_simple(entry: dict, calls: list[Call]) -> str | None:
    return _count_error(calls, 1) or _call_error(entry["function"][0], calls[0], entry["ground_truth"][0])


def _check_multiple(entry: dict, calls: list[Call]) -> str | None:
    answers = entry["ground_truth"]
    return _count_error(calls, len(answers)) or _call_error(_doc(entry, next(iter(answers[0]))), calls[0], answers[0])


def _check_parallel(entry: dict, calls: list[Call]) -> str | None:
    """Greedy one-to-one matching, in ground-truth order, as BFCL's parallel_function_checker_no_order."""
    answers = entry["ground_truth"]
    if error := _count_error(calls, len(answers)):
        return error
    unused = list(range(len(calls)))
    for number, answer in enumerate(answers, 1):
        name = next(iter(answer))
        doc = _doc(entry, name)
        match = next((index for index in unused if _call_error(doc, calls[index], answer) is None), None)
        if match is None:
            closest = next((index for index in unused if calls[index][0] == name), unused[0])
            return f"no call fits expected call {number} ({name}); call {closest + 1}: " \
                   f"{_call_error(doc, calls[closest], answer)}"
        unused.remove(match)
    return None


def _check_irrelevance(entry: dict, calls: list[Call]) -> str | None:
    names = ", ".join(str(name) for name, _ in calls)
    return f"expected no call (no function fits the request), got {len(calls)}: {names}" if calls else None


_CHECKS = {"simple_python": _check_simple, "multiple": _check_multiple, "parallel": _check_parallel,
           "parallel_multiple": _check_parallel, "live_simple": _check_simple, "live_multiple": _check_multiple,
           "live_parallel": _check_parallel, "live_parallel_multiple": _check_parallel,
           "irrelevance": _check_irrelevance, "live_irrelevance": _check_irrelevance}
CATEGORIES = tuple(_CHECKS)  # the single-turn Python categories graded here


def explain(entry: dict, calls: list[Call]) -> str | None:
    """Why `grade` says False, in one line (for people reading transcripts); None when the calls pass.

    >>> entry = {"category": "simple_python", "function": [{"name": "area", "parameters": {"type": "dict",
    ...     "properties": {"base": {"type": "integer"}}, "required": ["base"]}}],
    ...     "ground_truth": [{"area": {"base": [10]}}]}
    >>> explain(entry, [("area", {"base": 10})]), explain(entry, [("area", {"base": "10"})])
    (None, "area: argument 'base': expected integer, got str '10'")
    """
    category = entry.get("category")
    if category not in _CHECKS:
        raise UserError(f"BFCL entry {entry.get('id')} has category {category!r}; supported: {', '.join(CATEGORIES)} "
                        "(entries from load_entries carry theirs).")
    return _CHECKS[category](entry, list(calls))


def grade(entry: dict, calls: list[Call]) -> bool:
    """BFCL's AST-checker verdict on the calls `[(name, arguments), ...]` the model made for the entry.

    >>> entry = {"category": "irrelevance", "function": [], "ground_truth": []}
    >>> grade(entry, []), grade(entry, [("get_weather", {"city": "Paris"})])
    (True, False)
    """
    return explain(entry, calls) is None


def gold_calls(entry: dict) -> list[Call]:
    """One call per ground-truth call: each argument's first allowed value, optional ones whose first is "" left
    out (what a few-shot example shows; `grade` accepts it, but for the few live records whose answers allow
    nothing).

    >>> gold_calls({"ground_truth": [{"f": {"x": [4], "z": ["", 0]}}]})
    [('f', {'x': 4})]
    """
    def first(allowed: list):
        return allowed[0] if allowed else []

    return [(name, {arg: first(allowed) for arg, allowed in args.items() if first(allowed) != ""})
            for answer in entry["ground_truth"] for name, args in answer.items()]


# ------------------------------------------------------------------------------------- graded credit (ToolRL)
TOOLRL_RANGE = 3.0  # ToolRL's correctness reward lies in [-3, 3]


def _argument_fits(doc: dict, param: str, value, allowed: list) -> bool:
    schema = doc["parameters"].get("properties", {}).get(param)
    return schema is not None and _argument_error(value, schema, allowed) is None


def _pair_credit(entry: dict, call: Call, answer: dict) -> float:
    """Parameter-name Jaccard + the answer's keys whose value BFCL accepts, of one call against one ground-truth call
    of the same function (0 for another function's call, or arguments that are no JSON object).  An optional key
    (its allowed values hold "") the call leaves out counts as given and right, as BFCL accepts the omission."""
    (name, allowed), = answer.items()
    name_of, arguments = call
    if name_of != name or type(arguments) is not dict:
        return 0.0
    omitted = {param for param, choices in allowed.items() if "" in choices and param not in arguments}
    given = set(arguments) | omitted
    names = len(given & set(allowed)) / len(given | set(allowed)) if allowed or given else 1.0
    doc = _doc(entry, name)
    values = len(omitted) + sum(_argument_fits(doc, param, arguments[param], allowed[param])
                                for param in set(arguments) & set(allowed))
    return names + values


def _best_matching(credit: list[list[float]]) -> float:
    """The largest total credit of a one-to-one matching of rows to columns of `credit` [rows][columns], every entry
    >= 0 (a row may stay unmatched: 0).  The Hungarian algorithm with potentials, O(rows^2 * columns): rows are
    answers, columns calls, a parallel record's 8 answers against a dozen calls at once."""
    rows = len(credit)
    columns = len(credit[0]) + rows if rows else 0  # a zero column per row: left unmatched
    cost = [[-c for c in row] + [0.0] * rows for row in credit]  # [rows][columns], minimized
    row_potential, column_potential = [0.0] * (rows + 1), [0.0] * (columns + 1)
    owner, way = [0] * (columns + 1), [0] * (columns + 1)  # owner[j]: the row matched to column j (1-based; 0 none)
    for row in range(1, rows + 1):
        owner[0], column = row, 0
        slack, done = [math.inf] * (columns + 1), [False] * (columns + 1)
        while owner[column]:
            done[column] = True
            current, delta, nearest = owner[column], math.inf, 0
            for j in range(1, columns + 1):
                if not done[j]:
                    reduced = cost[current - 1][j - 1] - row_potential[current] - column_potential[j]
                    if reduced < slack[j]:
                        slack[j], way[j] = reduced, column
                    if slack[j] < delta:
                        delta, nearest = slack[j], j
            for j in range(columns + 1):
                if done[j]:
                    row_potential[owner[j]] += delta
                    column_potential[j] -= delta
                else:
                    slack[j] -= delta
            column = nearest
        while column:
            owner[column], column = owner[way[column]], way[column]
    return sum(-cost[owner[j] - 1][j - 1] for j in range(1, columns + 1) if owner[j])


def toolrl_score(entry: dict, calls: list[Call]) -> float:
    """ToolRL's correctness reward (Qian et al. 2025, arXiv 2504.13958; the GDPO paper's tool-calling setting trains on
    it beside format) on BFCL's ground truth, in [-3, 3]:
    6 * (name Jaccard + sum over ground-truth calls of (parameter-name Jaccard + values right)) / S_max - 3, with
    S_max = 1 + (ground-truth calls) + (their keys).  Names are counted with repeats (a second call of a function
    asked for once costs, as in ToolRL); each ground-truth call is credited through the call of the same function
    matched to it, one to one, by the matching that credits most.  A value is right when BFCL's own argument check
    accepts it (types and allowed values, as `grade`); an optional key left out is right.

    >>> entry = {"function": [{"name": "area", "parameters": {"properties": {"base": {"type": "integer"},
    ...     "height": {"type": "integer"}}}}], "ground_truth": [{"area": {"base": [10], "height": [5]}}]}
    >>> toolrl_score(entry, [("area", {"base": 10, "height": 5})]), toolrl_score(entry, [])
    (3.0, -3.0)
    >>> toolrl_score(entry, [("area", {"base": 10, "height": 4})])  # 6 * (1 + 1 + 1) / 4 - 3
    1.5
    >>> # a guess beside the right call: names 1 of 2 by count; 6 * (1/2 + 1 + 2) / 4 - 3
    >>> toolrl_score(entry, [("area", {"base": 10, "height": 4}), ("area", {"base": 10, "height": 5})])
    2.25
    """
    answers = entry["ground_truth"]
    wanted, made = Counter(next(iter(answer)) for answer in answers), Counter(name for name, _ in calls)
    common = sum((wanted & made).values())
    names = common / (sum(wanted.values()) + sum(made.values()) - common) if wanted or made else 1.0
    credit = [[_pair_credit(entry, call, answer) for call in calls] for answer in answers]  # [answer][call]
    keys = sum(len(next(iter(answer.values()))) for answer in answers)
    return 2 * TOOLRL_RANGE * (names + _best_matching(credit)) / (1 + len(answers) + keys) - TOOLRL_RANGE
