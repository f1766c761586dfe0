"""Routed Parquet files: the shuffle between two steps of a distributed phase.

A task that sends rows to ``n_dest`` partitions of the next step writes ONE file: its rows grouped by destination,
each destination's rows in row groups of their own, and the footer holding the row count of each destination
(8 bytes each: keep ``n_dest`` in the thousands, since every reader fetches every upstream footer).
A task of the next step reads, from every upstream file, only its own row groups. One file per upstream task (not
one per (task, destination) pair) keeps a step at P files on an object store.

Every file a task writes can carry the task's receipt (a small JSON dict) in its footer, so a task skipped on a
rerun because its output exists returns the same receipt, and a driver whose control flow depends on receipts
(how many edges are left) takes the same path on a rerun.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.storage import exists, write_bytes_atomic, write_parquet_atomic

ROUTES, RECEIPT = b"routes", b"receipt"
# Row groups of at most this many rows (each destination's rows start a new row group).
ROW_GROUP_ROWS = 1 << 17


def write_routed(
    fs: pafs.FileSystem, path: str, table: pa.Table, dest: np.ndarray, n_dest: int, receipt: dict | None = None
) -> None:
    """Write ``table`` as one file whose row ``k`` goes to partition ``dest[k]`` (row order kept per destination)."""
    dest = np.asarray(dest, np.int64)
    if dest.size and (dest.min() < 0 or dest.max() >= n_dest):
        raise ValueError(f"destinations out of range [0, {n_dest}) for {path}")
    order = np.argsort(dest, kind="stable")
    table = table.take(pa.array(order)) if not np.array_equal(order, np.arange(order.size)) else table
    counts = np.bincount(dest, minlength=n_dest)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    metadata = {ROUTES: counts.astype("<i8").tobytes()}  # rows per destination: 8 bytes each, read without parsing
    if receipt is not None:
        metadata[RECEIPT] = json.dumps(receipt, sort_keys=True).encode()
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, table.schema.with_metadata(metadata), compression="zstd") as writer:
        for d in np.flatnonzero(counts):  # each write_table call starts new row groups
            writer.write_table(table.slice(int(starts[d]), int(counts[d])), row_group_size=ROW_GROUP_ROWS)
    write_bytes_atomic(fs, path, sink.getvalue().to_pybytes())


def read_routed(
    fs: pafs.FileSystem, paths: Sequence[str], dest: int, schema: pa.Schema, columns: list[str] | None = None
) -> pa.Table:
    """The rows that every file of ``paths`` routed to partition ``dest``, file by file."""
    parts = []
    for path in paths:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            counts = np.frombuffer(pf.schema_arrow.metadata[ROUTES], "<i8")
            if counts[dest] == 0:
                continue
            start, count = int(counts[:dest].sum()), int(counts[dest])
            group_rows = np.asarray([pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)], np.int64)
            group_start = np.concatenate([[0], np.cumsum(group_rows)[:-1]])
            groups = np.flatnonzero((group_start >= start) & (group_start < start + count))
            if group_rows[groups].sum() != count or (groups.size and group_start[groups[0]] != start):
                raise ValueError(f"{path}: row groups do not match its routes for partition {dest}")
            parts.append(pf.read_row_groups(groups.tolist(), columns=columns).replace_schema_metadata(None))
    empty = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    return pa.concat_tables(parts) if parts else empty.empty_table()


def write_plain(fs: pafs.FileSystem, path: str, table: pa.Table, receipt: dict | None = None) -> None:
    """One Parquet file for one reader (no routes), with the receipt in its footer."""
    if receipt is not None:
        table = table.replace_schema_metadata({RECEIPT: json.dumps(receipt, sort_keys=True).encode()})
    write_parquet_atomic(fs, path, table, row_group_size=ROW_GROUP_ROWS)


def read_plain(fs: pafs.FileSystem, path: str, columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(path, columns=columns, filesystem=fs).replace_schema_metadata(None)


def read_receipt(fs: pafs.FileSystem, path: str) -> dict | None:
    """The receipt of a committed output, or None when the file does not exist yet."""
    if not exists(fs, path):
        return None
    with fs.open_input_file(path) as f:
        metadata = pq.ParquetFile(f).schema_arrow.metadata or {}
    return json.loads(metadata.get(RECEIPT, b"{}"))
