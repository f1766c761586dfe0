"""The documentation: the README as a front page, the configuration reference as the settings classes say, every
relative link and anchor resolving, every section the project cites existing, and the site built in strict mode
and rendered in headless Chromium."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.chromium import Chromium, chromium
from tests.docs_text import PAGES, headings

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
# A section cited by name: (README, "Section"), docs/page.md, "Section", infra/README.md ("Section" ...
CITATION = re.compile(r"\b(README(?:\.md)?|infra/README\.md|docs/[\w./-]+\.md)\)?[,:]? \(?\"([^\"\n]{3,120})\"")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans, line for line."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, each space a hyphen."""
    text = unicodedata.normalize("NFKC", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def site_anchor(heading: str) -> str:
    """The site's anchor of a heading (Python-Markdown's toc, as MkDocs configures it)."""
    return slugify(heading, "-")


def test_the_readme_is_a_front_page_with_the_two_commands_first():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert lines[:5] == [
        "# Humans-1B",
        "",
        "```bash",
        'pip install -e ".[test]" && python -m jobs.make_sample_pool --out sample_pool && python -m jobs.curate '
        "--config configs/curate/lite.yaml --input sample_pool --output out/curated && python -m jobs.pretrain "
        "--config configs/pretrain/tiny.yaml --data out/curated/shards --storage out/runs --name tiny",
        'pip install -e ".[test]" && python -m pytest -q',
    ]


def test_every_relative_link_and_anchor_resolves():
    """Links from docs/ pages follow the site's anchors; from the READMEs, GitHub's (where they are read)."""
    broken = []
    for page in PAGES:
        anchor_of = site_anchor if DOCS in page.parents else github_anchor
        for n, line in enumerate(_prose(page.read_text()).splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and anchor not in {anchor_of(h) for h in headings(dest)}:
                    broken.append(f"{where} (no such heading in {dest.relative_to(REPO)})")
    assert not broken, "\n".join(broken)


def test_every_section_the_project_cites_exists():
    """Config comments, docstrings, error messages and pages name sections as (docs/page.md, "Section")."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    missing, cited = [], 0
    for name in files:
        if not name.endswith((".py", ".yaml", ".yml", ".md", ".sh", ".toml")) or name.startswith("tests/test_docs"):
            continue
        for n, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1):
            for file, title in CITATION.findall(line):
                cited += 1
                path = REPO / ("README.md" if file == "README" else file)
                if not path.exists() or not any(h.startswith(title) for h in headings(path)):
                    missing.append(f'{name}:{n}: {file}, "{title}"')
    assert cited > 10  # the pattern still finds the project's citations
    assert not missing, "\n".join(missing)


def test_the_configuration_reference_is_the_settings_classes():
    done = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=REPO, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    text = (DOCS / "reference" / "configuration.md").read_text()
    for key in ("filters.min_short_side", "dedup.links", "objective.lambda_cl", "loss.ce", "watchdog.minutes"):
        assert f"| `{key}` |" in text, key


def test_no_internal_priorities_or_issue_numbers_in_the_pages():
    for page in PAGES:
        text = _prose(page.read_text())
        assert not re.search(r"\b(P[1-5])\b(?![0-9])|\bissue #?\d+", text), page


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as CI builds it: strict, so a warning (a broken link, a page left out of the nav) fails."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_site_renders_offline_in_headless_chromium(site, tmp_path):
    """The home page and the configuration reference, opened from the file system: the navigation and a known key
    are there, nothing is fetched from outside the site, nothing fails."""
    browser = Chromium(chromium(), tempfile.mkdtemp(dir=tmp_path))
    try:
        browser.load((site / "index.html").as_uri())
        nav = browser.evaluate("[...document.querySelectorAll('nav.md-nav--primary a')].map(a => a.textContent.trim())")
        home = browser.evaluate("document.querySelector('article').innerText")
        browser.load((site / "reference" / "configuration.html").as_uri())
        reference = browser.evaluate("document.querySelector('article').innerText")
        title = browser.evaluate("document.title")
    finally:
        browser.close()
    assert {"Getting started", "Curating a pool", "Configuration", "Runbook"} <= set(nav), nav
    assert "Where to start" in home
    assert title.startswith("Configuration") and "filters.min_short_side" in reference and "384" in reference
    urls = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
    outside = [u for u in urls if not u.startswith((site.as_uri() + "/", "data:"))]  # inline icons are data: URLs
    assert urls and not outside, outside
    failed = [e["params"] for e in browser.events if e.get("method") == "Network.loadingFailed"]
    assert not failed, failed
    errors = [e["params"] for e in browser.events if e.get("method") == "Runtime.exceptionThrown"]
    assert not errors, errors
