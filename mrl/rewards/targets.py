"""Every `_target_` of a rewards preset (its task, its channels, and a TRL function's dotted path) imported while
the config is validated, before anything is written: a misspelt name, a module that is not on the path, or a module
that raises on import is one line naming the key, the module and the cause.

Hydra would find out only when the run builds the channels, after the run dir exists, as `Error locating target`
with the cause deep in a traceback.
"""

from __future__ import annotations

import difflib
import inspect
import types
from importlib import import_module
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from mrl.core.config import UserError

TRL_ADAPTER = "mrl.rewards.trl.TrlReward"  # its `fn` is a dotted path too


def locate(path: str, key: str) -> Any:
    """The object a dotted path names (`my_rewards.correct`), imported as Hydra would: the longest prefix that is a
    module, then attributes.  A UserError names `key`, the module and why it failed."""
    if not isinstance(path, str) or not path.strip("."):
        raise UserError(f"{key}={path!r}: give a dotted path such as my_rewards.correct")
    parts = path.split(".")
    module, cut = None, 0
    for cut in range(1, len(parts) + 1):  # the longest prefix that is a module; the rest its attributes
        name = ".".join(parts[:cut])
        try:
            module = import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
                cut -= 1
                break
            raise UserError(f"{key}={path!r}: importing {name!r} raised ModuleNotFoundError: {err}{_where(err)}; "
                            f"install {err.name!r} or fix that import") from None
        except Exception as err:  # the user's module raised while it was imported
            raise UserError(f"{key}={path!r}: importing {name!r} raised {type(err).__name__}: {err}"
                            f"{_where(err)}") from None
    if module is None:
        raise UserError(f"{key}={path!r}: no module named {parts[0]!r} on the Python path; run from the directory "
                        f"that holds {parts[0]}.py with PYTHONPATH=. (or pip install it)")
    return _attribute(module, parts[cut:], path, key)


def _attribute(module: types.ModuleType, names: list[str], path: str, key: str) -> Any:
    found: Any = module
    for n, name in enumerate(names):
        if not hasattr(found, name):
            where = ".".join([module.__name__, *names[:n]])
            close = difflib.get_close_matches(name, [a for a in dir(found) if not a.startswith("_")], n=1)
            hint = f"; did you mean {where}.{close[0]}?" if close else ""
            raise UserError(f"{key}={path!r}: {where} ({getattr(module, '__file__', None) or 'a module'}) has no "
                            f"{name!r}{hint}")
        found = getattr(found, name)
    if isinstance(found, types.ModuleType):
        public = [a for a in dir(found) if not a.startswith("_") and callable(getattr(found, a))
                  and getattr(getattr(found, a), "__module__", None) == found.__name__]
        raise UserError(f"{key}={path!r} is a module, not a function or class; name one in it "
                        f"({', '.join(f'{path}.{a}' for a in public[:4]) or 'it defines none'})")
    return found


def _where(err: BaseException) -> str:
    """` (file:line)` of the innermost frame of the error's traceback."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})" if tb is not None else ""


def check_not_trl(node: Any, key: str) -> None:
    """A channel's `fn` that names a TRL reward function (it takes `completions`) without the adapter would fail at
    its first step with a TypeError: say how to wrap it instead."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if target is None or target == TRL_ADAPTER:
        return
    found = locate(target, f"{key}._target_")
    try:
        parameters = inspect.signature(found).parameters
    except (TypeError, ValueError):  # a builtin or a class without a readable signature
        return
    if "completions" in parameters:
        raise UserError(f"{key}._target_={target!r} takes `completions`: a TRL reward function, which mrl calls "
                        f"through its adapter: write {key}={{_target_: {TRL_ADAPTER}, fn: {target}}}")


def check_targets(node: Any, key: str) -> None:
    """Import every `_target_` under `node` (a config node at `key`), and the `fn` path of a TRL adapter."""
    if isinstance(node, DictConfig):
        target = node.get("_target_")
        if target is not None:
            locate(target, f"{key}._target_")
            if target == TRL_ADAPTER and isinstance(node.get("fn"), str):
                locate(node.fn, f"{key}.fn")
        for name in node:
            if name != "_target_" and not OmegaConf.is_missing(node, name):
                check_targets(node._get_node(name), f"{key}.{name}")
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node._iter_ex(resolve=False)):
            check_targets(item, f"{key}[{i}]")
