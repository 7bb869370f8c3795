"""The package's layers run one way: http -> service -> engine -> cache / store / protocol,
with the kernels and the CPU math below them all. These tests read every module's imports
(function-level ones too: a lazy import is still a dependency) and fail on an import that
runs upward or on a cycle, so the layout the folder names promise stays true."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each top-level package of lmsp_mlx lives (kernels/ ships as lmsp_mlx.kernels).
SOURCES = {"lmsp_mlx": ROOT / "lmsp_mlx", "lmsp_mlx.kernels": ROOT / "kernels"}

# A module may import its own layer or any lower one. The root package holds the versions.
# serve and models are the entry points (python -m lmsp_mlx.serve, python -m lmsp_mlx.models), cli and flags
# their flag parsers; settings, the typed settings every layer reads, imports nothing of the package.
LAYER = {"serve": 5, "models": 5, "cli": 5, "flags": 5, "settings": 0, "http": 4, "service": 3, "engine": 2, "cache": 1, "store": 1, "protocol": 1,
         "kernels": 0, "cpu_blas": 0, "": 0}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if package == "lmsp_mlx" and parts and parts[0] == "kernels":
                continue
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "lmsp_mlx"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lmsp_mlx":
                continue
            for alias in node.names:  # `from . import chat` names a module; `from .x import Y` a name in x
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m in known and m != name}


def layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return top, LAYER[top]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_folder_has_a_layer():
    assert {layer(m)[0] for m in graph()} <= set(LAYER)


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                    if layer(t)[1] > layer(m)[1])
    assert upward == []


def test_only_the_http_layer_knows_quart():
    found = modules()
    knows = sorted(m for m, path in found.items() if layer(m)[0] != "http" and any(
        isinstance(n, (ast.Import, ast.ImportFrom)) and any(
            (getattr(n, "module", None) or a.name).split(".")[0] in ("quart", "hypercorn", "werkzeug")
            for a in n.names)
        for n in ast.walk(ast.parse(path.read_text()))))
    assert knows == ["lmsp_mlx.serve"]  # it starts Hypercorn on the app


def test_the_package_has_no_import_cycle():
    edges = graph()
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_checks_see_an_upward_import(tmp_path):
    """The walk itself: a module of the engine that imports the service is caught."""
    engine = tmp_path / "engine.py"
    engine.write_text("def f():\n    from ..service.run import ResponseRun\n")
    known = {"lmsp_mlx.engine.worker", "lmsp_mlx.service.run"}
    assert imports("lmsp_mlx.engine.worker", engine, known) == {"lmsp_mlx.service.run"}
    assert layer("lmsp_mlx.service.run")[1] > layer("lmsp_mlx.engine.worker")[1]
