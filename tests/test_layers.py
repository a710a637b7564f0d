"""The house's layer contract (pyproject.toml, [tool.importlinter]) holds, and every `mrl` import made inside a
function says why it is not at the top of its module (start-up time, most often: torch takes seconds to import)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_the_layer_contract_holds():
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "10 kept, 0 broken" in done.stdout  # the packages' contract and one per package


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source) of each import of an mrl module inside a function of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and (inner.module or "").split(".")[0] == "mrl" or \
                    isinstance(inner, ast.Import) and any(a.name.split(".")[0] == "mrl" for a in inner.names):
                found.append(inner.lineno)
    lines = path.read_text().splitlines()
    return [(n, lines[n - 1]) for n in sorted(set(found))]


def says_why(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, on another line of its block of imports, or on the line above the block."""
    first = last = lineno - 1
    while first > 0 and lines[first - 1].lstrip().startswith(("from ", "import ")):
        first -= 1
    while last + 1 < len(lines) and lines[last + 1].lstrip().startswith(("from ", "import ")):
        last += 1
    block = lines[first:last + 1] + ([lines[first - 1]] if first > 0 else [])
    return any("#" in line and re.sub(r"noqa(: [A-Z0-9, ]+)?", "", line.split("#", 1)[1]).strip() for line in block)


def test_every_function_level_mrl_import_says_why():
    silent = []
    for path in sorted((ROOT / "mrl").rglob("*.py")):
        lines = path.read_text().splitlines()
        silent += [f"{path.relative_to(ROOT)}:{n}: {source.strip()}" for n, source in function_level_imports(path)
                   if not says_why(lines, n)]
    assert not silent, "function-level imports of mrl without a comment saying why:\n" + "\n".join(silent)


def test_the_import_check_sees_a_silent_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    x = 1\n    from mrl.train.loop import train\n    return train\n\n\n"
                      "def g():\n    # start-up time: torch\n    from mrl.train.loop import train\n"
                      "    from mrl import rollout\n")
    lines = module.read_text().splitlines()
    assert [(n, says_why(lines, n)) for n, _ in function_level_imports(module)] == [(3, False), (9, True), (10, True)]
