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
- Sidecars (``SIDECAR_SUFFIXES``) describe the picture of their sample key, in a folder as in a tar: they are its
  metadata, not inputs. A folder's sidecar with no picture beside it is read as an input, as any stray file is.
- A downloader's own files beside its shards (img2dataset's ``<shard>.parquet`` record of every URL it tried and
  ``<shard>_stats.json``) are not inputs: each URL the record says brought no image is one row (stage
  ``download``, the downloader's status as the reason code), so the ledger accounts for the whole URL list. In
  img2dataset's Parquet output, the record is the file itself: a row with null bytes and a failed status.

Naming of inputs (the ledger's ``source``): a file's path or URI (no query string, no credentials);
``<file.parquet>#row=<i>`` (or ``#<value of input.source_column>``); ``<shard.tar>#<member>``; a part of a
container that could not be read, ``<file.parquet>#<from row i>``, ``<shard.tar>#<after n members>``; a failed
download, ``<record.parquet>#row=<i>``.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import re
import stat
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema
from common.imageio import safe_error, safe_message
from common.layout import DOWNLOAD, LAYOUT
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

log = logging.getLogger(__name__)

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

# What img2dataset writes beside each shard it fetched (<stem>.tar, a folder <stem>/ of files, or <stem>.parquet):
# <stem>.parquet, its record of every URL it tried (the URL list's columns, key, status, error_message, sizes), and
# <stem>_stats.json, its counts. In its Parquet output the record is the shard itself, bytes in a column named by
# the encode format (jpg, png, webp) and null where the download failed.
STATS_SUFFIX = "_stats.json"
DOWNLOAD_STATUS, DOWNLOAD_ERROR, DOWNLOAD_URL = "status", "error_message", "url"
DOWNLOADED = "success"
_RECORD_BATCH_ROWS = 256

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
    records: tuple[str, ...] = ()  # the downloader's records of the shard, read for the URLs that failed

    def to_row(self) -> dict:
        """An Arrow-safe row: paths as raw bytes, since a local name need not be UTF-8. The records follow the
        paths in one list (a column of one type whether or not a shard has records)."""
        return {
            "shard_id": self.shard_id,
            "kind": self.kind,
            "paths": [path_bytes(p) for p in (*self.paths, *self.records)],
            "sizes": list(self.sizes),
            "records": len(self.records),
        }

    @classmethod
    def from_row(cls, row: dict) -> InputShard:
        paths = tuple(p.decode("utf-8", "surrogateescape") for p in row["paths"])
        inputs = len(paths) - (row.get("records") or 0)
        return cls(row["shard_id"], row["kind"], paths[:inputs], tuple(row["sizes"] or ()), paths[inputs:])


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
    kind, files, records, stats = _downloader_files(files, settings.format)
    base = root if info.type == pafs.FileType.Directory else os.path.dirname(root)
    own = [(p, s) for p, s in files if kind != "files" and _kind_of(p) == kind]
    loose = [(p, s) for p, s in files if kind == "files" or _kind_of(p) != kind]
    chunks = list(_sample_chunks(loose, settings.files_per_shard))
    homes = _record_homes(records, [p for p, _ in own], [p for p, _ in loose], [len(c) for c in chunks])
    shards = [
        InputShard(
            safe_name(f"{kind}-{_shard_stem(printable(p[len(base) :]).lstrip('/'))}"), kind, (p,), (s,),
            tuple(homes.get(i, ())),
        )
        for i, (p, s) in enumerate(own)
    ]  # fmt: skip
    for k, chunk in enumerate(chunks):
        paths, sizes = tuple(p for p, _ in chunk), tuple(s for _, s in chunk)
        shards.append(InputShard(f"files-{k:06d}", "files", paths, sizes, tuple(homes.get(len(own) + k, ()))))
    if not shards:  # every file is a downloader's record: every URL of the pool failed
        shards.append(InputShard("files-000000", "files", (), (), tuple(records)))
    if records or stats:
        what = [f"{len(records)} per-shard record(s) of the URLs it tried"] * bool(records)
        what += [f"{len(stats)} {STATS_SUFFIX}"] * bool(stats)
        failed = f"; each URL a record says failed is one ledger row (stage {DOWNLOAD})" if records else ""
        log.info(
            f"[score] {len(records) + len(stats)} files beside the shards are the downloader's own "
            f"({', '.join(what)}): not inputs{failed}"
        )
    if kind == "parquet" and own:
        _note_image_column(fs, own[0][0], settings)
    return shards


def _split_name(path: str) -> tuple[str, str]:
    """(folder, file name) of a listed path."""
    folder, _, name = path.rpartition("/")
    return folder, name


def _folder_stem(path: str) -> tuple[str, str]:
    """(folder, name without its format suffix) of a listed path: what a shard's companions share."""
    folder, name = _split_name(path)
    return folder, _shard_stem(name)


def _downloader_files(
    files: list[tuple[str, int]], fmt: str
) -> tuple[str, list[tuple[str, int]], list[str], list[str]]:
    """(kind, inputs, records, stats): the pool's kind (the majority kind of its inputs unless ``input.format``
    names it; "files" for loose files) and its input files, apart from what a downloader wrote about its shards: its
    records (``<stem>.parquet`` beside a tar or a folder ``<stem>``) and counts (``<stem>_stats.json`` beside any
    shard). Told by their names alone: the driver reads no file to list a pool."""
    paths = [p for p, _ in files]
    tars = {_folder_stem(p) for p in paths if _kind_of(p) == "webdataset"}
    folders = {_split_name(_split_name(p)[0]) for p in paths}  # (parent, name) of each folder that holds files
    shard_stems = tars | folders | {_folder_stem(p) for p in paths if _kind_of(p) == "parquet"}
    stats = {
        p: (d, n[: -len(STATS_SUFFIX)])
        for p, (d, n) in zip(paths, map(_split_name, paths))
        if n.lower().endswith(STATS_SUFFIX) and (d, n[: -len(STATS_SUFFIX)]) in shard_stems
    }

    def records_in(candidates: Iterable[str], homes: set[tuple[str, str]]) -> set[str]:
        return {p for p in candidates if _kind_of(p) == "parquet" and _folder_stem(p) in homes}

    records = records_in(paths, tars | folders)
    inputs = [(p, s) for p, s in files if p not in stats and p not in records]
    kind = fmt
    if kind == "auto":
        counts = Counter(_kind_of(p) for p, _ in inputs)
        kind = max(("webdataset", "parquet", "files"), key=lambda k: counts[k])  # ties go to the loose-file reading
    kind = "files" if kind == "folder" else kind
    if kind != "parquet":  # a folder whose every download failed holds no file: its stats name the record
        late = records_in((p for p, _ in inputs), set(stats.values()))
        records |= late
        inputs = [(p, s) for p, s in inputs if p not in late]
    return kind, inputs, sorted(records, key=path_bytes), sorted(stats, key=path_bytes)


def _sample_chunks(files: list[tuple[str, int]], step: int) -> Iterator[list[tuple[str, int]]]:
    """The loose files in groups of about ``step``: a group ends at a sample's end, so that a sidecar and its
    picture (adjacent in the listing's order) are read together; only a sample of ``2 * step`` files or more is
    parted."""
    chunk: list[tuple[str, int]] = []
    for path, size in files:
        if len(chunk) >= 2 * step or (len(chunk) >= step and sample_key(path)[0] != sample_key(chunk[-1][0])[0]):
            yield chunk
            chunk = []
        chunk.append((path, size))
    if chunk:
        yield chunk


def _record_homes(records: list[str], own: list[str], loose: list[str], chunk_sizes: list[int]) -> dict[int, list[str]]:
    """The shard (index into the own shards, then the chunks of loose files) that reads each record: the tar of its
    name, else the chunk holding its folder's first file (or where that folder would sort, when every download of
    the shard failed), else the nearest shard in the listing's order."""
    by_stem = {_folder_stem(p): i for i, p in enumerate(own)}
    loose_keys = [path_bytes(p) for p in loose]
    starts = list(itertools.accumulate([0, *chunk_sizes[:-1]]))  # index of each chunk's first loose file
    own_keys = [path_bytes(p) for p in own]
    homes: dict[int, list[str]] = {}
    for record in records:
        folder, stem = _folder_stem(record)
        home = by_stem.get((folder, stem))
        if home is None and chunk_sizes:
            first = bisect.bisect_left(loose_keys, path_bytes(f"{folder}/{stem}/"))
            home = len(own) + max(0, bisect.bisect_right(starts, first) - 1)
        elif home is None:
            home = max(0, bisect.bisect_right(own_keys, path_bytes(record)) - 1)
        homes.setdefault(home, []).append(record)
    return homes


def _note_image_column(fs: pafs.FileSystem, path: str, settings: InputSettings) -> None:
    """Say which column a Parquet pool's images are read from when ``input.image_column`` is not the files' own (as
    in img2dataset's output: jpg, png or webp); the first file's footer tells. A file that cannot be read here gets
    its own ledger row from the reader."""
    try:
        with open(path, "rb") if is_local(fs) else fs.open_input_file(path) as f:
            file_schema = pq.read_schema(f)
    except Exception:  # noqa: BLE001 - the reader records what is wrong with the file
        return
    column, problem = _image_column(file_schema, settings)
    if problem is None and column != settings.image_column:
        log.info(
            f"[score] the Parquet files hold no column {settings.image_column!r} (input.image_column): each file's "
            f"one binary column is read as its images ({column!r} in {printable(_split_name(path)[1])})"
        )


# --- the pinned listing of a run (driver) --------------------------------------------------------------------------

_LAYOUT_FIELDS = ("format", "files_per_shard", "image_column", "source_column")


def _layout(settings: InputSettings) -> dict[str, str]:
    return {name: str(getattr(settings, name)) for name in _LAYOUT_FIELDS}


def pin_listing(out_uri: str, shards: list[InputShard], settings: InputSettings) -> None:
    """Record the run's input shards beside its output (one row per file, a downloader's records marked), with the
    settings that formed them."""
    from common.storage import write_parquet_atomic

    fs, root = resolve(out_uri)
    rows = [
        (s.shard_id, s.kind, path_bytes(p), size, record)
        for s in shards
        for p, size, record in [*zip(s.paths, s.sizes, itertools.repeat(False)), *((r, -1, True) for r in s.records)]
    ]
    shard_id, kind, path, size, record = (list(col) for col in zip(*rows)) if rows else ([], [], [], [], [])
    table = pa.table(
        {
            "shard_id": pa.array(shard_id, pa.string()),
            "kind": pa.array(kind, pa.string()),
            "path": pa.array(path, pa.binary()),
            "size": pa.array(size, pa.int64()),
            "record": pa.array(record, pa.bool_()),
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
    paths: dict[str, list[str]] = {}
    sizes: dict[str, list[int]] = {}
    records: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    for row in table.to_pylist():  # a listing pinned before records were told apart has no "record" column
        shard_id, path_str = row["shard_id"], row["path"].decode("utf-8", "surrogateescape")
        kinds.setdefault(shard_id, row["kind"])
        if row.get("record"):
            records.setdefault(shard_id, []).append(path_str)
        else:
            paths.setdefault(shard_id, []).append(path_str)
            sizes.setdefault(shard_id, []).append(row["size"])
    return [
        InputShard(i, kind, tuple(paths.get(i, ())), tuple(sizes.get(i, ())), tuple(records.get(i, ())))
        for i, kind in kinds.items()
    ]


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
        rows = itertools.chain(
            {"files": self._files, "parquet": self._parquet, "webdataset": self._tar}[shard.kind](shard),
            *(self._download_record(record) for record in shard.records),
        )
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
            row.update(shard_id=shard_id, shard_size=total)
            row.setdefault("status", schema.PENDING)  # a failed download is decided already
        return pa.Table.from_pylist(rows, schema=self.schema)

    # --- one reader per kind: each yields rows {source, image, reason} ---------------------------------------------

    def _files(self, shard: InputShard) -> Iterator[dict]:
        """Loose files; the sidecars of a sample (files sharing its key, as in a tar) are its pictures' metadata."""
        sizes = shard.sizes or (None,) * len(shard.paths)
        for _, parts in itertools.groupby(zip(shard.paths, sizes), key=lambda part: sample_key(part[0])[0]):
            files = list(parts)
            # a regular file of a sidecar's name: links out of the pool and special files stay inputs, with their row
            sidecars = [(p, s) for p, s in files if _is_sidecar(p) and (s is None or s >= 0)]
            pictures = [(p, s) for p, s in files if (p, s) not in sidecars]
            if not pictures:  # no picture beside them: stray files, read as inputs
                yield from (self._read_file(p, s) for p, s in files)
                continue
            meta = self._metadata()
            for path, size in sidecars if meta.enabled else ():
                self._read_sidecar(path, size, meta)
            yield from _with_metadata([self._read_file(p, s) for p, s in pictures], meta)

    def _read_sidecar(self, path: str, listed_size: int | None, meta: InputMetadata) -> None:
        """A sidecar file into its sample's metadata, under the limit a tar's sidecar has; one that cannot be read
        is a note on its sample's rows."""
        name, extension = printable(_split_name(path)[1]), sample_key(path)[1]
        if not meta.parses(extension):
            return  # binary parts are not metadata: never read
        try:
            size = self._size(path) if listed_size is None or listed_size < 0 else listed_size
            data = None
            if size is None or size <= meta.limit:
                with self._open(path) as f:
                    data = f.read(meta.limit + 1)  # bounded even if the file grew since it was listed
                size = len(data)
            meta.add_sidecar(name, extension, data if size <= meta.limit else None, size)
        except Exception as exc:  # noqa: BLE001 - the picture goes on; its row says what was lost
            self._store_failed(exc, self.name(path))
            meta.note(f"sidecar {name} unreadable: {safe_error(exc)}")

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
        column, problem = _image_column(pf.schema_arrow, self.settings)
        if column not in pf.schema_arrow.names and DOWNLOAD_STATUS in pf.schema_arrow.names:
            # no bytes, a downloader's status: the record of a shard none of whose URLs brought a picture
            yield from self._download_record(path, beside_pictures=False)
            return
        if problem:  # one row for the file, with what to do: its rows cannot be told apart without its columns
            yield _row(uri, None, f"unreadable: {problem} ({promised} rows per the footer, none read)")
            return
        source_column = self.settings.source_column
        columns = [column] + ([source_column] if source_column else [])
        metadata_columns = self._metadata_columns(pf.schema_arrow, columns)
        # a downloader's status of each row (img2dataset's Parquet output): a null image is a failed download
        download_columns = [c for c in _DOWNLOAD_COLUMNS if c in pf.schema_arrow.names]
        columns = list(dict.fromkeys([*columns, *metadata_columns, *download_columns]))
        index = 0
        try:
            for group in range(meta.num_row_groups):
                rows, image_bytes = self._row_group_size(meta, group, column)
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
                    yield from self._parquet_rows(batch, uri, index, column, metadata_columns)
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

    @staticmethod
    def _row_group_size(meta: pq.FileMetaData, group: int, column: str) -> tuple[int, int]:
        """(rows, uncompressed bytes of the image column) of a row group, as its footer says."""
        rg = meta.row_group(group)
        image_bytes = sum(
            rg.column(i).total_uncompressed_size
            for i in range(rg.num_columns)
            if rg.column(i).path_in_schema.split(".")[0] == column
        )
        return rg.num_rows, image_bytes

    def _metadata_columns(self, file_schema: pa.Schema, taken: list[str]) -> list[str]:
        """The file's columns that are its rows' metadata: those ``input.metadata`` names (all with "*"), but never
        the image or name columns, nor bytes (a second image is not metadata)."""
        wanted = self.settings.metadata
        return [
            f.name
            for f in file_schema
            if f.name not in taken and ("*" in wanted or f.name in wanted) and not _is_binary(f.type)
        ]

    def _parquet_rows(
        self, batch: pa.RecordBatch, uri: str, first: int, column: str, metadata_columns: list[str]
    ) -> Iterator[dict]:
        images = batch.column(column)
        if pa.types.is_struct(images.type):
            images = images.field("bytes")
        if not (pa.types.is_binary(images.type) or pa.types.is_large_binary(images.type)):
            images = images.cast(pa.large_binary())  # binary_view, fixed_size_binary: lengths need an offset type
        lengths = pc.binary_length(images).to_pylist()  # sizes checked before any cell becomes a Python object
        source_column = self.settings.source_column
        names = batch.column(source_column).to_pylist() if source_column else [None] * batch.num_rows
        extra = batch.select(metadata_columns).to_pylist() if metadata_columns else None
        downloads = _Downloads(batch)
        for i, (length, name) in enumerate(zip(lengths, names)):
            source = f"{uri}#{_as_name(name)}" if name is not None else f"{uri}#row={first + i}"
            if length is None:
                failed = downloads.failed_row(source, i)
                row = failed or _row(source, None, "unreadable: image bytes are null in the Parquet row")
            elif length > self.max_file_bytes:
                row = _row(source, None, f"file_too_large: {length} bytes > {self.max_file_bytes}")
            else:
                row = _row(source, images[i].as_py())
            yield from self._with_fields(row, extra[i] if extra is not None else None)

    def _with_fields(self, row: dict, fields: dict | None) -> Iterator[dict]:
        """The row with the metadata of its Parquet columns (``fields``; None: the file gives none)."""
        if fields is None:
            yield row
            return
        meta = self._metadata()
        for field, value in fields.items():
            meta.add(field, value)
        yield from _with_metadata([row], meta)

    def _download_record(self, path: str, beside_pictures: bool = True) -> Iterator[dict]:
        """A downloader's record of a shard (img2dataset's ``<shard>.parquet``): one row per URL whose status is not
        a success. Beside the shard, the URLs that succeeded are its pictures, read from the shard itself; a record
        read alone (no picture of its shard is in the pool) gives each of them a row saying so."""
        uri, index = self.name(path), 0
        try:
            pf = pq.ParquetFile(self._open(path), buffer_size=_PARQUET_BUFFER)
            names = pf.schema_arrow.names
            if DOWNLOAD_STATUS not in names:
                yield _row(uri, None, f"unreadable: no column {DOWNLOAD_STATUS!r} in a downloader's record of a "
                                      f"shard (columns: {names[:32]})")  # fmt: skip
                return
            metadata_columns = self._metadata_columns(pf.schema_arrow, [])
            columns = list(dict.fromkeys([*metadata_columns, *(c for c in _DOWNLOAD_COLUMNS if c in names)]))
            for batch in pf.iter_batches(batch_size=_RECORD_BATCH_ROWS, columns=columns):
                downloads = _Downloads(batch)
                listed = [i for i in range(batch.num_rows) if downloads.failed(i) or not beside_pictures]
                extra = batch.select(metadata_columns).take(listed).to_pylist() if metadata_columns and listed else None
                for k, i in enumerate(listed):
                    source = f"{uri}#row={index + i}"
                    row = downloads.failed_row(source, i) or _row(
                        source, None, "unreadable: the downloader's record has no failure for it, and no picture of "
                                      "its shard is in the pool"
                    )  # fmt: skip
                    yield from self._with_fields(row, extra[k] if extra is not None else None)
                index += batch.num_rows
        except Exception as exc:  # noqa: BLE001 - what was read stands; one row for the rest of the record
            self._store_failed(exc, uri)
            yield _row(f"{uri}#<from row {index}>", None, f"unreadable: the downloader's record of the shard is "
                                                          f"unreadable from row {index}: {safe_error(exc)}")  # fmt: skip

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
                    sidecar = member.isfile() and _is_sidecar(member.name)
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


def _is_binary(dtype: pa.DataType) -> bool:
    return any(is_binary(dtype) for is_binary in _BINARY_TYPES)


def _is_sidecar(name: str) -> bool:
    return name.lower().endswith(SIDECAR_SUFFIXES)


def _image_column(file_schema: pa.Schema, settings: InputSettings) -> tuple[str, str | None]:
    """The column a Parquet pool file's images are read from: ``input.image_column``, or, in a file without it, the
    file's one binary column (img2dataset names it after its encode format: jpg, png, webp); and why the file's
    columns do not fit ``input.*`` (None when they do)."""
    names, column, source_column = file_schema.names, settings.image_column, settings.source_column
    if column not in names:
        binary = [f.name for f in file_schema if _is_binary(f.type)]
        if len(binary) != 1:
            choices = f" (one of its binary columns: {', '.join(binary)})" if binary else ""
            return column, f"no column {column!r} (columns: {names}); set input.image_column{choices}"
        column = binary[0]
    image_type = file_schema.field(column).type
    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        image_type = image_type.field("bytes").type
    if not _is_binary(image_type):
        return column, (
            f"column {column!r} holds {image_type}, not image bytes (binary, or a struct with a binary 'bytes' "
            "field); set input.image_column"
        )
    if source_column and source_column not in names:
        return column, f"no column {source_column!r} (columns: {names}); set input.source_column"
    return column, None


_DOWNLOAD_COLUMNS = (DOWNLOAD_STATUS, DOWNLOAD_ERROR, DOWNLOAD_URL)
_MAX_DOWNLOAD_MESSAGE = 4096  # characters of a downloader's message looked at; the ledger keeps far fewer


class _Downloads:
    """A batch's downloader columns (img2dataset's status, error_message and url), where it has them."""

    def __init__(self, batch: pa.RecordBatch):
        def texts(name: str) -> list[str | None]:
            if name not in batch.schema.names:
                return [None] * batch.num_rows
            return [None if v is None else str(v) for v in batch.column(name).to_pylist()]

        self.status, self.error, self.url = (texts(name) for name in _DOWNLOAD_COLUMNS)

    def failed(self, i: int) -> bool:
        return self.status[i] not in (None, DOWNLOADED)

    def failed_row(self, source: str, i: int) -> dict | None:
        """Row ``i`` as a failed download (stage download, the status as its reason code, the downloader's message
        as its detail, sanitised as every reason is); None where the row is no failed download."""
        status = self.status[i]
        if status is None or not self.failed(i):
            return None
        code = re.sub(r"[^a-z0-9_]+", "_", status.lower()).strip("_")[:64] or "failed"
        message, url = (self.error[i] or "")[:_MAX_DOWNLOAD_MESSAGE], self.url[i]
        detail = safe_message(message.replace(url, "the URL") if url else message)
        row = _row(source, None, f"{code}: {detail}" if detail else code)
        row.update(stage=DOWNLOAD, status=schema.REJECTED)
        return row


# The ledger reason of a Parquet file left unread for its columns, as the reader words it above.
_UNREAD_LAYOUT = re.compile(
    r"unreadable: (?P<problem>.*; set input\.\w+(?: \(one of its binary columns: [^)]*\))?) "
    r"\(-?\d+ rows per the footer, none read\)",
    re.S,
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
