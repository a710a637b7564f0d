"""The import graph between mrl's rooms, from the source (grimp, as import-linter reads it), for any checkout:

    cd <checkout> && PYTHONPATH=$PWD python scripts/import_graph.py

A room is a package directly under mrl (mrl/train/, mrl/envs/, ...), or mrl/ itself for the top-level modules. It
prints each room with its module count (a sub-package counts as one module, the room's own `__init__` as none), the
arrows between rooms (importer -> imported room: how many module -> module imports, one per pair of modules,
function-level imports included), the circles between rooms (rooms that reach each other through arrows) and the
climbs: imports from a lower layer to a higher one under any layers contract of the checkout's pyproject.toml (the
packages' and each package's own). Circles and climbs should both be 0 (exit status 1 otherwise). On the flat tree
before the packages (a01fa32) mrl/ was one room of 40 modules, in a circle with rewards/.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

PACKAGE = "mrl"


def room(module: str, packages: set[str]) -> str:
    """mrl.train.loop -> mrl/train/; mrl.cli -> mrl/."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return f"{PACKAGE}/{parts[1]}/" if len(parts) > 1 and top in packages else f"{PACKAGE}/"


def layer_contracts(root: Path) -> list[tuple[str, list[set[str]]]]:
    """(container, its layers top to bottom as sets of member names) for each layers contract of pyproject.toml."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    found = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    return [(container, [{m.strip() for m in layer.split("|")} for layer in c["layers"]])
            for c in found if c["type"] == "layers" for container in c.get("containers", [])]


def climbs(imports: list[tuple[str, str]], contracts: list[tuple[str, list[set[str]]]]) -> list[tuple[str, str]]:
    """The imports a -> b where, under one contract's container, a's layer is below b's."""
    def layer(module: str, container: str, layers: list[set[str]]) -> int | None:
        if not module.startswith(container + "."):
            return None
        child = module[len(container) + 1:].split(".")[0]
        return next((i for i, members in enumerate(layers) if child in members), None)

    found = []
    for a, b in imports:
        for container, layers in contracts:
            la, lb = layer(a, container, layers), layer(b, container, layers)
            if la is not None and lb is not None and la > lb:
                found.append((a, b))
    return found


def circles(arrows: Counter) -> list[list[str]]:
    """The rooms that reach each other, grouped (strongly connected components of more than one room)."""
    rooms = {r for pair in arrows for r in pair}
    reach = {r: {b for a, b in arrows if a == r} for r in rooms}
    for _ in rooms:  # transitive closure; a handful of rooms
        reach = {r: seen | {c for s in seen for c in reach[s]} for r, seen in reach.items()}
    groups = {frozenset({r} | {s for s in reach[r] if r in reach[s]}) for r in rooms}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def main() -> None:
    spec = importlib.util.find_spec(PACKAGE)
    root = Path(spec.origin).parent.parent
    graph = grimp.build_graph(PACKAGE, include_external_packages=False, cache_dir=None)  # no cache to litter
    modules = sorted(graph.modules)
    packages = {m for m in modules if m.count(".") == 1 and graph.find_children(m)}
    sizes = Counter(room(m, packages) for m in modules if m != PACKAGE and m not in packages)
    imports = [(a, b) for a in modules for b in sorted(graph.find_modules_directly_imported_by(a))]
    arrows = Counter((room(a, packages), room(b, packages)) for a, b in imports
                     if room(a, packages) != room(b, packages))
    print(f"{PACKAGE} at {root}: {sum(sizes.values())} modules in {len(sizes)} rooms, {len(imports)} imports")
    for name in sorted(sizes):
        out = [f"{b.removeprefix(PACKAGE + '/') or b} {n}" for (a, b), n in sorted(arrows.items()) if a == name]
        print(f"  {name:<17} {sizes[name]:>3} modules  -> {', '.join(out) or '(nothing)'}")
    cycles = circles(arrows)
    print(f"circles between rooms: {len(cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    climbing = climbs(imports, layer_contracts(root))
    print(f"climbs (imports from a lower layer to a higher one, pyproject.toml's layer contracts): {len(climbing)}"
          + "".join(f"\n  {a} -> {b}" for a, b in climbing))
    sys.exit(1 if cycles or climbing else 0)


if __name__ == "__main__":
    main()
