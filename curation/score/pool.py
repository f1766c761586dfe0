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
- What a container says about itself is checked against what it holds: a tar member that declares more bytes than
  the file has left, a Parquet footer that promises rows that are not there, a row group too large to hold. Each
  lie is one row; what was read before it stands. Tar members other than sidecars are all inputs, links and
  special members included (``not_a_file``).
- Repeated names inside one shard (tar members, a Parquet ``source_column``) are made unique with ``#dup=<k>``;
  a null name becomes ``#row=<i>``. A shard that holds no inputs (a 0-row Parquet file, a tar of sidecars only)
  gets one ``empty_shard`` row, so it is committed like any other.

Naming of inputs (the ledger's ``source``): a file's path or URI (no query string, no credentials);
``<file.parquet>#row=<i>`` (or ``#<value of input.source_column>``); ``<shard.tar>#<member>``; a part of a
container that could not be read, ``<file.parquet>#<from row i>``, ``<shard.tar>#<after n members>``.
"""

from __future__ import annotations

import os
import re
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema
from common.imageio import safe_error
from common.layout import LAYOUT
from common.storage import (
    StorageError,
    display_uri,
    exists,
    is_local,
    is_store_failure,
    join,
    redact,
    resolve,
    safe_name,
)
from curation.score.metadata import InputMetadata, sample_key

if TYPE_CHECKING:  # only: the config imports the stages, and the decode stage imports this module
    from curation.settings import InputSettings

# Members of a WebDataset sample that describe its picture (labels, captions, URLs, features): not inputs. Every other
# regular member is an input, whatever its suffix: the decode stage tells a picture from the rest.
SIDECAR_SUFFIXES = (
    ".json", ".txt", ".cls", ".cls2", ".caption", ".url", ".key", ".id", ".idx", ".index", ".meta", ".xml", ".yaml",
    ".yml", ".csv", ".tsv", ".md5", ".sha1", ".sha256", ".npy", ".npz", ".pickle", ".pkl", ".pth",
)  # fmt: skip
# Tar shards, plain or compressed (img2dataset and many mirrors write .tar.gz); tarfile reads each as a stream.
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
_SKIP_CHUNK = 1 << 20
_PARQUET_BUFFER = 8 << 20
_PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
# DEFLATE's largest expansion is 1032:1, so a gzip'ed member larger than that times what is left is a lie.
_GZIP_MAX_RATIO = 1032

# Reason codes of inputs that were never read; the decode stage records them as given.
READ_CODES = ("unreadable", "file_too_large", "empty_shard", "link_outside_pool", "linked_folder", "not_a_file")


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

    def unlistable(exc: OSError) -> None:  # a folder os.walk cannot enter (a path over PATH_MAX, no permission)
        if exc.filename is not None and os.fsdecode(exc.filename) != root:
            found.append((os.fsdecode(exc.filename), -1))  # the reader gives it a row saying why

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable, followlinks=False):
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
    lower = path.lower()
    return "parquet" if lower.endswith(".parquet") else "webdataset" if lower.endswith(TAR_SUFFIXES) else "files"


def _shard_stem(name: str) -> str:
    """A pool file's name without its format suffix (both parts of ``.tar.gz``)."""
    lower = name.lower()
    for suffix in (*TAR_SUFFIXES, ".parquet"):
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name.rsplit(".", 1)[0]


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
        InputShard(safe_name(f"{kind}-{_shard_stem(printable(p[len(base) :]).lstrip('/'))}"), kind, (p,), (s,))
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

    def _store_failed(self, exc: Exception, name: str) -> None:
        """Raise a store's passing failure (throttling, a 5xx, a dropped connection), naming the input ``name``: it
        says nothing about the input, so it goes to the read's retries (``retry_io_stream``) instead of into the
        input's ledger row."""
        if not is_local(self.fs) and is_store_failure(exc):
            if str(exc).startswith(f"{name}: "):  # named already (a tar member's read, raised through the tar's)
                raise exc
            raise OSError(f"{name}: {exc}") from exc  # a plain OSError, transient as the store's error was

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
                if len(path_bytes(path)) >= _PATH_MAX:
                    return _row(
                        source, None, f"unreadable: the path is {len(path_bytes(path))} bytes, longer than this "
                        f"system's PATH_MAX ({_PATH_MAX}); move the file to a shorter path",
                    )  # fmt: skip
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
            self._store_failed(exc, source)
            return _row(source, None, f"unreadable: cannot read the file: {safe_error(exc)}")

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
            return f"not_a_file: a {kind}; only regular files are read"
        return None

    def _parquet(self, shard: InputShard) -> Iterator[dict]:
        """Rows are what the file holds, never what its footer promises: a footer can claim any number of rows, and
        cells can be far larger than their compressed pages suggest."""
        (path,) = shard.paths
        uri = self.name(path)
        try:
            size = self._size(path)
            pf = pq.ParquetFile(self._open(path), buffer_size=_PARQUET_BUFFER)  # column chunks streamed
            meta = pf.metadata
        except Exception as exc:  # noqa: BLE001 - no footer: the whole file becomes one ledger row with the reason
            self._store_failed(exc, uri)
            yield _row(uri, None, f"unreadable: cannot read the Parquet file's footer: {safe_error(exc)}")
            return
        promised = meta.num_rows
        claims = [promised, *(meta.row_group(i).num_rows for i in range(meta.num_row_groups))]
        if min(claims) < 0 or (size is not None and max(claims) > max(size, 1)):
            # every row carries at least a byte of its image; a footer that claims more rows than the file has bytes
            # lies, and reading it could allocate for rows that are not there
            yield _row(uri, None, f"unreadable: the footer claims {promised} rows in a file of {size} bytes; not read")
            return
        problem = _layout_problem(pf.schema_arrow, self.settings)
        if problem:  # one row for the file, with what to do: its rows cannot be told apart without its columns
            yield _row(uri, None, f"unreadable: {problem} ({promised} rows per the footer, none read)")
            return
        column, source_column = self.settings.image_column, self.settings.source_column
        columns = [column] + ([source_column] if source_column else [])
        metadata_columns = self._metadata_columns(pf.schema_arrow, columns)
        columns += metadata_columns
        index = 0
        try:
            for group in range(meta.num_row_groups):
                rows, image_bytes = self._row_group_size(meta, group)
                if image_bytes > self.settings.max_row_group_mb * 2**20:
                    yield _row(
                        f"{uri}#<rows {index}-{index + rows - 1}>", None,
                        f"unreadable: row group {group} holds {image_bytes // 2**20} MiB of images uncompressed, more "
                        f"than input.max_row_group_mb ({self.settings.max_row_group_mb}); rewrite the file with "
                        "smaller row groups or raise the setting",
                    )  # fmt: skip
                    index += rows
                    continue
                batch_size = max(1, min(64, self.chunk_bytes * max(rows, 1) // max(image_bytes, 1)))
                for batch in pf.iter_batches(batch_size=batch_size, row_groups=[group], columns=columns):
                    yield from self._parquet_rows(batch, uri, index, metadata_columns)
                    index += batch.num_rows
        except Exception as exc:  # noqa: BLE001 - what was read stands; one row for the rest of the file
            self._store_failed(exc, uri)
            yield _row(
                f"{uri}#<from row {index}>", None,
                f"unreadable: unreadable from row {index} of the {promised} its footer promises: {safe_error(exc)}",
            )  # fmt: skip
            return
        if index != promised:
            yield _row(
                f"{uri}#<rows {index}-{promised}>", None,
                f"unreadable: the footer promises {promised} rows; {index} are in the file",
            )  # fmt: skip

    def _row_group_size(self, meta: pq.FileMetaData, group: int) -> tuple[int, int]:
        """(rows, uncompressed bytes of the image column) of a row group, as its footer says."""
        rg = meta.row_group(group)
        image_bytes = sum(
            rg.column(i).total_uncompressed_size
            for i in range(rg.num_columns)
            if rg.column(i).path_in_schema.split(".")[0] == self.settings.image_column
        )
        return rg.num_rows, image_bytes

    def _metadata_columns(self, file_schema: pa.Schema, taken: list[str]) -> list[str]:
        """The file's columns that are its rows' metadata: those ``input.metadata`` names (all with "*"), but never
        the image or name columns, nor bytes (a second image is not metadata)."""
        wanted = self.settings.metadata
        return [
            f.name
            for f in file_schema
            if f.name not in taken
            and ("*" in wanted or f.name in wanted)
            and not any(is_binary(f.type) for is_binary in _BINARY_TYPES)
        ]

    def _parquet_rows(self, batch: pa.RecordBatch, uri: str, first: int, metadata_columns: list[str]) -> Iterator[dict]:
        images = batch.column(self.settings.image_column)
        if pa.types.is_struct(images.type):
            images = images.field("bytes")
        if not (pa.types.is_binary(images.type) or pa.types.is_large_binary(images.type)):
            images = images.cast(pa.large_binary())  # binary_view, fixed_size_binary: lengths need an offset type
        lengths = pc.binary_length(images).to_pylist()  # sizes checked before any cell becomes a Python object
        source_column = self.settings.source_column
        names = batch.column(source_column).to_pylist() if source_column else [None] * batch.num_rows
        extra = batch.select(metadata_columns).to_pylist() if metadata_columns else None
        for i, (length, name) in enumerate(zip(lengths, names)):
            source = f"{uri}#{_as_name(name)}" if name is not None else f"{uri}#row={first + i}"
            if length is None:
                row = _row(source, None, "unreadable: image bytes are null in the Parquet row")
            elif length > self.max_file_bytes:
                row = _row(source, None, f"file_too_large: {length} bytes > {self.max_file_bytes}")
            else:
                row = _row(source, images[i].as_py())
            if extra is not None:
                meta = self._metadata()
                for field, value in extra[i].items():
                    meta.add(field, value)
                yield from _with_metadata([row], meta)
            else:
                yield row

    def _metadata(self) -> InputMetadata:
        return InputMetadata(self.settings.metadata, self.settings.max_metadata_kb)

    def _tar(self, shard: InputShard) -> Iterator[dict]:
        """Members are read as a stream; what a header claims is checked against what the file can hold. A sample's
        rows wait for its last part (sidecars may follow the image), then leave with the sample's metadata."""
        (path,) = shard.paths
        uri = self.name(path)
        members = 0
        sample: tuple[str | None, list[dict], InputMetadata] = (None, [], self._metadata())
        try:
            size = self._size(path)
            with self._open(path) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
                comptype = getattr(tar.fileobj, "comptype", "tar")
                for member in tar:
                    if member.isdir():
                        continue
                    key, extension = sample_key(member.name)
                    if key != sample[0]:
                        yield from _with_metadata(sample[1], sample[2])
                        sample = (key, [], self._metadata())
                    held, meta = sample[1], sample[2]
                    sidecar = member.isfile() and member.name.lower().endswith(SIDECAR_SUFFIXES)
                    source = f"{uri}#{printable(member.name)}"
                    if not sidecar:
                        members += 1
                        if not member.isfile():
                            held.append(_row(source, None, f"not_a_file: a {_member_kind(member)} in the tar; only "
                                                           "regular members are read (links are not followed)"))  # fmt: skip
                            continue
                    room = _room_left(member, comptype, size, stream.tell())
                    if room is not None and member.size > room:
                        if sidecar:  # the sidecar has no row of its own: its sample's rows say it
                            meta.note(f"sidecar {printable(member.name)} declares more bytes than the tar holds")
                            source = f"{uri}#<after {members} members>"
                        held.append(_row(source, None, f"unreadable: the member's header declares {member.size} "
                                                       f"bytes, more than the file can hold after it ({room}); the "
                                                       "tar is read no further"))  # fmt: skip
                        yield from _with_metadata(held, meta)
                        return
                    limit = (meta.limit if meta.enabled else 0) if sidecar else self.max_file_bytes
                    try:
                        data = _read_member(tar, member, limit)
                    except Exception as exc:  # noqa: BLE001 - the member's own row says why; nothing after it is read
                        self._store_failed(exc, uri)
                        if sidecar:
                            source = f"{uri}#<after {members} members>"
                        held.append(_row(source, None, f"unreadable: {safe_error(exc)}; the tar is read no further"))
                        yield from _with_metadata(held, meta)
                        return
                    if sidecar:
                        if meta.enabled:
                            meta.add_sidecar(printable(member.name), extension, data, member.size)
                    elif data is None:
                        held.append(
                            _row(source, None, f"file_too_large: {member.size} bytes > {self.max_file_bytes}, not read")
                        )
                    else:
                        held.append(_row(source, data))
                yield from _with_metadata(sample[1], sample[2])
                sample = (None, [], self._metadata())
                cut = _archive_cut(tar, comptype, size)
                if cut:
                    raise tarfile.ReadError(cut)
        except Exception as exc:  # noqa: BLE001 - a damaged tar keeps what was read plus one row for the rest
            self._store_failed(exc, uri)
            yield from _with_metadata(sample[1], sample[2])
            yield _row(
                f"{uri}#<after {members} members>",
                None,
                f"unreadable: tar shard unreadable from here: {safe_error(exc)}",
            )


def _room_left(member: tarfile.TarInfo, comptype: str, size: int | None, raw_offset: int) -> int | None:
    """The most bytes a member's data can have, given what is left of the file; None where no bound holds (bz2 and
    xz can expand past any ratio: there the stream's end tells)."""
    if size is None:
        return None
    if comptype == "tar":
        return size - member.offset_data
    if comptype == "gz":
        return (size - raw_offset) * _GZIP_MAX_RATIO
    return None


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes | None:
    """A regular member's bytes; None when it is over ``limit`` (its data skipped). Raises when the archive ends
    before the member does: tarfile's own skip would read on at the end of the stream, forever for a lying size."""
    member_file = tar.extractfile(member)
    assert member_file is not None  # a regular member
    data = member_file.read(limit + 1) if member.size > limit else member_file.read(member.size)
    got, keep = len(data), member.size <= limit
    while got < member.size and len(data) > 0:
        data = member_file.read(min(member.size - got, _SKIP_CHUNK))
        got += len(data)
    if got < member.size:
        raise tarfile.ReadError(f"member {printable(member.name)} cut off at {got} of its {member.size} bytes")
    return data if keep else None


def _archive_cut(tar: tarfile.TarFile, comptype: str, size: int | None) -> str | None:
    """Why a tar that ended quietly is incomplete (tarfile stops without a word at a cut-off header); None when it
    ended as a complete archive does."""
    if comptype == "tar":  # two zero blocks end a complete archive
        if size is not None and size - tar.offset < 2 * tarfile.BLOCKSIZE:
            return f"archive cut off at byte {size} (no end-of-archive marker)"
        return None
    stream = tar.fileobj  # a compressed stream: read past the archive's end (its padding) to the stream's own end
    for _ in range(64):
        if not stream.read(_SKIP_CHUNK):
            break
    decompressor = getattr(stream, "cmp", None)
    if decompressor is not None and not getattr(decompressor, "eof", True):
        return f"the {comptype} stream is cut off (it ends before its end marker)"
    return None


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.isfifo():
        return "FIFO"
    if member.ischr() or member.isblk():
        return "device"
    return f"member of type {member.type!r}"


_BINARY_TYPES = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view, pa.types.is_fixed_size_binary)


def _layout_problem(file_schema: pa.Schema, settings: InputSettings) -> str | None:
    """Why the columns of a Parquet pool file do not fit ``input.*``; None when they do."""
    names, column, source_column = file_schema.names, settings.image_column, settings.source_column
    if column not in names:
        return f"no column {column!r} (columns: {names}); set input.image_column"
    image_type = file_schema.field(column).type
    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        image_type = image_type.field("bytes").type
    if not any(is_binary(image_type) for is_binary in _BINARY_TYPES):
        return (
            f"column {column!r} holds {image_type}, not image bytes (binary, or a struct with a binary 'bytes' "
            "field); set input.image_column"
        )
    if source_column and source_column not in names:
        return f"no column {source_column!r} (columns: {names}); set input.source_column"
    return None


# The ledger reason of a Parquet file left unread for its columns, as the reader words it above.
_UNREAD_LAYOUT = re.compile(
    r"unreadable: (?P<problem>.*; set input\.\w+) \(-?\d+ rows per the footer, none read\)", re.S
)


def layout_problem(reason: str | None) -> str | None:
    """What a ledger reason says is wrong with an unread Parquet file's columns (``no column 'image' (columns:
    [...]); set input.image_column``); None for any other reason."""
    found = _UNREAD_LAYOUT.fullmatch(reason or "")
    return found["problem"] if found else None


def _with_metadata(rows: list[dict], meta: InputMetadata) -> Iterator[dict]:
    """A sample's rows, each with the sample's metadata."""
    if not rows:
        return
    text, note = meta.result()
    for row in rows:
        row.update(metadata_json=text, metadata_note=note)
        yield row


def _row(source: str, data: bytes | None, error: str | None = None) -> dict:
    image = None if data is None else {"bytes": data, "path": source.rsplit("/", 1)[-1]}
    return {"source": source, "image": image, "reason": error}


def _nbytes(row: dict) -> int:
    return 256 + (len(row["image"]["bytes"]) if row["image"] else 0) + len(row.get("metadata_json") or "")


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
