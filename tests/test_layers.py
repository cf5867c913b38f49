"""The import graph of oxygen_torch: no circle, and every arrow points down the layer map

    __main__ -> tools -> face (api, __init__) -> integrations -> engine -> compile -> kv -> pool
    -> base

where base is config, profiles, the patch module and the step context; triton_kernels knows
nothing of oxygen_torch. Imports inside functions count: they are how circles hide."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "oxygen_torch"
LAYERS = ["base", "pool", "kv", "compile", "engine", "integrations", "face", "tools", "main"]
BASE = {"config", "profiles", "_patching", "context", "triton_kernels"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in PKG.rglob("*.py")}
    found.update(
        {
            _module_name(p).replace("triton_kernels", "oxygen_torch.triton_kernels", 1): p
            for p in (ROOT / "triton_kernels").rglob("*.py")
        }
    )
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The oxygen_torch modules `name` imports (at any depth of its code)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports pkg.sub; `from pkg import name` imports pkg
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "oxygen_torch" or len(parts) == 1:
        return "face"
    head = parts[1]
    if head in BASE:
        return "base"
    if head == "api":
        return "face"
    if head == "__main__":
        return "main"
    return head if head in LAYERS else f"unknown:{head}"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer():
    unknown = sorted(m for m in _graph() if _layer(m).startswith("unknown"))
    assert not unknown, unknown


def test_arrows_point_down_the_layer_map():
    up = []
    for mod, deps in _graph().items():
        for dep in deps:
            if LAYERS.index(_layer(dep)) > LAYERS.index(_layer(mod)):
                up.append(f"{mod} ({_layer(mod)}) -> {dep} ({_layer(dep)})")
    assert not up, up


def test_triton_kernels_know_nothing_of_oxygen_torch():
    graph = _graph()
    bad = {
        m: sorted(d for d in deps if "triton_kernels" not in d)
        for m, deps in graph.items()
        if ".triton_kernels" in m
    }
    assert not {m: d for m, d in bad.items() if d}, bad


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exporting its own submodules is not a circle of ideas
    edges = {
        m: {d for d in deps if not (m.startswith(d + ".") and d != "oxygen_torch")}
        for m, deps in graph.items()
    }
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                circles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, [" -> ".join(c) for c in circles]


def test_import_oxygen_torch_in_a_fresh_interpreter():
    proc = subprocess.run(
        [sys.executable, "-c", "import oxygen_torch, oxygen_torch.integrations.hf"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
