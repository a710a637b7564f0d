"""The names that moved on 2026-12-06 (mrl.MOVED) still import, as the objects at their new homes; the extension
points docs/extending.md names import at the paths it gives."""

import importlib
import re
import sys
from pathlib import Path

import pytest

from mrl import MOVED

EXTENDING = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def resolve(dotted: str):
    """`mrl.a.b.Name` -> the object: the longest prefix that imports as a module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("old", sorted(k for k, v in MOVED.items() if isinstance(v, str)))
def test_an_old_module_name_is_the_module_at_its_home(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old]), \
        f"{old} is not {MOVED[old]}: mrl.MOVED must map it to its home"


def test_the_old_graders_are_the_homes_functions():
    from mrl.benchmarks.bfcl import grade as old_bfcl_grade
    from mrl.benchmarks.bfcl import replay as old_replay
    from mrl.benchmarks.humaneval import grade as old_humaneval_grade
    from mrl.envs.bfcl.grader import grade
    from mrl.envs.bfcl_agent.gym import replay
    from mrl.envs.humaneval import grade as humaneval_grade

    assert old_bfcl_grade is grade and old_replay is replay and old_humaneval_grade is humaneval_grade


def test_the_extension_points_import_where_docs_extending_md_says():
    """Every dotted `mrl.` name in backticks (a module, or a name in one); none at an old home."""
    names = sorted(set(re.findall(r"`(mrl(?:\.\w+)+)", EXTENDING.read_text())))
    assert {"mrl.algo.advantages.ESTIMATORS", "mrl.generation.rollout.ROLLOUT_ENGINES"} <= set(names)
    old = [n for n in names if any(n == o or n.startswith(o + ".") for o in MOVED)]
    assert not old, f"docs/extending.md names {old} by their old homes: write the new ones (mrl.MOVED)"
    for name in names:
        assert resolve(name) is not None, f"docs/extending.md names {name}, which does not import"


def test_an_old_name_leaves_the_new_homes_as_they_were():
    """Importing mrl.benchmarks.bfcl (a module of two homes' names) must not replace mrl.envs.bfcl on its parent, as
    aliasing mrl.benchmarks to mrl.envs did (Hydra's `_target_: mrl.envs.bfcl.BfclTask` then failed); and a module
    reached by its old name keeps its own `__spec__`."""
    from hydra.utils import get_class

    import mrl.benchmarks.bfcl  # noqa: F401
    import mrl.config  # noqa: F401
    import mrl.envs

    assert mrl.envs.bfcl.__name__ == "mrl.envs.bfcl" and get_class("mrl.envs.bfcl.BfclTask").__name__ == "BfclTask"
    assert sys.modules["mrl.config"].__spec__.name == "mrl.core.config"
