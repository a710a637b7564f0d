"""Shared fixtures: compose the real config (conf/train.yaml) and shrink it; keep every cache and log in tmp."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import mrl.core.config  # noqa: F401  registers the schemas
from mrl.core.config import CONF_DIR

# A small, fast run: 2 steps of 2 prompts x 4 rollouts, no W&B.
SHRINK = ["trainer.max_steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=4",
          "logger=none"]
ALGOS = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))
DEEPSPEED = sorted(p.stem for p in (CONF_DIR / "deepspeed").glob("*.yaml"))
REWARDS = sorted(p.stem for p in (CONF_DIR / "rewards").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("mrl_cache")
    os.environ["MRL_CACHE"] = str(cache)
    os.environ["WANDB_DIR"] = str(tmp_path_factory.mktemp("wandb"))
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    # DeepSpeed compiles a C++ op on first use: keep it in the persistent cache the CLI uses too.
    from mrl.modeling.trainable import torch_extensions_dir

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    yield


def makefile_overrides(variable: str) -> list[str]:
    """The Hydra overrides a Makefile variable holds (`TRAIN_REAL := model=... \\`), the settings of its target."""
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    block = re.search(rf"^{variable} := (.*?)(?<!\\)$", makefile, flags=re.MULTILINE | re.DOTALL).group(1)
    return block.replace("\\\n", " ").split()


def bwrap_problem() -> str | None:
    """Why the bubblewrap sandbox cannot start here (its one-line SandboxUnavailable), or None when it can."""
    from mrl.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox("bwrap")
        return None
    except SandboxUnavailable as err:
        return str(err)


def has_bwrap() -> bool:
    """Whether the bubblewrap sandbox can start here.  Where it cannot, the sandbox tests skip (the summary says why
    and how to fix it, once); under CI=true that is a failure instead: CI must test the boundary."""
    problem = bwrap_problem()
    if problem is not None and os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the sandbox tests cannot run: {problem}", pytrace=False)
    return problem is None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that builds a code channel where bwrap cannot start skips, as those marked with has_bwrap do."""
    from mrl.sandbox import SandboxUnavailable

    try:
        return (yield)
    except Exception as err:
        cause = err
        while cause is not None and not isinstance(cause, SandboxUnavailable):  # Hydra wraps a target's errors
            cause = cause.__cause__ or cause.__context__
        if cause is None or os.environ.get("CI") == "true":
            raise
        pytest.skip(f"sandbox unavailable: {cause}")


def pytest_terminal_summary(terminalreporter):
    problem = bwrap_problem()
    if problem is not None:
        terminalreporter.write_line(f"mrl: the code sandbox tests were skipped: {problem} (make install, as root, "
                                    "installs it; CI=true makes this a failure)")


def compose_config(*overrides: str, shrink: bool = True):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=(SHRINK if shrink else []) + list(overrides))


def algo_settings(cfg):
    """Phases 2 to 4's settings as a run builds them from `cfg` (mrl.train.loop.start_run)."""
    from mrl.generation.rollout import Sampling
    from mrl.train.update import AlgoSettings

    return AlgoSettings.of(cfg, Sampling.of(cfg.trainer))


@pytest.fixture
def make_cfg():
    return compose_config


def assert_one_line_validation_error(overrides: list[str], named: list[str]) -> None:
    """`validate` refuses the composed `overrides` with one line (a UserError) that contains every part of `named`."""
    from mrl.core.config import UserError
    from mrl.train.validation import validate

    with pytest.raises(UserError) as err:
        validate(compose_config(*overrides))
    assert "\n" not in str(err.value)
    for part in named:
        assert part in str(err.value)


# The default config's tiny model and tokenizer, loaded once per test module.
@pytest.fixture(scope="module")
def cfg(_isolated_env):
    return compose_config()


@pytest.fixture(scope="module")
def tokenizer(cfg):
    from mrl.modeling.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(cfg.model))


@pytest.fixture(scope="module")
def model(cfg):
    import torch

    from mrl.modeling.models import load_causal_lm, resolve_model_path

    return load_causal_lm(resolve_model_path(cfg.model), cfg.model, torch.device("cpu")).eval()


def scale_logits(model, factor: float) -> None:
    """Make `model`'s own forward return its logits times `factor`: a family whose forward transforms its logits in a
    way mrl does not know, for the checks that must refuse it."""
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * factor
        return out

    model.forward = scaled
