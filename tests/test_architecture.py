"""The import graph of the packages: imports at module level only, no cycles, and the boundaries
(pallas_kernels knows nothing of k3jax; k3jax never imports convert or serve)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("k3jax", "pallas_kernels", "convert", "serve")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _imported(node: ast.AST, module: str) -> list[str]:
    """Our modules an import statement names (a `from X import y` of a submodule y names X.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if _ours(a.name)]
    if isinstance(node, ast.ImportFrom):
        assert node.level == 0, f"{module}: relative import at line {node.lineno} (the packages use absolute ones)"
        target = node.module or ""
        if not _ours(target):
            return []
        return [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
    return []


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module-level import edges, and every import found inside a function or method."""
    edges, nested = {m: set() for m in MODULES}, []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                for target in _imported(child, module):
                    if in_function:
                        nested.append(f"{path.relative_to(ROOT)}:{child.lineno} imports {target}")
                    else:
                        edges[module].add(target if target in MODULES else target.rsplit(".", 1)[0])
                visit(child, inside)

        visit(tree, False)
    return edges, nested


def test_no_imports_inside_functions():
    _, nested = _graph()
    assert not nested, "imports of our packages inside functions (hidden cycles?):\n" + "\n".join(nested)


def test_import_graph_has_no_cycles():
    edges, _ = _graph()
    state, stack = {}, []

    def dfs(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if n not in MODULES:
                continue
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                dfs(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            dfs(m)


@pytest.mark.parametrize("package,forbidden", [("pallas_kernels", ("k3jax", "convert", "serve")),
                                               ("k3jax", ("convert", "serve"))])
def test_boundaries(package, forbidden):
    edges, _ = _graph()
    bad = sorted(f"{m} -> {t}" for m, targets in edges.items() if m.split(".")[0] == package
                 for t in targets if t.split(".")[0] in forbidden)
    assert not bad, f"{package} must not import {forbidden}: {bad}"


def test_the_check_sees_real_imports():
    """Guard against a vacuous pass: known edges are found."""
    edges, _ = _graph()
    assert "k3jax.config" in edges["k3jax.causal_lm"]
    assert "pallas_kernels.kda.ops" in edges["pallas_kernels.kda"]
