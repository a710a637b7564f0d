"""docs/design.md's layer list ("Layout, by layer") agrees with the import contracts in pyproject.toml and with the
files under mrl/, so that it cannot drift: the packages' layers in the contract's order, each module under its
package's layer with its own layer number, every module named once.  Pure text: nothing of mrl is imported."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SECTION = "## Layout, by layer"
MODULE_LINE = re.compile(r"^\s+(?:(\d+)\s+)?(mrl/\S+\.py)(?:\s|$)")


def contracts() -> dict[str, list[list[str]]]:
    """container ('mrl', 'mrl.train', ...) -> its layers top to bottom, each the list of its `a | b` members."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return {c["containers"][0]: [[m.strip() for m in layer.split("|")] for layer in c["layers"]]
            for c in found if c["type"] == "layers"}


def doc_block() -> list[tuple[int, str]]:
    """The first fenced block after SECTION, as (line number in docs/design.md, line)."""
    lines = DESIGN.read_text().splitlines()
    start = lines.index(SECTION)
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return [(i + 1, lines[i]) for i in range(fence + 1, end) if lines[i].strip()]


def read_doc() -> tuple[list[list[str]], list[tuple[int, str, int | None, list[str]]]]:
    """The block's package layers (margin lines) and its modules: (line number, path, layer number or None, the
    package layer it is listed under)."""
    layers, modules = [], []
    for number, line in doc_block():
        if not line.startswith(" "):
            layers.append([m.strip() for m in re.split(r"\s{2,}", line)[0].split("|")])
            continue
        match = MODULE_LINE.match(line)
        assert match and layers, f"docs/design.md:{number} is neither a package layer nor a module line: {line!r}"
        modules.append((number, match[2], int(match[1]) if match[1] else None, layers[-1]))
    return layers, modules


def layer_of(name: str, layers: list[list[str]]) -> int | None:
    """1-based, top = 1."""
    return next((i + 1 for i, members in enumerate(layers) if name in members), None)


def module_files() -> set[str]:
    """Every module file under mrl/, less `__main__.py` and the package `__init__.py`s one level down (docstrings;
    a sub-package's `__init__.py`, e.g. mrl/envs/bfcl/__init__.py, holds an environment and is listed)."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mrl").rglob("*.py")}
    return {f for f in files if not f.endswith("__main__.py") and not re.fullmatch(r"mrl/(\w+/)?__init__\.py", f)}


def place_problems(path: str, number: int | None, listed_under: list[str], rules: dict) -> list[str]:
    """What is wrong with one module line's place: its package layer, then its layer in its package."""
    parts = path.removesuffix(".py").split("/")
    package, top = parts[1], rules["mrl"]
    where = f"docs/design.md lists {path} under the package layer '{' | '.join(listed_under)}'"
    if package not in listed_under:
        home = layer_of(package, top)
        return [f"{where}, the contract puts {package} in '{' | '.join(top[home - 1])}': move the line" if home else
                f"{where}, but the contract has no package {package}: add it to pyproject.toml's mrl layers"]
    inner = rules.get(f"mrl.{package}")
    if inner is None:
        return [f"{where} with layer {number}, but mrl.{package} has no layer contract: drop the number"] \
            if number is not None else []
    expected = layer_of(parts[2], inner)
    if expected is None:
        return [f"{where}, but the contract of mrl.{package} has no layer {parts[2]}: add it to pyproject.toml"]
    if number != expected:
        return [f"docs/design.md lists {path} under {package}'s layer {number}, the contract says layer {expected}: "
                f"move the line"]
    return []


def test_the_package_layers_are_the_contracts_in_its_order():
    layers, _ = read_doc()
    assert layers == contracts()["mrl"], (
        f"docs/design.md's package layers, top to bottom, are {[' | '.join(x) for x in layers]}; pyproject.toml's "
        f"contract says {[' | '.join(x) for x in contracts()['mrl']]}: write the margin lines as the contract's")


def test_each_module_is_listed_under_its_layers_top_to_bottom():
    rules = contracts()
    _, modules = read_doc()
    problems = [p for _, path, number, under in modules for p in place_problems(path, number, under, rules)]
    last: dict[str, tuple[int, str]] = {}
    for line, path, number, _ in modules:
        package = path.split("/")[1]
        if number is not None and package in last and number < last[package][0]:
            problems.append(f"docs/design.md:{line} lists {path} (layer {number}) below {last[package][1]} (layer "
                            f"{last[package][0]}): move it up, the layers run top to bottom")
        if number is not None:
            last[package] = (number, path)
    assert not problems, "\n".join(problems)


def test_every_module_file_is_listed_once():
    listed = [path for _, path, _, _ in read_doc()[1]]
    files = module_files()
    problems = [f"docs/design.md does not list {f}: add its line under its package's layer"
                for f in sorted(files - set(listed))]
    problems += [f"docs/design.md lists {p}, which is no module file: remove or rename the line"
                 for p in sorted(set(listed) - files)]
    problems += [f"docs/design.md lists {p} {listed.count(p)} times: keep one line"
                 for p in sorted(set(listed)) if listed.count(p) > 1]
    assert not problems, "\n".join(problems)
