"""One final shard checked on its own against the manifest's entry for it (the checks across shards, ledger and
manifest are ``verify``'s), and the ``Problem`` every check reports."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema
from common.imageio import open_reduced, safe_error
from common.layout import LAYOUT
from common.storage import file_sha256, join


@dataclass(frozen=True, order=True)
class Problem:
    file: str  # relative to the output root
    row: int | None  # 0-based row in that file, when the problem is one row's
    what: str

    def __str__(self) -> str:
        where = self.file if self.row is None else f"{self.file} row {self.row}"
        return f"{where}: {self.what}"


@dataclass
class ShardRows:
    """What one shard contributes to the cross-shard checks: (key, source) per row, in file order."""

    file: str
    keys: list[str | None] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)
    decoded: int = 0


def short(digest: str | None) -> str:
    return "null" if digest is None else f"{digest[:16]}…"


def decode_error(data: bytes) -> str | None:
    """None when the bytes decode to an image; else why not. A draft decode still reads the whole stream."""
    try:
        open_reduced(data, max_side=64).load()
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the finding
        return safe_error(exc, data)
    return None


def schema_difference(actual: pa.Schema, expected: pa.Schema) -> str | None:
    if actual.remove_metadata().equals(expected):
        return None
    parts = []
    missing = [n for n in expected.names if n not in actual.names]
    extra = [n for n in actual.names if n not in expected.names]
    if missing:
        parts.append(f"missing {'column' if len(missing) == 1 else 'columns'} {', '.join(missing)}")
    if extra:
        parts.append(f"unexpected {'column' if len(extra) == 1 else 'columns'} {', '.join(extra)}")
    for f in expected:
        if f.name in actual.names:
            got = actual.field(f.name)
            if not got.type.equals(f.type) or got.nullable != f.nullable:
                parts.append(
                    f"column {f.name} is {got.type}{'' if got.nullable else ' not null'}, expected {f.type}"
                    f"{'' if f.nullable else ' not null'}"
                )
    if not parts and actual.names != expected.names:
        parts.append(f"columns in order {actual.names}, expected {expected.names}")
    return "schema differs from common/schema.py curated_schema: " + "; ".join(parts)


def check_shard(
    fs: pafs.FileSystem, root: str, entry: dict, manifest: dict, decode: bool
) -> tuple[list[Problem], ShardRows]:
    """A final shard the manifest lists, checked on its own: its file against the manifest's entry, its schema and
    file metadata, every image's key (and decoding, with ``decode``); and its keys and sources for the checks across
    shards."""
    rel = f"{LAYOUT.shards}/{entry['file']}"
    problems: list[Problem] = []
    rows = ShardRows(rel)
    add = lambda row, what: problems.append(Problem(rel, row, what))  # noqa: E731
    path = join(root, rel)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        add(None, "listed in the manifest but missing")
        return problems, rows
    if info.size != entry["bytes"]:
        add(None, f"{info.size} bytes, the manifest says {entry['bytes']} (truncated or appended to)")
    digest = file_sha256(fs, path)
    if digest != entry["sha256"]:
        add(
            None,
            f"sha256 {short(digest)} differs from the manifest's {short(entry['sha256'])} (contents changed)",
        )
    try:
        pf = pq.ParquetFile(fs.open_input_file(path))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for damaged footers
        add(None, f"not a readable Parquet file: {type(exc).__name__}: {exc}")
        return problems, rows
    actual = pf.schema_arrow
    meta = schema.read_metadata(actual)
    dim = (meta.get("extra") or {}).get("embedding_dim") if "embedding" in actual.names else None
    expected = schema.curated_schema(dim, manifest.get("metadata_fields"))
    if (diff := schema_difference(actual, expected)) is not None:
        add(None, diff)
    for name, want in (
        ("table", "curated"),
        ("schema_version", manifest["schema_version"]),
        ("config_hash", manifest["config_hash"]),
    ):
        if meta.get(name) != want:
            add(None, f"file metadata humans1b.{name} is {meta.get(name)!r}, expected {want!r}")
    if (actual.metadata or {}).get(schema.HF_METADATA_KEY) != schema.hf_metadata(actual)[schema.HF_METADATA_KEY]:
        add(
            None,
            "file metadata huggingface is missing or does not describe the columns (datasets would not "
            "decode the images)",
        )
    if pf.metadata.num_rows != entry["rows"]:
        add(None, f"{pf.metadata.num_rows} rows, the manifest says {entry['rows']}")
    columns = [c for c in ("key", "source", "image") if c in actual.names]
    offset = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        try:
            t = pf.read_row_group(rg, columns=columns)
        except Exception as exc:  # noqa: BLE001 - a damaged page: name the rows it holds
            add(offset, f"row group {rg} (rows {offset}-{offset + n - 1}) unreadable: {type(exc).__name__}: {exc}")
            rows.keys.extend([None] * n)
            rows.sources.extend([None] * n)
            offset += n
            continue
        keys = t.column("key").to_pylist() if "key" in columns else [None] * n
        sources = t.column("source").to_pylist() if "source" in columns else [None] * n
        images = t.column("image").to_pylist() if "image" in columns else [None] * n
        for i, (key, image) in enumerate(zip(keys, images)):
            data = (image or {}).get("bytes")
            if data is None:
                add(offset + i, "image bytes are null")
                continue
            actual_key = hashlib.sha256(data).hexdigest()
            if actual_key != key:
                add(offset + i, f"sha256 of the image bytes is {short(actual_key)}, the key says {short(key)}")
            if decode:
                if (err := decode_error(data)) is not None:
                    add(offset + i, f"image does not decode: {err}")
                else:
                    rows.decoded += 1
        rows.keys.extend(keys)
        rows.sources.extend(sources)
        offset += n
    return problems, rows
