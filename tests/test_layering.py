"""The package's modules form layers: no import circle, no pass importing another pass.

Imports are read from the source with ast, function-local ones included (a local import that
closes a circle is still a circle: it only moves the failure from import time to call time).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Installed package name -> source folder (pyproject's package-dir).
PACKAGES = {"onnxfuse": ROOT / "onnxfuse", "onnxfuse.passes": ROOT / "passes"}

# Lower layers never import higher ones (index = layer; a module may import its own layer and
# the ones below). Modules not listed (graph layer, program, passes...) are checked for circles
# only.
LAYERS = [
    {"onnxfuse.version", "onnxfuse.ops", "onnxfuse.ops.contract", "onnxfuse.ops.header", "onnxfuse.ops.pointwise",
     "onnxfuse.ops.conv_bias_act", "onnxfuse.ops.attention", "onnxfuse.ops.channel_shuffle",
     "onnxfuse.ops.squeeze_excite", "onnxfuse.ops.stacked_mlp", "onnxfuse.ops.attention_nan_guard",
     "onnxfuse.target", "onnxfuse.optimize_options", "onnxfuse.fused", "onnxfuse.modelio", "onnxfuse.normalize",
     "onnxfuse.modelsave", "onnxfuse.modelfields", "onnxfuse.errors", "onnxfuse.weights", "onnxfuse.outfiles",
     "onnxfuse.records", "onnxfuse.protowire", "onnxfuse.cuda.emit",
     "onnxfuse.environment", "onnxfuse.runtime", "onnxfuse.ortfiles", "onnxfuse.supervise"},  # ort
    {"onnxfuse.inputs", "onnxfuse.dimchoice", "onnxfuse.compare", "onnxfuse.verify", "onnxfuse.region_verify",
     "onnxfuse.profile",
     "onnxfuse.zoo"},
    {"onnxfuse.api", "onnxfuse.cli", "onnxfuse.display"},
]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            # a sub-package of onnxfuse that pyproject maps elsewhere is not this folder's
            if package == "onnxfuse" and parts and f"onnxfuse.{parts[0]}" in PACKAGES:
                continue
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module pkg.mod
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for t in targets:
            # `import onnxfuse.graph.core` also runs onnxfuse.graph's __init__: count the module itself
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_reader_sees_every_module_and_local_imports():
    # the premise of the tests below: the graph is read, function-local imports included
    assert "onnxfuse.api" in GRAPH and "onnxfuse.passes.pointwise" in GRAPH
    assert "onnxfuse.runtime" in GRAPH["onnxfuse.verify"]  # verify imports runtime inside a function


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_package_modules():
    assert _circles(GRAPH) == []


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("onnxfuse.passes.")))
def test_no_pass_imports_another_pass(name):
    others = sorted(m for m in GRAPH[name] if m.startswith("onnxfuse.passes"))
    assert others == [], f"{name} imports {others}: shared helpers belong in the graph layer"


@pytest.mark.parametrize("layer", range(len(LAYERS) - 1))
def test_lower_layers_do_not_import_higher_ones(layer):
    higher = set().union(*LAYERS[layer + 1:])
    wrong = {m: sorted(GRAPH[m] & higher) for m in LAYERS[layer] if GRAPH[m] & higher}
    assert wrong == {}
