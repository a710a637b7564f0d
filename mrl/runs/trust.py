"""Which run dirs mrl builds from: a run dir's saved config is code (its `_target_`s run when the task and the
channels are built), so it is read typed, with environments' old homes renamed, and refused when it names code mrl
does not ship (unless the user says where it came from is trusted).  `mrl eval` and `mrl export` read run dirs here.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mrl.core.config import CONF_DIR, TrainConfig, UserError


def run_config(run_dir: Path, trust_config: bool = False):
    """The config the run trained with: its `.hydra/config.yaml`, typed by the schemas.

    Not composed again from `.hydra/overrides.yaml`: the run may have used a `--config-dir` (or config files that
    changed since), and config.yaml is what was composed then.  A `_target_` in it is code that building the task
    and the channels runs, so a run dir is as trusted as its config: one naming a `_target_` outside `mrl.` is
    refused unless `trust_config` (`--trust-config`) says where the run dir came from is trusted."""
    import yaml

    saved = run_dir / ".hydra" / "config.yaml"
    if saved.is_symlink():  # a link to a host file would have its first line printed in the refusal below
        raise UserError(f"{saved} is a symlink: a run dir's config is its own file; replace the link with the "
                        "config `mrl train` wrote, or score the checkpoint with --model DIR")
    if not saved.is_file():
        raise UserError(f"{run_dir}: not a run dir (no .hydra/config.yaml); give the dir `mrl train` wrote")
    try:
        loaded = OmegaConf.create(with_moved_targets(OmegaConf.to_container(OmegaConf.load(saved), resolve=False)))
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), loaded)
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, TypeError, UnicodeDecodeError) as err:
        reason = " ".join(str(err).split())[:160]
        raise UserError(f"{saved} is not a config mrl can read ({type(err).__name__}: {reason}); restore the file "
                        "`mrl train` wrote there, or score the checkpoint with --model DIR") from None
    if not trust_config:
        problem = untrusted(OmegaConf.to_container(loaded, resolve=False), cfg)
        if problem:
            raise UserError(f"{saved} {problem}: building the run's task and rewards would run code it chose; pass "
                            "--trust-config if you trust where this run dir came from")
    return cfg


# Where environments' tasks and channels lived before each got one home in mrl/envs/ (2026-12-03): runs saved
# then name them so, e.g. mrl.tasks.bfcl.BfclTask, mrl.rewards.bfcl.Format, mrl.benchmarks.humaneval.HumanEvalTask.
OLD_HOMES = ("mrl.tasks.", "mrl.rewards.", "mrl.benchmarks.")


def with_moved_targets(node: Any) -> Any:
    """A config container with every `_target_` that names an environment's old home (OLD_HOMES) renamed to its
    home in mrl/envs/, where that is one of mrl's own tasks and channels (`allowed_targets`); others unchanged.

    >>> with_moved_targets({"task": {"_target_": "mrl.tasks.bfcl.BfclTask", "seed": 0}})
    {'task': {'_target_': 'mrl.envs.bfcl.BfclTask', 'seed': 0}}
    """
    if isinstance(node, list):
        return [with_moved_targets(value) for value in node]
    if not isinstance(node, dict):
        return node
    renamed = {key: with_moved_targets(value) for key, value in node.items()}
    target = renamed.get("_target_")
    for home in OLD_HOMES:
        if isinstance(target, str) and target.startswith(home) \
                and f"mrl.envs.{target[len(home):]}" in allowed_targets():
            renamed["_target_"] = f"mrl.envs.{target[len(home):]}"
    return renamed


@lru_cache(maxsize=1)
def allowed_targets() -> frozenset[str]:
    """mrl's own tasks and channels: every `_target_` of the shipped conf/rewards/*.yaml (classes, exactly: Hydra
    follows attribute paths, so `mrl.` as a prefix reaches `mrl.sandbox.run_tests` and `mrl.runs.rundir.Path`)."""
    found = set()
    for path in sorted((CONF_DIR / "rewards").glob("*.yaml")):
        found.update(t for _, t in _targets(OmegaConf.to_container(OmegaConf.load(path), resolve=False)))
    return frozenset(t for t in found if isinstance(t, str))


def untrusted(config: Any, cfg) -> str | None:
    """What in a run dir's config (unresolved, and `cfg`, the typed one) would run code mrl does not ship, said
    after the file's name, or None: a `_target_` not on the allow-list (`allowed_targets`), one anywhere but at
    `rewards.task` and `rewards.channels.<name>.fn`, or generated code run without the sandbox (rewards.sandbox, or
    a channel's own `sandbox`)."""
    channels = {f"rewards.channels.{name}.fn" for name in (config.get("rewards") or {}).get("channels") or {}} \
        if isinstance(config, dict) and isinstance(config.get("rewards"), dict) else set()
    for place, target in _targets(config):
        if place not in channels and place != "rewards.task":
            return f"names _target_ {str(target)[:80]!r} at {place or 'the top'}, where a run's config names no code"
        if target not in allowed_targets():
            return (f"names _target_ {str(target)[:80]!r} at {place}, not one of mrl's own tasks and channels "
                    "(conf/rewards/*.yaml)")
    sandboxes = [("rewards.sandbox", OmegaConf.select(cfg, "rewards.sandbox"))] + [
        (f"rewards.channels.{name}.fn.sandbox", OmegaConf.select(cfg, f"rewards.channels.{name}.fn.sandbox"))
        for name in (OmegaConf.select(cfg, "rewards.channels") or {})]
    for key, value in sandboxes:
        if value is not None and str(getattr(value, "value", value)) != "bwrap":
            return f"sets {key}={getattr(value, 'value', value)}: the checkpoint's code would run outside the sandbox"
    return None


def _targets(node: Any, place: str = "") -> Iterator[tuple[str, Any]]:
    """(the dotted key of the node, its `_target_` value) of every `_target_` in a config container, at any
    depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield place, value
            else:
                yield from _targets(value, f"{place}.{key}" if place else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{place}[{i}]")
