"""`make repro-engine` (mrl/repro/engine_bfcl.py): its vLLM arms are repro-precision's bf16 arms with only the engine
apart, and its summary (the paired vLLM - native verdict, the logged gap) from fake runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import compose_config
from test_precision_repro import write_run

from mrl.repro import engine_bfcl, precision_bfcl
from mrl.runs.tracking import METRICS_FILE


def test_the_vllm_arm_is_the_native_arm_with_the_engine_changed():
    root = Path("runs")
    vllm = engine_bfcl.arm_args(3, root)
    native = precision_bfcl.arm_args(3, "bfloat16", engine_bfcl.NATIVE)
    assert [a for a in vllm if a not in native] == ["rollout.engine=vllm", "hydra.run.dir=runs/seed3/vllm"]
    assert [a for a in native if a not in vllm] == [f"hydra.run.dir={engine_bfcl.NATIVE / 'seed3' / 'bfloat16'}"]
    gap = engine_bfcl.gap_args(root)
    assert {a for a in gap if a not in vllm} == {"trainer.max_steps=10", "trainer.eval_every=0", "trainer.seed=0",
                                                 "model.compute_dtype=float32", "hydra.run.dir=runs/gap_fp32",
                                                 f"trainer.init_from={engine_bfcl.NATIVE / 'seed0' / 'sft'}"}
    cfg = compose_config(*[a for a in gap[1:] if not a.startswith(("hydra.", "trainer.init_from="))], shrink=False)
    assert cfg.rollout.engine == "vllm" and cfg.trainer.max_steps == 10 and cfg.model.compute_dtype == "float32"


def add_gaps(run_dir: Path, gaps: list[float]) -> None:
    """The vLLM run's metrics.jsonl with `rollout/logprob_gap` = gaps[step - 1], its max 10x, the weight 1 - gap."""
    lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    for line, gap in zip(lines, gaps):
        line |= {"rollout/logprob_gap": gap, "rollout/logprob_gap_max": 10 * gap, "rollout/importance_weight": 1 - gap}
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("vllm_solved, verdict, cell", [
    (12, "HELD", "+0.000 [+0.000, +0.000]"),  # the same 12 records as native: no loss, the interval at 0
    (6, "DID NOT HOLD", "-0.300 [-0.500, -0.100]"),  # 6 of 20 lost: as repro-precision's test
])
def test_the_summary_pairs_vllm_with_native_and_reports_the_gap(tmp_path, monkeypatch, vllm_solved, verdict, cell):
    import mrl.repro.common as common

    native = tmp_path / "reports" / "precision" / "runs"
    calls, threads = [], []

    def fake_mrl(args: list[str]) -> None:
        calls.append(args)
        threads.append(os.environ.get("OMP_NUM_THREADS"))
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        last = 10 if "trainer.max_steps=10" in args else 40
        write_run(run_dir, last, vllm_solved, (3.0, 10.0))
        add_gaps(run_dir, [0.01 * s for s in range(1, last + 1)])

    for module in (common, engine_bfcl):
        monkeypatch.setattr(module, "REPORTS", tmp_path / "reports")
    monkeypatch.setattr(engine_bfcl, "NATIVE", native)
    monkeypatch.setattr(engine_bfcl.warm, "mrl", fake_mrl)
    monkeypatch.setenv("SEEDS", "0,1")
    monkeypatch.setenv("JOBS", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(SystemExit, match="missing: .*seed0/sft .*make repro-precision first"):
        engine_bfcl.main()
    assert calls == [] and not (tmp_path / "reports" / "engine").exists()
    for seed in (0, 1):
        write_run(native / f"seed{seed}" / "sft", 10, 6, (0.0, 10.0))
        write_run(native / f"seed{seed}" / "bfloat16", 40, 12, (4.0, 10.0))
    engine_bfcl.main()
    assert [a[0] for a in calls] == ["train"] * 3 and all("rollout.engine=vllm" in a for a in calls)
    assert threads[:2] == [str(max(1, (os.cpu_count() or 1) // 2))] * 2 and threads[2] is None  # the pair shares
    summary = (tmp_path / "reports" / "engine" / "summary.md").read_text()
    same = [line for line in summary.splitlines() if line.startswith("| correctness: vLLM over native")]
    assert [line.split(" | ")[1] for line in same] == ["0", "1", "0,1"] and all(cell in line for line in same[:2])
    gain = [line for line in summary.splitlines() if line.startswith("| correctness: native RL over its start")]
    assert all("+0.300 [+0.100, +0.500]" in line and line.endswith("| HELD |") for line in gain[:2])
    assert f"**Verdict: {verdict}.**" in summary
    # 40 steps of gap 0.01 s: mean 0.205, first 0.01, last 0.40, largest max 4.0; the fp32 run's 10 steps: mean 0.055
    bf16 = "| seed 0, bf16, 40 steps | rollout/logprob_gap"
    assert f"{bf16} | 40 | 2.05e-01 | 1.00e-02 | 4.00e-01 | 4.00e-01 |" in summary
    assert f"{bf16}_max | 40 | 2.05e+00 | 1.00e-01 | 4.00e+00 | 4.00e+00 |" in summary
    assert "| seed 0, fp32, 10 steps | rollout/importance_weight | 10 | 0.9450 | 0.9900 | 0.9000 | 0.9900 |" in summary
    assert "| 1 | vllm | 3.00 | 10.00 | 13.00 |" in summary and "| 1 | native | 4.00 | 10.00 | 14.00 |" in summary
