"""mrl.envs.bfcl.grader: BFCL's data read from the installed package, and grade() agreeing with BFCL's own AST checker.

The agreement test runs BFCL's `ast_checker` as a test-only oracle (its API-client imports stubbed in sys.modules for
this module only) on the gold calls of every graded AST category and on mutations of them; the hand-worked tests pin
the rules on made-up entries, so they run without the package.
"""

import sys
import types
from collections import Counter
from importlib.util import find_spec

import pytest

from mrl.core.config import UserError
from mrl.envs.bfcl import files as bfcl_data
from mrl.envs.bfcl import grader as bfcl

needs_bfcl = pytest.mark.skipif(find_spec("bfcl_eval") is None, reason="bfcl-eval not installed: run `make bfcl`")
AST_CATEGORIES = [c for c in bfcl.CATEGORIES if "irrelevance" not in c]
# Records per category in bfcl-eval 2026.3.23.
SIZES = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "live_simple": 258,
         "live_multiple": 1053, "live_parallel": 16, "live_parallel_multiple": 24, "irrelevance": 240,
         "live_irrelevance": 884}


# ------------------------------------------------------------------------------------------- hand-worked rules
def _entry(category, functions, answers):
    """A made-up entry: functions as {name: (properties, required)}, answers as BFCL's ground truth."""
    docs = [{"name": name, "description": "", "parameters": {"type": "dict", "properties": props, "required": req}}
            for name, (props, req) in functions.items()]
    return {"id": "made_up_0", "category": category, "function": docs, "ground_truth": answers}


WEATHER = _entry("simple_python",
                 {"weather.get": ({"city": {"type": "string"}, "days": {"type": "integer"},
                                   "threshold": {"type": "float"}, "unit": {"type": "string"}}, ["city"])},
                 [{"weather.get": {"city": ["New York, NY"], "days": [3], "threshold": [2.0], "unit": ["C", ""]}}])


def _weather(**overrides):
    args = {"city": "New York, NY", "days": 3, "threshold": 2.0}
    args.update(overrides)
    return [("weather.get", {k: v for k, v in args.items() if v is not None})]


def test_strings_compare_after_bfcl_normalization():
    # " ,./-_*^" dropped, case folded: "new-york ny" -> "newyorkny" == "New York, NY" -> "newyorkny".
    assert bfcl.grade(WEATHER, _weather(city="new-york ny"))
    assert bfcl.grade(WEATHER, _weather(city="NEWYORK,NY."))
    assert not bfcl.grade(WEATHER, _weather(city="New York City"))
    assert bfcl.explain(WEATHER, _weather(city="Boston")) == \
        "weather.get: argument 'city': 'Boston' is not one of ['New York, NY']"


def test_types_float_accepts_int_integer_refuses_float_string_and_bool():
    assert bfcl.grade(WEATHER, _weather(threshold=2))  # 2 -> 2.0, as Python promotes it
    assert not bfcl.grade(WEATHER, _weather(threshold=3))  # promoted, but 3.0 is not allowed
    assert not bfcl.grade(WEATHER, _weather(days=3.0))  # 3.0 == 3, but an integer argument needs an int
    assert not bfcl.grade(WEATHER, _weather(days="3"))
    assert not bfcl.grade(WEATHER, _weather(days=True))  # True == 1 in Python; the type check refuses it
    assert bfcl.explain(WEATHER, _weather(days=3.0)) == "weather.get: argument 'days': expected integer, got float 3.0"


def test_optional_arguments_and_unexpected_or_missing_ones():
    assert bfcl.grade(WEATHER, _weather())  # unit's answers include "": it may be left out
    assert bfcl.grade(WEATHER, _weather(unit="c"))
    # days is optional in the doc but its answers have no "": leaving it out fails.
    assert bfcl.explain(WEATHER, _weather(days=None)) == "weather.get: argument 'days' missing (the answer needs it)"
    assert bfcl.explain(WEATHER, [("weather.get", {"days": 3})]) == "weather.get: required argument 'city' missing"
    assert bfcl.explain(WEATHER, _weather(country="US")) == "weather.get: unexpected argument 'country'"
    assert bfcl.explain(WEATHER, [("weather_get", _weather()[0][1])]) == "called 'weather_get', expected 'weather.get'"
    assert bfcl.explain(WEATHER, _weather() * 2) == "expected 1 call(s), got 2"


def test_variable_rule_lists_and_dicts():
    params = {"n": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "float"}},
              "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "dict", "properties": {}}}
    entry = _entry("simple_python", {"f": (params, [])},
                   [{"f": {"n": ["n"], "xs": [[1.0, 2.5]], "tags": [["Fast Mode", "x"], ""],
                           "opts": [{"mode": ["Fast Mode"], "k": [1, ""]}, ""]}}])
    # BFCL's "variable" rule: the answer "n" (a str) for an integer argument lets the string "n" through, as is.
    assert bfcl.grade(entry, [("f", {"n": "n", "xs": [1.0, 2.5], "opts": {"mode": "fast_mode"}})])
    assert not bfcl.grade(entry, [("f", {"n": "N", "xs": [1.0, 2.5]})])
    # Strings inside a list are normalized; "" among a list's answers lets the empty list through.
    assert bfcl.grade(entry, [("f", {"n": "n", "xs": [1.0, 2.5], "tags": ["fast-mode", "X"]})])
    assert bfcl.grade(entry, [("f", {"n": "n", "xs": [1.0, 2.5], "tags": []})])
    # Element types: the int 1 is not promoted inside a list of floats.
    assert bfcl.explain(entry, [("f", {"n": "n", "xs": [1, 2.5]})]) == \
        "f: argument 'xs': elements of [1, 2.5] are not all float"
    assert bfcl.explain(entry, [("f", {"n": "n", "xs": [1.0, 2.5], "opts": {"mode": "fast", "k": 1}})]) == \
        "f: argument 'opts': {'mode': 'fast', 'k': 1} is not one of [{'mode': ['Fast Mode'], 'k': [1, '']}, '']"
    assert not bfcl.grade(entry, [("f", {"n": "n", "xs": [1.0, 2.5], "opts": {"k": 1}})])  # "mode" has no ""


def test_lists_of_dicts_tuples_and_arguments_the_answer_lacks():
    params = {"legs": {"type": "array", "items": {"type": "dict"}},
              "span": {"type": "tuple", "items": {"type": "integer"}},
              "stops": {"type": "array", "items": {"type": "string"}}, "note": {"type": "string"}}
    entry = _entry("simple_python", {"book": (params, ["legs"])},
                   [{"book": {"legs": [[{"from": ["New York"], "to": ["Paris"]}, {"from": ["Paris"], "to": ["Rome"]}]],
                              "span": [[1, 3], ""], "stops": [["Lyon"], ""]}}])
    legs = [{"from": "new york", "to": "PARIS"}, {"from": "Paris", "to": "Rome"}]
    assert bfcl.grade(entry, [("book", {"legs": legs, "span": (1, 3)})])  # a tuple for a tuple argument: as a list
    assert not bfcl.grade(entry, [("book", {"legs": legs, "stops": ("Lyon",)})])  # an array needs a list
    assert not bfcl.grade(entry, [("book", {"legs": legs[:1]})])
    assert not bfcl.grade(entry, [("book", {"legs": legs + legs[1:]})])
    assert not bfcl.grade(entry, [("book", {"legs": legs[::-1]})])  # position by position
    assert bfcl.explain(entry, [("book", {"legs": legs, "note": "window"})]) == "book: unexpected argument 'note'"


def test_parallel_any_order_one_to_one_and_greedy():
    entry = _entry("parallel", {"spin": ({"x": {"type": "integer"}}, ["x"])},
                   [{"spin": {"x": [1, 2]}}, {"spin": {"x": [1]}}])
    assert bfcl.grade(entry, [("spin", {"x": 2}), ("spin", {"x": 1})])
    assert not bfcl.grade(entry, [("spin", {"x": 1})])
    assert not bfcl.grade(entry, [("spin", {"x": 1}), ("spin", {"x": 1}), ("spin", {"x": 2})])
    # Greedy, as BFCL: the first answer takes x=1, the second then finds only x=2, though a matching exists.
    assert bfcl.explain(entry, [("spin", {"x": 1}), ("spin", {"x": 2})]) == \
        "no call fits expected call 2 (spin); call 2: spin: argument 'x': 2 is not one of [1]"


def test_multiple_grades_the_one_call_against_the_named_function():
    entry = _entry("multiple", {"add": ({"a": {"type": "integer"}}, ["a"]), "mul": ({"a": {"type": "integer"}}, ["a"])},
                   [{"mul": {"a": [4]}}])
    assert bfcl.grade(entry, [("mul", {"a": 4})])
    assert bfcl.explain(entry, [("add", {"a": 4})]) == "called 'add', expected 'mul'"
    assert not bfcl.grade(entry, [("mul", {"a": 4}), ("mul", {"a": 4})])
    assert not bfcl.grade(entry, [])


def test_irrelevance_passes_only_without_calls():
    entry = _entry("irrelevance", {"area": ({"r": {"type": "float"}}, ["r"])}, [])
    assert bfcl.grade(entry, [])
    assert bfcl.explain(entry, [("area", {"r": 1.0})]) == \
        "expected no call (no function fits the request), got 1: area"


def test_unknown_category_and_missing_package_are_user_errors(monkeypatch):
    with pytest.raises(UserError, match="simple_python, multiple.*live_irrelevance"):
        bfcl.load_entries("simple_java")
    with pytest.raises(UserError, match="'multi_turn_base'"):
        bfcl.grade({**WEATHER, "category": "multi_turn_base"}, [])
    monkeypatch.setattr(bfcl_data, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="make bfcl"):
        bfcl.load_entries("simple_python")


def test_tool_schemas_map_bfcl_types_to_json_schema():
    entry = _entry("simple_python", {"geo.route": ({
        "points": {"type": "array", "items": {"type": "tuple", "items": {"type": "float"}}, "description": "Stops."},
        "opts": {"type": "dict", "properties": {"mode": {"type": "string", "enum": ["car", "bike"]}},
                 "required": ["mode"], "optional": True},
        "tag": {"type": "any", "default": None}}, ["points"])}, [])
    assert bfcl_data.tool_schemas(entry) == [{"type": "function", "function": {
        "name": "geo.route", "description": "", "parameters": {"type": "object", "required": ["points"], "properties": {
            "points": {"type": "array", "description": "Stops.",
                       "items": {"type": "array", "items": {"type": "number"}}},
            "opts": {"type": "object", "required": ["mode"],
                     "properties": {"mode": {"type": "string", "enum": ["car", "bike"]}}},
            "tag": {"default": None}}}}}]


# ------------------------------------------------------------------------------------------ the package's data
@needs_bfcl
@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_load_entries_joins_ground_truth_and_schemas_are_json_schema(category):
    entries = bfcl.load_entries(category)
    assert len(entries) == SIZES[category]
    assert all(e["category"] == category for e in entries)
    assert all(bool(e["ground_truth"]) == (category in AST_CATEGORIES) for e in entries)
    for entry in entries:
        for tool in bfcl_data.tool_schemas(entry):
            assert tool["type"] == "function" and set(tool["function"]) == {"name", "description", "parameters"}
            assert tool["function"]["parameters"]["type"] == "object"
            _assert_json_schema(tool["function"]["parameters"], f"{entry['id']}:{tool['function']['name']}")
        assert bfcl.messages(entry)[-1]["role"] == "user"  # every first turn ends with the request


def _assert_json_schema(schema, where):
    assert isinstance(schema, dict), where
    assert schema.get("type", "string") in {"object", "array", "string", "integer", "number", "boolean"}, where
    assert set(schema) <= {"type", "properties", "items", *bfcl_data._SCHEMA_KEYS}, where
    assert all(isinstance(name, str) for name in schema.get("required", [])), where
    assert isinstance(schema.get("enum", []), list), where
    for name, sub in schema.get("properties", {}).items():
        _assert_json_schema(sub, f"{where}.{name}")
    if "items" in schema:
        _assert_json_schema(schema["items"], f"{where}[]")


@needs_bfcl
def test_first_records_read_as_bfcl_writes_them():
    simple = bfcl.load_entries("simple_python")[0]
    assert simple["id"] == "simple_python_0"
    assert simple["ground_truth"] == [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}]
    assert bfcl.messages(simple) == [{"role": "user", "content": "Find the area of a triangle with a base of 10 units "
                                                                 "and height of 5 units."}]
    assert bfcl_data.tool_schemas(simple)[0]["function"]["parameters"]["properties"]["base"] == \
        {"type": "integer", "description": "The base of the triangle."}
    with_system = next(e for e in bfcl.load_entries("live_simple") if e["question"][0][0]["role"] == "system")
    assert [m["role"] for m in bfcl.messages(with_system)] == ["system", "user"]


# --------------------------------------------------------------------------- agreement with BFCL's own checker
@pytest.fixture(scope="module")
def oracle():
    """BFCL's ast_checker module; model_config (which imports every API client) is replaced by a one-model stub."""
    before = set(sys.modules)
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {"mrl": types.SimpleNamespace(underscore_to_dot=False)}  # names keep their dots
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, stub.__name__, stub)
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval import ast_checker
        yield lambda entry, calls: ast_checker.ast_checker(
            entry["function"], [{name: args} for name, args in calls], entry["ground_truth"], Language.PYTHON,
            entry["category"], "mrl")["valid"]
    for name in set(sys.modules) - before:
        if name.startswith("bfcl_eval"):
            del sys.modules[name]


_gold = bfcl.gold_calls


def _not_allowed(value, allowed):
    """A value of the same type that no allowed value equals, even after BFCL's string normalization."""
    norm = [bfcl._normalize(a) for a in allowed]
    step = {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.5, str: lambda v: v + "q",
            list: lambda v: v + (v[:1] or ["q"]), dict: lambda v: {**v, "zz": 1}}.get(type(value), lambda v: "q")
    candidate = step(value)
    while candidate in allowed or bfcl._normalize(candidate) in norm:
        candidate = step(candidate)
    return candidate


def _first(calls, entry, pick):
    """calls with the first call's first argument for which pick(arg, value, allowed) returns a replacement
    (`...` = drop the argument); None when no argument qualifies."""
    name, args = calls[0]
    allowed = entry["ground_truth"][0][name]
    doc = bfcl._doc(entry, name)
    for arg in list(args) + [a for a in allowed if a not in args]:
        new = pick(arg, args.get(arg, ...), allowed.get(arg, [""]), doc)
        if new is not None:
            changed = {k: v for k, v in {**args, arg: new}.items() if v is not ...}
            return [(name, changed)] + calls[1:]
    return None


def _required(arg, doc):
    return arg in doc["parameters"].get("required", [])


def _restyled(value):
    """A string (or the strings of a list) upper-cased with "_" for " " and a "." added: equal after normalization."""
    if type(value) is str and value.strip():
        return value.upper().replace(" ", "_") + "."
    if type(value) is list and value and all(type(item) is str for item in value):
        return [_restyled(item) or item for item in value]
    return None


def _unanswered(calls, entry):
    """The first call plus an argument its function declares but the answer does not list (BFCL: unexpected)."""
    name, args = calls[0]
    declared = bfcl._doc(entry, name)["parameters"]["properties"]
    extra = next((arg for arg in declared if arg not in entry["ground_truth"][0][name]), None)
    return None if extra is None else [(name, {**args, extra: "q"})] + calls[1:]


def _retyped(value):
    """A list of ints as floats, or of whole floats as ints: equal under ==, refused by BFCL's element types."""
    if type(value) is not list or not value:
        return None
    if all(type(item) is int for item in value):
        return [float(item) for item in value]
    if all(type(item) is float and item.is_integer() for item in value):
        return [int(item) for item in value]
    return None


MUTATIONS = {
    "gold": lambda calls, e: calls,
    "wrong value": lambda calls, e: _first(calls, e, lambda a, v, al, d: None if v is ... else _not_allowed(v, al)),
    "int as string": lambda calls, e: _first(calls, e, lambda a, v, al, d: str(v) if type(v) is int else None),
    "numeric string as int": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: int(v) if type(v) is str and v.isdigit() else None),
    "string as int": lambda calls, e: _first(calls, e, lambda a, v, al, d: 10 if type(v) is str else None),
    "int for float": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: int(v) if type(v) is float and v.is_integer() else None),
    "float for int": lambda calls, e: _first(calls, e, lambda a, v, al, d: float(v) if type(v) is int else None),
    "bool for int": lambda calls, e: _first(calls, e, lambda a, v, al, d: v == 1 if type(v) is int else None),
    "missing required": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: ... if v is not ... and _required(a, d) else None),
    "omitted optional": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: ... if v is not ... and "" in al and not _required(a, d) else None),
    "dropped answer": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: ... if v is not ... and "" not in al and not _required(a, d) else None),
    "second allowed value": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: al[1] if v is not ... and len(al) > 1 and al[1] != "" else None),
    "restyled string": lambda calls, e: _first(calls, e, lambda a, v, al, d: _restyled(v)),
    "list elements retyped": lambda calls, e: _first(calls, e, lambda a, v, al, d: _retyped(v)),
    "dict list lengthened": lambda calls, e: _first(
        calls, e, lambda a, v, al, d: v + v[-1:] if type(v) is list and v and type(v[0]) is dict else None),
    "argument the answer lacks": lambda calls, e: _unanswered(calls, e),
    "extra argument": lambda calls, e: [(calls[0][0], {**calls[0][1], "zz_unexpected": 1})] + calls[1:],
    "wrong function name": lambda calls, e: [(calls[0][0] + "_x", calls[0][1])] + calls[1:],
    "duplicated call": lambda calls, e: calls + calls[:1],
    "calls reversed": lambda calls, e: calls[::-1] if len(calls) > 1 else None,
    "one call dropped": lambda calls, e: calls[:-1] if len(calls) > 1 else None,
}


@needs_bfcl
def test_grade_agrees_with_bfcl_ast_checker(oracle):
    agree, applied, passed, wrong = Counter(), Counter(), Counter(), []
    for category in AST_CATEGORIES:
        for entry in bfcl.load_entries(category):
            gold = _gold(entry)
            for mutation, mutate in MUTATIONS.items():
                calls = mutate(gold, entry)
                if calls is None:
                    continue
                expected, got = oracle(entry, calls), bfcl.grade(entry, calls)
                key = (category, mutation)
                applied[key] += 1
                agree[key] += expected == got
                passed[key] += expected
                if expected != got:
                    wrong.append(f"{entry['id']} {mutation}: bfcl {expected}, mrl {got} on {calls}")
    table = "\n".join(f"{c:24s} {m:26s} agree {agree[c, m]}/{applied[c, m]} (BFCL passes {passed[c, m]})"
                      for c, m in applied)
    assert not wrong, f"{len(wrong)} disagreements, first: {wrong[:5]}\n{table}"
    print(table)
    # The mutations reach every rule: gold calls mostly pass, wrong ones fail, int for float passes.
    for category in ("simple_python", "multiple", "parallel"):
        assert passed[category, "gold"] >= 0.95 * applied[category, "gold"], table
        for mutation in ("wrong value", "int as string", "float for int", "bool for int", "missing required",
                         "extra argument", "wrong function name", "duplicated call", "dropped answer"):
            assert passed[category, mutation] <= 0.05 * applied[category, mutation], (mutation, table)
        assert passed[category, "int for float"] >= 0.9 * applied[category, "int for float"], table
        assert passed[category, "omitted optional"] >= 0.95 * applied[category, "omitted optional"], table
    assert passed["parallel", "calls reversed"] >= 0.95 * applied["parallel", "calls reversed"], table
    assert passed["parallel", "one call dropped"] == 0, table
