"""The house's layers: each package imports only the packages below it, and no module imports itself back through
others, deferred (function-level) imports included. ``TYPE_CHECKING`` imports are annotations, not dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Package -> the packages of ours it may import. The product (common .. finetune) never imports the generators of
# test and demo data, the jobs or the benchmarks; training never imports curation.
ALLOWED = {
    "common": set(),
    "curation": {"common"},
    "training": {"common"},
    "pretrain": {"common", "training"},
    "finetune": {"common", "training", "pretrain"},
    "generators": {"common", "curation", "finetune"},
    "jobs": {"common", "curation", "training", "pretrain", "finetune", "generators"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (REPO / package).rglob("*.py"):
            found[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def _imports(path: Path, known: set[str], type_only: bool = False) -> set[str]:
    """Modules of ours that ``path`` imports, at the top or inside functions; under ``if TYPE_CHECKING`` too when
    ``type_only``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            guarded = (
                isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING"
            )
            if guarded and not type_only:
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module, *(f"{child.module}.{a.name}" for a in child.names)]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                names = []
            out.update(n for n in names if n in known)
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
            connect(v)
    return found


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules), type_only) - {name} for name, path in modules.items()}


def test_packages_import_only_the_layers_below_them():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if (a := module.split(".")[0]) != (b := target.split(".")[0]) and b not in ALLOWED[a]
    )
    assert not wrong, wrong


# Inside curation: sub-package -> what of curation it may import (settings, config and records are shared by all).
SHARED = {"settings", "config", "records"}
CURATION_ALLOWED = {
    "models": {"settings"},
    "steps": SHARED,
    "score": SHARED | {"stages", "steps"},
    "stages": {"settings", "score", "models"},
    "phases": SHARED | {"score", "steps"},
    "audit": SHARED | {"score", "steps", "phases"},
}


def _curation_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "curation" and len(parts) > 1 else None


def test_curation_sub_packages_import_only_their_layers():
    """The score phase and the stages never import the global phases or the audit; the models never import a stage;
    the step runner imports no phase."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if (a := _curation_part(module)) in CURATION_ALLOWED
        for target in targets
        if (b := _curation_part(target)) is not None and b != a and b not in CURATION_ALLOWED[a]
    )
    assert not wrong, wrong


def test_curation_holds_only_its_sub_packages_and_shared_modules():
    """A new module goes into the sub-package of its layer (or is one of the modules every layer shares)."""
    top = sorted(p.name for p in (REPO / "curation").glob("*.py") if p.name != "__init__.py")
    assert top == ["config.py", "records.py", "settings.py"], top
    assert {p.name for p in (REPO / "curation").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        CURATION_ALLOWED
    )


def test_the_code_map_names_every_curation_module():
    text = (REPO / "docs" / "code-map.md").read_text()
    start = text.index("Inside `curation/`")
    end = text.find("\n\n", text.index("| `audit/`", start))
    code_map = text[start : end if end >= 0 else len(text)]
    missing = []
    for path in sorted((REPO / "curation").rglob("*.py")):
        rel = path.relative_to(REPO / "curation")
        if path.name == "__init__.py" or rel.parts[0] == "stages":
            continue  # packages and stages are named by their folder
        row = next((line for line in code_map.splitlines() if f"| `{'/'.join(rel.parts[:-1])}/` |" in line), "")
        if f"`{rel.name}`" not in (row if len(rel.parts) > 1 else code_map):
            missing.append(str(rel))
    assert not missing, missing


def test_no_import_cycle_even_through_deferred_imports():
    assert _cycles(_graph()) == []


def test_no_import_cycle_even_through_annotations():
    """Type-only imports count too: a module typed against another's class must not be imported by it."""
    assert _cycles(_graph(type_only=True)) == []


def test_the_checker_sees_a_cycle_and_a_deferred_import(tmp_path):
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(cyclic) == [["a", "b", "c"]]
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import common.schema\n"
        "def f():\n    from curation import stage\n"
    )
    assert _imports(module, {"common.schema", "curation.stage", "curation"}) == {"curation", "curation.stage"}
    everything = {"common.schema", "curation.stage", "curation"}
    assert _imports(module, {"common.schema", "curation.stage", "curation"}, type_only=True) == everything
