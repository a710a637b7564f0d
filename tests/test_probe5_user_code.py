"""Issue 59, item 5: a user's reward function that returns a huge int, raises SystemExit/KeyboardInterrupt/a
BaseException of its own, or an endless iterable ends the run in one line, non-zero, the last checkpoint kept; bools
and NumPy scalars are read as TRL reads them (`torch.tensor(values, dtype=torch.float32)`)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config

from mrl.core.episode import Episode, Prompt
from mrl.rewards.channels import ChannelSpec, RewardError, RewardSet
from mrl.rewards.trl import TrlReward
from mrl.runs.rundir import CHECKPOINTS, Interrupted, checkpoint_problem, latest_checkpoint

TESTS = Path(__file__).resolve().parent
SEARCH = f"hydra.searchpath=[file://{TESTS / 'conf'}]"
EPISODES = [Episode(Prompt("2+3="), "5", [1], 1, False, 8), Episode(Prompt("1+1="), "3", [2], 1, False, 8)]


def score(fn, on_error: str = "raise"):
    return RewardSet([ChannelSpec("mine", TrlReward(fn), 1.0)]).score(EPISODES, on_error)


def test_bools_and_numpy_scalars_score_as_trl_reads_them():
    values = [True, np.float32(0.25)], [np.bool_(False), np.int64(2)], [np.array(0.5), torch.tensor(-1.5)]
    got = [score(lambda completions, v=v, **kw: v)[0][:, 0].tolist() for v in values]
    assert got == [[1.0, 0.25], [0.0, 2.0], [0.5, -1.5]]
    trl = [torch.tensor(v, dtype=torch.float32).tolist() for v in values[:2]]  # TRL's own conversion, the oracle
    assert trl == got[:2]


def test_a_huge_int_is_one_line_naming_its_size_not_an_overflow_traceback():
    with pytest.raises(RewardError) as caught:
        score(lambda completions, **kw: [10**400, 1.0])
    assert "'mine' returned an int of 401 digits, not a finite number" in str(caught.value)
    assert "\n" not in str(caught.value)
    rewards, failed = score(lambda completions, **kw: [10**400, 1.0], on_error="drop")  # dropped, as NaN is
    assert failed[:, 0].tolist() == [True, False] and rewards[1, 0].item() == 1.0


class Mine(BaseException):
    pass


def raises(error: BaseException):
    def fn(completions, **kwargs):
        raise error
    return fn


@pytest.mark.parametrize("error, shown", [
    (SystemExit(0), "SystemExit(0)"), (KeyboardInterrupt(), "KeyboardInterrupt()"), (Mine("x"), "Mine('x')"),
    (GeneratorExit(), "GeneratorExit()")])
@pytest.mark.parametrize("on_error", ["raise", "drop"])
def test_a_base_exception_from_user_code_is_a_reward_error_even_under_drop(error, shown, on_error):
    with pytest.raises(RewardError) as caught:
        score(raises(error), on_error)
    assert str(caught.value).startswith(f"reward channel 'mine' raised {shown}, which would stop the trainer: raise "
                                        "an Exception instead")
    plain = RewardSet([ChannelSpec("plain", lambda episode: (_ for _ in ()).throw(error), 1.0)])  # a per-episode one
    with pytest.raises(RewardError, match="'plain' raised"):
        plain.score(EPISODES, on_error)


def test_a_signal_stop_passes_through_user_code_for_the_loop_to_checkpoint():
    with pytest.raises(Interrupted):  # StopSignals raises it inside whatever runs when SIGTERM comes
        score(raises(Interrupted(15)))


def test_an_endless_generator_is_read_one_past_the_batch_and_refused():
    pulled = itertools.count()

    def endless(completions, **kwargs):  # endless to the reader; bounded here so the old code fails, not the machine
        return (float(next(pulled)) for _ in range(10**5))

    with pytest.raises(RewardError, match="'mine' returned more than 2 values for 2 episodes"):
        score(endless)
    assert next(pulled) == 3  # 3 values read (2 episodes + 1), then the 4th is this one
    with pytest.raises(RewardError, match="returned more than 2 values"):
        score(lambda completions, **kw: itertools.repeat(1.0, 10**5))
    with pytest.raises(RewardError, match="returned 1 values for 2 episodes"):
        score(lambda completions, **kw: iter([1.0]))


ARMED = {"on": False}


def exit_when_armed(completions, **kwargs):
    """A TRL reward that calls exit() once the test arms it (after step 1's checkpoint)."""
    if ARMED["on"]:
        raise SystemExit(0)
    return [float(len(c[0]["content"]) % 3) for c in completions]


CONVERSATIONAL = [{"prompt": [{"role": "user", "content": f"add {a} {b} ="}], "solution": str((a + b) % 10)}
                  for a in range(3) for b in range(3)]


def trl_run_args(path: Path) -> list[str]:
    return [SEARCH, "rewards=trl_style", f"data.path={path}", "algo=gdpo", "trainer.eval_every=0",
            "rewards.channels.length.fn.fn=test_probe5_user_code.exit_when_armed"]


def test_exit_in_a_reward_function_stops_the_run_as_an_error_with_the_last_checkpoint_kept(tmp_path, monkeypatch):
    import mrl.train.loop
    from mrl.train.loop import train

    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL))
    real = mrl.train.loop.checkpoint_if_due

    def arm_after(run, step):
        real(run, step)
        ARMED["on"] = step >= 1

    monkeypatch.setattr(mrl.train.loop, "checkpoint_if_due", arm_after)
    cfg = compose_config(*trl_run_args(path), "trainer.max_steps=3", "trainer.save_every=1")
    try:
        with pytest.raises(RewardError, match="'length' raised SystemExit\\(0\\)"):  # the old code: exit 0, at step 2
            train(cfg, tmp_path / "run")
    finally:
        ARMED["on"] = False
    assert latest_checkpoint(tmp_path / "run").name == "step_000001"
    assert checkpoint_problem(latest_checkpoint(tmp_path / "run")) is None
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (tmp_path / "run" / CHECKPOINTS).iterdir()) == ["latest", "step_000001"]


def test_mrl_train_exits_non_zero_in_one_error_line_when_a_reward_calls_exit(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONAL))
    (tmp_path / "exits.py").write_text("def reward(completions, **kwargs):\n    raise SystemExit(0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS)])}
    result = subprocess.run([sys.executable, "-m", "mrl.cli", "train", *trl_run_args(path)[:-1],
                             "rewards.channels.length.fn.fn=exits.reward", "trainer.max_steps=1",
                             "trainer.prompts_per_step=2", "trainer.group_size=2", "logger=none",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("mrl: error: ")]
    assert result.returncode == 1, result.stderr  # the old code: 0
    assert len(errors) == 1 and "reward channel 'length' raised SystemExit(0)" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
