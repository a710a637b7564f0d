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


def run_config(run_dir: Path, trust_config: bool = False, renders: bool = True):
    """The config the run trained with: its `.hydra/config.yaml`, typed by the schemas.

    Not composed again from `.hydra/overrides.yaml`: the run may have used a `--config-dir` (or config files that
    changed since), and config.yaml is what was composed then.  A `_target_` in it is code that building the task
    and the channels runs, so a run dir is as trusted as its config: unless `trust_config` (`--trust-config`) says
    where the run dir came from is trusted, the config is checked as it will be built (`foreign_config_problem`:
    its interpolations resolved, every `_target_`, `_args_` and keyword) and refused in one line when it would run
    code mrl does not ship, or, where the caller `renders` conversations (`mrl eval`), when it would have the
    checkpoint's chat template rendered (`template_problem`).  A `_target_` that is not a string is refused even with
    trust: nothing can build it."""
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
        raise UserError(f"{saved} is not a config mrl can read ({type(err).__name__}: {_short(err)}); restore the "
                        "file `mrl train` wrote there, or score the checkpoint with --model DIR") from None
    raw = OmegaConf.to_container(loaded, resolve=False)
    problem = target_type_problem(raw)
    if problem:
        raise UserError(f"{saved} {problem}: a _target_ is a dotted name (mrl.envs.code.PassRate); restore the file "
                        "`mrl train` wrote there")
    problem = None if trust_config else foreign_config_problem(raw, cfg) or (template_problem(cfg) if renders else None)
    if problem:
        raise UserError(f"{saved} {problem}: building the run's task and rewards would run code it chose; pass "
                        "--trust-config if you trust where this run dir came from")
    return cfg


def _short(err: BaseException) -> str:
    return " ".join(str(err).split())[:160]


# The one table of old names a run dir's saved config may hold: where environments' tasks and channels lived before
# each got one home in mrl/envs/ (2026-12-03), e.g. mrl.tasks.bfcl.BfclTask, mrl.rewards.bfcl.Format,
# mrl.benchmarks.humaneval.HumanEvalTask.  The packages by layer (2026-12-06) renamed no `_target_` a config.yaml
# holds (the Hydra callbacks they renamed are in hydra.yaml, which `mrl eval` and `mrl export` do not build from);
# nothing else in mrl resolves an old name.
OLD_HOMES = {"mrl.tasks.": "mrl.envs.", "mrl.rewards.": "mrl.envs.", "mrl.benchmarks.": "mrl.envs."}


def with_moved_targets(node: Any) -> Any:
    """A config container with every `_target_` that names an old home (OLD_HOMES) renamed to its home today, where
    that is one of mrl's own tasks and channels (`allowed_targets`); others unchanged.

    >>> with_moved_targets({"task": {"_target_": "mrl.tasks.bfcl.BfclTask", "seed": 0}})
    {'task': {'_target_': 'mrl.envs.bfcl.BfclTask', 'seed': 0}}
    """
    if isinstance(node, list):
        return [with_moved_targets(value) for value in node]
    if not isinstance(node, dict):
        return node
    renamed = {key: with_moved_targets(value) for key, value in node.items()}
    target = renamed.get("_target_")
    for old, home in OLD_HOMES.items():
        if isinstance(target, str) and target.startswith(old) and home + target[len(old):] in allowed_targets():
            renamed["_target_"] = home + target[len(old):]
    return renamed


@lru_cache(maxsize=1)
def allowed_targets() -> frozenset[str]:
    """mrl's own tasks and channels: every `_target_` of the shipped conf/rewards/*.yaml (classes, exactly: Hydra
    follows attribute paths, so `mrl.` as a prefix reaches `mrl.sandbox.run_tests` and `mrl.runs.rundir.Path`)."""
    found = set()
    for path in sorted((CONF_DIR / "rewards").glob("*.yaml")):
        found.update(t for _, t in _targets(OmegaConf.to_container(OmegaConf.load(path), resolve=False)))
    return frozenset(t for t in found if isinstance(t, str))


# Resolvers a run dir's config may call without --trust-config: mrl's own, which compute a number from numbers (what
# conf/ uses).  oc.create and oc.decode build config nodes, a `_target_` among them, from a string; oc.env reads the
# environment; any other resolver is code the file chose to call.
SAFE_RESOLVERS = frozenset({"mrl.worst_token_cost"})
# Hydra's instantiate keys a run's config may give beside `_target_`; `_partial_`, `_convert_` and `_recursive_` are
# refused as any keyword the class does not take.
ARGS = "_args_"


def target_type_problem(config: Any) -> str | None:
    """A `_target_` that is not a string (`[x]`, `{a: 1}`: Hydra fails on it with a traceback), said after the file's
    name, or None."""
    for place, target in _targets(config):
        if not isinstance(target, str):
            return (f"names a _target_ that is not a string ({type(target).__name__} {str(target)[:60]!r}) at "
                    f"{place or 'the top'}")
    return None


def foreign_config_problem(config: Any, cfg) -> str | None:
    """What in a run dir's config (`config`: its container, unresolved; `cfg`: typed by the schemas, what is built)
    would run code mrl does not ship, said after the file's name, or None.  Decided on what will be built: first
    every interpolation (`interpolation_problem`: only node references and SAFE_RESOLVERS, each a whole value, each
    to a scalar), then the config resolved (`untrusted`)."""
    problem = interpolation_problem(config) or reference_problem(cfg)
    if problem:
        return problem
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except (OmegaConfBaseException, ValueError, TypeError) as err:
        return f"does not resolve ({type(err).__name__}: {_short(err)})"
    return untrusted(resolved)


def template_problem(cfg) -> str | None:
    """Whether a run's config has its checkpoint's chat template rendered (model.use_chat_template, or
    model.tool_format=chat), said after the file's name, or None: the template is a Jinja program that came with the
    run dir.  Every render is bounded in time and size (mrl.chat.chat_template.render_template); a foreign config
    does not choose to render one at all.  The command line may (`mrl eval RUN model.use_chat_template=true`)."""
    if cfg.model.use_chat_template:
        return "sets model.use_chat_template=true: scoring would render the checkpoint's chat template, a program " \
               "that came with the run dir"
    if str(cfg.model.tool_format) == "chat":
        return "sets model.tool_format=chat: scoring would render the checkpoint's chat template, a program that " \
               "came with the run dir"
    return None


def interpolation_problem(config: Any, place: str = "") -> str | None:
    """An interpolation in `config` (a container, unresolved) that a foreign config may not make, in words, or None:
    a resolver other than SAFE_RESOLVERS (oc.create and oc.decode turn a string into a `_target_` after the check
    of the file), or an interpolation that is not the whole value (`"${a}${a}"` doubles a string per level)."""
    if isinstance(config, dict):
        items = [(f"{place}.{k}" if place else str(k), v) for k, v in config.items()]
    else:
        items = [(f"{place}[{i}]", v) for i, v in enumerate(config)] if isinstance(config, list) else []
    for key, value in items:
        if isinstance(value, (dict, list)):
            problem = interpolation_problem(value, key)
        else:
            problem = _interpolation(key, value) if isinstance(value, str) and "${" in value else None
        if problem:
            return problem
    return None


def _interpolation(key: str, value: str) -> str | None:
    """`interpolation_problem` of one string value, parsed by OmegaConf's own grammar."""
    from omegaconf import grammar_parser
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar

    try:
        tree = grammar_parser.parse(value)
    except Exception as err:  # omegaconf's GrammarParseError, and antlr's own errors
        return f"sets {key} to {value[:60]!r}, an interpolation that does not parse ({type(err).__name__})"
    nodes = list(_nodes(tree))
    unsafe = [n.resolverName().getText() for n in nodes if isinstance(n, Grammar.InterpolationResolverContext)
              and n.resolverName().getText() not in SAFE_RESOLVERS]
    if unsafe:
        return (f"sets {key} to {value[:60]!r}, which calls the resolver {unsafe[0]!r} (a foreign config may call "
                f"only {', '.join(sorted(SAFE_RESOLVERS))})")
    text = tree.text()
    whole = text.getChildCount() == 1 and isinstance(text.getChild(0), Grammar.InterpolationContext)
    if not whole and any(isinstance(n, Grammar.InterpolationContext) for n in nodes):
        return (f"sets {key} to {value[:60]!r}, an interpolation inside a longer value (a foreign config's "
                "interpolation is the whole value)")
    return None


def _nodes(tree) -> Iterator[Any]:
    """Every node of an antlr parse tree, depth first."""
    yield tree
    for i in range(getattr(tree, "getChildCount", lambda: 0)()):
        yield from _nodes(tree.getChild(i))


def reference_problem(node, place: str = "") -> str | None:
    """An interpolation in the typed config `node` that stands for a mapping or a list, in words, or None: each
    reference is then a copy when the config is resolved, so ten levels of `{x: ${a}, y: ${a}}` resolve to 2**10
    copies.  Only the references themselves are resolved here (one node each)."""
    keys = list(range(len(node))) if OmegaConf.is_list(node) else list(node.keys())
    for key in keys:
        where = f"{place}[{key}]" if isinstance(key, int) else (f"{place}.{key}" if place else str(key))
        if OmegaConf.is_interpolation(node, key):
            try:
                value = node[key]
            except (OmegaConfBaseException, ValueError, TypeError) as err:
                return f"sets {where} to an interpolation that does not resolve ({type(err).__name__}: {_short(err)})"
            if OmegaConf.is_config(value):
                return f"sets {where} to an interpolation of a mapping or list (a foreign config's interpolation " \
                       "names a single value)"
            continue
        child = node._get_node(key)
        if OmegaConf.is_config(child) and not child._is_none() and not child._is_missing():
            problem = reference_problem(child, where)
            if problem:
                return problem
    return None


def untrusted(config: Any) -> str | None:
    """What in a run dir's config, resolved (a container), would run code mrl does not ship, said after the file's
    name, or None: a `_target_` not on the allow-list (`allowed_targets`), one anywhere but at `rewards.task` and
    `rewards.channels.<name>.fn`, arguments (`_args_` and keywords) its class does not take, or generated code run
    without the sandbox (rewards.sandbox, or a channel's `sandbox` however it is passed: by name, by position in
    `_args_`, or by the class's default)."""
    rewards = config.get("rewards") if isinstance(config, dict) else None
    rewards = rewards if isinstance(rewards, dict) else {}
    channels = rewards.get("channels") if isinstance(rewards.get("channels"), dict) else {}
    places = {f"rewards.channels.{name}.fn" for name in channels} | {"rewards.task"}
    nodes = {"rewards.task": rewards.get("task"), **{f"rewards.channels.{n}.fn": (c or {}).get("fn")
                                                      for n, c in channels.items() if isinstance(c, dict)}}
    for place, target in _targets(config):
        if place not in places:
            return f"names _target_ {str(target)[:80]!r} at {place or 'the top'}, where a run's config names no code"
        if target not in allowed_targets():
            return (f"names _target_ {str(target)[:80]!r} at {place}, not one of mrl's own tasks and channels "
                    "(conf/rewards/*.yaml)")
    sandbox = rewards.get("sandbox", "bwrap")
    if str(getattr(sandbox, "value", sandbox)) != "bwrap":
        return f"sets rewards.sandbox={getattr(sandbox, 'value', sandbox)}: the checkpoint's code would run " \
               "outside the sandbox"
    for place, target in _targets(config):  # each at its place, each mrl's own: now what it is called with
        problem = arguments_problem(target, nodes[place], place)
        if problem:
            return problem
    return None


def arguments_problem(target: str, node: dict, place: str) -> str | None:
    """Whether `node` (a `_target_` node, resolved) calls `target`, one of mrl's own classes, with arguments it takes
    and with generated code in the sandbox, in words, or None.  The arguments are bound to the class's signature as
    Hydra would pass them (`_args_` by position, the other keys by name), without calling it."""
    import inspect

    from hydra.utils import get_object

    args = node.get(ARGS, [])
    kwargs = {k: v for k, v in node.items() if k not in ("_target_", ARGS)}
    if not isinstance(args, list):
        return f"sets {place}.{ARGS} to a {type(args).__name__}, not a list of arguments"
    try:
        bound = inspect.signature(get_object(target)).bind(*args, **kwargs)
    except TypeError as err:
        return f"calls {target} at {place} with arguments it does not take ({_short(err)})"
    bound.apply_defaults()
    sandbox = bound.arguments.get("sandbox", "bwrap")
    if str(getattr(sandbox, "value", sandbox)) != "bwrap":
        return f"sets {place}'s sandbox={getattr(sandbox, 'value', sandbox)}: the checkpoint's code would run " \
               "outside the sandbox"
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
