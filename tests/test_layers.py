"""The package's floors (docs/architecture.md, "Floors"): each top-level part of logra_rl imports only itself and the
parts below it in ORDER, counting every import statement of every module (inside functions and `TYPE_CHECKING`
blocks too), so no two parts import each other, however indirectly."""

import ast
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "logra_rl"
ROOT = PACKAGE.name
# The parts, low to high: a part may import itself and the parts before it, never a part after it.
ORDER = [
    # core: no Ray actor, no engine, no step loop
    "utils",
    "logra",
    "rl",
    "rewards",
    "data",
    "config",
    "models",
    # runtime: the engines, the train workers, evaluation, the driver
    "rollout",
    "train",
    "eval",
    "orchestration",
    # the console scripts and the benchmarks' helpers
    "apps",
]
PART_OF = {"configs": "config"}  # the Hydra tree (logra_rl/configs/) belongs to the config (logra_rl/config.py)


def part_of(module: str) -> str | None:
    """The top-level part a dotted module name of the package belongs to; None for the package root itself."""
    names = module.split(".")
    return PART_OF.get(names[1], names[1]) if len(names) > 1 else None


def module_of(path: Path) -> str:
    names = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def imported(path: Path) -> Iterator[tuple[ast.stmt, str]]:
    """(statement, module of the package it imports) for every import in `path`, relative ones resolved."""
    source = path.read_text()
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from logra_rl import config`, `from . import x`: each name may be a module of its own
            names = [f"{base}.{alias.name}" for alias in node.names] if base == ROOT or not node.module else [base]
        else:
            continue
        for name in names:
            if name == ROOT or name.startswith(f"{ROOT}."):
                yield node, name


def edges() -> list[tuple[str, str, str]]:
    """(importing part, imported part, `file:line: statement`) for every import of one part by another."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        here = part_of(module_of(path))
        for node, name in imported(path):
            there = part_of(name)
            if there is not None and there != here:
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.get_source_segment(source, node)}"
                found.append((here or ROOT, there, where))
    return found


def parts() -> set[str]:
    """Every top-level part: a subpackage or a module directly under logra_rl (its __init__.py aside)."""
    return {
        part_of(module_of(path))
        for path in PACKAGE.rglob("*.py")
        if path.parent != PACKAGE or path.name != "__init__.py"
    }


def test_every_part_has_its_floor():
    unplaced = sorted(parts() - set(ORDER))
    assert not unplaced, f"parts of {ROOT} missing from ORDER (tests/test_layers.py): {unplaced}; place each one"
    gone = sorted(set(ORDER) - parts())
    assert not gone, f"ORDER names parts {ROOT} no longer has: {gone}"


def test_no_part_imports_a_part_above_it():
    floor = {part: index for index, part in enumerate(ORDER)} | {ROOT: -1}  # the root imports no part
    upward = [
        f"{where}  ({here} imports {there}, which is above it)"
        for here, there, where in edges()
        if floor.get(there, len(ORDER)) > floor.get(here, len(ORDER))
    ]
    assert not upward, "imports of a higher part (ORDER: " + " < ".join(ORDER) + "):\n" + "\n".join(upward)


def test_the_parts_import_each_other_in_no_cycle():
    graph: dict[str, dict[str, str]] = {}
    for here, there, where in edges():
        graph.setdefault(here, {}).setdefault(there, where)

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for nxt in graph.get(path[-1], {}):
            if nxt == start:
                return [*path, start]
            if nxt not in path and nxt > start:  # each cycle is found once, from its smallest part
                found = cycle_from(start, [*path, nxt])
                if found:
                    return found
        return None

    for start in sorted(graph):
        cycle = cycle_from(start, [start])
        assert cycle is None, (
            "a cycle of parts: " + " -> ".join(cycle) + "\n" + "\n".join(graph[a][b] for a, b in pairwise(cycle))
        )
