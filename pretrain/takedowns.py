"""Takedowns reaching a running pretraining: which rows of the run's index are gone, and where the others now are.

A takedown (``jobs.takedown``) rewrites the final shards holding a listed image under new names (``part-NNNNN-<new
digest>``: the other rows in order, the same row group size), switches the manifest and records what it replaced
(``_state/takedown/<list id>.json``). A run keeps its own index (``pretrain.data``); ``Takedowns`` says, for each of
its files a takedown replaced, the file holding its remaining rows and which of its rows (file-wide numbers) are
gone. Those rows leave the epoch order (``data.EpochOrder``): the order of the others is unchanged and a removed
image's place goes to the next one. The removed rows are the record's own (``removed_rows``: per replaced file, the
rows the takedown took out), so a file deleted at once (``--grace-minutes 0``) is never needed. A record written
before them is read by key in the replaced file while it is still there; once that is gone its last rows count as
removed instead: none that is removed is read, but in the epoch the takedown lands in a few of the file's other
images may come twice or not at all.

Sizes at 1B images: one listing of the records per check, and state per replaced file and removed image.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow.fs as pafs

from common import storage
from common.layout import LAYOUT
from common.takedown_lists import takedown_records

if TYPE_CHECKING:
    from pretrain.data import DataIndex


@dataclass(frozen=True)
class Replaced:
    """An index file a takedown replaced: ``file`` holds its remaining rows in order (None: none remain);
    ``removed`` are its rows taken down, sorted, numbered over the whole file."""

    file: str | None
    removed: tuple[int, ...]


@dataclass(frozen=True)
class Takedowns:
    """The takedowns a run honours: its replaced files and the records they come from (``seen``: id, status and
    version of each, so a check re-reads the files only when a record is new or moved on)."""

    files: dict[str, Replaced] = field(default_factory=dict)
    seen: tuple[str, ...] = ()

    @property
    def removed(self) -> int:
        return sum(len(r.removed) for r in self.files.values())

    def to_dict(self) -> dict:
        return {"seen": list(self.seen), "files": {k: [r.file, list(r.removed)] for k, r in self.files.items()}}

    @classmethod
    def from_dict(cls, d: dict | None) -> Takedowns:
        if not d:
            return cls()
        return cls({k: Replaced(f, tuple(rows)) for k, (f, rows) in d["files"].items()}, tuple(d["seen"]))


def _output_root(data_uri: str) -> tuple[pafs.FileSystem, str] | None:
    """The curated output whose shards folder ``data_uri`` is (None for a folder of shards of its own)."""
    fs, root = storage.resolve(data_uri)
    root = posixpath.normpath(root)
    return (fs, posixpath.dirname(root)) if posixpath.basename(root) == LAYOUT.shards else None


def replaced_files(data_uri: str) -> set[str]:
    """Names (relative to the shards folder) of every file a recorded takedown replaced."""
    out = _output_root(data_uri)
    if out is None:
        return set()
    fs, root = out
    prefix = f"{LAYOUT.shards}/"
    return {rel[len(prefix) :] for r in takedown_records(fs, root) for rel in r["superseded"] if rel.startswith(prefix)}


def update(state: Takedowns, index: DataIndex) -> Takedowns:
    """``state`` with the takedowns recorded on the run's data since: files already replaced keep their rows (a
    later takedown of their replacement adds to them)."""
    out = _output_root(index.root)
    if out is None:
        return state
    fs, root = out
    records = takedown_records(fs, root)
    seen = tuple(f"{r['id']}:{r['status']}:{r.get('version')}" for r in records)
    if seen == state.seen:
        return state
    prefix = f"{LAYOUT.shards}/"
    superseded = {rel[len(prefix) :] for r in records for rel in r["superseded"] if rel.startswith(prefix)}
    removed_keys = {row["key"] for r in records for row in r["removed"]}
    removed_rows = {name: rows for r in records for name, rows in r.get("removed_rows", {}).items()}
    data_fs, data_root = storage.resolve(index.root)
    manifest = storage.read_json(data_fs, storage.join(data_root, LAYOUT.manifest_name))
    listed = {s["file"]: s["rows"] for s in manifest["shards"]}
    by_part = {_part(name): name for name in listed}
    file_rows = np.bincount(index.file, weights=index.rows, minlength=len(index.files)).astype(np.int64)
    files = dict(state.files)
    for i, name in enumerate(index.files):
        known = files.get(name, Replaced(name, ()))
        current = known.file
        # a file of the run's own output (not a release's, ``../``) that a takedown replaced and the manifest dropped
        if current is None or current.startswith("..") or current in listed or current not in superseded:
            continue
        new = by_part.get(_part(current))
        left = int(file_rows[i]) - len(known.removed)  # rows ``current`` holds
        kept = listed[new] if new else 0
        recorded = removed_rows.get(current)  # the takedown's own record of the rows it took out
        gone = recorded if recorded is not None and len(recorded) == left - kept else None
        gone = gone if gone is not None else _removed_rows(index, current, left, kept, removed_keys)
        files[name] = Replaced(new, _compose(known.removed, gone, int(file_rows[i])))
    return Takedowns(files, seen)


def _part(name: str) -> str:
    return name.rsplit("-", 1)[0]  # part-NNNNN: a rewrite keeps it, naming the file by its new content


def _removed_rows(index: DataIndex, name: str, rows: int, kept: int, removed_keys: set[str]) -> list[int]:
    """Rows of ``name`` (``rows`` of them) not in its replacement (``kept`` rows), for a record without
    ``removed_rows`` (a takedown run before them): those whose key a record removed, read while the file is there;
    else its last ``rows - kept`` rows."""
    try:
        keys = index.open(name).read(columns=["key"]).column("key").to_pylist()
    except (OSError, ValueError):  # gone (--grace-minutes 0): DataError is a ValueError
        keys = None
    if keys is not None and len(keys) == rows:
        found = [i for i, k in enumerate(keys) if k in removed_keys]
        if len(found) == rows - kept:
            return found
    return list(range(kept, rows))


def _compose(before: tuple[int, ...], gone: list[int], rows: int) -> tuple[int, ...]:
    """Rows of the original file removed: ``before`` and ``gone`` (numbered among the rows ``before`` left)."""
    left = np.setdiff1d(np.arange(rows), np.array(before, np.int64))
    return tuple(sorted({*before, *left[np.array(gone, np.int64)].tolist()}))


class Removals:
    """``Takedowns`` on an index's row groups: the removed rows of each (``rows``: unit -> its row group's removed
    rows, sorted), and where a row of a replaced file now is."""

    def __init__(self, index: DataIndex, takedowns: Takedowns | None) -> None:
        self.index = index
        self.rows: dict[int, np.ndarray] = {}
        self._files: dict[str, tuple[str | None, np.ndarray, int]] = {}
        self._offset: dict[int, int] = {}
        files = (takedowns.files if takedowns else {}) or {}
        ids = {name: i for i, name in enumerate(index.files)}
        for name, replaced in files.items():
            if name not in ids:
                continue
            units = np.flatnonzero(index.file == ids[name])
            units = units[np.argsort(index.row_group[units])]
            starts = np.concatenate([[0], np.cumsum(index.rows[units])])
            removed = np.array(replaced.removed, np.int64)
            group_rows = int(index.rows[units[0]])  # a rewrite keeps the row group size
            self._files[name] = (replaced.file, removed, group_rows)
            for u, lo, hi in zip(units, starts[:-1], starts[1:]):
                self._offset[int(u)] = int(lo)
                inside = removed[(removed >= lo) & (removed < hi)] - lo
                if len(inside):
                    self.rows[int(u)] = inside
        self.count = sum(len(r) for r in self.rows.values())

    def removed_in(self, unit: int) -> np.ndarray | None:
        return self.rows.get(unit)

    def locate(self, unit: int, rows: list[int]) -> list[tuple[str, int, list[int]]]:
        """Where rows of a row group are now, in order: (file, row group, rows), one per run of one row group."""
        name = self.index.files[self.index.file[unit]]
        if name not in self._files:
            return [(name, int(self.index.row_group[unit]), rows)]
        new, removed, group_rows = self._files[name]
        assert new is not None  # a file with no rows left has none in the order
        at = np.array(rows, np.int64) + self._offset[unit]
        at -= np.searchsorted(removed, at)
        out: list[tuple[str, int, list[int]]] = []
        for g, r in zip((at // group_rows).tolist(), (at % group_rows).tolist()):
            if out and out[-1][1] == g:
                out[-1][2].append(r)
            else:
                out.append((new, g, [r]))
        return out
