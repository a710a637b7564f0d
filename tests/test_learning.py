"""Slow checks (`make test-slow`): the default run learns, and dynamic sampling trains on live groups only.

Each trains the tiny model for a few hundred steps on CPU (~10-30 s on 2 idle cores)."""

from __future__ import annotations

import pytest
from conftest import compose_config

from mrl.runs.tracking import METRICS_FILE, read_metrics
from mrl.train.loop import train

pytestmark = pytest.mark.slow


def mean(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values)


def test_default_run_learns_to_use_the_tool(tmp_path):
    train(compose_config("logger=none", shrink=False), tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert mean(records[:10], "reward/correctness/mean") < 0.35
    assert mean(records[-10:], "reward/correctness/mean") > 0.6
    assert mean(records[-10:], "reward/safety/mean") > -0.05  # the vetoed shortcut is not used


@pytest.mark.parametrize("algo", ["dapo", "gdpo_dapo"])
def test_dynamic_sampling_trains_only_live_groups(algo, tmp_path):
    train(compose_config(f"algo={algo}", "trainer.max_steps=150", "logger=none", shrink=False), tmp_path)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert mean(records, "groups/dead_frac_raw") > 0
    assert all(r["groups/dead_frac"] in (0.0, None) for r in records)
