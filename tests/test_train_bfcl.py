"""`make train-bfcl` and `make train-bfcl-agent`: their settings compose (SFT, then RL from its checkpoint), and
(slow, with `make smollm2`) a short version of each pipeline runs SmolLM2-135M-Instruct base -> SFT -> RL with
held-out accuracy at every stage; train-bfcl's summary (RL's paired gain over its start, SFT alone beside it) from
fake runs."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from conftest import compose_config, makefile_overrides
from hydra import compose, initialize_config_dir

from mrl.core.config import CONF_DIR
from mrl.repro import train_bfcl
from mrl.runs.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics
from mrl.train.loop import train
from mrl.train.sft import sft

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"


def stage_overrides(stage: str) -> list[str]:
    """train-bfcl's overrides of one stage (sft, rl, sft_more) for seed 0, without where it runs and starts from."""
    args = train_bfcl.stage_args(0, Path("runs"), extra_sft=5)[stage][1:]
    return [a for a in args if not a.startswith(("hydra.run.dir=", "trainer.init_from=", "trainer.resume="))]


PIPELINES = [(stage_overrides("sft"), stage_overrides("rl")),
             (makefile_overrides("SFT_BFCL_AGENT"), makefile_overrides("TRAIN_BFCL_AGENT"))]


def compose_sft(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("sft", overrides=list(overrides))


@pytest.mark.parametrize("sft_settings, rl_settings", PIPELINES)
def test_the_two_stages_compose_on_the_same_task_and_evaluation(sft_settings, rl_settings):
    first = compose_sft(*sft_settings)
    second = compose_config(*rl_settings, shrink=False)
    assert first.stage == "sft" and second.stage == "rl" and second.algo.name == "gdpo"
    assert first.rewards.task == second.rewards.task  # SFT's demonstrations and RL's prompts: one task
    sampled = ("temperature",) if second.trainer.eval_samples else ()  # mean@k at the same temperature
    for key in ("max_new_tokens", "max_tool_tokens", "eval_prompts", "eval_samples", *sampled):  # RL's step 0 scores
        # what SFT's end scored
        assert first.trainer[key] == second.trainer[key], key
    assert second.trainer.max_steps % second.trainer.eval_every == 0  # the held-out curve ends on the last step


def test_train_bfcl_scores_every_held_out_record():
    from mrl.envs.task import build_task

    cfg = compose_config(*stage_overrides("rl"), shrink=False)
    assert cfg.trainer.eval_prompts == len(build_task(cfg).split.eval) == 78
    more = compose_sft(*stage_overrides("sft_more"))
    assert more.sft.steps == train_bfcl.SFT_STEPS + 5 and more.trainer.eval_samples == cfg.trainer.eval_samples


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make smollm2` first")
def test_a_short_train_bfcl_pipeline_logs_held_out_accuracy_at_every_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model.name_or_path is relative to the repository
    short = ["trainer.eval_prompts=4"]
    sft(compose_sft(*stage_overrides("sft"), *short, "sft.steps=2", "trainer.eval_samples=0"), tmp_path / "sft")
    rl = ["trainer.max_steps=2", "trainer.eval_every=2", "logger.samples_every=1",
          f"trainer.init_from={tmp_path / 'sft'}"]
    train(compose_config(*stage_overrides("rl"), *short, *rl, "trainer.eval_samples=0", "trainer.eval_at_start=true",
                         shrink=False), tmp_path / "rl")
    sft_evals = {r["step"]: r for r in read_metrics(tmp_path / "sft" / METRICS_FILE) if "eval/accuracy" in r}
    records = read_metrics(tmp_path / "rl" / METRICS_FILE)
    rl_evals = {r["step"]: r for r in records if "eval/accuracy" in r}
    assert sorted(sft_evals) == [0, 2] and sorted(rl_evals) == [0, 2]  # base, after SFT; RL's start and end
    assert rl_evals[0]["eval/accuracy"] == sft_evals[2]["eval/accuracy"]  # RL starts where SFT ended
    for r in [*sft_evals.values(), *rl_evals.values()]:
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/simple_python/accuracy"] == r["eval/accuracy"]
        assert 0 <= r["eval/correctness/mean"] <= r["eval/right_functions/mean"] + 1e-9 <= 1 + 1e-9
    trained = [r for r in records if "reward/correctness/mean" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["reward/total/mean"]) for r in trained)
    sample = json.loads((tmp_path / "rl" / SAMPLES_FILE).read_text().splitlines()[-1])
    assert "You can call tools" in sample["prompt"] and sample["prompt"].count("<|im_start|>user") == 1  # no shots
    assert json.loads((tmp_path / "rl" / "lineage.json").read_text())["step"] == 2


# ---- the summary, from fake runs -----------------------------------------------------------------------------------

def write_stage(run_dir: Path, steps: range, step_s: float, step: int, solved: int, records: int = 20) -> None:
    """What an mrl stage leaves: metrics.jsonl (each step's perf/step_s, an evaluation at `step`) and that
    evaluation's outcomes, the first `solved` of `records` right on every sampled episode (format always 1)."""
    from mrl.train.evaluate import outcomes_path

    run_dir.mkdir(parents=True, exist_ok=True)
    share = {"eval/accuracy": solved / records, "eval/format/mean": 1.0, "eval/correctness/mean@4": solved / records,
             "eval/format/mean@4": 1.0}
    lines = [{"step": s, "perf/step_s": step_s} | (share if s == step else {}) for s in steps]
    with (run_dir / METRICS_FILE).open("a") as file:
        file.writelines(json.dumps(line) + "\n" for line in lines)
    rows = [{"id": f"r{i}", "sample": k, "correctness": float(i < solved), "format": 1.0}
            for i in range(records) for k in ["greedy", 0, 1, 2, 3]]
    outcomes_path(run_dir, step).parent.mkdir(exist_ok=True)
    outcomes_path(run_dir, step).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_train_bfcl_summary_pairs_rl_with_its_start_and_sft_alone(tmp_path, monkeypatch):
    """Both seeds: the start solves 6 of 20 records, RL 12 (the same 6 and 6 more), SFT alone 8.  RL - start: 6 of 20
    records +1, the resampled mean Binomial(20, 0.3)/20 with P(<= 1/20) = 0.008 and P(<= 2/20) = 0.035: the interval
    starts at 0.1, HELD on each seed.  SFT alone - start: 2 of 20, P(0) = 0.9^20 = 0.12: NOT RESOLVED.  SFT steps
    take 10 s and RL's 40 steps 30 s each: SFT alone gets 1200 / 10 = 120 more steps.  Both seeds together, SFT
    alone's 4 of 40 pairs: P(0) = 0.9^40 = 0.015 < 0.025, HELD.  RL - SFT alone: 4 of 20 records +1, Binomial(20,
    0.2): P(0) = 0.012, P(<= 7) = 0.968, P(<= 8) = 0.990: [0.05, 0.40], HELD, said beside the claim's verdict."""
    import mrl.repro.common as common

    calls = []

    def fake_mrl(args: list[str]) -> None:
        calls.append(args)
        if args[0] == "report":
            return
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        if args[0] == "train":
            write_stage(run_dir, range(1, 41), 30.0, 40, 12)
        elif "trainer.resume=true" in args:
            write_stage(run_dir, range(11, 131), 10.0, 130, 8)
        else:
            write_stage(run_dir, range(1, 11), 10.0, 10, 6)

    for module in (common, train_bfcl):
        monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(train_bfcl.warm, "mrl", fake_mrl)
    monkeypatch.setenv("SEEDS", "0,1")
    train_bfcl.main()
    assert [a[0] for a in calls] == ["sft", "train", "sft", "report"] * 2
    assert "sft.steps=130" in calls[2] and "trainer.resume=true" in calls[2]
    summary = (tmp_path / "reports" / "train-bfcl" / "summary.md").read_text()
    gain = [line for line in summary.splitlines() if line.startswith("| accuracy (correctness): RL (GDPO) over")]
    assert [line.split(" | ")[1] for line in gain] == ["0", "1", "0,1"]
    assert all("| 0.600 | 0.300 |" in line or "| 0.600 ± 0.000 | 0.300 ± 0.000 |" in line for line in gain)
    assert all("+0.300 [+0.100, +0.500]" in line and line.endswith("| HELD |") for line in gain[:2])
    alone = [line for line in summary.splitlines() if line.startswith("| accuracy (correctness): SFT alone")]
    assert all(line.endswith("| NOT RESOLVED |") and "+0.100 [+0.000," in line for line in alone[:2])
    assert alone[2].endswith("| HELD |")  # both seeds: Binomial(40, 0.1) is 0 with chance 0.015 < 0.025
    assert "1 seed x 20 records; this difference needs ~1.6x" in alone[0]  # (0.125 / 0.1)^2
    assert "**Verdict: HELD.** RL over its start, per seed: seed 0 HELD; seed 1 HELD. RL over SFT alone for the " \
           "same training time, per seed: seed 0 HELD (+0.200 [+0.050, +0.400]); seed 1 HELD (+0.200" in summary
    assert "| 0 | sft | 10 | 0.300 | 1.000 | 0.300 | 1.000 | 100 |" in summary  # the start, after 100 s of SFT
    assert "| 0 | rl | 40 | 0.600 | 1.000 | 0.600 | 1.000 | 1200 |" in summary


def test_jobs_runs_the_seeds_side_by_side_with_a_core_each(tmp_path, monkeypatch):
    """JOBS=2: each seed's chain (sft, train, sft resumed, report) still runs in its order, the children get one
    torch thread a seed on 2 cores, and the extra SFT steps are each seed's own."""
    import mrl.repro.common as common

    calls, threads = [], []

    def fake_mrl(args: list[str]) -> None:
        calls.append(args)
        threads.append(os.environ.get("OMP_NUM_THREADS"))
        if args[0] == "report":
            return
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        seed = int(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.seed=")))
        if args[0] == "train":
            write_stage(run_dir, range(1, 41), 30.0 * (seed + 1), 40, 12)
        elif "trainer.resume=true" not in args:
            write_stage(run_dir, range(1, 11), 10.0, 10, 6)

    for module in (common, train_bfcl):
        monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(train_bfcl.warm, "mrl", fake_mrl)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "unset")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("JOBS", "2")
    extra = train_bfcl.run_seeds([0, 1], tmp_path / "runs")
    assert extra == {0: 120, 1: 240}
    for seed, steps in extra.items():
        mine = [a for a in calls if f"trainer.seed={seed}" in a or str(tmp_path / "runs" / f"seed{seed}") in a[1]]
        assert [a[0] for a in mine] == ["sft", "train", "sft", "report"]
        assert f"sft.steps={10 + steps}" in mine[2]
    assert threads == ["1"] * 8


def test_sft_alone_resumes_the_sft_run_for_more_steps(tmp_path):
    """The SFT-alone stage is the SFT run resumed with more steps: the command line the run was started with (as
    Hydra saves it) and the resume's agree but for sft.steps, which a resume may extend."""
    import yaml

    from mrl.overrides import expand_resume

    args = train_bfcl.stage_args(0, tmp_path, extra_sft=25)
    sft_dir = tmp_path / "seed0" / "sft"
    (sft_dir / ".hydra").mkdir(parents=True)
    (sft_dir / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump([a for a in args["sft"][1:] if not a.startswith("hydra.")]))
    expanded = expand_resume(args["sft_more"][1:])
    assert expanded[-len(args["sft_more"]) + 1:] == args["sft_more"][1:]
    assert f"sft.steps={train_bfcl.SFT_STEPS + 25}" in expanded and "trainer.resume=true" in expanded


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_jobs_that_is_no_count_stops_in_one_line(value, monkeypatch):
    from mrl.repro.common import jobs

    monkeypatch.setenv("JOBS", value)
    with pytest.raises(SystemExit, match=rf"JOBS='{re.escape(value)}': .*a whole number from 1"):
        jobs()
