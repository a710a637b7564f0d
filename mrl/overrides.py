"""What `mrl train` / `mrl sft` make of their arguments before Hydra sees them.

- A resume is one command: `trainer.resume=true hydra.run.dir=RUN` (or `--resume RUN`) re-reads the overrides the
  run was started with (RUN/.hydra/overrides.yaml, and its `--config-dir`), so that it composes the run's config;
  a new override that contradicts a saved one is refused, but for the steps, the save and eval intervals and the
  logger (`EXTENDABLE`: trainer.max_steps=600 goes on to step 600, and `mrl sft`'s sft.steps=600 likewise).
- The run dir is not trusted for what it makes run: a saved override the resume would re-read that sets Hydra's own
  config (`hydra.*`: a callback is code Hydra runs at start), names code (`_target_`, `_args_`, any `_key_`), runs
  generated code outside the sandbox (`*.sandbox`), or interpolates (`${...}`: a resolver may build a `_target_`),
  and a `--config-dir` recorded in `.hydra/hydra.yaml`, are refused in one line unless the command line gives them
  again or `--trust-config` says the run dir is trusted (`saved_override_problem`).  mrl's own runs save none of
  these unless their command line had them.
- A misspelt config group or choice (`reward=agent_triple`, `algo=gdop`) is one line with the nearest name, where
  Hydra would advise `+reward=...` or list its search path.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

import yaml

from mrl.core.config import CONF_DIR, TrainConfig, UserError

RESUME_FLAG = "--resume"
TRUST_FLAG = "--trust-config"  # `mrl train --resume RUN --trust-config`: re-read all RUN saved, code included
TRUE = ("true", "yes", "1", "latest")
# What a resume may change: how long it goes on, how often it saves and evaluates, where it logs.  Any other key the
# run was started with is the run's: a new value for it is refused.
EXTENDABLE = ("trainer.resume", "trainer.max_steps", "trainer.save_every", "trainer.eval_every", "sft.steps",
              "sft.save_every", "sft.eval_every", "logger.")


def _split(arg: str) -> tuple[str, str] | None:
    """`key=value` -> (key, value) for a plain override (not a flag; `+`, `++` and `~` prefixes kept in key)."""
    if arg.startswith("-") or "=" not in arg:
        return None
    key, value = arg.split("=", 1)
    return key, value


def expand_resume(args: list[str]) -> list[str]:
    """`--resume RUN` -> `trainer.resume=true hydra.run.dir=RUN`; then, for a resume into a run dir with saved
    overrides, those overrides first and the new ones after (a repeat dropped; a contradiction refused; one that
    would run code the run dir chose refused unless `--trust-config`, which is taken out of the arguments)."""
    trusted = TRUST_FLAG in args
    args = [a for a in args if a != TRUST_FLAG]
    for i, arg in enumerate(args):
        if arg == RESUME_FLAG or arg.startswith(RESUME_FLAG + "="):
            run = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if not run:
                raise UserError(f"{RESUME_FLAG} needs the run dir: mrl train {RESUME_FLAG} outputs/DATE/TIME")
            args[i:i + (1 if "=" in arg else 2)] = ["trainer.resume=true", f"hydra.run.dir={run}"]
            break
    given = dict(kv for kv in map(_split, args) if kv is not None)
    run_dir = given.get("hydra.run.dir", "").strip("'\"")
    if str(given.get("trainer.resume", "")).lower() not in TRUE or not run_dir:
        return args
    from mrl.runs.rundir import refuse_planted  # (imports no torch: a refused resume stays fast)

    refuse_planted(Path(run_dir).expanduser(), "hydra.run.dir")  # before anything in it is read, or written
    saved_file = Path(run_dir).expanduser() / ".hydra" / "overrides.yaml"
    if not saved_file.is_file():
        return args
    saved = _saved_yaml(saved_file, list)
    kept = []
    for old in saved:
        key, value = _split(old) or (old, "")
        if key in given:  # the new value stands where a resume may change it; elsewhere it must be the saved one
            if given[key] != value and not key.startswith(EXTENDABLE):
                raise UserError(f"trainer.resume: {run_dir} was started with {old}; this command gives {key}="
                                f"{given[key]}: a resume continues that run as it was, so drop {key}={given[key]} "
                                f"(or start a new run in another hydra.run.dir with trainer.init_from={run_dir})")
            continue
        problem = None if trusted else saved_override_problem(old)
        if problem:
            raise UserError(f"trainer.resume: {saved_file} holds {old[:120]!r}, which {problem}; a resume re-reads "
                            f"only plain settings: give it on the command line yourself, or pass {TRUST_FLAG} if "
                            "you trust where this run dir came from")
        if key != "trainer.resume":
            kept.append(old)
    return _config_dir_of(Path(run_dir).expanduser(), args, trusted) + kept + args


def _saved_yaml(path: Path, kind: type):
    """A run dir's .hydra/ file as the `kind` (list or dict) Hydra wrote, or a one-line refusal naming it."""
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"trainer.resume: {path} cannot be read ({type(err).__name__}); restore the file Hydra wrote "
                        "there, or start a new run in another hydra.run.dir") from None
    if loaded is None:
        return kind()
    if not isinstance(loaded, kind):
        raise UserError(f"trainer.resume: {path} holds a {type(loaded).__name__}, not the {kind.__name__} Hydra "
                        "writes there; restore the file Hydra wrote, or start a new run in another hydra.run.dir")
    return [str(o) for o in loaded] if kind is list else loaded


def saved_override_problem(override: str) -> str | None:
    """Why a resume must not re-read `override` from a run dir's .hydra/overrides.yaml, in words, or None (Hydra's
    own grammar parses it, so a spelling of a key or a value cannot hide what it is)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
    except HydraException:
        return "does not parse as an override"
    keys = [parsed.key_or_group, parsed.package or ""]
    if any(k == "hydra" or k.startswith(("hydra.", "hydra/")) for k in keys):
        return "sets Hydra's own config (callbacks, launcher, run dir), which Hydra never saves there"
    if any(re.fullmatch(r"_\w+_", part) for k in keys for part in re.split(r"[./]", k)):
        return "names code to build (a _key_ of Hydra's instantiate)"
    value = parsed.value()
    if keys[0].split(".")[-1] == "sandbox" and value is not None and str(value) != "bwrap":
        return "runs generated code outside the sandbox"
    for leaf in _leaves(value):
        if isinstance(leaf, str) and "${" in leaf:
            return "interpolates (a resolver may build code from a string)"
        if isinstance(leaf, str) and re.fullmatch(r"_\w+_", leaf):
            return "names code to build (a _key_ of Hydra's instantiate)"
    return None


def _leaves(value) -> list:
    """Every key and scalar of an override's value (dicts, lists, a sweep's choices)."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in (k, *_leaves(v))]
    if isinstance(value, (list, tuple)) or hasattr(value, "list"):
        return [leaf for v in (value if isinstance(value, (list, tuple)) else value.list) for leaf in _leaves(v)]
    return [value]


def _config_dir_of(run_dir: Path, args: list[str], trusted: bool = False) -> list[str]:
    """`--config-dir DIR` the run was started with (.hydra/hydra.yaml), where this command gives none: refused
    unless `trusted` (its files name the code a run builds, and hydra.yaml is as easy to edit as the overrides)."""
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if any(a in ("--config-dir", "-cd") or a.startswith("--config-dir=") for a in args) or not hydra_file.is_file():
        return []
    hydra = _saved_yaml(hydra_file, dict).get("hydra")
    runtime = hydra.get("runtime") if isinstance(hydra, dict) else None
    sources = runtime.get("config_sources") if isinstance(runtime, dict) else None
    dirs = [str(s.get("path")) for s in (sources if isinstance(sources, list) else []) if isinstance(s, dict)
            and s.get("provider") == "command-line" and s.get("schema") == "file"]
    if dirs and not trusted:
        raise UserError(f"trainer.resume: {hydra_file} names the config dir {dirs[0]}, whose files name the code the "
                        f"run builds; a resume reads a config dir only from the command line: give --config-dir "
                        f"{dirs[0]} again, or pass {TRUST_FLAG} if you trust where this run dir came from")
    return [arg for path in dirs for arg in ("--config-dir", path)]


def check_groups(args: list[str], config_dirs: list[str]) -> None:
    """A plain `group=choice` override whose group or choice does not exist, refused with the nearest one.
    The groups are conf/'s, the --config-dir dirs' and hydra.searchpath's `file://` dirs'; a `pkg://` search path
    leaves the choices unchecked."""
    roots = [CONF_DIR, *(Path(d).expanduser() for d in config_dirs)]
    searched = [p.strip(" '\"") for a in args if a.lstrip("+").startswith("hydra.searchpath=")
                for p in a.split("=", 1)[1].strip("[]").split(",")]
    roots += [Path(p[len("file://"):]).expanduser() for p in searched if p.startswith("file://")]
    other_paths = any(p and not p.startswith("file://") for p in searched)
    groups = {d.name: d for root in roots if root.is_dir() for d in root.iterdir() if d.is_dir()}
    keys = {f.name for f in dataclasses.fields(TrainConfig)} | {"hydra"}
    for arg in args:
        key, value = _split(arg) or ("", "")
        if not key or key[0] in "+~" or "." in key or "/" in key:
            continue
        if key not in groups and key not in keys:
            close = difflib.get_close_matches(key, [*groups, *keys], n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}={value}?" if close else f"config groups: {', '.join(sorted(groups))}"
            raise UserError(f"{arg}: there is no config group or key {key!r}; {hint} (a new key: +{arg})")
        if key in groups and not other_paths and not any(c in value for c in "()[]{}$"):
            choices = sorted({p.stem for root in roots for p in (root / key).glob("*.yaml")} | {f"{key}_schema"})
            for choice in value.split(","):
                if choice and choice not in choices and choice != "null":
                    close = difflib.get_close_matches(choice, choices, n=1, cutoff=0.5)
                    hint = f"did you mean {key}={close[0]}? " if close else ""
                    raise UserError(f"{key}={choice}: there is no {key}/{choice}.yaml; {hint}choose one of "
                                    f"{', '.join(c for c in choices if not c.endswith('_schema'))}")
