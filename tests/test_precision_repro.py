"""`make repro-precision` (mrl/repro/precision_bfcl.py): its runs are train-bfcl's stages with only the compute dtype
apart, and its summary (the paired bf16 - fp32 verdict, the step times side by side) from fake runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import compose_config

from mrl.repro import precision_bfcl, train_bfcl
from mrl.runs.tracking import METRICS_FILE
from mrl.train.evaluate import outcomes_path


def test_the_two_arms_differ_in_the_compute_dtype_only():
    root = Path("runs")
    bf16, fp32 = (precision_bfcl.arm_args(3, arm, root) for arm in precision_bfcl.ARMS)
    assert [a for a in bf16 if a not in fp32] == ["model.compute_dtype=bfloat16", "hydra.run.dir=runs/seed3/bfloat16"]
    assert "trainer.init_from=runs/seed3/sft" in bf16 and "trainer.seed=3" in bf16
    warm_start = precision_bfcl.sft_args(3, root)
    assert "model.compute_dtype=float32" in warm_start and warm_start[0] == "sft"
    # train-bfcl's RL stage but for its one evaluation, at the last step
    assert set(bf16) - set(train_bfcl.stage_args(3, root)["rl"]) == {
        "trainer.eval_every=40", "model.compute_dtype=bfloat16", "hydra.run.dir=runs/seed3/bfloat16"}
    cfg = compose_config(*[a for a in bf16[1:] if not a.startswith(("hydra.", "trainer.init_from="))], shrink=False)
    assert cfg.model.compute_dtype == "bfloat16" and cfg.trainer.max_steps % cfg.trainer.eval_every == 0


def write_run(run_dir: Path, last: int, solved: int, step_s: tuple[float, float], gap: float | None = None) -> None:
    """metrics.jsonl with rollout/update seconds every step (step 1 twice as slow), a gap at step 1, an evaluation
    at `last` whose first `solved` of 20 records are right on every sampled episode."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rollout, update = step_s
    lines = [{"step": s, "perf/rollout_s": rollout * (2 if s == 1 else 1), "perf/update_s": update,
              "perf/step_s": (rollout * (2 if s == 1 else 1) + update)} for s in range(1, last + 1)]
    if gap is not None:
        lines[0] |= {"perf/precision_logprob_gap": gap, "perf/precision_logprob_gap_max": 10 * gap}
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = [{"id": f"r{i}", "sample": k, "correctness": float(i < solved), "format": 1.0}
            for i in range(20) for k in ["greedy", 0, 1, 2, 3]]
    outcomes_path(run_dir, last).parent.mkdir(exist_ok=True)
    outcomes_path(run_dir, last).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("bf16_solved, verdict, cell", [
    (12, "HELD", "+0.000 [+0.000, +0.000]"),  # the same 12 records: no loss, the interval at 0
    (6, "DID NOT HOLD", "-0.300 [-0.500, -0.100]"),  # 6 of 20 records lost: Binomial(20, 0.3) / 20, as train-bfcl's
])
def test_the_summary_pairs_bf16_with_fp32_and_times_them_side_by_side(tmp_path, monkeypatch, bf16_solved, verdict,
                                                                      cell):
    import mrl.repro.common as common

    calls, threads = [], []

    def fake_mrl(args: list[str]) -> None:
        calls.append(args)
        threads.append(os.environ.get("OMP_NUM_THREADS"))
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        if args[0] == "sft":
            write_run(run_dir, 10, 6, (0.0, 10.0))
        elif "model.compute_dtype=bfloat16" in args:
            write_run(run_dir, 40, bf16_solved, (4.0, 10.0), gap=0.03)
        else:
            write_run(run_dir, 40, 12, (5.0, 15.0))

    for module in (common, precision_bfcl):
        monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(precision_bfcl.warm, "mrl", fake_mrl)
    monkeypatch.setenv("SEEDS", "0,1")
    monkeypatch.setenv("JOBS", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    precision_bfcl.main()
    assert sorted(a[0] for a in calls[:2]) == ["sft", "sft"] and [a[0] for a in calls[2:]] == ["train"] * 4
    assert threads == [str(max(1, (os.cpu_count() or 1) // 2))] * 6  # every run shares the cores with its pair
    summary = (tmp_path / "reports" / "precision" / "summary.md").read_text()
    same = [line for line in summary.splitlines() if line.startswith("| correctness: bf16 over fp32")]
    assert [line.split(" | ")[1] for line in same] == ["0", "1", "0,1"] and all(cell in line for line in same[:2])
    gain = [line for line in summary.splitlines() if line.startswith("| correctness: fp32 RL over its start")]
    assert all("+0.300 [+0.100, +0.500]" in line and line.endswith("| HELD |") for line in gain[:2])
    assert f"**Verdict: {verdict}.**" in summary
    # medians over steps 2-40 (step 1's doubled rollout left out): rollout 4 / 5, update 10 / 15, step 14 / 20
    assert "| 0 | bfloat16 | 4.00 | 10.00 | 14.00 | 0.0300 | 0.3000 |" in summary
    assert "| 0 | float32 | 5.00 | 15.00 | 20.00 | n/a | n/a |" in summary
    assert "| 0 | fp32 / bf16 | 1.25x | 1.50x | 1.43x |" in summary
