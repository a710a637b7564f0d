"""Every check a run's config gets before anything is written.

The schemas (mrl/core/config.py) refuse misspelt keys, wrong types and bad enum values while Hydra composes. What they
cannot express is checked by `validate`: the one-value checks here (numeric ranges, the choices of plain-string
keys), then each component's own `check(cfg)` (a registry's names, channels against the algorithm, the model and
data a run reads, LoRA's targets); the run dir it writes is mrl.runs.rundir's.  `mrl train` runs `validate` from a Hydra
callback (`Preflight`), before Hydra creates the run dir and writes `.hydra/` into it, and `train(cfg)` runs it again
first thing (tests and the Python API compose configs without Hydra's callbacks).  Each problem is one UserError:
the key, the bad value, what is allowed, and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from mrl.core.config import (
    AlgoConfig,
    DataConfig,
    DeepSpeedConfig,
    LoggerConfig,
    LoraSettings,
    RolloutConfig,
    SftConfig,
    TrainerConfig,
    UserError,
    VllmSettings,
    schema_bounds,
)
from mrl.core.distributed import exit_with_error
from mrl.runs.rundir import check_run_dir

# Plain-string keys with a fixed set of values (the Enum-typed keys are checked by the schema): key -> (choices, fix).
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "rewards.on_error": (("raise", "drop"), "raise stops the run at a failing channel (after a checkpoint); drop "
                                            "leaves the sample out of the update and counts it"),
    "model.dtype": (("float32", "bfloat16", "float16"), "trained weights are float32 whatever it says; it picks "
                                                        "the compute and export dtype"),
    "logger.backend": (("wandb", "none"), "metrics.jsonl is written either way; `none` turns W&B off"),
    "logger.mode": (("offline", "online", "disabled"), "offline needs no login (wandb sync later)"),
}


# Every bounded schema field (mrl.core.config.bounded: the bound stands beside the field and its default), in this
# order.
BOUNDS = [bound for prefix, schema in (("trainer", TrainerConfig), ("sft", SftConfig), ("algo", AlgoConfig),
                                       ("data", DataConfig), ("deepspeed", DeepSpeedConfig), ("logger", LoggerConfig),
                                       ("model.lora", LoraSettings), ("rollout", RolloutConfig),
                                       ("rollout.vllm", VllmSettings))
          for bound in schema_bounds(prefix, schema)]


def check_values(cfg: DictConfig) -> None:
    """The checks of one value at a time (CHOICES, BOUNDS): no imports beyond OmegaConf, so they are quick."""
    for key, (choices, fix) in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise UserError(f"{key}={value!r}: choose one of {', '.join(choices)} ({fix})")
    for bound in BOUNDS:
        bound.check(OmegaConf.select(cfg, bound.key))


def validate(cfg: DictConfig) -> None:
    """Raise a UserError for the first bad value in `cfg` (the composed conf/train.yaml), or for a path the run
    would read that is missing: the quick checks of one value at a time, then each component's own `check(cfg)`.
    (The run dir's own checks, under its lock: mrl.runs.rundir.check_run_dir.)"""
    check_values(cfg)
    # Start-up time: the components import torch; imported once the plain checks passed, so refusals come fast.
    from mrl.algo import algos
    from mrl.chat import protocols
    from mrl.envs import task
    from mrl.generation import rollout
    from mrl.modeling import fits, lora, models, trainable
    from mrl.rewards import channels
    from mrl.runs import warm_start
    from mrl.train import demonstrations

    for check in (fits.check, rollout.check, algos.check, protocols.check, trainable.check, channels.check,
                  models.check, task.check, lora.check, warm_start.check, demonstrations.check):
        check(cfg)


def check_yaml_syntax(config_dirs: list[str]) -> None:
    """A user's config dir (`--config-dir`): the first YAML file that does not parse, as `file:line: message`."""
    import yaml

    for config_dir in config_dirs:
        for path in sorted(Path(config_dir).expanduser().rglob("*.yaml")):
            try:
                OmegaConf.load(path)  # Hydra's own YAML loader (duplicate keys are errors too)
            except yaml.MarkedYAMLError as err:
                mark = err.problem_mark or err.context_mark
                where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
                context = f" ({err.context}, line {err.context_mark.line + 1})" \
                    if err.context and err.context_mark is not None and err.problem_mark is not None else ""
                raise UserError(f"{where}: {err.problem or err.context}{context}") from None
            except (yaml.YAMLError, UnicodeDecodeError) as err:
                raise UserError(f"{path}: not valid YAML ({err})") from None


def config_dirs_in(args: list[str]) -> list[str]:
    """The directories given with --config-dir/-cd among Hydra's arguments."""
    dirs = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
    return dirs


class Preflight(Callback):
    """Hydra callback (conf/train.yaml: hydra.callbacks): validate before Hydra creates a run dir or writes .hydra/.

    Raising SystemExit (not an Exception) passes Hydra's error reporting, which would print a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate(config)
        except UserError as err:
            # Ranks > 0 get here only once rank 0's checks passed (mrl.cli): what fails now failed on this rank alone
            # (a model dir or dataset missing on its node), so it says so itself.
            exit_with_error(str(err), every_rank=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Compose every job of the sweep as the basic sweeper will and validate each, before the sweep dir exists.
        Other sweepers choose their jobs as they go: their jobs are validated by train() instead."""
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.override_parser.overrides_parser import OverridesParser

        if config.hydra.sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
            return
        loader = GlobalHydra.instance().config_loader()
        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(
            params + list(config.hydra.overrides.task))
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        configs = []
        for num, job in enumerate(jobs):
            job_cfg = loader.load_sweep_config(config, list(job))
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = job_cfg.hydra.job.num = num
            configs.append(job_cfg)
        # The quick checks of every job first: a bad value in the last job is refused as fast as one in the first.
        # Then each job's full checks, its run dir's included (a rerun sweep must not mix into finished jobs).
        for check in (check_values, _check_job):
            for num, (job, job_cfg) in enumerate(zip(jobs, configs)):
                try:
                    check(job_cfg)
                except UserError as err:
                    exit_with_error(f"job #{num} ({' '.join(job)}): {err}")


def _check_job(job_cfg: DictConfig) -> None:
    validate(job_cfg)
    check_run_dir(job_cfg, Path(job_cfg.hydra.sweep.dir) / str(job_cfg.hydra.sweep.subdir))
