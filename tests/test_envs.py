"""Environments: one home each (mrl/envs/), a new one is one module and one YAML, and the graders stay importable by
their documented names."""

from __future__ import annotations

import math
from pathlib import Path

from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.validation import validate

TEST_CONF = Path(__file__).resolve().parent / "conf"


def test_an_environment_is_one_module_and_one_yaml(make_cfg, tmp_path):
    """tests/parity_env.py and tests/conf/rewards/parity.yaml, on Hydra's search path: `rewards=parity` trains."""
    from mrl.train.loop import train

    cfg = make_cfg(f"hydra.searchpath=[file://{TEST_CONF}]", "rewards=parity", "algo=gdpo")
    validate(cfg)
    final = train(cfg, tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2]
    assert all(0.0 <= r["reward/correct/mean"] <= 1.0 and r["reward/brevity/mean"] <= -1.0 for r in records)
    assert math.isfinite(final["loss/policy"])


def test_the_documented_graders_stay_importable():
    """At their homes, as docs/benchmarks.md names them."""
    from mrl.envs.bfcl.grader import grade as bfcl_grade
    from mrl.envs.bfcl_agent.gym import replay
    from mrl.envs.humaneval import grade as humaneval_grade
    from mrl.sandbox import run_tests

    assert all(map(callable, (bfcl_grade, replay, humaneval_grade, run_tests)))


def test_no_environment_is_split_across_folders():
    """Each conf/rewards/<name>.yaml names code in one home: mrl.envs.<its environment> (HumanEval: code's channels;
    a variant preset: the environment it varies)."""
    from omegaconf import OmegaConf

    from mrl.core.config import CONF_DIR

    variants = {"agent_triple_binding": "agent_triple",  # agent_triple with an uncomputable share
                "agent_triple_judged": "agent_triple",  # agent_triple with correctness judged twice (repro-successors)
                "bfcl_paper": "bfcl"}  # bfcl with the GDPO paper's channels

    def load(path):  # a preset over the presets its defaults name
        preset = OmegaConf.load(path)
        bases = [d for d in preset.get("defaults", []) if d not in ("rewards_schema", "_self_")]
        return OmegaConf.merge(*(load(path.parent / f"{base}.yaml") for base in bases), preset)

    for path in sorted((CONF_DIR / "rewards").glob("*.yaml")):
        preset = load(path)
        targets = [preset.task._target_] + [c.fn._target_ for c in preset.channels.values()]
        homes = {".".join(t.split(".")[:3]) for t in targets}
        shared = {"mrl.envs.bfcl_agent"} if path.stem == "bfcl_gen" else set()  # bfcl_agent's channels, unchanged
        assert homes <= {f"mrl.envs.{variants.get(path.stem, path.stem)}", "mrl.envs.code", *shared}, (path.name, homes)
