"""The runbook's page of error lines, ``docs/errors.md``, keeps up with the jobs.

Every exception class that a job catches in an ``except`` whose handler prints an ``error:`` line to stderr (itself,
or through a function of ours that does, as ``training.runner.ended_with``) has a ``## <ClassName>`` section; every
such section names a class the code still has (defined by us, or a built-in or library class a job still catches);
every fixed ``error:`` line a job prints is quoted on the page; and the page's links lead to its own headings.
Read from the source with ``ast`` alone: nothing of the jobs is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "errors.md"
JOBS = REPO / "jobs"
CODE = ("common", "curation", "training", "pretrain", "finetune", "jobs", "generators")
# the page's sections that are not about one class
OTHER_SECTIONS = {"Which job prints which line", "Other lines"}


def _code_files() -> list[Path]:
    return [path for package in CODE for path in sorted((REPO / package).rglob("*.py"))]


def _starts_with_error(node: ast.expr) -> bool:
    """A plain string or an f-string whose text starts with ``error:``."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("error:")


def _error_print(node: ast.AST) -> ast.Call | None:
    """``node`` when it is ``print(<error: ...>, file=sys.stderr, ...)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"):
        return None
    to_stderr = any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords)
    return node if to_stderr and node.args and _starts_with_error(node.args[0]) else None


def _printers() -> set[str]:
    """The functions outside the jobs that print an ``error:`` line: a job's handler that calls one prints it too."""
    names = set()
    for path in _code_files():
        if path.parent == JOBS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(map(_error_print, ast.walk(node))):
                names.add(node.name)
    return names


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    return None


def _class_names(node: ast.expr | None) -> list[str]:
    """The classes an ``except`` names: ``X``, ``module.X`` or a tuple of them."""
    if isinstance(node, ast.Tuple):
        return [name for elt in node.elts for name in _class_names(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def caught_with_error_line(jobs: Path = JOBS) -> dict[str, set[str]]:
    """Exception class -> the jobs whose ``except`` of it prints an ``error:`` line."""
    printers = _printers()
    caught: dict[str, set[str]] = {}
    for path in sorted(jobs.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            inside = [n for statement in node.body for n in ast.walk(statement)]
            if any(_error_print(n) or _called(n) in printers for n in inside):
                for name in _class_names(node.type):
                    caught.setdefault(name, set()).add(path.stem)
    return caught


def page_sections(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^## (.+)$", text, re.MULTILINE)]


def defined_classes() -> set[str]:
    """Every class the code defines (``class <Name>(``), found as grep would."""
    pattern = re.compile(r"^\s*class (\w+)\(", re.MULTILINE)
    return {name for path in _code_files() for name in pattern.findall(path.read_text())}


def test_every_caught_class_has_a_section():
    caught = caught_with_error_line()
    assert {"ConfigError", "DataError", "Permanent", "Exhausted", "FixtureMissing"} <= caught.keys()  # the scan works
    sections = set(page_sections(PAGE.read_text()))
    missing = {name: sorted(jobs) for name, jobs in caught.items() if name not in sections}
    assert not missing, f"classes whose error line {PAGE.relative_to(REPO)} does not cover (## <ClassName>): {missing}"


def test_every_section_names_a_class_the_code_has():
    sections = page_sections(PAGE.read_text())
    assert sections[-1] == "Other lines", "the lines without a class come last"
    classes = [s for s in sections if s not in OTHER_SECTIONS]
    not_names = [s for s in classes if not re.fullmatch(r"[A-Za-z_]\w*", s)]
    assert not not_names, f"sections that are neither a class name nor one of {sorted(OTHER_SECTIONS)}: {not_names}"
    known = defined_classes() | caught_with_error_line().keys()
    gone = [s for s in classes if s not in known]
    assert not gone, f"sections of classes the code no longer defines or catches: {gone}"
    assert len(classes) == len(set(classes)), "a class has two sections"


def test_every_fixed_error_line_is_quoted():
    """The literal text of each ``error:`` line that is not an exception's message (``print("error: give ...")``)."""
    page = PAGE.read_text()
    absent = []
    for path in sorted(JOBS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = _error_print(node)
            if call is None:
                continue
            message = call.args[0]
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            if not (isinstance(parts[0], ast.Constant) and parts[0].value.strip() != "error:"):
                continue  # error: {exc}: the class's section quotes it
            texts = [p.value.strip() for p in parts if isinstance(p, ast.Constant) and p.value.strip()]
            absent += [f"{path.stem}: {text!r}" for text in texts if text not in page]
    assert not absent, f"fixed error lines {PAGE.relative_to(REPO)} does not quote: {absent}"


def test_links_lead_to_headings():
    text = PAGE.read_text()
    anchors = {
        re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())
        for title in re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    }
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"links to no heading of the page: {broken}"


def test_a_class_caught_without_a_section_is_found(tmp_path):
    """The scan sees a new class in a job's except tuple, and a helper that prints the line."""
    (tmp_path / "new_job.py").write_text(
        "import sys\n"
        "from training.runner import ended_with\n\n"
        "def main():\n"
        "    try:\n"
        "        pass\n"
        "    except (BrandNewError, storage.OtherNewError) as exc:\n"
        '        print(f"error: {exc}", file=sys.stderr)\n'
        "    except ThirdNewError as exc:\n"
        "        return ended_with(exc)\n"
        "    except QuietError:\n"
        "        pass\n"
    )
    caught = caught_with_error_line(tmp_path)
    assert caught.keys() == {"BrandNewError", "OtherNewError", "ThirdNewError"}
    assert not caught.keys() & set(page_sections(PAGE.read_text()))
