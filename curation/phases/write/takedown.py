"""Takedown lists and their records: what a list names, the lists recorded on an output, and their mark in the
ledger.

A list names images by key (the sha256 of their bytes), ledger source, or the pool's ``url`` metadata field, one a
line. A takedown (``curation.phases.write.takedown_run``) records each list it ran, with the list's entries beside
it: ``_state/takedown/<list id>.json``. From those records a later write phase (``--phases write`` with other
settings) leaves the listed images out (``Takedowns``), and the audit checks every recorded list against the current
shards. A taken-down image's ledger row says so: status ``taken_down``, stage ``takedown``, the reason naming the
list and the date.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from hashlib import sha256

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common import schema
from common.layout import LAYOUT, TAKEDOWN
from common.storage import StorageError, join, list_files, read_json, redact, resolve

URL_FIELD = "url"  # the pool's metadata field that names where an image came from (img2dataset's)

record_path, entries_path = LAYOUT.takedown_record, LAYOUT.takedown_entries


class TakedownError(ValueError):
    """The list or the output cannot be used; the message says what to do."""


@dataclass(frozen=True)
class TakedownList:
    name: str  # the list's URI, without query or credentials
    entries: tuple[str, ...]  # sorted, unique
    sha256: str

    @property
    def id(self) -> str:
        return self.sha256[:16]


def read_list(uri: str) -> TakedownList:
    """Entries one a line; blank lines and lines starting with ``#`` are skipped."""
    fs, path = resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise TakedownError(f"{redact(uri)}: no such list; give a file of keys, sources or URLs, one a line") from None
    except UnicodeDecodeError:
        raise TakedownError(f"{redact(uri)}: not UTF-8 text; give keys, sources or URLs, one a line") from None
    entries = sorted({line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")})
    if not entries:
        raise TakedownError(f"{redact(uri)}: the list holds no entries (keys, sources or URLs, one a line)")
    return TakedownList(redact(uri), tuple(entries), sha256("\n".join(entries).encode()).hexdigest())


def check_list_uri(uri: str) -> None:
    try:
        resolve(uri)
    except StorageError as exc:
        raise TakedownError(str(exc)) from None


def listed_rows(table: pa.Table, entries: pa.Array) -> pa.ChunkedArray:
    """Which rows of a shard or ledger table the entries name: by key, source, or the metadata's url."""
    hit = pc.is_in(table.column("source"), value_set=entries)
    if "key" in table.column_names:
        hit = pc.or_(hit, pc.fill_null(pc.is_in(table.column("key"), value_set=entries), False))
    urls = _urls(table)
    if urls is not None:
        hit = pc.or_(hit, pc.fill_null(pc.is_in(urls, value_set=entries), False))
    return hit


def _urls(table: pa.Table) -> pa.Array | None:
    """The pool's url of each row: the typed metadata field, else the one in metadata_json."""
    has_typed = "metadata" in table.column_names and table.schema.field("metadata").type.get_field_index(URL_FIELD) >= 0
    typed = pc.struct_field(table.column("metadata"), URL_FIELD) if has_typed else None
    if "metadata_json" not in table.column_names:
        return typed
    rest = [
        json.loads(t).get(URL_FIELD) if t and URL_FIELD in t else None
        for t in table.column("metadata_json").to_pylist()
    ]
    from_json = pa.array([u if isinstance(u, str) else None for u in rest], pa.string())
    return from_json if typed is None else pc.coalesce(typed, from_json)


@dataclass(frozen=True)
class Takedowns:
    """The lists recorded on an output, applied when its shards and ledger are written again."""

    lists: tuple[tuple[tuple[str, ...], str], ...] = ()  # (entries, ledger reason) per takedown

    def without(self, table: pa.Table) -> pa.Table:
        """``table`` (rows with key, source, metadata_json) without the rows a list names."""
        for entries, _ in self.lists:
            table = table.filter(pc.invert(listed_rows(table, pa.array(entries, pa.string()))))
        return table

    def mark(self, ledger: pa.Table) -> pa.Table:
        """Kept ledger rows a list names, as taken down."""
        for entries, reason in self.lists:
            listed = ledger.filter(listed_rows(ledger, pa.array(entries, pa.string()))).column("source")
            ledger = mark_taken_down(ledger, listed.combine_chunks(), reason)
        return ledger


def applied_takedowns(fs, root: str) -> Takedowns:
    lists = []
    for record in takedown_records(fs, root):
        entries = tuple(recorded_entries(fs, root, record).to_pylist())
        lists.append((entries, taken_down_reason(record["list"], record["id"], record["at"])))
    return Takedowns(tuple(lists))


def taken_down_reason(lst_name: str, list_id: str, at: str) -> str:
    return f"taken_down: listed in {lst_name} (list {list_id}, {at[:10]})"


def mark_taken_down(ledger: pa.Table, sources: pa.Array, reason: str) -> pa.Table:
    """Ledger rows of ``sources`` that were kept, as taken down with ``reason``."""
    hit = pc.and_(pc.is_in(ledger.column("source"), value_set=sources), pc.equal(ledger.column("status"), schema.KEPT))
    for name, value in (("status", schema.TAKEN_DOWN), ("stage", TAKEDOWN), ("reason", reason)):
        column = ledger.column(name)
        ledger = ledger.set_column(
            ledger.schema.get_field_index(name), ledger.schema.field(name), pc.if_else(hit, value, column)
        )
    return ledger


def takedown_records(fs, root: str) -> list[dict]:
    """Every takedown recorded on the output, oldest first."""
    records = [read_json(fs, p) for p in list_files(fs, join(root, LAYOUT.takedowns), ".json")]
    return sorted(records, key=lambda r: (r["at"], r["id"]))


def recorded_entries(fs, root: str, record: dict) -> pa.Array:
    return pq.read_table(join(root, entries_path(record["id"])), filesystem=fs).column("entry").combine_chunks()
