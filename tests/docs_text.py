"""The project's documentation as tests read it: its pages, their headings, a section by its heading."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "infra" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def headings(path: Path) -> list[str]:
    """A Markdown file's headings as plain text (code spans, emphasis and links reduced to their words)."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+?)\s*#*$", line)):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
            found.append(re.sub(r"[`*_]{1,2}([^`*_]+)[`*_]{1,2}", r"\1", text).replace("`", ""))
    return found


def section(title: str) -> str:
    """The text under the heading ``title`` in README.md or docs/, up to the next heading: tests that run what the
    documentation shows find it wherever it moves."""
    for path in PAGES:
        text = path.read_text()
        m = re.search(rf"^#+ {re.escape(title)}\s*$", text, flags=re.M)
        if m:
            rest = text[m.end() :]
            end = re.search(r"^#+ ", _without_code(rest), flags=re.M)
            return rest[: end.start()] if end else rest
    raise AssertionError(f"no section {title!r} in README.md or docs/")


def _without_code(text: str) -> str:
    """``text`` with its fenced code blocks blanked, same length (a comment line in a block is no heading)."""
    return re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
