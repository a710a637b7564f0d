"""Prompts from a local dataset: JSONL, Parquet, or a directory saved with HF `datasets` `save_to_disk`.

Record schema: each record (a JSONL line, a Parquet row, a dataset row) is one prompt.
- `prompt` (or whatever `Schema.text_field` / `text_field` names) holds the text shown to the policy; it must be a
  string.
- every other field goes, unchanged, to `Prompt.meta` for the reward channels to read, e.g. `answer` for math,
  `tests` for code, `call` for tool calling.  `Schema.rename` maps a record key to a different meta key.
- `Schema.required` lists fields each record must have (a missing field, or a null one, is an error naming the record).

- `messages` (optional): the conversation shown to a chat model (`Prompt.messages`): system, few-shot and user turns,
  each `{"role": "system" | "user" | "assistant" | "tool", "content": str}` (an assistant turn may carry
  `tool_calls`), ending with a user turn.  With `messages`, `prompt` may be left out: it is the last user turn.
- `tools` (optional): the record's own tools (`Prompt.tools`), declared to the model instead of the task's: a list of
  function declarations, OpenAI form `{"type": "function", "function": {"name", "description", "parameters"}}` or
  bare `{"name", "description", "parameters"}` (BFCL's), `parameters` a JSON schema; or tool_call's short form
  `{tool name: [parameter names]}`.

Example JSONL line: `{"prompt": "What is 2 + 3?", "answer": "5"}` -> `Prompt(text="What is 2 + 3?",
meta={"answer": "5"})`.

A Hub id (`data.path=org/name`, `org/name::test`) that is not a local path loads through `datasets.load_dataset`
where the Hub can be reached; without a network it is refused at once, in one line saying how to save it locally.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from mrl.core import safe_json
from mrl.core.config import UserError
from mrl.core.episode import Demonstration, Prompt, train_split_only

FORMATS = ("a .jsonl file", "a .parquet file", "a directory saved with HF datasets save_to_disk")
SPLIT_SEP = "::"


def _parse_path(path: str | Path) -> tuple[Path, str | None]:
    """`data/my_ds::test` -> (Path("data/my_ds"), "test"); a path without `::` has no split."""
    text = str(path)
    split = None
    if SPLIT_SEP in text:
        text, split = text.rsplit(SPLIT_SEP, 1)
        if not split:
            raise UserError(f"dataset path {str(path)!r} ends in {SPLIT_SEP!r} with no split name; "
                            f"write PATH{SPLIT_SEP}SPLIT (e.g. data/my_ds{SPLIT_SEP}train) or drop the {SPLIT_SEP!r}")
    return Path(text).expanduser(), split


# A record's JSON: nesting (a tool's JSON schema is a few levels deep) and number literals bounded (mrl.core.safe_json),
# so that nothing read from a file crashes a recursive walk or Python's int() after the run dir exists.
RECORD_DEPTH = 64
RECORD_DIGITS = 100
RECORD_CHARS = 64_000_000


def _load_jsonl(path: Path) -> list[dict]:
    records, offset = [], 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: line {lineno} is not UTF-8 (byte {raw[e.start]:#04x} at byte offset "
                                f"{start + e.start} of the file); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = safe_json.loads(line, RECORD_CHARS, RECORD_DEPTH, RECORD_DIGITS)
            except safe_json.Unreadable as e:
                raise UserError(f"{path}: line {lineno} {e}; each non-blank line must be one JSON object") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}: line {lineno} is a JSON {type(record).__name__}, not an object; "
                                "each non-blank line must be one JSON object such as {\"prompt\": \"...\"}")
            records.append(record)
    return records


def _load_parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return _bounded_records(pq.read_table(path).to_pylist(), str(path))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None


def _bounded_records(records: list[dict], shown: str) -> list[dict]:
    """Records parsed by another reader (Parquet, HF datasets), bounded as a JSONL line is."""
    for i, record in enumerate(records):
        problem = safe_json.check(record, RECORD_DEPTH)
        if problem:
            raise UserError(f"{shown}: record {i} {problem}; flatten the record")
    return records


def _load_hf_dir(path: Path, split: str | None, shown: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise UserError(f"dataset directory {shown!r} is not one saved with HF datasets save_to_disk "
                        "(no dataset_info.json / dataset_dict.json in it); supported formats: "
                        f"{', '.join(FORMATS)}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        name = split if split is not None else "train"
        if name not in ds:
            if split is None:
                raise UserError(f"dataset {shown!r} has no 'train' split; pick one of {splits} with "
                                f"{path}{SPLIT_SEP}SPLIT")
            raise UserError(f"dataset {shown!r} has no split {split!r}; choose from {splits}")
        ds = ds[name]
    elif split is not None:
        raise UserError(f"dataset {shown!r} is a single Dataset with no splits, so {SPLIT_SEP}{split} does not apply; "
                        f"drop the {SPLIT_SEP}{split}")
    return _bounded_records(ds.to_list(), shown)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hub spells a repository
HUB_HOST = "huggingface.co"


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached, or None: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, or no TCP
    connection to huggingface.co:443 within 3 s (a thread: a name lookup has no timeout of its own)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    host = os.environ.get("HF_ENDPOINT", f"https://{HUB_HOST}").split("://")[-1].split("/")[0]
    problem: list[str] = ["no answer within 3 s"]

    def connect() -> None:
        try:
            socket.create_connection((host, 443), timeout=3).close()
            problem[0] = ""
        except OSError as err:
            problem[0] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(3.5)
    return f"no connection to {host}:443 ({problem[0]})" if problem[0] else None


def _load_hub(hub_id: str, split: str | None) -> list[dict]:
    """A Hub dataset through `datasets.load_dataset` (its `train` split, or `::SPLIT`), or one line saying to save it
    locally when the Hub cannot be reached."""
    reason = hub_unreachable()
    name = hub_id.split("/")[-1]
    if reason is not None:
        raise UserError(f"data.path={hub_id!r} is not a local path, and as a Hub dataset id it cannot be loaded: "
                        f"{reason}. Save it where there is a network: python -c \"import datasets; "
                        f"datasets.load_dataset('{hub_id}').save_to_disk('data/{name}')\", then give "
                        f"data.path=data/{name}")
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, split=split or "train")
    except Exception as err:  # the hub's own errors (no such dataset, no such split, gated) in one line
        raise UserError(f"data.path={hub_id!r}: datasets.load_dataset failed: {type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}") from None
    return _bounded_records(ds.to_list(), hub_id)


def dataset_file(path: str | Path) -> tuple[Path | None, str | None]:
    """(file or directory, split or None) of a dataset path that exists; a UserError if it does not.  A Hub id
    (org/name, no such local path) is None: it loads through `datasets` (`load_records`)."""
    file, split = _parse_path(path)
    if not file.exists():
        if HUB_ID.fullmatch(str(file)) and not str(path).startswith((".", "/", "~")):
            return None, split
        raise UserError(f"dataset path {str(path)!r} does not exist (looked for {file.resolve()})")
    return file, split


def load_records(path: str | Path) -> list[dict]:
    """The records of a local JSONL file, Parquet file, or HF `save_to_disk` directory (`DIR::SPLIT` picks a split)."""
    shown = str(path)
    file, split = dataset_file(path)
    if file is None:
        return _load_hub(shown.split(SPLIT_SEP)[0], split)
    if file.is_dir():
        return _load_hf_dir(file, split, shown)
    if split is not None:
        raise UserError(f"dataset {shown!r}: {SPLIT_SEP}{split} only applies to HF dataset directories, not to a file; "
                        f"drop the {SPLIT_SEP}{split}")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return _load_jsonl(file)
    if suffix == ".parquet":
        return _load_parquet(file)
    raise UserError(f"dataset file {shown!r} has unsupported extension {suffix or '(none)'!r}; "
                    f"supported formats: {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Schema:
    """How a record becomes a Prompt: which field is the text, which fields must exist, meta keys to rename."""

    text_field: str = "prompt"
    required: tuple[str, ...] = ()
    rename: dict[str, str] = field(default_factory=dict)


def _present(record: dict, key: str) -> bool:
    return key in record and record[key] is not None


ROLES = ("system", "user", "assistant", "tool")


def record_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """A record's `messages`, checked: a list of {role, content} turns with at least one user turn.

    >>> record_messages([{"role": "user", "content": "Hi"}], "record 0")
    [{'role': 'user', 'content': 'Hi'}]
    """
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: `messages` must be a non-empty list of {{\"role\", \"content\"}} turns, got "
                        f"{json.dumps(value)[:80]}")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise UserError(f"{where}: messages[{k}] = {json.dumps(m)[:80]} is not a turn; write "
                            f"{{\"role\": one of {list(ROLES)}, \"content\": \"...\"}}")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", {}), (dict, str)) for c in calls)):
            raise UserError(f"{where}: messages[{k}].tool_calls = {json.dumps(calls)[:80]} is not a list of calls "
                            "of an assistant turn; write [{\"type\": \"function\", \"function\": {\"name\": \"...\", "
                            "\"arguments\": {...}}}]")
    if value[-1]["role"] != "user":
        raise UserError(f"{where}: `messages` must end with the user's turn (the policy answers it), not a "
                        f"{value[-1]['role']!r} turn")
    return [dict(m) for m in value]


def record_tools(value: Any, where: str) -> list[dict[str, Any]]:
    """A record's `tools` as OpenAI-form declarations (what chat templates take as `tools=`).

    >>> record_tools({"calc": ["a", "b"]}, "record 0")[0]["function"]["parameters"]["required"]
    ['a', 'b']
    >>> record_tools([{"name": "f", "parameters": {"type": "object", "properties": {}}}], "r")[0]["type"]
    'function'
    """
    if isinstance(value, dict) and all(isinstance(params, list) for params in value.values()):
        # tool_call's short form {name: [parameter names]}: untyped parameters, all required
        value = [{"name": name, "parameters": {"type": "object", "properties": {p: {} for p in params},
                                               "required": list(params)}} for name, params in value.items()]
    if not isinstance(value, list):
        raise UserError(f"{where}: `tools` must be a list of function declarations "
                        "({\"name\", \"description\", \"parameters\"}) or {tool name: [parameter names]}")
    declared = []
    for k, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"] \
                or not isinstance(function.get("parameters", {}), dict):
            raise UserError(f"{where}: tools[{k}] = {json.dumps(tool)[:80]} is not a function declaration; write "
                            "{\"name\": \"...\", \"description\": \"...\", \"parameters\": {JSON schema}}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        declared.append({"type": "function", "function": {"name": function["name"],
                                                          "description": function.get("description", ""),
                                                          "parameters": parameters}})
    return declared


def record_tests(value: Any, where: str) -> list:
    """A code record's `tests`: a list of Python expressions (str) or {"stdin", "stdout"} runs.  A lone string is
    refused rather than read as a list of its characters."""
    if not isinstance(value, list) or not all(
            isinstance(t, str) or (isinstance(t, dict) and set(t) == {"stdin", "stdout"}
                                   and all(isinstance(v, str) for v in t.values())) for t in value):
        raise UserError(f"{where}: `tests` must be a list of Python expressions or {{\"stdin\", \"stdout\"}} runs, "
                        f"got {json.dumps(value)[:80]}; write e.g. \"tests\": [\"f(0) == 3\"]")
    return value


def record_call(value: Any, where: str) -> dict:
    """A tool-calling record's expected `call`: {"name": str, "arguments": {name: value} or [values]}."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and isinstance(value.get("arguments"), (dict, list))):
        raise UserError(f"{where}: `call` must be {{\"name\": \"...\", \"arguments\": {{...}}}}, got "
                        f"{json.dumps(value)[:80]}")
    return value


# Fields whose shape the channels rely on, checked wherever a record has them.
FIELD_CHECKS = {"tests": record_tests, "call": record_call}


def conversation_messages(record: dict, where: str) -> Any:
    """The turns of a TRL SFT record: `messages` (conversational language modeling), or `prompt` and `completion`,
    each a string (standard prompt-completion: a user and an assistant turn) or a list of turns (conversational).

    >>> conversation_messages({"prompt": "2+2?", "completion": "4"}, "record 0")[1]
    {'role': 'assistant', 'content': '4'}
    """
    if _present(record, "messages"):
        return record["messages"]
    if _present(record, "prompt") and _present(record, "completion"):
        turns = lambda v, role: v if isinstance(v, list) else [{"role": role, "content": v}]  # noqa: E731
        return turns(record["prompt"], "user") + turns(record["completion"], "assistant")
    raise UserError(f"{where}: a conversation needs `messages` (a list of turns) or `prompt` and `completion` (TRL's "
                    f"conversational and prompt-completion formats); it has fields {sorted(record)}")


def conversation_prompt(record: dict, where: str) -> dict:
    """A conversation record as a prompt record: its turns before the first assistant turn are the `messages`
    (`mrl sft`'s held-out prompts); its other columns stay."""
    turns = conversation_messages(record, where)
    first = next((k for k, m in enumerate(turns) if isinstance(m, dict) and m.get("role") == "assistant"), len(turns))
    rest = {k: v for k, v in record.items() if k not in ("messages", "prompt", "completion")}
    return {**rest, "messages": turns[:first]}


def records_to_prompts(records: Iterable[dict], schema: Schema | None = None) -> list[Prompt]:
    """One Prompt per record: text from `schema.text_field` (or the last user turn of `messages`), `messages` and
    `tools` to the Prompt's own fields, every other field (renamed per `schema.rename`) to meta.  A text field that
    holds a list of turns (TRL's conversational format: `"prompt": [{"role": "user", ...}]`) is the `messages`."""
    schema = schema or Schema()
    prompts = []
    for i, record in enumerate(records):
        if isinstance(record.get(schema.text_field), list) and not _present(record, "messages"):
            record = {**{k: v for k, v in record.items() if k != schema.text_field},
                      "messages": record[schema.text_field]}
        has = sorted(k for k in record if record[k] is not None)
        messages = record_messages(record["messages"], f"record {i}") if _present(record, "messages") else []
        tools = record_tools(record["tools"], f"record {i}") if _present(record, "tools") else []
        if messages and not _present(record, schema.text_field):
            record = {**record, schema.text_field: messages[-1]["content"]}
        for name in (schema.text_field, *schema.required):
            if not _present(record, name):
                role = "text field" if name == schema.text_field else "required field"
                raise UserError(f"record {i} is missing the {role} {name!r}; it has fields {has}. Set the text field "
                                "(text_field) and required fields to ones the data has, or fix the record")
        text = record[schema.text_field]
        if not isinstance(text, str):
            raise UserError(f"record {i}: text field {schema.text_field!r} must be a string, got "
                            f"{type(text).__name__} {text!r:.80}")
        for name, check in FIELD_CHECKS.items():
            if _present(record, name):
                check(record[name], f"record {i}")
        meta: dict[str, Any] = {}
        for key, value in record.items():
            if key in (schema.text_field, "messages", "tools"):
                continue
            new = schema.rename.get(key, key)
            if new in meta:
                raise UserError(f"record {i}: renaming {key!r} to {new!r} collides with another field named {new!r}; "
                                "choose a different name in rename")
            meta[new] = value
        prompts.append(Prompt(text=text, meta=meta, messages=messages, tools=tools))
    return prompts


def split_train_eval(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a `random.Random(seed)` shuffle; the first round(len * eval_fraction) items go to eval.

    Eval gets at least 1 item when eval_fraction > 0 and there are 2+ items, and at most len - 1, so train is never
    emptied by the split.  Same items and seed -> same split.
    """
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or math.isnan(eval_fraction) \
            or not 0 <= eval_fraction < 1:
        raise UserError(f"eval_fraction must be a number in [0, 1), got {eval_fraction!r}; "
                        "use 0 for no eval set, e.g. 0.1 to hold out 10%")
    n = len(items)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = round(n * eval_fraction)
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, max(n - 1, 0))
    eval_items = [items[i] for i in order[:n_eval]]
    train_items = [items[i] for i in order[n_eval:]]
    return train_items, eval_items


class EpochStream:
    """`items` served as an endless stream, reshuffled each epoch: index i is item i % n of epoch i // n, whose order
    is a `random.Random(f"{key}/{epoch}")` shuffle.  The same index always gives the same item, and every item
    appears once per epoch (the train split of every dataset-backed task)."""

    def __init__(self, items: list, key: Any):
        self.items, self.key = items, key
        self._epoch: int | None = None
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self.items))
        if epoch != self._epoch:  # one epoch at a time: the stream walks forward
            self._order = list(range(len(self.items)))
            random.Random(f"{self.key}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.items[self._order[pos]]


class SplitPrompts:
    """A task's items split once into train and held out, served as prompts: `prompt(index)` walks the train items as
    an EpochStream keyed by `key`, `eval_prompts()` gives the held-out ones, each made a Prompt by `to_prompt` (the
    items may be Prompts already).  What a dataset, HumanEval and BFCL share; a task holds one and hands `prompt`
    and `eval_prompts` on to it.

    >>> split = SplitPrompts(["a", "b"], ["c"], key=0, to_prompt=lambda word: Prompt(text=word))
    >>> len(split), sorted(split.prompt(i).text for i in range(2)), [p.text for p in split.eval_prompts()]
    (2, ['a', 'b'], ['c'])
    """

    def __init__(self, train: list, eval: list, key: Any, to_prompt: Callable[[Any], Prompt] | None = None):
        self.train, self.eval = train, eval
        self.to_prompt = to_prompt if to_prompt is not None else _as_is
        self._stream = EpochStream(train, key)

    @classmethod
    def shuffled(cls, items: list, eval_fraction: float, seed: int, key: Any,
                 to_prompt: Callable[[Any], Prompt] | None = None) -> SplitPrompts:
        """`items` split by `split_train_eval(items, eval_fraction, seed)`, the train part streamed by `key`."""
        train, held_out = split_train_eval(items, eval_fraction, seed)
        return cls(train, held_out, key, to_prompt)

    def __len__(self) -> int:
        return len(self.train)

    def prompt(self, index: int) -> Prompt:
        """Train item number `index` of the stream as a prompt: the same index always gives the same prompt."""
        return self.to_prompt(self._stream[index])

    def eval_prompts(self) -> list[Prompt]:
        """The held-out items as prompts, in their order; never served by `prompt()`."""
        return [self.to_prompt(item) for item in self.eval]

    def demonstrations(self, split: str, preset: str,
                       solve: Callable[[Any], Demonstration | None]) -> list[Demonstration]:
        """`solve(item)` of each train item, those it solves (None: left out); only the train split has any."""
        train_split_only(split, preset)
        return [demo for demo in map(solve, self.train) if demo is not None]


def _as_is(prompt: Prompt) -> Prompt:
    return prompt


class DatasetTask:
    """A task over a local dataset's prompts: `prompt(index)` walks the train split, reshuffled each epoch.

    Index i is prompt i % n of epoch i // n (n train prompts), whose order is a `random.Random(f"{seed}/{epoch}")`
    shuffle: the same index always gives the same prompt and every train prompt appears once per epoch.
    """

    def __init__(self, path: str, seed: int = 0, eval_fraction: float = 0.1, schema: Schema | None = None,
                 text_field: str = "prompt", required: tuple[str, ...] | list[str] = (), conversations: bool = False):
        """conversations: the records are whole conversations (`mrl sft`'s), prompted with their turns before the
        first assistant turn (`conversation_prompt`)."""
        self.path, self.seed = str(path), seed
        self.schema = schema if schema is not None else Schema(text_field=text_field, required=tuple(required))
        records = load_records(path)
        if conversations:
            records = [conversation_prompt(r, f"{path} record {i}") for i, r in enumerate(records)]
        prompts = records_to_prompts(records, self.schema)
        self.split = SplitPrompts.shuffled(prompts, eval_fraction, seed, key=seed)
        if not self.split.train:
            raise UserError(f"dataset {self.path!r} has no train prompts ({len(prompts)} records, "
                            f"eval_fraction={eval_fraction}); point it at a dataset with at least one record")

    def prompt(self, index: int) -> Prompt:
        return self.split.prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        return self.split.eval_prompts()
