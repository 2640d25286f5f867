"""The tree's layering: every import inside polyrl runs from a higher layer to a lower one (no cycles, no import
upwards). A new module must be placed in LAYERS; an import against the order fails here with both names."""

import ast
from pathlib import Path

import polyrl

ROOT = Path(polyrl.__file__).parent
# lowest first; a unit may import only units listed before it
LAYERS = ["errors", "registry", "latents", "media", "batch", "perf", "models", "sampling", "algorithms", "toy", "rewards", "data",
          "evaluation",
          "distributed", "actor", "config", "serving", "trainer", "cli", "__init__", "__main__"]


def _unit(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix("").parts[0]


def imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit, package = _unit(path), list(path.relative_to(ROOT).parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level > 0:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [node.names[0].name])
            elif node.module and node.module.startswith("polyrl."):
                target = node.module.split(".")[1:]
            else:
                continue
            if target and target[0] != unit:
                edges.setdefault(unit, set()).add(target[0])
    return edges


def test_every_import_runs_downwards():
    edges = imports()
    units = {_unit(p) for p in ROOT.rglob("*.py")}
    assert units <= set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS"
    upward = [(a, b) for a, targets in edges.items() for b in targets if LAYERS.index(b) >= LAYERS.index(a)]
    assert not upward, f"imports from a lower layer to a higher one: {sorted(upward)}"
    assert "trainer" in edges["cli"] and "models" in edges["sampling"]  # the scan sees real imports
