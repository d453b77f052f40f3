"""The package's shape: layers that import only downwards, no import circles, one public face, one
exception root.

The import graph is read from the source (every ``import`` statement, also those inside functions and
under ``TYPE_CHECKING``), so a circle that only closes at run time, or only for a type checker, counts.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import liver
from liver.shared.errors import BusError, HandoffError, InputError, LiverError, PlanningError

ROOT = Path(liver.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (``liver.a.b.C`` -> ``liver.a.b``)."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> Iterator[str]:
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("liver"):
                resolved = _resolve(target)
                if resolved is not None and resolved != module:
                    yield resolved


@cache
def _graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(_imports(module)) for module in _modules()}


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph, index, low, stack, on_stack, found = _graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _edges_from(prefix: str, to: str) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        if a.startswith(prefix)
        for b in targets
        if b.startswith(to)
    )


def test_the_graph_sees_the_package() -> None:
    assert "liver.worker_runtime.runtime" in _graph()
    assert "liver.shared.layout" in _graph()["liver.worker_runtime.runtime"]


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _circles() == []


def test_shared_imports_nothing_above_it() -> None:
    above = [
        e for e in _edges_from("liver.shared", "liver.") if not e.split(" -> ")[1].startswith("liver.shared")
    ]
    assert above == []


def test_reshard_imports_only_shared() -> None:
    above = [
        e
        for e in _edges_from("liver.reshard", "liver.")
        if not e.split(" -> ")[1].startswith(("liver.shared", "liver.reshard"))
    ]
    assert above == []


def test_no_service_imports_another_service() -> None:
    def service(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "services" else None

    across = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if service(a) and service(b) and service(a) != service(b)
    ]
    assert "liver.services.coordinator" in {m.rpartition(".")[0] for m in _graph()}
    assert across == []


def test_services_and_the_worker_runtime_never_import_each_other() -> None:
    assert _edges_from("liver.services", "liver.worker_runtime") == []
    assert _edges_from("liver.worker_runtime", "liver.services") == []


@pytest.mark.slow
def test_importing_liver_loads_neither_torch_nor_megatron() -> None:
    probe = "import sys, liver; print(sorted(m for m in ('torch', 'megatron', 'nats') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_loads_from_the_package() -> None:
    for name in liver.__all__:
        assert getattr(liver, name) is not None, name
    from liver.worker_runtime.runtime import LiveRuntime

    assert liver.LiveRuntime is LiveRuntime


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        _ = liver.NoSuchThing  # type: ignore[attr-defined]
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("liver.NoSuchThing did not raise")


# -- one exception root -------------------------------------------------------------------------------

_BUILTIN_BASES = {
    "Exception",
    "ValueError",
    "RuntimeError",
    "TimeoutError",
    "KeyError",
    "TypeError",
    "OSError",
}
_NOT_FAILURES = {
    "liver.worker_runtime.worker_main.WorkerStopped": "a BaseException that unwinds a worker on a signal",
    "liver.reshard.verifier._Enough": "stops a search early; never leaves its function",
    "liver.reshard.verifier._Unproved": "ends the class proof early; never leaves _prove_by_class",
}


def _exception_classes() -> dict[str, list[str]]:
    """Every class in the package that derives (by name) from an exception, with its base names."""
    classes: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                classes[f"{module}.{node.name}"] = bases
    by_name: dict[str, list[str]] = {}
    for qualified, bases in classes.items():
        by_name.setdefault(qualified.rpartition(".")[2], []).extend(bases)

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in _BUILTIN_BASES or name == "BaseException":
            return True
        return name not in seen and any(is_exception(b, seen | {name}) for b in by_name.get(name, []))

    return {q: b for q, b in classes.items() if any(is_exception(x) for x in b)}


def test_every_exception_liver_raises_descends_from_liver_error() -> None:
    families = {"LiverError", "InputError", "PlanningError", "HandoffError", "BusError"}
    classes = _exception_classes()
    by_name = {q.rpartition(".")[2]: b for q, b in classes.items()}

    def rooted(name: str) -> bool:
        return name in families or any(rooted(b) for b in by_name.get(name, []) if b not in _BUILTIN_BASES)

    strays = [q for q in classes if q not in _NOT_FAILURES and not rooted(q.rpartition(".")[2])]
    assert len(classes) > 30, "the scan found too few exception classes to be looking at the package"
    assert strays == []


def test_each_family_keeps_the_builtin_base_callers_already_catch() -> None:
    assert issubclass(InputError, ValueError) and issubclass(PlanningError, ValueError)
    assert issubclass(HandoffError, RuntimeError) and issubclass(BusError, RuntimeError)
    assert all(issubclass(f, LiverError) for f in (InputError, PlanningError, HandoffError, BusError))


def test_a_bad_layout_is_caught_as_liver_input_and_still_names_its_field() -> None:
    try:
        liver.ParallelLayout(tp=0, pp=1, dp=1)
    except LiverError as error:
        assert isinstance(error, InputError)
        assert "tp" in str(error)
    else:
        raise AssertionError("a zero TP was accepted")
