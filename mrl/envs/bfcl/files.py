"""BFCL v4's files, as the installed `bfcl-eval` package ships them (`make bfcl`): where they are, reading them, and an
entry's function docs as JSON-schema tool declarations.  Read as files: importing `bfcl_eval` would pull in every API
client it supports.  The single-turn grader (mrl.envs.bfcl.grader) and the multi-turn gym (mrl.envs.bfcl_agent.gym)
both read through here.
"""

import copy
import json
from importlib.util import find_spec
from pathlib import Path

from mrl.core.config import UserError

INSTALL = "run `make bfcl` (pip install --no-deps bfcl-eval==2026.3.23)"
# BFCL type -> JSON-schema type; "any" constrains nothing, so its schema has no "type".
_JSON_TYPES = {"string": "string", "integer": "integer", "float": "number", "boolean": "boolean", "array": "array",
               "tuple": "array", "dict": "object", "any": None}
# Schema keywords kept as they are; BFCL's own `optional` flag is dropped (`required` already says it).
_SCHEMA_KEYS = ("description", "enum", "default", "required", "format", "minimum", "maximum", "minItems", "maxItems")


def data_dir() -> Path:
    """The package's data folder, found without importing bfcl_eval (its __init__ chain needs API clients)."""
    spec = find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"BFCL data is not installed (no module bfcl_eval): {INSTALL}.")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"BFCL file {path} is missing: the installed bfcl-eval is not the expected one; {INSTALL}.")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _json_schema(bfcl: dict) -> dict:
    """One BFCL parameter doc as JSON schema: types mapped, properties and items converted recursively."""
    kind = bfcl.get("type")
    if kind is not None and kind not in _JSON_TYPES:
        raise ValueError(f"BFCL type {kind!r} is not one of {sorted(_JSON_TYPES)}: add its JSON-schema type to "
                         "_JSON_TYPES in mrl/envs/bfcl/files.py.")
    schema = {"type": _JSON_TYPES[kind]} if kind is not None and _JSON_TYPES[kind] else {}
    schema.update({key: copy.deepcopy(bfcl[key]) for key in _SCHEMA_KEYS if key in bfcl})
    if "properties" in bfcl:
        schema["properties"] = {name: _json_schema(doc) for name, doc in bfcl["properties"].items()}
    if "items" in bfcl:
        schema["items"] = _json_schema(bfcl["items"])
    return schema


def tool_schemas(entry: dict) -> list[dict]:
    """The entry's functions as OpenAI-style tool declarations; names kept as BFCL writes them (dots too).

    >>> tool_schemas({"function": [{"name": "math.hypot", "description": "Norm.", "parameters": {"type": "dict",
    ...     "properties": {"x": {"type": "float"}}, "required": ["x"]}}]})[0]["function"]["parameters"]
    {'type': 'object', 'required': ['x'], 'properties': {'x': {'type': 'number'}}}
    """
    return [{"type": "function",
             "function": {"name": doc["name"], "description": doc.get("description", ""),
                          "parameters": _json_schema(doc["parameters"])}}
            for doc in entry["function"]]
