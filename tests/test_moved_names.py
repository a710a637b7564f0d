"""The names that moved on 2026-12-06 (mrl.MOVED) still import, as the objects at their new homes; the extension
points docs/extending.md names import at the paths it gives."""

import importlib
import re
import sys
from pathlib import Path

import pytest

from mrl import MOVED

ROOT = Path(__file__).resolve().parents[1]
EXTENDING = ROOT / "docs" / "extending.md"


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


def test_mrl_imports_only_the_new_names():
    """An import of an old name inside mrl/ or scripts/ would pass the layer contract unseen (import-linter does not
    follow the hook): every import there names a module's home."""
    import ast

    old = []
    for path in sorted([*(ROOT / "mrl").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            old += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names if name in MOVED]
    assert not old, "imports of old names (write the home from mrl.MOVED):\n" + "\n".join(old)


def test_an_old_name_runs_as_a_module():
    """`python -m mrl.local_models` (the Makefile's command before the move) runs the module at its home."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "mrl.local_models", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "smollm2" in done.stdout, done.stderr[-2000:]
