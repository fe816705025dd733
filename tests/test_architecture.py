"""Architecture rules read from the package's source: no import cycles, ops/ backends independent of each other.

The import graph counts every ``import`` / ``from ... import`` statement anywhere in a module (module level and
inside functions), because a function-local import is a cycle that only waits for its first call. Importing a
submodule also runs its parents' ``__init__``; those implicit edges are not counted (every package would otherwise be
in a cycle with its own ``__init__``), only the modules a statement names.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_glm5"


def module_files(root: Path, package: str) -> Dict[str, Path]:
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _target(module: str, is_package: bool, level: int, name: str) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path, package: str) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports anywhere in its source."""
    files = module_files(root, package)
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _target(module, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in files else target)
        graph[module] = {m for m in found if m in files and m != module}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_detector_finds_function_local_and_relative_cycles(tmp_path):
    """The checker itself: a cycle closed by a function-local relative import is found, a chain is not a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import g\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(textwrap.dedent("""
        def g():
            from .. import a
            return a
    """))
    (pkg / "c.py").write_text("import pkg.a\n")
    found = cycles(import_graph(tmp_path, "pkg"))
    assert found == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []


def test_package_has_no_import_cycles():
    found = cycles(import_graph(ROOT, PACKAGE))
    assert not found, "import cycles in megatron_glm5 (module-level or function-local imports):\n" + "\n".join(
        " <-> ".join(c) for c in found)


# the backend every GPU backend composes as its visible fallback (``self.fallback``) for what its library lacks
FALLBACK_BACKEND = "megatron_glm5.ops.triton_backend"


def test_ops_backends_are_layered():
    """ops/: every backend module imports the base and its own kernels, never another backend (except the one
    fallback, composed explicitly); the fallback and the base import no backend; nothing in ops/ imports the
    registry back."""
    from megatron_glm5.ops.registry import BACKENDS

    graph = import_graph(ROOT, PACKAGE)
    backend_modules = {type(b).__module__ for b in BACKENDS.values()}
    assert FALLBACK_BACKEND in backend_modules and len(backend_modules) == len(BACKENDS)
    problems = []
    for module in sorted(backend_modules):
        allowed = {FALLBACK_BACKEND} if module != FALLBACK_BACKEND else set()
        for other in sorted(graph[module] & (backend_modules - allowed)):
            problems.append(f"{module} imports backend {other}")
        outside = {m for m in graph[module] if not m.startswith(f"{PACKAGE}.ops")} - {f"{PACKAGE}.errors"}
        problems.extend(f"{module} imports {m} (a backend sees only ops/)" for m in sorted(outside))
    for module in sorted(graph):
        if module.startswith(f"{PACKAGE}.ops.") and f"{PACKAGE}.ops.registry" in graph[module]:
            problems.append(f"{module} imports the registry")
    assert not (graph[f"{PACKAGE}.ops.base"] & backend_modules), "ops/base.py imports a backend"
    assert not problems, "\n".join(problems)


def test_gpu_skip_reasons_say_what_is_needed():
    """A skipped GPU test says what it needs ("needs a CUDA GPU"), not where this project's developers run it."""
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("*.py"))
                 if "device" + " machine" in p.read_text()]
    assert not offenders, offenders
