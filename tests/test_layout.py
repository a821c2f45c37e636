"""The package layout's import rules (docs/design.md, "Layout"): each layer imports only itself and
the layers below it, and no modules import each other in a cycle.

Imports are read from the source with ``ast`` (both module-level and function-level ones), so the
rules hold for lazy imports too. Imports under ``if TYPE_CHECKING:`` are annotations only and never
run, so they count for the layers but not for cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import package -> source folder (pyproject's package-dir maps pd.kernels, pd.router, pd.monitoring).
SOURCES = {"pd": ROOT / "pd", "pd.kernels": ROOT / "kernels", "pd.router": ROOT / "router",
           "pd.monitoring": ROOT / "monitoring", "pd.deploy": ROOT / "deploy"}
# Layer of each package, lowest first; a module may import its own layer's package and lower layers.
LAYERS = [
    {"pd.util"},
    {"pd.router", "pd.kernels", "pd.monitoring", "pd.engines", "pd.deploy"},
    {"pd.config"},
    {"pd.commands", "pd.bench"},
    {"pd.tools", "pd.planner"},
    {"pd.cluster"},
    {"pd.cli", "pd.launch"},
]
# Packages of one layer that may use each other: none, except the ones listed.
# The engine's MTP draft computes its MXFP4 MoE with the kernels' torch reference (and Triton kernel on a GPU).
SIDEWAYS = {("pd.engines", "pd.kernels")}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "pd" and parts and parts[0] in ("kernels", "router", "monitoring", "deploy"):
                continue
            mods[name] = path
    return mods


def _nodes(tree: ast.AST, runtime_only: bool):
    """Every node of ``tree``; with ``runtime_only``, none inside an ``if TYPE_CHECKING:`` block."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """The pd.* modules ``name`` imports, resolved to modules that exist (``from pd.x import y`` is
    module ``pd.x.y`` when that exists, else ``pd.x``)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in _nodes(ast.parse(path.read_text()), runtime_only):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("pd") and t != name and t != "pd":
                out.add(t)
    return out


def _package(mod: str) -> str:
    for layer in LAYERS:
        for pkg in sorted(layer, key=len, reverse=True):
            if mod == pkg or mod.startswith(pkg + "."):
                return pkg
    raise AssertionError(f"{mod} is in no layer of tests/test_layout.py: add its package to LAYERS")


def _layer(pkg: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def _graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"pd"}
    return {m: _imports(m, p, known, runtime_only) for m, p in mods.items()}


def test_every_module_imports_only_its_layer_and_below():
    bad = []
    for mod, deps in _graph().items():
        if mod == "pd":
            continue
        src = _package(mod)
        for dep in deps:
            dst = _package(dep)
            if dst == src or (src, dst) in SIDEWAYS:
                continue
            if _layer(dst) >= _layer(src):
                bad.append(f"{mod} imports {dep} ({dst} is not below {src})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph(runtime_only=True)
    # Tarjan's strongly connected components; any component of more than one module is a cycle.
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_rules_see_a_real_upward_import(tmp_path):
    """The checker itself: an upward import in a scratch module is found."""
    mod = tmp_path / "m.py"
    mod.write_text("from pd.cluster.launch import main\nimport pd.config\n"
                   "if TYPE_CHECKING:\n    from pd.tools import plan\n")
    known = set(_modules())
    assert _imports("pd.engines.m", mod, known) == {"pd.cluster.launch", "pd.config", "pd.tools.plan"}
    assert _imports("pd.engines.m", mod, known, runtime_only=True) == {"pd.cluster.launch", "pd.config"}


def test_every_package_is_in_pyproject():
    """pyproject lists packages by name (the package-dir mapping rules out discovery): a package left off
    that list works in an editable checkout but is missing from a wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    # a folder of data files only (pd/bench/data) is listed so that setuptools ships it without a warning
    data_only = {name for name in setuptools["package-data"] if name not in found}
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert listed - found - data_only == set(), "pyproject.toml lists packages that do not exist"
