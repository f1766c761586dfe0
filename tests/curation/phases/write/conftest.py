"""A published output to take images down from, a list file to take them down with, and what the takedown tests
read back. Handed to tests as fixtures (a function each)."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.layout import LAYOUT
from curation.score.ledger import read_ledger


@pytest.fixture()
def out(wds_curated_run, tmp_path) -> Path:
    """A copy of the session's curated WebDataset output, to change."""
    copy = tmp_path / "out"
    shutil.copytree(wds_curated_run[1], copy)
    return copy


def _manifest(out: Path) -> dict:
    return json.loads((out / LAYOUT.manifest).read_text())


def _rows(out: Path) -> list[dict]:
    files = [out / LAYOUT.shards / s["file"] for s in _manifest(out)["shards"]]
    return pa.concat_tables([pq.read_table(f, columns=["key", "source", "metadata"]) for f in files]).to_pylist()


def _ledger(out: Path) -> dict[str, dict]:
    return {r["source"]: r for r in read_ledger(str(out), ["source", "status", "stage", "reason"]).to_pylist()}


def _three_entries(out: Path) -> tuple[list[str], set[str]]:
    """A key, a source and a URL naming three different kept images, and their sources."""
    a, b, c = _rows(out)[:3]
    return [a["key"], b["source"], c["metadata"]["url"]], {a["source"], b["source"], c["source"]}


@pytest.fixture()
def takedown_list(tmp_path) -> Callable[..., Path]:
    """``takedown_list(*entries)``: a list file of the entries, with a comment and a blank line as people write."""

    def write(*entries: str) -> Path:
        path = tmp_path / "takedown.txt"
        path.write_text("# requests of 2026-12-01\n\n" + "\n".join(entries) + "\n")
        return path

    return write


@pytest.fixture(scope="session")
def manifest_of() -> Callable[[Path], dict]:
    """``manifest_of(out)``: the output's manifest."""
    return _manifest


@pytest.fixture(scope="session")
def rows_of() -> Callable[[Path], list[dict]]:
    """``rows_of(out)``: key, source and metadata of every row of the shards the manifest lists."""
    return _rows


@pytest.fixture(scope="session")
def ledger_of() -> Callable[[Path], dict[str, dict]]:
    """``ledger_of(out)``: each input's final ledger row (status, stage, reason) by source."""
    return _ledger


@pytest.fixture(scope="session")
def three_entries() -> Callable[[Path], tuple[list[str], set[str]]]:
    """``three_entries(out)``: see ``_three_entries``."""
    return _three_entries
