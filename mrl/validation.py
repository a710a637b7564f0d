"""Every check a run's config gets before anything is written.

The schemas (mrl/config.py) refuse misspelt keys, wrong types and bad enum values while Hydra composes. What they
cannot express is checked here: numeric ranges, the choices of plain-string keys, channels against the algorithm,
the paths a run reads and the run dir it writes. `mrl train` runs `validate` from a Hydra callback (`Preflight`),
before Hydra creates the run dir and writes `.hydra/` into it, and `train(cfg)` runs it again first thing (tests and
the Python API compose configs without Hydra's callbacks). Each problem is one UserError: the key, the bad value,
what is allowed, and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from mrl.config import UserError
from mrl.distributed import exit_with_error

# Plain-string keys with a fixed set of values (the Enum-typed keys are checked by the schema): key -> (choices, fix).
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "rewards.on_error": (("raise", "drop"), "raise stops the run at a failing channel (after a checkpoint); drop "
                                            "leaves the sample out of the update and counts it"),
    "model.dtype": (("float32", "bfloat16", "float16"), "trained weights are float32 whatever it says; it picks "
                                                        "the compute and export dtype"),
    "logger.backend": (("wandb", "none"), "metrics.jsonl is written either way; `none` turns W&B off"),
    "logger.mode": (("offline", "online", "disabled"), "offline needs no login (wandb sync later)"),
}


@dataclass(frozen=True)
class Bound:
    """A finite number within [low, high] (an end left None is open; `strict` excludes `low`)."""

    key: str
    low: float | None = None
    high: float | None = None
    strict: bool = False  # value > low rather than >= low
    below_high: bool = False  # value < high rather than <= high
    fix: str = ""

    def rule(self) -> str:
        lo = None if self.low is None else f"{'>' if self.strict else '>='} {self.low:g}"
        hi = None if self.high is None else f"{'<' if self.below_high else '<='} {self.high:g}"
        return " ".join(["a finite number", " and ".join(part for part in (lo, hi) if part)]).strip()

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.strict else value < self.low):
            return False
        return self.high is None or (value < self.high if self.below_high else value <= self.high)


BOUNDS = [
    Bound("trainer.max_steps", 1, fix="a positive number of steps"),
    Bound("trainer.seed", 0, 2**32 - 1, fix="NumPy takes 32-bit unsigned seeds"),
    Bound("trainer.prompts_per_step", 1),
    Bound("trainer.group_size", 1),
    Bound("trainer.max_new_tokens", 1),
    Bound("trainer.max_tool_tokens", 1, fix="the most tokens one tool result adds (256 by default)"),
    Bound("trainer.temperature", 0, strict=True, fix="rollouts are sampled from softmax(logits / temperature); 1.0 "
                                                     "samples the model's own distribution"),
    Bound("trainer.top_p", 0, 1, strict=True, fix="1.0 turns nucleus sampling off"),
    Bound("trainer.top_k", 0, fix="0 turns top-k sampling off"),
    Bound("trainer.lr", 0, strict=True, fix="AdamW's learning rate: 3e-4 suits the built-in tiny model, about 1e-6 "
                                            "a pretrained one"),
    Bound("trainer.weight_decay", 0, fix="0 turns it off"),
    Bound("trainer.grad_clip", 0, strict=True, fix="the gradient norm is clipped to it (1.0 by default)"),
    Bound("trainer.micro_batch_size", 1),
    Bound("trainer.num_mini_batches", 1, fix="optimizer steps per epoch over the batch"),
    Bound("trainer.save_every", 1, fix="a checkpoint every N steps (and at the end)"),
    Bound("trainer.eval_every", 0, fix="a held-out evaluation every N steps (and at step 0 and the end); 0 turns it "
                                       "off"),
    Bound("trainer.eval_prompts", 1, fix="held-out prompts scored at each evaluation (32 by default)"),
    Bound("trainer.eval_samples", 0, fix="sampled episodes per held-out prompt, for pass@k; 0 scores greedy only"),
    Bound("algo.adv_eps", 0, strict=True, fix="it keeps the advantage's std away from 0 (1e-6 by default)"),
    Bound("algo.epochs", 1, fix="passes over each batch"),
    Bound("algo.clip_low", 0, 1, below_high=True, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]; PPO "
                                                      "uses 0.2"),
    Bound("algo.clip_high", 0, fix="the ratio is clipped to [1 - clip_low, 1 + clip_high]; DAPO's clip-higher "
                                   "uses 0.28"),
    Bound("algo.kl_coef", 0, fix="0 turns the KL term off (no reference model is loaded)"),
    Bound("algo.entropy_coef"),
    Bound("algo.max_gen_batches", 1, fix="generation rounds per step with dynamic sampling"),
    Bound("algo.overlong_buffer", 0, fix="0 turns overlong shaping off"),
    Bound("algo.overlong_penalty", 0, fix="the overlong channel's weight"),
    Bound("algo.gamma", 0, 1),
    Bound("algo.lam", 0, 1),
    Bound("algo.value_clip", 0),
    Bound("algo.vf_coef", 0),
    Bound("data.eval_fraction", 0, 1, below_high=True, fix="0 holds nothing out; 0.1 holds out 10%"),
    Bound("deepspeed.stage", 0, 3, fix="the ZeRO stage; pick a preset: deepspeed=none|zero1|zero2|zero3"),
    Bound("deepspeed.gradient_clipping", 0),
    Bound("logger.log_every", 1),
    Bound("logger.samples_every", 0, fix="0 writes no transcripts"),
    Bound("model.lora.r", 0, fix="the adapters' rank; 0 turns LoRA off, 16 is usual"),
    Bound("model.lora.alpha", 0, strict=True, fix="the adapters' output is scaled by alpha / r; 2 * r is usual"),
    Bound("model.lora.dropout", 0, 1, below_high=True, fix="dropout on the adapters' input; 0 turns it off"),
]
CHANNEL_BOUNDS = [Bound("weight"), Bound("threshold"), Bound("gated_value"), Bound("violation_below")]


def _check_bound(bound: Bound, value: Any, key: str | None = None) -> None:
    key = key or bound.key
    if not bound.holds(float(value)):
        fix = f"; {bound.fix}" if bound.fix else ""
        raise UserError(f"{key}={value}: must be {bound.rule()}{fix}")


def check_values(cfg: DictConfig) -> None:
    """The checks of one value at a time (CHOICES, BOUNDS): no imports beyond OmegaConf, so they are quick."""
    for key, (choices, fix) in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise UserError(f"{key}={value!r}: choose one of {', '.join(choices)} ({fix})")
    for bound in BOUNDS:
        _check_bound(bound, OmegaConf.select(cfg, bound.key))


def validate(cfg: DictConfig) -> None:
    """Raise a UserError for the first bad value in `cfg` (the composed conf/train.yaml), or for a path the run
    would read that is missing.  (The run dir's own checks, under its lock: mrl.rundir.check_run_dir.)"""
    check_values(cfg)
    from mrl.algos import ESTIMATORS  # torch: imported once the plain checks passed, so refusals come fast
    from mrl.rollout import ROLLOUT_ENGINES

    if cfg.rollout.engine not in ROLLOUT_ENGINES:
        raise UserError(f"rollout.engine={cfg.rollout.engine!r}: choose one of {', '.join(ROLLOUT_ENGINES)} (the "
                        "engine that generates rollouts, registered in mrl/rollout.py's ROLLOUT_ENGINES; auto samples "
                        "from the training module with mrl's captured decoder on CUDA where it passes its first-use "
                        "check, mrl's native decoder elsewhere where it runs the model, else HF generate)")
    t, a = cfg.trainer, cfg.algo
    estimator = ESTIMATORS[a.advantage.value]
    if estimator.group_relative and t.group_size < 2:
        raise UserError(f"trainer.group_size={t.group_size}: algo={a.name} normalizes within groups of rollouts, "
                        "so it needs group_size >= 2 (try 8)")
    if a.critic is None and estimator.needs_critic:
        raise UserError(f"algo.advantage={a.advantage.value} needs a critic: set algo.critic=model or head")
    if a.critic is not None and not estimator.needs_critic:
        raise UserError(f"algo.critic={a.critic.value}: algo.advantage={a.advantage.value} takes its baseline from the "
                        "group of rollouts and trains no critic; drop algo.critic (critic=null) or use advantage=gae")
    if a.critic is not None:
        _check_bound(Bound("algo.critic_lr", 0, strict=True, fix="the critic's learning rate (the model preset's "
                                                                "model.critic_lr by default)"), a.critic_lr)
    if a.kl_coef > 0 and a.kl_mode == "reward" and not estimator.reward_kl:
        raise UserError(f"algo.kl_mode=reward with algo.advantage={a.advantage.value}: a group-relative estimator "
                        "normalizes a per-rollout penalty away; use algo.kl_mode=loss (the KL term in the loss)")
    if a.overlong_buffer >= t.max_new_tokens:
        raise UserError(f"algo.overlong_buffer={a.overlong_buffer} must be < trainer.max_new_tokens="
                        f"{t.max_new_tokens}: the penalty rises over the last overlong_buffer tokens of the budget")
    check_device(t.device)
    _check_ranks(cfg)
    check_pass_channel(cfg.rewards, list(configured_channels(cfg.rewards, a)[0]))
    _check_inputs(cfg)
    _check_lora(cfg)


def check_device(name: str) -> None:
    """`trainer.device` names a device torch knows, and a CUDA one only where CUDA is visible."""
    import torch

    try:
        device = torch.device(name) if name != "auto" else None
    except (RuntimeError, ValueError):
        raise UserError(f"trainer.device={name!r} is not a device: use auto (cuda if present, else cpu), cpu, cuda "
                        "or cuda:N") from None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name!r} but no CUDA device is visible; use trainer.device=auto or cpu")


def _check_ranks(cfg: DictConfig) -> None:
    """Under a launcher (WORLD_SIZE > 1): the global batch splits into whole groups per rank, and DeepSpeed is the
    one path that averages gradients over ranks (mrl/distributed.py)."""
    from mrl.distributed import world_size

    world = world_size()
    if world == 1:
        return
    if not cfg.deepspeed.enabled:
        raise UserError(f"deepspeed=none under a launcher (WORLD_SIZE={world}): the plain PyTorch path trains one "
                        "process and would let the ranks' weights drift apart; use "
                        "deepspeed=zero2 (or zero1, zero3), or run on one process")
    if cfg.trainer.prompts_per_step % world:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} does not split over {world} ranks: "
                        "it is the global batch, and each rank generates whole groups for an equal share; use a "
                        f"multiple of {world} (e.g. {world * max(1, cfg.trainer.prompts_per_step // world)})")


def configured_channels(rewards: Any, algo: Any) -> tuple[dict[str, Any], list[str]]:
    """({name: channel config} a run trains on, [names left out]), after checking every channel against `algo`.

    Left out: the entries a preset wrote for channels these rewards do not have (`algo.shapes`: they have no `fn`).
    Any other entry without `fn` is a misspelt or incomplete channel."""
    channels = {name: ch for name, ch in rewards.channels.items() if not OmegaConf.is_missing(ch, "fn")}
    left_out = [name for name in rewards.channels if name not in channels]
    names = list(channels)
    for name in left_out:
        if name not in algo.shapes:
            raise UserError(f"rewards.channels.{name} has no fn: rewards={rewards.name} has no channel {name!r} (its "
                            f"channels: {', '.join(names) or 'none'}); fix the name, or add the channel in your "
                            "rewards YAML with fn: {_target_: my_module.my_channel}")
    if not channels:
        raise UserError(f"rewards={rewards.name} defines no channels; give rewards.channels.<name>.fn")
    for name, ch in channels.items():
        for bound in CHANNEL_BOUNDS:
            _check_bound(bound, ch[bound.key], f"rewards.channels.{name}.{bound.key}")
        if ch.enforce is not None and ch.kind.value != "constraint":
            raise UserError(f"rewards.channels.{name}.enforce needs kind: constraint (it is {ch.kind.value}); set "
                            f"rewards.channels.{name}.kind=constraint or drop the enforce")
        if ch.condition_on is not None and ch.condition_on not in names:
            raise UserError(f"rewards.channels.{name}.condition_on={ch.condition_on!r} is not a channel; "
                            f"choose one of {names}")
    if algo.weights is not None:
        weights = dict(algo.weights)
        if set(weights) != set(names):
            extra, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
            parts = [f"weights for {', '.join(extra)}, which rewards={rewards.name} does not have"] if extra else []
            parts += [f"no weight for {', '.join(missing)}"] if missing else []  # joined with ", and "
            raise UserError(
                f"algo.weights has channels {sorted(weights)} but rewards={rewards.name} has {sorted(names)} "
                f"(algo={algo.name} gives {', and '.join(parts)}); give one weight per channel, e.g. "
                f"algo.weights={{{','.join(f'{n}:1' for n in names)}}}, or use a preset without weights (algo=grpo)")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise UserError(f"algo.weights.{name}={weight!r}: weights must be finite numbers")
    return channels, left_out


def check_pass_channel(rewards: Any, names: list[str]) -> None:
    """`rewards.pass_channel`, when set, is one of the task's channels (`names`)."""
    chosen = rewards.pass_channel
    if chosen is not None and chosen not in names:
        raise UserError(f"rewards.pass_channel={chosen!r} is not a channel of rewards={rewards.name}: choose one of "
                        f"{', '.join(names)} (an episode passes when it is >= 1), or null for no accuracy or pass@k")


def _check_inputs(cfg: DictConfig) -> None:
    """Paths the run reads: the model directory and the dataset (a checkpoint to resume from: mrl.rundir)."""
    from mrl.data import dataset_file
    from mrl.models import BUILTIN_TINY, resolve_model_path

    path = None
    if cfg.model.name_or_path != BUILTIN_TINY:  # the tiny model is built on first use: nothing to check yet
        path = resolve_model_path(cfg.model)
    context = context_length(cfg.model, path)
    if context is not None and cfg.trainer.max_new_tokens > context:
        raise UserError(f"trainer.max_new_tokens={cfg.trainer.max_new_tokens} is more than the model's context of "
                        f"{context} tokens (max_position_embeddings): give at most {context}")
    if cfg.data.path:
        dataset_file(cfg.data.path)
        _check_dataset(cfg, context)


# A token of a BPE vocabulary rarely spans more characters than this: a longer prompt cannot fit the context.
CHARS_PER_TOKEN = 16


def context_length(model: DictConfig, path: str | None) -> int | None:
    """The model's context in tokens (max_position_embeddings of the tiny spec or of a local config.json), or None
    where it cannot be read without loading the model (a hub id)."""
    if path is None:
        return int(model.tiny.max_position_embeddings) if model.get("tiny") is not None else None
    config = Path(path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int and value > 0 else None


def _check_dataset(cfg: DictConfig, context: int | None) -> None:
    """Read the dataset as the run will, before Hydra creates the run dir: an empty file, a record without its
    prompt, or a prompt no context can hold is refused here, with nothing written."""
    from mrl.data import DatasetTask

    task = DatasetTask(cfg.data.path, seed=cfg.trainer.seed, eval_fraction=cfg.data.eval_fraction,
                       text_field=cfg.data.text_field)
    if context is None:
        return
    limit = context * CHARS_PER_TOKEN
    for prompt in [*task.train, *task.eval]:
        chars = len(prompt.text) + sum(len(str(m.get("content") or "")) for m in prompt.messages or ())
        if chars > limit:
            raise UserError(f"dataset {cfg.data.path!r}: a prompt of {chars} characters ({prompt.text[:40]!r}...) "
                            f"cannot fit the model's context of {context} tokens (at most ~{limit} characters): "
                            "shorten it or drop the record")


def _check_lora(cfg: DictConfig) -> None:
    """model.lora.target_modules: all-linear, or names that are modules of this model (peft would silently skip a
    misspelt one as long as another name matches)."""
    lora = cfg.model.lora
    if lora.r == 0:
        return
    target = lora.target_modules
    names = [target] if isinstance(target, str) else list(target) if OmegaConf.is_list(target) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"model.lora.target_modules={target!r}: give all-linear, or a list of module names such as "
                        "[q_proj,k_proj,v_proj,o_proj]")
    if names == ["all-linear"]:
        return
    from mrl.lora import linear_module_names, unknown_targets

    linear = linear_module_names(cfg.model)
    if linear is None:  # a hub id whose config this machine cannot read: peft checks when it loads the model
        return
    unknown = unknown_targets(target if isinstance(target, str) else names, linear)
    if unknown:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise UserError(f"model.lora.target_modules: {', '.join(unknown)} matches no linear layer of "
                        f"{cfg.model.name_or_path} (its linear layers: {', '.join(kinds)}; the output layer takes no "
                        "adapters); fix the name, or use all-linear (every linear layer of attention and MLP)")


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
    from mrl.rundir import check_run_dir

    validate(job_cfg)
    check_run_dir(job_cfg, Path(job_cfg.hydra.sweep.dir) / str(job_cfg.hydra.sweep.subdir))
