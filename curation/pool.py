"""Image pools: find the input shards of a pool, pin them for the run, and stream one shard as working-schema rows.

A pool is a folder of image files (recursive), Parquet files with an image-bytes column, or WebDataset tar shards,
on a local disk or an object store. The unit of work and of resume is the *input shard*: a fixed group of files of
a folder pool, one Parquet file, or one tar. The first run of an output lists the pool once and pins that listing
in ``_state/inputs.parquet``; a resumed run reads the pin, so files that land in the pool later, or a changed
``input.*`` setting, can never remap a shard and score an input twice or never.

What a pool may hold, and what becomes of it (every input gets exactly one ledger row):
- Names are bytes on a local disk: a name that is not valid UTF-8 is opened by its bytes and shown in the ledger
  with ``\\xNN`` escapes. Names starting with ``_`` or ``.`` are not inputs (manifests, commit records, hidden
  files), as in Spark and pyarrow datasets.
- A symbolic link is an input when it resolves inside the pool root; one that leads outside, dangles or loops gets a
  ledger row and is never read. Links to folders are never followed (they could loop or repeat the pool), each is
  one ledger row.
- Sizes are checked before anything is read: a file or tar member above ``filters.max_file_bytes`` is recorded
  unread. Parquet files and tars are streamed in chunks of about ``input.read_chunk_mb``, never read whole.
- The pool's format is the majority kind of its files: in a pool of tars (or of Parquet files), any other file is
  read as a single image file, so a stray ``README`` becomes one ``not_an_image`` row, not a failed run.
- Repeated names inside one shard (tar members, a Parquet ``source_column``) are made unique with ``#dup=<k>``;
  a null name becomes ``#row=<i>``. A shard that holds no inputs (a 0-row Parquet file, a tar of sidecars only)
  gets one ``empty_shard`` row, so it is committed like any other.

Naming of inputs (the ledger's ``source``): a file's path or URI (no query string, no credentials);
``<file.parquet>#row=<i>`` (or ``#<value of input.source_column>``); ``<shard.tar>#<member>``.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema
from common.layout import LAYOUT
from common.storage import StorageError, display_uri, exists, is_local, join, redact, resolve, safe_name

if TYPE_CHECKING:  # only: the config imports the stages, and the decode stage imports this module
    from curation.config import InputSettings

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".jfif", ".mpo")

# Reason codes of inputs that were never read; the decode stage records them as given.
READ_CODES = ("unreadable", "file_too_large", "empty_shard", "link_outside_pool", "linked_folder")


class PoolError(ValueError):
    """The pool cannot be used as given; the message names the input and what to do."""


def path_bytes(path: str) -> bytes:
    """The exact bytes of a path as listed (local names that are not UTF-8 arrive as surrogate escapes)."""
    return path.encode("utf-8", "surrogateescape")


def printable(path: str) -> str:
    """A valid-UTF-8 name for a path whose bytes may not be UTF-8: undecodable bytes become ``\\xNN``."""
    return path_bytes(path).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class InputShard:
    shard_id: str
    kind: str  # "files" | "parquet" | "webdataset"
    paths: tuple[str, ...]  # filesystem paths under the pool root (local ones may hold surrogate escapes)
    sizes: tuple[int, ...] = ()  # bytes per path as listed (-1: not a regular file, read to learn why)

    def to_row(self) -> dict:
        """An Arrow-safe row: paths as raw bytes, since a local name need not be UTF-8."""
        return {
            "shard_id": self.shard_id,
            "kind": self.kind,
            "paths": [path_bytes(p) for p in self.paths],
            "sizes": list(self.sizes),
        }

    @classmethod
    def from_row(cls, row: dict) -> InputShard:
        paths = tuple(p.decode("utf-8", "surrogateescape") for p in row["paths"])
        return cls(row["shard_id"], row["kind"], paths, tuple(row["sizes"] or ()))


# --- listing (driver) ----------------------------------------------------------------------------------------------


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _list_local(root: str) -> list[tuple[str, int]]:
    """Walk a local folder by its raw names. Broken links, links leading outside the pool and links to folders are
    kept (with size -1) so that the reader gives each one its ledger row."""
    real_root = os.path.realpath(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        kept_dirs = []
        for d in sorted(dirnames):
            if d.startswith(("_", ".")):
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                found.append((os.path.join(dirpath, d), -1))  # os.walk lists a folder link as a folder
            else:
                kept_dirs.append(d)
        dirnames[:] = kept_dirs
        for f in filenames:
            if f.startswith(("_", ".")):
                continue
            path = os.path.join(dirpath, f)
            try:
                st = os.stat(path)  # follows links; raises on dangling links and loops
                regular = stat.S_ISREG(st.st_mode) and _inside(os.path.realpath(path), real_root)
                found.append((path, st.st_size if regular else -1))
            except OSError:
                found.append((path, -1))
    return sorted(found, key=lambda f: path_bytes(f[0]))


def _list(fs: pafs.FileSystem, root: str) -> list[tuple[str, int]]:
    if is_local(fs):
        return _list_local(root)
    out = []
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        rel = info.path[len(root) :].lstrip("/")
        if info.type == pafs.FileType.File and not any(p.startswith(("_", ".")) for p in rel.split("/")):
            out.append((info.path, info.size if info.size is not None else -1))
    return sorted(out)


def _kind_of(path: str) -> str:
    return "parquet" if path.endswith(".parquet") else "webdataset" if path.endswith(".tar") else "files"


def list_shards(input_uri: str, settings: InputSettings) -> list[InputShard]:
    """The input shards of a pool, in a stable order. Fails fast with a clear message on a wrong ``--input``.

    Holds one entry per file of the pool: O(shards) for Parquet and tar pools; a folder pool of 10^8 loose files
    would need ~10 GB here, so pools that large should be packed into tars or Parquet first.
    """
    try:
        fs, root = resolve(input_uri)
        info = fs.get_file_info(root)
    except StorageError as exc:
        raise PoolError(f"--input {exc}") from None
    except OSError as exc:
        raise PoolError(f"--input {redact(input_uri)}: cannot be listed: {exc}") from None
    if info.type == pafs.FileType.NotFound:
        raise PoolError(f"--input {redact(input_uri)}: no such file or folder")
    if info.type == pafs.FileType.File:
        files = [(root, info.size if info.size is not None else -1)]
    else:
        files = _list(fs, root)
    if not files:
        raise PoolError(
            f"--input {redact(input_uri)}: the folder holds no files (names starting with '_' or '.' are skipped)"
        )
    kind: str = settings.format  # the format read: "files" for a folder's loose files
    if kind == "auto":
        counts = Counter(_kind_of(p) for p, _ in files)
        kind = max(("webdataset", "parquet", "files"), key=lambda k: counts[k])  # ties go to the loose-file reading
    kind = "files" if kind == "folder" else kind
    base = root if info.type == pafs.FileType.Directory else os.path.dirname(root)
    own = [(p, s) for p, s in files if kind != "files" and _kind_of(p) == kind]
    loose = [(p, s) for p, s in files if kind == "files" or _kind_of(p) != kind]
    shards = [
        InputShard(safe_name(f"{kind}-{printable(p[len(base) :]).lstrip('/').rsplit('.', 1)[0]}"), kind, (p,), (s,))
        for p, s in own
    ]
    step = settings.files_per_shard
    for i in range(0, len(loose), step):
        chunk = loose[i : i + step]
        shards.append(
            InputShard(f"files-{i // step:06d}", "files", tuple(p for p, _ in chunk), tuple(s for _, s in chunk))
        )
    return shards


# --- the pinned listing of a run (driver) --------------------------------------------------------------------------

_LAYOUT_FIELDS = ("format", "files_per_shard", "image_column", "source_column")


def _layout(settings: InputSettings) -> dict[str, str]:
    return {name: str(getattr(settings, name)) for name in _LAYOUT_FIELDS}


def pin_listing(out_uri: str, shards: list[InputShard], settings: InputSettings) -> None:
    """Record the run's input shards beside its output (one row per file), with the settings that formed them."""
    from common.storage import write_parquet_atomic

    fs, root = resolve(out_uri)
    rows = [(s.shard_id, s.kind, path_bytes(p), size) for s in shards for p, size in zip(s.paths, s.sizes)]
    shard_id, kind, path, size = (list(col) for col in zip(*rows)) if rows else ([], [], [], [])
    table = pa.table(
        {
            "shard_id": pa.array(shard_id, pa.string()),
            "kind": pa.array(kind, pa.string()),
            "path": pa.array(path, pa.binary()),
            "size": pa.array(size, pa.int64()),
        }
    ).replace_schema_metadata({f"input.{k}": v for k, v in _layout(settings).items()})
    write_parquet_atomic(fs, join(root, LAYOUT.listing), table, row_group_size=100_000)


def pinned_listing(out_uri: str, settings: InputSettings) -> list[InputShard] | None:
    """The shards pinned by the run in ``out_uri``; None when it has none. Refuses input settings that would lay
    the pool out differently from the pin."""
    fs, root = resolve(out_uri)
    path = join(root, LAYOUT.listing)
    if not exists(fs, path):
        return None
    table = pq.read_table(path, filesystem=fs)
    pinned = {
        k.decode()[len("input.") :]: v.decode()
        for k, v in (table.schema.metadata or {}).items()
        if k.startswith(b"input.")
    }
    changed = {k: (pinned.get(k), v) for k, v in _layout(settings).items() if pinned.get(k) != v}
    if changed:
        was = ", ".join(f"input.{k}={old} (this command: {new})" for k, (old, new) in changed.items())
        raise PoolError(
            f"{redact(out_uri)} was started with {was}; its input shards are pinned in {LAYOUT.listing}. Resume with "
            "the same input settings, choose another --output, or pass --new-run to start over."
        )
    shards: dict[str, InputShard] = {}
    for row in table.to_pylist():
        s = shards.get(row["shard_id"])
        path_str = row["path"].decode("utf-8", "surrogateescape")
        if s is None:
            shards[row["shard_id"]] = InputShard(row["shard_id"], row["kind"], (path_str,), (row["size"],))
        else:
            shards[row["shard_id"]] = InputShard(s.shard_id, s.kind, (*s.paths, path_str), (*s.sizes, row["size"]))
    return list(shards.values())


# --- reading one shard (runs inside Ray tasks) ---------------------------------------------------------------------


class _Names:
    """Unique ledger names within one shard: a repeated name gets ``#dup=<k>``."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, name: str) -> str:
        unique, k = name, 1
        while unique in self.seen:
            k += 1
            unique = f"{name}#dup={k}"
        self.seen.add(unique)
        return unique


class ShardReader:
    """Streams one input shard as working-schema tables of about ``input.read_chunk_mb`` each.

    Every row carries ``shard_size`` = null except the rows of the last chunk, which carry the number of rows the
    shard produced: the driver commits a shard when that many rows have been written. A shard that holds no input
    still yields one row (``empty_shard``), so it is committed too.
    """

    def __init__(self, input_uri: str, settings: InputSettings, embedding_dim: int, max_file_bytes: int):
        self.input_uri, self.settings, self.max_file_bytes = input_uri, settings, max_file_bytes
        self.fs, self.root = resolve(input_uri)
        self.real_root = os.path.realpath(self.root) if is_local(self.fs) else None
        self.schema = schema.working_schema(embedding_dim)
        self.chunk_bytes = settings.read_chunk_mb * 2**20

    def name(self, path: str) -> str:
        return printable(display_uri(self.input_uri, path))

    def _open(self, path: str):
        """A seekable binary file. Local files open through Python, which takes names that are not UTF-8."""
        return open(path, "rb") if is_local(self.fs) else self.fs.open_input_file(path)

    def _size(self, path: str) -> int | None:
        return os.stat(path).st_size if is_local(self.fs) else self.fs.get_file_info(path).size

    def read(self, shard: InputShard) -> Iterator[pa.Table]:
        rows = {"files": self._files, "parquet": self._parquet, "webdataset": self._tar}[shard.kind](shard)
        chunk: list[dict] = []
        chunk_bytes, total, names = 0, 0, _Names()
        for row in rows:
            row["source"] = names(row["source"])
            if chunk and chunk_bytes + _nbytes(row) > self.chunk_bytes:
                yield self._table(chunk, shard.shard_id, None)
                chunk, chunk_bytes = [], 0
            chunk.append(row)
            chunk_bytes += _nbytes(row)
            total += 1
        if total == 0:
            what = {
                "parquet": "the Parquet file holds no rows",
                "webdataset": "the tar holds no image members",
                "files": "the shard lists no files",
            }[shard.kind]
            chunk = [_row(self.name(shard.paths[0]) if shard.paths else shard.shard_id, None, f"empty_shard: {what}")]
            total = 1
        yield self._table(chunk, shard.shard_id, total)

    def read_table(self, shard: InputShard) -> pa.Table:
        """The whole shard as one table (for small shards: tests, in-process baselines)."""
        return pa.concat_tables(self.read(shard))

    def _table(self, rows: list[dict], shard_id: str, total: int | None) -> pa.Table:
        for row in rows:
            row.update(shard_id=shard_id, shard_size=total, status=schema.PENDING)
        return pa.Table.from_pylist(rows, schema=self.schema)

    # --- one reader per kind: each yields rows {source, image, reason} ---------------------------------------------

    def _files(self, shard: InputShard) -> Iterator[dict]:
        sizes = shard.sizes or (None,) * len(shard.paths)
        for path, size in zip(shard.paths, sizes):
            yield self._read_file(path, size)

    def _read_file(self, path: str, listed_size: int | None) -> dict:
        source = self.name(path)
        try:
            if is_local(self.fs):
                refused = self._local_refusal(path)
                if refused:
                    return _row(source, None, refused)
            size = self._size(path) if listed_size is None or listed_size < 0 else listed_size
            if size is not None and size > self.max_file_bytes:
                return _row(source, None, f"file_too_large: {size} bytes > {self.max_file_bytes}, not read")
            with self._open(path) as f:
                data = f.read(self.max_file_bytes + 1)  # bounded even if the file grew since it was listed
            if len(data) > self.max_file_bytes:
                return _row(source, None, f"file_too_large: more than {self.max_file_bytes} bytes, not read")
            return _row(source, data)
        except Exception as exc:  # noqa: BLE001 - any read failure becomes a ledger reason
            return _row(source, None, f"unreadable: cannot read {source}: {type(exc).__name__}: {exc}")

    def _local_refusal(self, path: str) -> str | None:
        """Why a local path is not read (links leading out, folder links, special files); None to read it."""
        if os.path.islink(path):
            if not os.path.exists(path):
                return "unreadable: broken or looping symbolic link"
            if os.path.isdir(path):
                return "linked_folder: a symbolic link to a folder; links to folders are not followed"
            assert self.real_root is not None  # set for a local pool, the only kind this checks
            if not _inside(os.path.realpath(path), self.real_root):
                return "link_outside_pool: a symbolic link to a file outside the pool root; not followed"
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO or device would block or never end
            kind = "fifo" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
            return f"unreadable: not a regular file ({kind})"
        return None

    def _parquet(self, shard: InputShard) -> Iterator[dict]:
        (path,) = shard.paths
        uri = self.name(path)
        column, source_column = self.settings.image_column, self.settings.source_column
        try:
            pf = pq.ParquetFile(self._open(path))
            total = pf.metadata.num_rows
        except Exception as exc:  # noqa: BLE001 - no footer: the whole file becomes one ledger row with the reason
            yield _row(uri, None, f"unreadable: cannot read Parquet pool file {uri}: {type(exc).__name__}: {exc}")
            return
        problem = _layout_problem(pf.schema_arrow, self.settings)
        if problem:  # each row the footer promises gets its ledger row, with what to do
            for i in range(total):
                yield _row(f"{uri}#row={i}", None, f"unreadable: {problem}")
            return
        columns = [column] + ([source_column] if source_column else [])
        index = 0
        try:
            for batch in pf.iter_batches(batch_size=64, columns=columns):
                images = batch.column(column)
                if pa.types.is_struct(images.type):
                    images = images.field("bytes")
                sources = batch.column(source_column).to_pylist() if source_column else [None] * batch.num_rows
                for data, name in zip(images.to_pylist(), sources):
                    source = f"{uri}#{_as_name(name)}" if name is not None else f"{uri}#row={index}"
                    index += 1
                    if data is None:
                        yield _row(source, None, "unreadable: image bytes are null in the Parquet row")
                    elif len(data) > self.max_file_bytes:
                        yield _row(source, None, f"file_too_large: {len(data)} bytes > {self.max_file_bytes}")
                    else:
                        yield _row(source, data)
        except Exception as exc:  # noqa: BLE001 - every row the footer promised still gets its ledger row
            reason = f"unreadable: Parquet pool file {uri} unreadable from row {index}: {type(exc).__name__}: {exc}"
            for i in range(index, total):
                yield _row(f"{uri}#row={i}", None, reason)

    def _tar(self, shard: InputShard) -> Iterator[dict]:
        (path,) = shard.paths
        uri = self.name(path)
        members = 0
        try:
            with self._open(path) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile() or not member.name.lower().endswith(IMAGE_SUFFIXES):
                        continue  # sidecars (json, txt, cls) of WebDataset samples are not inputs
                    members += 1
                    source = f"{uri}#{printable(member.name)}"
                    if member.size > self.max_file_bytes:
                        yield _row(
                            source, None, f"file_too_large: {member.size} bytes > {self.max_file_bytes}, not read"
                        )
                        continue  # the stream skips the member's data without keeping it
                    member_file = tar.extractfile(member)
                    assert member_file is not None  # a regular file: member.isfile() was checked above
                    data = member_file.read()
                    if len(data) < member.size:
                        raise tarfile.ReadError(
                            f"member {printable(member.name)} truncated at {len(data)} of {member.size} bytes"
                        )
                    yield _row(source, data)
                # tarfile ends quietly at a cut-off header; a complete archive ends with two zero blocks.
                size = self._size(path)
                if size is not None and size - tar.offset < 2 * tarfile.BLOCKSIZE:
                    raise tarfile.ReadError(f"archive cut off at byte {size} (no end-of-archive marker)")
        except Exception as exc:  # noqa: BLE001 - a damaged tar keeps what was read plus one row for the rest
            yield _row(
                f"{uri}#<after {members} members>",
                None,
                f"unreadable: tar shard unreadable from here: {type(exc).__name__}: {exc}",
            )


def _layout_problem(file_schema: pa.Schema, settings: InputSettings) -> str | None:
    """Why the columns of a Parquet pool file do not fit ``input.*``; None when they do."""
    names, column, source_column = file_schema.names, settings.image_column, settings.source_column
    if column not in names:
        return f"no column {column!r} (columns: {names}); set input.image_column"
    image_type = file_schema.field(column).type
    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        image_type = image_type.field("bytes").type
    if not (pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type)):
        return (
            f"column {column!r} holds {image_type}, not image bytes (binary, or a struct with a binary 'bytes' "
            "field); set input.image_column"
        )
    if source_column and source_column not in names:
        return f"no column {source_column!r} (columns: {names}); set input.source_column"
    return None


def _row(source: str, data: bytes | None, error: str | None = None) -> dict:
    image = None if data is None else {"bytes": data, "path": source.rsplit("/", 1)[-1]}
    return {"source": source, "image": image, "reason": error}


def _nbytes(row: dict) -> int:
    return 256 + (len(row["image"]["bytes"]) if row["image"] else 0)


def _as_name(value) -> str:
    """A name from a Parquet source column of any type (bytes that are not UTF-8 are escaped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def split_read_reason(reason: str | None) -> tuple[str, str]:
    """(code, detail) of the reason a reader gave an unread input; unknown reasons are ``unreadable``."""
    code, _, detail = (reason or "").partition(": ")
    if code in READ_CODES:
        return code, detail
    return "unreadable", reason or "no bytes could be read"
