"""The tree's layering: every import inside polyrl runs from a higher layer to a lower one (no import upwards), no
two modules import each other through any chain (no circle, also through imports inside functions), and no file
of the trainer grows past what one reads in a sitting. A new module must be placed in LAYERS; an import against the
order fails here with both names. A unit is a top-level module or package, or a sub-package or module named in LAYERS
with its dots: the toy tasks sit low, for the rewards to read, while their pretraining (`toy.pretrain`) sits above
the trainer, whose grids it writes; the evaluation math (`evaluation.stats`, `evaluation.hacking`) sits low, for the
trainer's evaluations, while `polyrl eval`'s engine (the rest of `evaluation`) sits above the trainer."""

import ast
from pathlib import Path

import polyrl

ROOT = Path(polyrl.__file__).parent
# lowest first; a unit may import only units listed before it
LAYERS = ["errors", "run_files", "registry", "draws", "latents", "media", "batch", "perf", "models", "sampling", "algorithms",
          "toy", "rewards", "data", "evaluation.stats", "evaluation.hacking", "distributed", "actor", "config", "serving",
          "trainer", "evaluation", "toy.pretrain", "view", "cli", "__init__", "__main__"]
TRAINER_MAX_LINES = 400


def _module(path: Path, root: Path) -> tuple[str, ...]:
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def module_imports(root: Path, package: str = "polyrl") -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Module -> the package's modules it imports (module level or inside functions), as dotted parts under root.
    `from . import x` counts as importing module x where x is a module, else the package itself."""
    modules = {_module(p, root): p for p in root.rglob("*.py")}
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = list(mod if is_pkg else mod[:-1])  # the package the module lives in
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    base = here[: len(here) - (node.level - 1)]
                    target = tuple(base + (node.module.split(".") if node.module else []))
                elif node.module and node.module.split(".")[0] == package:
                    target = tuple(node.module.split(".")[1:])
                else:
                    continue
                for alias in node.names:  # `from .pkg import module` imports that module
                    sub = (*target, alias.name)
                    targets.append(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                targets = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == package]
            for target in targets:
                if target in modules and target != mod:
                    edges.setdefault(mod, set()).add(target)
    return edges


def circles(edges: dict) -> list[list]:
    """Every set of modules that import each other through some chain (strongly connected, size > 1)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(".".join(m) for m in component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _unit(module: tuple[str, ...]) -> str:
    """The longest leading part of the module's dotted name that LAYERS names, else its top-level name."""
    for n in range(len(module), 1, -1):
        if ".".join(module[:n]) in LAYERS:
            return ".".join(module[:n])
    return module[0] if module else "__init__"


def test_every_import_runs_downwards():
    edges = module_imports(ROOT)
    units = {_unit(_module(p, ROOT)) for p in ROOT.rglob("*.py")}
    assert units <= set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS"
    upward = sorted({(_unit(a), _unit(b)) for a, targets in edges.items() for b in targets
                     if _unit(a) != _unit(b) and LAYERS.index(_unit(b)) >= LAYERS.index(_unit(a))})
    assert not upward, f"imports from a lower layer to a higher one: {upward}"
    assert ("sampling", "diffusion") in edges[("trainer", "build")] or ("sampling",) in edges[("trainer", "build")]


def test_no_module_imports_itself_through_a_chain():
    assert circles(module_imports(ROOT)) == []


def test_a_planted_circle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from pkg.sub import c\n")  # a lazy import closes it too
    (pkg / "sub" / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("from .sub import a\n")  # imports into the circle without being part of it
    assert circles(module_imports(pkg, "pkg")) == [["sub.a", "sub.b", "sub.c"]]
    (pkg / "sub" / "c.py").write_text("x = 1\n")
    assert circles(module_imports(pkg, "pkg")) == []


def test_trainer_files_stay_readable():
    long = {p.name: n for p in (ROOT / "trainer").glob("*.py") if (n := len(p.read_text().splitlines())) > TRAINER_MAX_LINES}
    assert not long, f"trainer files over {TRAINER_MAX_LINES} lines: {long}"


def test_the_view_reads_files_only():
    """`polyrl view` imports no trainer or model code: only the run-file readers and the error type."""
    edges = module_imports(ROOT)
    reached = {_unit(b) for a, targets in edges.items() if _unit(a) == "view" for b in targets} - {"view"}
    assert reached <= {"errors", "run_files"}, reached
