"""mrl.core.data: loading local datasets, records -> prompts, the train/eval split, and DatasetTask."""

from __future__ import annotations

import json

import pytest

from mrl.core.config import UserError
from mrl.core.data import DatasetTask, Schema, load_records, records_to_prompts, split_train_eval

RECORDS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "level": i % 3} for i in range(12)]


def write_jsonl(path, records, blank_lines=False):
    lines = [json.dumps(r) for r in records]
    if blank_lines:
        lines = [x for line in lines for x in (line, "")]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def save_dataset(path, records):
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def save_dataset_dict(path, splits):
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return path


# --- loading ---

def test_every_format_loads_the_same_records(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", RECORDS, blank_lines=True)
    parquet = write_parquet(tmp_path / "d.parquet", RECORDS)
    hf = save_dataset(tmp_path / "hf", RECORDS)
    hf_dict = save_dataset_dict(tmp_path / "hf_dict", {"train": RECORDS, "test": RECORDS[:2]})
    for path in (jsonl, parquet, hf, hf_dict, str(jsonl)):
        assert load_records(path) == RECORDS, path


def test_split_syntax_picks_a_split(tmp_path):
    save_dataset_dict(tmp_path / "ds", {"train": RECORDS, "test": RECORDS[:3]})
    assert load_records(f"{tmp_path / 'ds'}::test") == RECORDS[:3]
    assert load_records(f"{tmp_path / 'ds'}::train") == RECORDS
    with pytest.raises(UserError, match=r"no split 'dev'.*\['test', 'train'\]"):
        load_records(f"{tmp_path / 'ds'}::dev")


def test_dataset_dict_without_train_lists_its_splits(tmp_path):
    save_dataset_dict(tmp_path / "ds", {"validation": RECORDS[:2], "test": RECORDS[:3]})
    with pytest.raises(UserError, match=r"no 'train' split.*\['test', 'validation'\]"):
        load_records(tmp_path / "ds")


def test_split_syntax_rejected_where_it_does_not_apply(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(UserError, match="only applies to HF dataset directories"):
        load_records(f"{jsonl}::train")
    save_dataset(tmp_path / "hf", RECORDS)
    with pytest.raises(UserError, match="single Dataset"):
        load_records(f"{tmp_path / 'hf'}::train")


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl.*does not exist"):
        load_records(tmp_path / "nope.jsonl")


def test_unknown_extension_lists_formats(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(UserError, match=r"'\.csv'.*jsonl.*parquet.*save_to_disk"):
        load_records(path)


def test_plain_directory_is_not_a_dataset(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="save_to_disk"):
        load_records(tmp_path / "empty")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(UserError, match=r"d\.jsonl: line 3 is not valid JSON"):
        load_records(path)
    path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(UserError, match="line 2 is a JSON list"):
        load_records(path)


# --- records -> prompts ---

def test_records_to_prompts_moves_other_fields_to_meta():
    prompts = records_to_prompts(RECORDS[:2], Schema())
    assert prompts[1].text == "What is 1 + 1?"
    assert prompts[1].meta == {"answer": "2", "level": 1}
    renamed = records_to_prompts([{"q": "hi", "a": "x", "tests": []}], Schema(text_field="q", rename={"a": "answer"}))
    assert renamed[0].text == "hi" and renamed[0].meta == {"answer": "x", "tests": []}


def test_missing_field_names_field_index_and_fields_present():
    records = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
    with pytest.raises(UserError, match=r"record 1 is missing the required field 'answer'.*\['prompt'\]"):
        records_to_prompts(records, Schema(required=("answer",)))
    with pytest.raises(UserError, match=r"record 0 is missing the text field 'question'.*\['answer', 'prompt'\]"):
        records_to_prompts(records, Schema(text_field="question"))


def test_non_string_text_rejected():
    with pytest.raises(UserError, match="record 0: text field 'prompt' must be a string, got int"):
        records_to_prompts([{"prompt": 3}], Schema())


# --- split ---

def test_split_is_deterministic_disjoint_and_sized():
    items = list(range(10))
    train, eval_ = split_train_eval(items, 0.2, seed=7)
    assert (train, eval_) == split_train_eval(items, 0.2, seed=7)
    assert len(eval_) == 2 and len(train) == 8
    assert not set(train) & set(eval_) and sorted(train + eval_) == items
    assert split_train_eval(items, 0.2, seed=8) != (train, eval_)
    assert split_train_eval(items, 0.0, seed=7)[1] == []
    assert len(split_train_eval(items, 0.01, seed=7)[1]) == 1  # at least one eval item when eval_fraction > 0
    assert len(split_train_eval([1, 2], 0.9, seed=0)[0]) == 1  # train is never emptied by the split


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan")])
def test_split_rejects_bad_fraction(bad):
    with pytest.raises(UserError, match=r"eval_fraction must be a number in \[0, 1\)"):
        split_train_eval([1, 2, 3], bad, seed=0)


# --- DatasetTask ---

@pytest.fixture
def task(tmp_path):
    return DatasetTask(str(write_jsonl(tmp_path / "d.jsonl", RECORDS)), seed=3, eval_fraction=0.25,
                       required=("answer",))


def test_task_same_index_same_prompt(task, tmp_path):
    again = DatasetTask(str(tmp_path / "d.jsonl"), seed=3, eval_fraction=0.25)
    for i in (0, 5, 8, 9, 30, 4, 0):
        assert task.prompt(i) == again.prompt(i) == task.prompt(i)


def test_task_epochs_cover_train_exactly_once(task):
    n = len(task.split)
    assert n == 9 and len(task.eval_prompts()) == 3
    train_texts = sorted(p.text for p in task.split.train)
    epoch0 = [task.prompt(i).text for i in range(n)]
    epoch1 = [task.prompt(i).text for i in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == train_texts
    assert epoch0 != epoch1


def test_task_eval_prompts_never_served(task):
    eval_texts = {p.text for p in task.eval_prompts()}
    served = {task.prompt(i).text for i in range(5 * len(task.split))}
    assert eval_texts and not eval_texts & served
    assert served | eval_texts == {r["prompt"] for r in RECORDS}


def test_task_meta_carries_other_fields(task):
    by_text = {r["prompt"]: r for r in RECORDS}
    for i in range(len(task.split)):
        p = task.prompt(i)
        assert p.meta == {"answer": by_text[p.text]["answer"], "level": by_text[p.text]["level"]}


def test_task_from_parquet_with_schema(tmp_path):
    records = [{"question": f"q{i}", "answer": i} for i in range(4)]
    task = DatasetTask(str(write_parquet(tmp_path / "d.parquet", records)), eval_fraction=0.0,
                       schema=Schema(text_field="question", rename={"answer": "target"}))
    assert sorted(task.prompt(i).text for i in range(4)) == ["q0", "q1", "q2", "q3"]
    assert task.prompt(0).meta == {"target": int(task.prompt(0).text[1:])}


def test_task_empty_dataset_rejected(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no train prompts"):
        DatasetTask(str(tmp_path / "d.jsonl"))
