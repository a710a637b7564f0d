"""Held-out evaluation: pass@k and the summary worked out by hand; the train-time curve (its keys, its steps, and a
training stream it leaves unchanged); `mrl eval RUN_DIR` and `mrl eval --model DIR` end to end, in subprocesses (a
table, eval.json and eval.jsonl; a short error otherwise); the report's held-out panels; the unknown-token warning."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from matplotlib.figure import Figure

from mrl.core.config import UserError
from mrl.core.episode import Episode, Prompt, ToolCall
from mrl.envs.task import build_task, episode_protocol
from mrl.generation.rollout import Rollouts, Sampling, generate
from mrl.modeling.models import resolve_model_path
from mrl.runs.report import make_report
from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.runs.trust import run_config, with_moved_targets
from mrl.train.batch import StepBatch
from mrl.train.evaluate import (
    HeldOut,
    eval_metrics,
    nonempty_held_out,
    outcome_rows,
    outcomes_path,
    pass_at_k,
    pass_ks,
    prompt_records,
    summarize,
)
from mrl.train.loop import train
from mrl.train.validation import validate

CPU = torch.device("cpu")
MRL = [sys.executable, "-m", "mrl.cli"]
CHANNELS = ["correctness", "efficiency", "safety"]  # the default run: rewards=agent_triple


def mrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MRL, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A 3-step run of the default config (2 prompts x 4 rollouts), checkpointed at every step, trained once for this
    module."""
    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    result = mrl("train", "trainer.max_steps=3", "trainer.save_every=1", "trainer.prompts_per_step=2",
                 "trainer.group_size=4", "logger=none", f"hydra.run.dir={run}", cwd=root)
    assert result.returncode == 0, result.stderr
    assert (run / "checkpoints" / "latest").exists()
    return run


def test_eval_prints_a_table_and_writes_eval_json(trained_run):
    result = mrl("eval", str(trained_run), "--prompts", "8", "--samples", "2", cwd=trained_run.parent)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Held-out prompts: 8 (step_000003)" in out
    assert "| decoding | correctness | efficiency | safety |" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"greedy", "sampled"} <= set(rows)
    for mode in ("greedy", "sampled"):
        cells = [c.strip() for c in rows[mode].strip().strip("|").split("|")][1:]
        assert len(cells) == len(CHANNELS)
        assert all(c == "-" or math.isfinite(float(c)) for c in cells)
    assert f"json: {trained_run / 'eval.json'}" in out
    lines = (trained_run / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 8 and [json.loads(line)["id"] for line in lines] == list(range(8))
    outcomes = [json.loads(line) for line in (trained_run / "outcomes.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in outcomes] == [(p, s) for p in range(8) for s in ["greedy", 0, 1]]

    report = json.loads((trained_run / "eval.json").read_text())
    assert {"greedy", "sampled", "prompts", "checkpoint"} <= set(report)
    assert report["prompts"] == 8 and report["checkpoint"] == "step_000003"
    for mode in ("greedy", "sampled"):
        assert list(report[mode]) == CHANNELS
        for name, value in report[mode].items():
            assert isinstance(value, float) and math.isfinite(value), (mode, name, value)
        assert 0.0 <= report[mode]["correctness"] <= 1.0
        assert -1.0 <= report[mode]["safety"] <= 0.0
        assert report[mode]["efficiency"] < 0  # every episode costs at least one token


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mrl: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_eval_of_a_run_with_overrides_of_its_config(trained_run, tmp_path):
    out = tmp_path / "out"
    result = mrl("eval", str(trained_run), "rewards.pass_channel=correctness", "--prompts", "2", "--samples", "0",
                 "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "eval.json").read_text())
    assert report["pass_channel"] == "correctness" and report["accuracy"] in (0.0, 0.5, 1.0)
    assert report["sampled"] is None and report["pass@k"] == {}  # --samples 0: greedy only
    assert [json.loads(line)["passed"] in (True, False) for line in (out / "eval.jsonl").read_text().splitlines()] \
        == [True, True]
    line = one_line_error(mrl("eval", str(trained_run), "rewards=tool_call", "--out", str(tmp_path / "o2"),
                              cwd=tmp_path))
    assert "rewards=tool_call: a run's config takes key=value overrides" in line and not (tmp_path / "o2").exists()


def test_a_run_saved_before_environments_moved_to_mrl_envs_is_read_with_their_homes_today(trained_run, tmp_path):
    """A config.yaml naming mrl.tasks.<env> and mrl.rewards.<env> (runs saved before 2026-12-03) is read with
    mrl.envs.<env>'s names through the one table of old names (mrl.runs.trust.OLD_HOMES): its task and channels
    build, the allow-list accepts it, `mrl export` reads it (renders=False) and `mrl eval` scores it."""
    run = tmp_path / "old"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval.json"))
    saved = run / ".hydra" / "config.yaml"
    text = saved.read_text()
    old = text.replace("mrl.envs.agent_triple.AgentTriple", "mrl.tasks.agent_triple.AgentTriple") \
        .replace("mrl.envs.agent_triple.", "mrl.rewards.agent_triple.")
    assert old.count("mrl.rewards.agent_triple.") == 3 and "mrl.envs" not in old
    saved.write_text(old)
    cfg = run_config(run)
    assert cfg.rewards.task._target_ == "mrl.envs.agent_triple.AgentTriple"
    assert {c.fn._target_ for c in cfg.rewards.channels.values()} == \
        {f"mrl.envs.agent_triple.{name}" for name in ("Correctness", "Efficiency", "Safety")}
    assert with_moved_targets({"_target_": "mrl.rewards.channels.OverlongPenalty"}) == \
        {"_target_": "mrl.rewards.channels.OverlongPenalty"}  # not an environment's: unchanged
    assert with_moved_targets({"_target_": "mrl.benchmarks.humaneval.HumanEvalTask"}) == \
        {"_target_": "mrl.envs.humaneval.HumanEvalTask"}
    assert run_config(run, renders=False).rewards.task._target_ == "mrl.envs.agent_triple.AgentTriple"  # as export
    result = mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_an_old_module_name_no_longer_imports():
    """The packages by layer (2026-12-06) keep no aliases: a fresh interpreter cannot import mrl.validation (its home
    is mrl.train.validation), and mrl has no table of moved modules; run dirs' old names are OLD_HOMES' alone."""
    done = subprocess.run([sys.executable, "-c", "import mrl.validation"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'mrl.validation'" in done.stderr
    import mrl

    assert not hasattr(mrl, "MOVED")


def test_eval_of_a_dir_that_is_not_a_run(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    line = one_line_error(mrl("eval", str(tmp_path / "not_a_run"), cwd=tmp_path))
    assert "not a run dir" in line


def test_eval_of_a_run_without_checkpoints(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("checkpoints", "eval.json"))
    assert (run / ".hydra" / "overrides.yaml").exists() and not (run / "checkpoints").exists()
    line = one_line_error(mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path))
    assert "no checkpoint" in line
    assert not (run / "eval.json").exists()


def test_eval_skips_a_damaged_checkpoint_for_the_newest_intact_one(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval.json"))
    weights = next((run / "checkpoints" / "step_000003").rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-64])  # cut short, as by a crash mid-copy
    result = mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Held-out prompts: 2 (step_000002)" in result.stdout
    assert "skipped step_000003" in result.stderr and "using step_000002" in result.stderr
    assert json.loads((run / "eval.json").read_text())["checkpoint"] == "step_000002"


def test_eval_with_every_checkpoint_damaged(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("eval.json"))
    for weights in (run / "checkpoints").rglob("*.safetensors"):
        weights.write_bytes(b"")
    line = one_line_error(mrl("eval", str(run), "--prompts", "2", "--samples", "1", cwd=tmp_path))
    assert "no intact checkpoint in" in line and "step_000003" in line
    assert not (run / "eval.json").exists()


# ---- pass@k and the summary, by hand ------------------------------------------------------------------------------

def test_pass_at_k_by_hand():
    # n=4 episodes, c=1 passes: 1 - C(3,k)/C(4,k) = 1 - 3/4, 1 - 3/6, 1 - 1/4, 1 - 0/1
    assert [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k: every draw of 2 holds a pass
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError, match=r"n=2, c=1, k=3"):
        pass_at_k(2, 1, 3)
    assert pass_ks(0) == [] and pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(7) == [1, 2, 4]


NAN = float("nan")


def scored(prompts: list[Prompt], rewards: list[list[float]], group_size: int) -> StepBatch:
    """Rollouts of `prompts` x `group_size` whose episodes and per-channel rewards are all the summary reads."""
    n = len(rewards)
    zeros = torch.zeros(n, 1, dtype=torch.long)
    episodes = [Episode(prompts[i // group_size], f"answer {i}", [], 1, False, 8, [ToolCall("calc", {"x": i})],
                        [f"answer {i}"]) for i in range(n)]
    failed = torch.zeros(n, len(rewards[0]), dtype=torch.bool)
    return StepBatch(Rollouts(zeros, zeros, zeros, zeros, zeros, episodes, group_size), torch.tensor(rewards), failed)


@pytest.fixture
def held() -> HeldOut:
    """3 prompts (categories a, a, b; the first has an id), channels [correctness, length], 2 samples each.
    Greedy correctness 1 (passes), 0.999 (fails: the pass is >= 1), abstained (fails)."""
    prompts = [Prompt("q0", {"category": "a", "id": "x-0"}), Prompt("q1", {"category": "a"}),
               Prompt("q2", {"category": "b"})]
    greedy = scored(prompts, [[1.0, 5.0], [0.999, 3.0], [NAN, 1.0]], 1)
    sampled = scored(prompts, [[1.0, 2.0], [1.0, 2.0], [1.0, 4.0], [0.0, 4.0], [0.0, 6.0], [0.0, 6.0]], 2)
    return HeldOut(prompts, ["correctness", "length"], greedy, sampled, 2)


def test_summary_and_metrics_by_hand(held):
    summary = summarize(held, "correctness")
    assert summary["greedy"] == {"correctness": pytest.approx((1 + 0.999) / 2), "length": 3.0}  # NaN left out
    assert summary["sampled"] == {"correctness": 0.5, "length": 4.0}
    assert summary["accuracy"] == pytest.approx(1 / 3)
    assert summary["categories"] == {"a": 0.5, "b": 0.0}
    # sampled passes per prompt c = 2, 1, 0 of n = 2: pass@1 = (1 + 1/2 + 0)/3, pass@2 = (1 + 1 + 0)/3
    assert summary["pass@k"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    assert eval_metrics(summary) == {
        "eval/correctness/mean": pytest.approx(0.9995), "eval/length/mean": 3.0, "eval/accuracy": pytest.approx(1 / 3),
        "eval/correctness/mean@2": 0.5, "eval/length/mean@2": 4.0,  # the 6 sampled episodes' means
        "eval/pass@1": pytest.approx(0.5), "eval/pass@2": pytest.approx(2 / 3), "eval/a/accuracy": 0.5,
        "eval/b/accuracy": 0.0}


def test_without_a_pass_channel_only_the_means(held):
    summary = summarize(held, None)
    assert summary["accuracy"] is None and summary["pass@k"] == {} and summary["categories"] == {}
    assert set(eval_metrics(summary)) == {"eval/correctness/mean", "eval/length/mean", "eval/correctness/mean@2",
                                          "eval/length/mean@2"}
    greedy_only = summarize(HeldOut(held.prompts, held.names, held.greedy, None, 0), None)
    assert set(eval_metrics(greedy_only)) == {"eval/correctness/mean", "eval/length/mean"}  # eval_samples=0: as before
    assert [r["passed"] for r in prompt_records(held, None)] == [None, None, None]


def test_outcome_rows_one_per_prompt_and_episode(held):
    rows = outcome_rows(held)
    assert [(r["id"], r["sample"]) for r in rows] == [("x-0", "greedy"), ("x-0", 0), ("x-0", 1), (1, "greedy"),
                                                      (1, 0), (1, 1), (2, "greedy"), (2, 0), (2, 1)]
    assert rows[0] == {"id": "x-0", "category": "a", "sample": "greedy", "correctness": 1.0, "length": 5.0}
    assert [r["correctness"] for r in rows[3:]] == [pytest.approx(0.999), 1.0, 0.0, None, 0.0, 0.0]  # sampled rows 2-5
    assert [r["length"] for r in rows if r["sample"] != "greedy"] == [2.0, 2.0, 4.0, 4.0, 6.0, 6.0]


def test_prompt_records_one_per_prompt(held):
    records = prompt_records(held, "correctness")
    assert [r["id"] for r in records] == ["x-0", 1, 2]  # meta["id"], else the index
    assert [r["passed"] for r in records] == [True, False, False]
    assert [r["sampled_passed"] for r in records] == [2, 1, 0]
    assert records[2]["rewards"] == {"correctness": None, "length": 1.0}  # the abstention
    assert records[0]["prompt"] == "q0" and records[0]["completion"] == "answer 0" and records[0]["category"] == "a"
    assert records[1]["tool_calls"] == [{"name": "calc", "arguments": {"x": 1}, "observation": "", "valid": True,
                                         "cut": False, "user_turn": 0}]
    json.dumps(records)  # eval.jsonl's lines


def test_pass_channel_must_name_a_channel(make_cfg):
    with pytest.raises(UserError, match=r"rewards.pass_channel='correct' is not a channel of rewards=agent_triple: "
                                        r"choose one of correctness, efficiency, safety"):
        validate(make_cfg("rewards.pass_channel=correct"))
    with pytest.raises(UserError, match=r"trainer.eval_prompts=0: must be a finite number >= 1"):
        validate(make_cfg("trainer.eval_prompts=0"))


# ---- the curve during training -------------------------------------------------------------------------------------

EVAL_RUN = ["trainer.max_steps=3", "trainer.eval_prompts=3", "trainer.eval_samples=2",
            "rewards.pass_channel=correctness"]
EVAL_KEYS = {"eval/correctness/mean", "eval/efficiency/mean", "eval/safety/mean", "eval/accuracy", "eval/pass@1",
             "eval/pass@2", "eval/correctness/mean@2", "eval/efficiency/mean@2", "eval/safety/mean@2"}


def training_curve(records: list[dict]) -> list[dict]:
    """What the training stream decides: every step's metrics but the evaluation's and the clocks'."""
    return [{k: v for k, v in r.items() if not k.startswith(("eval/", "perf/", "mem/"))} for r in records if r["step"]]


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory):
    """The same 3-step run twice: with held-out evaluations every 2 steps (3 prompts, 2 samples each), and without."""
    runs = {}
    for name, extra in (("with", "trainer.eval_every=2"), ("without", "trainer.eval_every=0")):
        runs[name] = tmp_path_factory.mktemp(name)
        train(compose_config(*EVAL_RUN, extra), runs[name])
    return runs


def test_eval_metrics_at_step_0_every_eval_every_steps_and_the_last(eval_runs):
    records = read_metrics(eval_runs["with"] / METRICS_FILE)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [EVAL_KEYS <= set(r) for r in records] == [True, False, True, True]
    assert set(records[0]) == EVAL_KEYS | {"step", "perf/eval_s"}  # the base model, before any update
    for record in (records[0], records[2], records[3]):
        assert record["eval/accuracy"] * 3 == pytest.approx(round(record["eval/accuracy"] * 3))  # k of 3 prompts
        assert record["eval/pass@1"] * 6 == pytest.approx(round(record["eval/pass@1"] * 6))  # k of 6 episodes
        assert 0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= 1
        assert record["eval/efficiency/mean"] < 0 and record["eval/correctness/mean"] == record["eval/accuracy"]
    assert not any(k.startswith("eval/") for k in read_metrics(eval_runs["without"] / METRICS_FILE)[0])


def test_each_evaluation_keeps_every_episodes_outcome(eval_runs):
    """held_out/step_<N>.jsonl per evaluation: 3 prompts x (greedy + 2 samples), whose means are the logged ones."""
    records = {r["step"]: r for r in read_metrics(eval_runs["with"] / METRICS_FILE)}
    assert sorted(p.name for p in (eval_runs["with"] / "held_out").iterdir()) == [
        "step_000000.jsonl", "step_000002.jsonl", "step_000003.jsonl"]
    for step in (0, 2, 3):
        rows = [json.loads(line) for line in outcomes_path(eval_runs["with"], step).read_text().splitlines()]
        assert [r["sample"] for r in rows] == ["greedy", 0, 1] * 3
        sampled = [r["correctness"] for r in rows if r["sample"] != "greedy"]
        greedy = [r["correctness"] for r in rows if r["sample"] == "greedy"]
        assert sum(sampled) / 6 == pytest.approx(records[step]["eval/correctness/mean@2"])
        assert sum(greedy) / 3 == pytest.approx(records[step]["eval/correctness/mean"])
    assert not (eval_runs["without"] / "held_out").exists()


def test_evaluations_leave_the_training_stream_unchanged(eval_runs):
    with_eval = training_curve(read_metrics(eval_runs["with"] / METRICS_FILE))
    without = training_curve(read_metrics(eval_runs["without"] / METRICS_FILE))
    assert [r["step"] for r in with_eval] == [1, 2, 3]
    assert with_eval == without  # rewards, advantages, losses: exactly equal


def test_an_evaluation_drawing_from_the_training_rng_would_change_the_stream(eval_runs, make_cfg, tmp_path,
                                                                              monkeypatch):
    """The check above can fail: with the evaluation's sampling on the training generators, step 1 differs."""
    @contextmanager
    def shared_rng(seed, device):
        yield

    monkeypatch.setattr("mrl.train.evaluate.separate_rng", shared_rng)  # what held_out_metrics draws under
    train(compose_config(*EVAL_RUN, "trainer.eval_every=2", "trainer.max_steps=1"), tmp_path)
    changed = training_curve(read_metrics(tmp_path / METRICS_FILE))
    assert changed[0] != training_curve(read_metrics(eval_runs["without"] / METRICS_FILE))[0]


def test_report_draws_held_out_panels_and_their_last_values(eval_runs, monkeypatch):
    drawn = []
    save = Figure.savefig

    def keep_axes(fig, *args, **kwargs):
        drawn.extend(ax for ax in fig.axes if ax.get_visible())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_axes)
    png, table = make_report([eval_runs["with"]])
    assert png.exists()
    titles = [ax.get_title() for ax in drawn]
    assert titles == ["train: correctness", "train: efficiency", "train: safety", "train: total",
                      "adv/share/correctness", "adv/share/efficiency", "adv/share/safety", "groups/dead_frac",
                      "adv/conflict_frac", "adv/corr/correctness~efficiency", "adv/corr/correctness~safety",
                      "adv/corr/efficiency~safety", "groups/dead_sum_live_channel",
                      "constraint/safety/violation_frac", "clip_frac", "entropy",  # the diagnostics logged
                      "held-out: correctness", "held-out: efficiency", "held-out: safety", "held-out: accuracy",
                      "held-out: pass@k"]
    records = read_metrics(eval_runs["with"] / METRICS_FILE)
    accuracy = drawn[titles.index("held-out: accuracy")].lines[0]
    assert list(accuracy.get_xdata()) == [0, 2, 3] and accuracy.get_marker() == "o"
    assert list(accuracy.get_ydata()) == [records[s]["eval/accuracy"] for s in (0, 2, 3)]  # not smoothed
    assert len(drawn[titles.index("held-out: pass@k")].lines) == 2  # k = 1, 2
    assert "Held-out at the last evaluation" in table
    assert "| run | step | correctness | efficiency | safety | accuracy | pass@1 | pass@2 |" in table
    last = records[3]
    assert f"| {eval_runs['with'].name} | 3 | {last['eval/correctness/mean']:.3f} |" in table
    assert "| correctness | efficiency | safety | total |" in table  # the training table is still there


# ---- mrl eval --model -----------------------------------------------------------------------------------------------

def test_eval_of_a_base_model_writes_eval_json_and_one_line_per_prompt(tmp_path):
    model_dir = resolve_model_path(compose_config().model)  # the built-in tiny model, as a model directory
    out = tmp_path / "out"
    result = mrl("eval", "--model", model_dir, "--prompts", "3", "--samples", "2", "--out", str(out),
                 "rewards.pass_channel=correctness", "trainer.max_new_tokens=6", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Held-out prompts: 3 ({model_dir})" in result.stdout and "accuracy (correctness >= 1" in result.stdout
    report = json.loads((out / "eval.json").read_text())
    assert report["model"] == model_dir and report["prompts"] == 3 and report["samples"] == 2
    assert list(report["greedy"]) == list(report["sampled"]) == CHANNELS
    assert set(report["pass@k"]) == {"1", "2"} and 0 <= report["accuracy"] <= 1
    assert report["greedy"]["efficiency"] >= -6  # max_new_tokens=6 applied: no episode spends more
    lines = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and [r["id"] for r in lines] == [0, 1, 2]
    for line in lines:
        assert {"id", "prompt", "completion", "turns", "tool_calls", "rewards", "passed", "sampled_passed"} <= set(line)
        assert list(line["rewards"]) == CHANNELS and line["passed"] == (line["rewards"]["correctness"] >= 1)
        assert line["prompt"].startswith("add ")


@pytest.mark.parametrize("args, expected", [
    (["--model", "no/such/model"], "--model no/such/model: no such directory"),
    (["--model", "builtin:tiny", "--prompts", "0"], "--prompts 0: give at least 1 held-out prompt"),
    (["--model", "builtin:tiny", "rewards.pass_channel=nope"], "rewards.pass_channel='nope' is not a channel"),
    (["--model", "builtin:tiny", "rewards=nope"], "Could not find 'rewards/nope'"),
    ([], "give a RUN_DIR (then key=value overrides, if any), or --model DIR"),
])
def test_eval_of_bad_input_is_one_line_and_writes_nothing(args, expected, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(mrl("eval", *args, "--out", str(out), cwd=tmp_path))
    assert expected in line
    assert not out.exists() and not (tmp_path / "outputs").exists()


# ---- unknown tokens ------------------------------------------------------------------------------------------------

def test_prompts_mostly_unknown_to_the_tokenizer_are_a_warning_once(cfg, model, tokenizer, capsys):
    task = build_task(cfg)
    protocol = episode_protocol(cfg, tokenizer, task)
    sampling = Sampling(max_new_tokens=2, greedy=True)
    generate(model, tokenizer, [Prompt("add 3 7 ="), Prompt("add 3 banana =")], 1, sampling, protocol, CPU)
    assert "unknown" not in capsys.readouterr().err  # 1 of 4 tokens unknown: not mostly
    english = [Prompt("add 3 7 ="), Prompt("What is three plus seven ?"), Prompt("add the numbers =")]
    generate(model, tokenizer, english, 1, sampling, protocol, CPU)
    err = capsys.readouterr().err
    # "What is three plus seven ?": 6 of 6 unknown; "add the numbers =": 2 of 4 (50%, not more)
    assert f"1 of 3 prompts are mostly unknown tokens to {model.name_or_path} (up to 100% <unk>)" in err
    generate(model, tokenizer, english, 1, sampling, protocol, CPU)
    assert "unknown" not in capsys.readouterr().err  # once per run


def test_a_task_without_held_out_prompts_is_refused():
    class NoneHeldOut:
        def eval_prompts(self):
            return []

    with pytest.raises(UserError, match="no held-out prompts .* data.eval_fraction > 0"):
        nonempty_held_out(NoneHeldOut(), 8)
