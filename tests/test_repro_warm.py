"""The real-benchmark reproductions (repro-paper's BFCL setting, repro-agent): the 2-SE verdict by hand, the shared
warm start reused or rebuilt, the summaries and CSVs from fake run dirs, every command of both targets composed at
CPU and GPU scale without running one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mrl.core.config import CONF_DIR
from mrl.repro import warm
from mrl.repro.common import HELD, NOT_HELD, NOT_RESOLVED, combined_verdict, mean_se, two_se_verdict

SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"


# ---- the verdict rule, by hand -----------------------------------------------------------------------------------

def test_mean_and_standard_error_by_hand():
    # [1, 3]: mean 2, sample variance ((1-2)^2 + (3-2)^2) / 1 = 2, SE = sqrt(2 / 2) = 1
    assert mean_se([1.0, 3.0]) == (2.0, 1.0)
    assert mean_se([0.5, 0.5, 0.5]) == (0.5, 0.0)
    mean, se = mean_se([0.7])
    assert mean == 0.7 and se != se  # one seed: no standard error (NaN)


@pytest.mark.parametrize("ours, theirs, verdict", [
    # SE of ours 1, of theirs 0 -> SE of the difference 1; the difference against 2 SE = 2.0
    ([1.0, 3.0], [0.0, 0.0], NOT_RESOLVED),  # difference 2.0: exactly on the boundary, within
    ([1.5, 3.5], [0.0, 0.0], HELD),  # 2.5 > 2
    ([1.0, 3.0], [4.5, 4.5], NOT_HELD),  # -2.5 < -2
    ([1.0, 3.0], [4.0, 4.0], NOT_RESOLVED),  # -2.0: on the boundary again
    # both arms spread: SE 1 each -> SE of the difference sqrt(2) = 1.414, 2 SE = 2.83
    ([4.0, 6.0], [1.0, 3.0], HELD),  # 3.0 > 2.83
    ([3.5, 5.5], [1.0, 3.0], NOT_RESOLVED),  # 2.5 < 2.83
    ([0.3, 0.3, 0.3], [0.2, 0.2, 0.2], HELD),  # no spread at all: any difference resolves
    ([0.3, 0.3, 0.3], [0.3, 0.3, 0.3], NOT_RESOLVED),  # and none does not
    ([0.9], [0.1, 0.2], NOT_RESOLVED),  # one seed: nothing to resolve with
])
def test_two_se_verdict_by_hand(ours, theirs, verdict):
    assert two_se_verdict(ours, theirs) == verdict


def test_combined_verdict():
    assert combined_verdict([HELD, HELD]) == HELD
    assert combined_verdict([HELD, NOT_RESOLVED]) == NOT_RESOLVED
    assert combined_verdict([HELD, NOT_HELD]) == NOT_HELD
    assert combined_verdict([NOT_RESOLVED, NOT_HELD]) == NOT_HELD


def test_the_fingerprint_counts_the_sft_preset():
    from mrl.repro.common import named_presets

    assert named_presets("mrl sft rewards=bfcl trainer.seed=0\nmrl train -m rewards=bfcl algo=grpo,gdpo") == [
        "conf/algo/gdpo.yaml", "conf/algo/grpo.yaml", "conf/rewards/bfcl.yaml", "conf/sft.yaml", "conf/train.yaml"]


def test_bfcl_eval_per_category_keeps_the_first_of_each():
    from mrl.envs.bfcl import BfclTask

    every = BfclTask(["simple_python", "parallel"])
    some = BfclTask(["simple_python", "parallel"], eval_per_category=3)
    firsts = [[e["id"] for e in every.split.eval if e["category"] == c][:3] for c in ("simple_python", "parallel")]
    assert [e["id"] for e in some.split.eval] == firsts[0] + firsts[1]
    assert some.split.train == every.split.train  # the train split is untouched


# ---- fake runs: what `mrl sft` and `mrl train -m` would leave ------------------------------------------------------

def fake_checkpoint(run_dir: Path, step: int, payload: bytes = b"weights") -> None:
    """A sealed checkpoint as mrl writes one: state.json, policy weights (a real safetensors file), manifest.json."""
    import torch
    from safetensors.torch import save_file

    from mrl.runs.rundir import CHECKPOINTS, STATE_FILE, seal_checkpoint

    checkpoint = run_dir / CHECKPOINTS / f"step_{step:06d}"
    (checkpoint / "policy").mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": step}))
    save_file({"w": torch.tensor(list(payload), dtype=torch.float32)}, str(checkpoint / "policy" / "model.safetensors"))
    seal_checkpoint(checkpoint, {"stage": "sft"})


def fake_run(run_dir: Path, config: dict, records: list[dict], overrides: list[str] = ()) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), run_dir / ".hydra" / "overrides.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def arg(args: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(key + "="))


class FakeMrl:
    """Stands in for `warm.mrl`: `sft` writes a warm start (its evaluations, a checkpoint), `train -m` one run per
    algo and seed whose last evaluation is `finals[algo][i]` (the i-th seed swept), started from the warm start
    (lineage.json)."""

    def __init__(self, finals: dict[str, list[dict]], start: dict):
        self.finals, self.start, self.calls = finals, start, []

    def __call__(self, args: list[str]) -> None:
        self.calls.append(args)
        if args[0] == "sft":
            run_dir = Path(arg(args, "hydra.run.dir"))
            fake_run(run_dir, {"stage": "sft", "algo": {"name": "grpo"}, "trainer": {"seed": 0}},
                     [{"step": 0, "eval/accuracy": 0.0}, {"step": 1, "sft/loss": 0.5}, {"step": 2, **self.start}])
            fake_checkpoint(run_dir, 2)
            return
        from mrl.runs.rundir import intact_checkpoint
        from mrl.runs.warm_start import lineage

        sweep, source = Path(arg(args, "hydra.sweep.dir")), Path(arg(args, "trainer.init_from"))
        sha = lineage(intact_checkpoint(source, "test"))["policy_sha256"]
        job = 0
        for algo in arg(args, "algo").split(","):
            for index, seed in enumerate(arg(args, "trainer.seed").split(",")):
                run_dir = sweep / f"{job}_{algo}_seed{seed}"
                final = self.finals[algo][index]
                fake_run(run_dir, {"algo": {"name": algo}, "trainer": {"seed": int(seed), "max_steps": 4,
                                                                        "prompts_per_step": 1, "group_size": 4}},
                         [{"step": 0, **self.start}, {"step": 1, "reward/correctness/mean": 0.1,
                                                      "dapo/rollouts_generated": 8 if "dapo" in algo else 4},
                          {"step": 4, **final}], [f"algo={algo}", f"trainer.seed={seed}"])
                (run_dir / "lineage.json").write_text(json.dumps({"policy_sha256": sha}))
                fake_outcomes(run_dir, 4, final)
                job += 1


def fake_outcomes(run_dir: Path, step: int, final: dict, records: int = 10, samples: int = 4) -> None:
    """held_out/step_<step>.jsonl as mrl writes it, for `final`'s numbers: of `records` records, the first
    round(value x records) score 1 on a channel (greedy: eval/accuracy and eval/format/mean; each of the `samples`
    sampled episodes: eval/<channel>/mean@<samples>), the rest 0."""
    from mrl.train.evaluate import outcomes_path

    def value(key: str, i: int) -> float | None:
        return None if key not in final else float(i < round(final[key] * records))

    rows = []
    for i in range(records):
        rows.append({"id": f"r{i}", "sample": "greedy", "correctness": value("eval/accuracy", i),
                     "format": value("eval/format/mean", i)})
        rows += [{"id": f"r{i}", "sample": s, "correctness": value(f"eval/correctness/mean@{samples}", i),
                  "format": value(f"eval/format/mean@{samples}", i)} for s in range(samples)]
    path = outcomes_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def reports(tmp_path, monkeypatch):
    import mrl.repro.agent as agent
    import mrl.repro.common as common
    import mrl.repro.paper_bfcl as paper_bfcl

    for module in (common, agent, paper_bfcl):
        monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setenv("SCALE", "cpu")
    return tmp_path / "reports"


def bfcl_eval(accuracy: float, fmt: float) -> dict:
    """An evaluation's numbers; mean@4 the same as greedy."""
    return {"eval/accuracy": accuracy, "eval/format/mean": fmt, "eval/simple_python/accuracy": accuracy,
            "eval/multiple/accuracy": accuracy, "eval/parallel/accuracy": accuracy,
            "eval/correctness/mean@4": accuracy, "eval/format/mean@4": fmt}


def test_the_warm_start_is_reused_when_intact_and_made_again_when_not(reports, monkeypatch):
    from mrl.repro import paper_bfcl

    fake = FakeMrl({}, bfcl_eval(0.4, 0.8))
    monkeypatch.setattr(warm, "mrl", fake)
    plan = paper_bfcl.plan("cpu")
    first, reused = warm.ensure_warm_start(plan)
    assert not reused and len(fake.calls) == 1
    again, reused = warm.ensure_warm_start(plan)
    assert reused and again == first and len(fake.calls) == 1  # intact, made by the same arguments: not made again

    weights = next(plan.warm_dir.rglob("model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # a damaged checkpoint: its sha256 differs
    _, reused = warm.ensure_warm_start(plan)
    assert not reused and len(fake.calls) == 2

    other = warm.Plan(plan.root, plan.sft + ("sft.lr=1e-4",), plan.train, plan.sweeps)  # made by other arguments
    _, reused = warm.ensure_warm_start(other)
    assert not reused and len(fake.calls) == 3
    (plan.root / warm.WARM_FILE).unlink()  # a warm start whose record is lost is made again
    _, reused = warm.ensure_warm_start(other)
    assert not reused and len(fake.calls) == 4


def test_paper_bfcl_writes_the_table_verdict_csvs_and_figure(reports, monkeypatch):
    """gdpo leads on accuracy (mean@4) by 0.3 with a standard error of 0.0577 each (2 SE of the difference: 0.163):
    unpaired HELD; paired, 3 of 10 records differ by +1 in every seed: the resampled difference is Binomial(30, 0.3)
    / 30, whose 2.5th percentile is above 0: HELD.  On format the arms are 0.1 apart, within 2 SE: NOT RESOLVED;
    paired, 1 record of 10 per seed: Binomial(30, 0.1) is 0 with chance 0.04 > 0.025, the interval holds 0: NOT
    RESOLVED.  Both together: NOT RESOLVED."""
    from mrl.repro import paper_bfcl

    finals = {"grpo": [bfcl_eval(a, f) for a, f in ((0.2, 0.7), (0.3, 0.8), (0.4, 0.9))],
              "gdpo": [bfcl_eval(a, f) for a, f in ((0.5, 0.8), (0.6, 0.9), (0.7, 1.0))]}
    monkeypatch.setattr(warm, "mrl", FakeMrl(finals, bfcl_eval(0.35, 0.85)))
    monkeypatch.setattr(warm, "write_html", lambda plan, out, title: out)  # plotly's page: tested in test_report_html
    monkeypatch.setitem(paper_bfcl.SAMPLES, "cpu", 4)  # the fake runs' mean@4
    monkeypatch.setattr(paper_bfcl, "SEEDS", "0,1,2")  # the fake's three seeds, whatever the plan's
    paper_bfcl.main()
    out = reports / "paper" / "bfcl"
    summary = (out / "summary.md").read_text()
    assert "| start (warm start) | 0.350 | 0.850 |" in summary
    assert "| gdpo | 0.600 ± 0.058 | 0.900 ± 0.058 |" in summary
    assert "| held-out accuracy (BFCL's verdict): correctness/mean@4 | 0.600 ± 0.058 | 0.300 ± 0.058 | HELD (0.163) " \
           "| +0.300 [+0." in summary
    assert "| format: format/mean@4 | 0.900 ± 0.058 | 0.800 ± 0.058 | NOT RESOLVED (0.163) | +0.100 [+0.000, " \
           in summary
    rows = [line for line in summary.splitlines() if line.startswith(("| held-out accuracy", "| format:"))]
    assert [row.split(" | ")[-1] for row in rows] == ["HELD |", "NOT RESOLVED |"]  # the paired verdicts
    assert "3 seeds x 10 records" in rows[0] and "x the seeds x records" in rows[1]  # format: what would resolve it
    assert "**Verdict: NOT RESOLVED.**" in summary and "**Cost.**" in summary
    assert "Every run started from the warm start's weights" in summary
    assert "mrl sft model=smollm2_local rewards=bfcl" in summary and "mrl train -m model=smollm2_local" in summary
    assert "`conf/sft.yaml`" in summary and "`conf/algo/gdpo.yaml`" in summary  # the fingerprint
    rows = {(r["arm"], r["key"]): r for r in warm_csv(out / "bfcl.csv")}
    assert float(rows["gdpo", "eval/accuracy"]["mean"]) == pytest.approx(0.6)
    assert rows["start", "eval/accuracy"]["mean"] == "0.35"
    assert len(warm_csv(out / "bfcl_evals.csv")) == 12  # 6 runs x evaluations at steps 0 and 4
    assert (out / "bfcl.png").stat().st_size > 10_000


def test_paper_bfcl_judges_the_greedy_episodes_when_no_samples_are_drawn(reports, monkeypatch):
    """k = 0 (SCALE=cpu in the plans of 2026-12-06b to d): the claims are judged on each record's greedy episode, keyed
    eval/accuracy and eval/format/mean, with the same numbers as above (the fake's greedy rows equal its mean@4
    ones): accuracy HELD paired (Binomial(30, 0.3) / 30), format NOT RESOLVED; no mean@k column anywhere."""
    from mrl.repro import paper_bfcl

    finals = {"grpo": [bfcl_eval(a, f) for a, f in ((0.2, 0.7), (0.3, 0.8), (0.4, 0.9))],
              "gdpo": [bfcl_eval(a, f) for a, f in ((0.5, 0.8), (0.6, 0.9), (0.7, 1.0))]}
    fake, threads = FakeMrl(finals, bfcl_eval(0.35, 0.85)), []
    monkeypatch.setattr(warm, "mrl", lambda args: (threads.append(os.environ.get("OMP_NUM_THREADS")), fake(args)))
    monkeypatch.setattr(warm, "write_html", lambda plan, out, title: out)
    monkeypatch.setitem(paper_bfcl.SAMPLES, "cpu", 0)
    monkeypatch.setattr(paper_bfcl, "SEEDS", "0,1,2")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "unset")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("JOBS", "2")  # the two arms' multiruns side by side, a core each
    paper_bfcl.main()
    assert sorted(Path(arg(a, "hydra.sweep.dir")).name for a in fake.calls[1:]) == ["arms_gdpo", "arms_grpo"]
    assert [arg(a, "algo") for a in fake.calls[1:]] in (["grpo", "gdpo"], ["gdpo", "grpo"]) and threads[1:] == ["1"] * 2
    assert threads[0] is None and "OMP_NUM_THREADS" not in os.environ  # the warm start, and after: the cores' own
    summary = (reports / "paper" / "bfcl" / "summary.md").read_text()
    assert "| held-out accuracy (BFCL's verdict): accuracy | 0.600 ± 0.058 | 0.300 ± 0.058 | HELD (0.163) " \
           "| +0.300 [+0." in summary
    assert "| format: format/mean | 0.900 ± 0.058 | 0.800 ± 0.058 | NOT RESOLVED (0.163) | +0.100 [+0.000, " in summary
    assert "mean@" not in summary and "Claims judged on the greedy episode of each record" in summary
    assert "trainer.eval_samples=0" in summary


def test_agent_writes_start_and_end_per_preset_and_dapo_generations(reports, monkeypatch):
    from mrl.repro import agent

    def channels(correctness):
        return {"eval/correctness/mean": correctness, "eval/turns/mean": correctness,
                "eval/efficiency/mean": -0.5, "eval/safety/mean": -0.1}

    finals = {p: [channels(0.1 * s) for s in range(3)] for p in agent.PRESETS}
    fake = FakeMrl(finals, channels(0.05))

    def fake_mrl(args):
        if args[0] != "eval":
            return fake(args)
        run_dir, out = Path(args[1]), Path(args[args.index("--out") + 1])
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        out.mkdir()
        solved = round(last["eval/correctness/mean"] * 10)  # of 10 entries, the first ones; even: id, odd: ood
        greedy = {k.split("/")[1]: v for k, v in last.items() if k.startswith("eval/")}
        holdouts = {h: {"greedy": greedy | {"correctness": sum(i < solved for i in range(j, 10, 2)) / 5}}
                    for j, h in enumerate(["id", "ood"])}
        (out / "eval.json").write_text(json.dumps({"accuracy": last["eval/correctness/mean"], "greedy": greedy,
                                                   "holdouts": holdouts}))
        (out / "outcomes.jsonl").write_text("".join(json.dumps({
            "id": f"bfcl_gen/{['id', 'ood'][i % 2]}/fs_touch/{i // 2}", "sample": "greedy",
            "correctness": float(i < solved)}) + "\n" for i in range(10)))
        fake.calls.append(args)

    monkeypatch.setattr(warm, "mrl", fake_mrl)
    monkeypatch.setattr(warm, "write_html", lambda plan, out, title: out)
    agent.main()
    summary = (reports / "agent" / "summary.md").read_text()
    assert sum(a[0] == "eval" for a in fake.calls) == 21  # every run's final checkpoint scored
    assert "| start (warm start) | 0.050 | 0.050 | -0.500 | -0.100 |" in summary
    assert "| gdpo_dapo | 0.100 ± 0.058 | 0.100 ± 0.058 | -0.500 ± 0.000 | -0.100 ± 0.000 |" in summary
    # every preset solves the same entries seed for seed: each paired difference is 0, the interval [0, 0]
    assert "| gdpo vs grpo | 0.100 ± 0.058 | 0.100 ± 0.058 | NOT RESOLVED (0.163) | +0.000 [+0.000, +0.000] | " \
           "±0.000 (3 seeds x 10 records) | NOT RESOLVED |" in summary
    # each holdout on its own (SCALE=cpu: bfcl_gen's id and ood), from eval.json's holdouts and the outcomes' ids:
    # seeds 0, 1, 2 solve entries 0, 0-1, 0-2, so id (even entries) 0, 0.2, 0.2 and ood (odd) 0, 0, 0.2 of 5
    assert "| id/correctness |" in summary and "| ood/safety |" in summary
    assert "| gdpo vs grpo (id) | 0.133 ± 0.067 | 0.133 ± 0.067 | NOT RESOLVED (0.189) | +0.000 [+0.000, +0.000] " \
           "| ±0.000 (3 seeds x 5 records) | NOT RESOLVED |" in summary
    assert "| gdpo vs grpo (ood) | 0.067 ± 0.067 | 0.067 ± 0.067 |" in summary
    assert all("--samples" in a and a[a.index("--samples") + 1] == "0" for a in fake.calls if a[0] == "eval")
    assert "dapo 8.0 (2.00x)" in summary and "grpo 4.0 (1.00x)" in summary
    assert "**Verdict: NOT RESOLVED.**" in summary
    assert (reports / "agent" / "agent.png").exists() and warm_csv(reports / "agent" / "agent.csv")


def warm_csv(path: Path) -> list[dict]:
    from mrl.repro.common import read_csv

    return read_csv(path)


# ---- every command of both targets, at both scales, composed without running -------------------------------------

def expand(overrides: tuple[str, ...]) -> list[list[str]]:
    """A multirun's overrides as the jobs it runs: one list per combination of the comma-swept algo and seed."""
    swept = {o.split("=", 1)[0]: o.split("=", 1)[1].split(",") for o in overrides
             if o.split("=", 1)[0] in ("algo", "trainer.seed")}
    fixed = [o for o in overrides if o.split("=", 1)[0] not in swept]
    return [[*fixed, f"algo={algo}", f"trainer.seed={seed}"]
            for algo in swept["algo"] for seed in swept["trainer.seed"]]


def composed(config: str, overrides: list[str]):
    from mrl.train.validation import validate

    plain = [o for o in overrides if not o.startswith("hydra.")]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config, overrides=plain)
    validate(cfg)
    return cfg


@pytest.mark.parametrize("target", ["paper_bfcl", "agent"])
@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_every_command_of_the_plan_composes(target, scale, monkeypatch):
    import importlib

    from mrl.modeling import models
    from mrl.runs import warm_start as warm_start_module

    monkeypatch.setenv("MODEL", "/models/Qwen3-0.6B")
    if scale == "gpu" or not (SMOLLM2 / "config.json").exists():
        monkeypatch.setattr(models, "check", lambda cfg: None)  # a model dir that is not here: values still checked
    monkeypatch.setattr(warm_start_module, "check", lambda cfg: None)  # the warm start does not exist yet
    module = importlib.import_module(f"mrl.repro.{target}")
    plan = module.plan(scale)
    sft = composed("sft", plan.sft_args()[1:])
    assert sft.stage == "sft" and sft.trainer.eval_prompts == plan.eval_prompts
    jobs, sizes = 0, set()
    for sweep in plan.sweeps:
        args = plan.sweep_args(sweep)
        assert args[:2] == ["train", "-m"] and f"trainer.init_from={plan.warm_dir}" in args
        for job in expand(tuple(args[2:])):
            cfg = composed("train", job)
            jobs += 1
            # the warm start's task and prompt budget; the same compute for every arm
            task = {k: v for k, v in cfg.rewards.task.items() if k != "seed"}  # the seed orders the train split
            assert task == {k: v for k, v in sft.rewards.task.items() if k != "seed"}
            assert cfg.trainer.max_new_tokens == sft.trainer.max_new_tokens
            sizes.add((cfg.trainer.max_steps, cfg.trainer.prompts_per_step, cfg.trainer.group_size))
            if cfg.trainer.eval_every:
                assert cfg.trainer.max_steps % cfg.trainer.eval_every == 0  # the curve ends on the last step
    assert len(sizes) == 1
    if target == "paper_bfcl":
        assert jobs == len(module.ARMS) * len(module.SEEDS.split(",")) == 6  # the plan of 2026-12-06g: 3 seeds
        assert list(cfg.rewards.channels) == ["format", "correctness", "graded_correctness"]
        assert [cfg.rewards.channels[c].weight for c in cfg.rewards.channels] == [1.0, 0.0, 1.0]  # the paper's sum
        assert list(cfg.rewards.task.categories) == ["simple_python", "multiple", "parallel"]
    else:
        assert jobs == 21
    if scale == "gpu":
        assert cfg.trainer.max_steps >= 100 and cfg.trainer.group_size == 8
        assert cfg.model.name_or_path == "/models/Qwen3-0.6B"
        assert plan.thinking == ("enable_thinking" in (cfg.model.chat_template_kwargs or {}))
    if plan.thinking:  # Qwen3: each final checkpoint scored with thinking off and on
        think = plan.thinking_args(Path("run"), True)
        assert think[:2] == ["eval", "run"] and "model.chat_template_kwargs.enable_thinking=true" in think
        assert f"trainer.max_new_tokens={plan.thinking_tokens}" in think  # room for the thoughts
        assert "enable_thinking=false" in plan.commands()[-2] and "enable_thinking=true" in plan.commands()[-1]
    assert all(line.startswith("mrl ") for line in plan.commands())


def test_the_gpu_plans_score_qwen3_with_and_without_thinking(monkeypatch):
    from mrl.repro import agent, paper_bfcl

    monkeypatch.setenv("GPU_MODEL", "qwen3_0_6b")
    assert paper_bfcl.plan("gpu").thinking and agent.plan("gpu").thinking
    monkeypatch.setenv("GPU_MODEL", "qwen2_5_1_5b_instruct")
    assert not paper_bfcl.plan("gpu").thinking and not agent.plan("gpu").thinking
    assert not paper_bfcl.plan("cpu").thinking


def test_paper_settings_default_to_bfcl(monkeypatch):
    from mrl.repro.paper import SETTINGS, chosen_settings

    monkeypatch.delenv("SETTINGS", raising=False)
    assert chosen_settings() == (True, [])
    monkeypatch.setenv("SETTINGS", "toy")
    assert chosen_settings() == (False, SETTINGS)
    monkeypatch.setenv("SETTINGS", "bfcl,code")
    assert chosen_settings() == (True, [s for s in SETTINGS if s.rewards == "code"])
    monkeypatch.setenv("SETTINGS", "bfcl2")
    with pytest.raises(SystemExit, match="unknown"):
        chosen_settings()


# ---- end to end, at toy size -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="run `make smollm2` first")
def test_paper_bfcl_end_to_end_on_smollm2(reports, monkeypatch):
    """The BFCL setting for real at toy size: SmolLM2, a 2-step warm start, both arms x 2 seeds of 2 steps from it,
    one held-out record per category; the summary, CSVs and figure written, every arm from the warm start's weights."""
    from mrl.repro import paper_bfcl

    monkeypatch.chdir(SMOLLM2.parent.parent)
    model = paper_bfcl.SIZES["cpu"][0]
    tiny_rl = ["trainer.max_steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=1", "trainer.group_size=2",
               "trainer.micro_batch_size=2", "trainer.lr=3e-6"]
    tiny_sft = ["sft.steps=2", "sft.batch_size=2", "sft.micro_batch_size=2", "trainer.eval_at_start=false"]
    monkeypatch.setitem(paper_bfcl.SIZES, "cpu", (model, 1, tiny_sft, tiny_rl))  # 3 held-out records
    monkeypatch.setitem(paper_bfcl.MAX_NEW_TOKENS, "cpu", 32)
    monkeypatch.setattr(paper_bfcl, "SEEDS", "0,1")
    paper_bfcl.main()
    summary = (reports / "paper" / "bfcl" / "summary.md").read_text()
    assert "Every run started from the warm start's weights" in summary
    assert any(v in summary for v in ("**Verdict: HELD.**", "**Verdict: NOT HELD.**", "**Verdict: NOT RESOLVED.**"))
    assert len(warm_csv(reports / "paper" / "bfcl" / "bfcl_evals.csv")) == 4  # 4 runs x step 2 (0: the start's)
    assert (reports / "paper" / "bfcl" / "report.html").exists()


def test_eval_at_start_false_skips_only_step_zero(make_cfg, tmp_path):
    """Runs from one warm start repeat its evaluation at step 0 (greedy, the same weights): skipped, the rest kept."""
    from mrl.runs.tracking import METRICS_FILE, read_metrics
    from mrl.train.loop import train

    train(make_cfg("trainer.eval_every=1", "trainer.eval_prompts=2", "trainer.eval_at_start=false"), tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records if any(k.startswith("eval/") for k in r)] == [1, 2]
