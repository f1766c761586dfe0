"""Image pools: find the input shards of a pool and pin them for the run (the readers stream one shard as rows).

A pool is a folder of image files (recursive), Parquet files with an image-bytes column, or WebDataset tar shards,
on a local disk or an object store. The unit of work and of resume is the *input shard*: a fixed group of files of
a folder pool, one Parquet file, or one tar. The first run of an output lists the pool once and pins that listing
in ``_state/inputs.parquet``; a resumed run reads the pin, so files that land in the pool later, or a changed
``input.*`` setting, can never remap a shard and score an input twice or never.

What a pool may hold, and what becomes of it (every input gets exactly one ledger row; ``reader.ShardReader`` and
the readers of each format, ``read_folder``, ``read_parquet``, ``read_tar``, ``read_downloads``):
- Names starting with ``_`` or ``.`` are not inputs (manifests, commit records, hidden files), as in Spark and
  pyarrow datasets. Links to folders are never followed (they could loop or repeat the pool), each is one ledger row.
- The pool's format is the majority kind of its files: in a pool of tars (or of Parquet files), any other file is
  read as a single image file, so a stray ``README`` becomes one ``not_an_image`` row, not a failed run.
- A shard that holds no inputs (a 0-row Parquet file, a tar of sidecars only) gets one ``empty_shard`` row, so it
  is committed like any other. Sizes are checked before anything is read (``filters.max_file_bytes``); Parquet
  files and tars are streamed in chunks of about ``input.read_chunk_mb``, never read whole.
- A downloader's own files beside its shards (img2dataset's ``<shard>.parquet`` record of every URL it tried and
  ``<shard>_stats.json``) are not inputs: each URL the record says brought no image is one row.

Inputs are named as ``curation.score.sources`` says.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.layout import DOWNLOAD, LAYOUT
from common.storage import StorageError, is_local, redact, resolve, safe_name
from curation.score.inputs import InputShard, inside
from curation.score.metadata import sample_key
from curation.score.read_parquet import image_column
from curation.score.sources import TAR_SUFFIXES, container_kind, path_bytes, printable
from curation.steps.output import Output

if TYPE_CHECKING:  # only: the config imports the stages, and the decode stage imports this module
    from curation.settings import InputSettings

log = logging.getLogger(__name__)

# What img2dataset writes beside each shard it fetched (<stem>.tar, a folder <stem>/ of files, or <stem>.parquet):
# <stem>.parquet, its record of every URL it tried (read by read_downloads), and <stem>_stats.json, its counts.
STATS_SUFFIX = "_stats.json"


class PoolError(ValueError):
    """The pool cannot be used as given; the message names the input and what to do."""


@dataclass(frozen=True)
class Pool:
    """An image pool, resolved once where a job starts: its URI (what the chain's readers are handed), filesystem and
    root (a folder, or a single Parquet file or tar)."""

    uri: str
    fs: pafs.FileSystem
    root: str

    @classmethod
    def at(cls, uri: str) -> Pool:
        try:
            return cls(uri, *resolve(uri))
        except StorageError as exc:
            raise PoolError(f"--input {exc}") from None


# --- listing (driver) ----------------------------------------------------------------------------------------------


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
                regular = stat.S_ISREG(st.st_mode) and inside(os.path.realpath(path), real_root)
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


def _shard_stem(name: str) -> str:
    """A pool file's name without its format suffix (both parts of ``.tar.gz``)."""
    lower = name.lower()
    for suffix in (*TAR_SUFFIXES, ".parquet"):
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name.rsplit(".", 1)[0]


def list_shards(pool: Pool, settings: InputSettings) -> list[InputShard]:
    """The input shards of a pool, in a stable order. Fails fast with a clear message on a wrong ``--input``.

    Holds one entry per file of the pool: O(shards) for Parquet and tar pools; a folder pool of 10^8 loose files
    would need ~10 GB here, so pools that large should be packed into tars or Parquet first.
    """
    fs, root, input_uri = pool.fs, pool.root, pool.uri
    try:
        info = fs.get_file_info(root)
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
    own = [(p, s) for p, s in files if kind != "files" and container_kind(p) == kind]
    loose = [(p, s) for p, s in files if kind == "files" or container_kind(p) != kind]
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
        _noteimage_column(fs, own[0][0], settings)
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
    tars = {_folder_stem(p) for p in paths if container_kind(p) == "webdataset"}
    folders = {_split_name(_split_name(p)[0]) for p in paths}  # (parent, name) of each folder that holds files
    shard_stems = tars | folders | {_folder_stem(p) for p in paths if container_kind(p) == "parquet"}
    stats = {
        p: (d, n[: -len(STATS_SUFFIX)])
        for p, (d, n) in zip(paths, map(_split_name, paths))
        if n.lower().endswith(STATS_SUFFIX) and (d, n[: -len(STATS_SUFFIX)]) in shard_stems
    }

    def records_in(candidates: Iterable[str], homes: set[tuple[str, str]]) -> set[str]:
        return {p for p in candidates if container_kind(p) == "parquet" and _folder_stem(p) in homes}

    records = records_in(paths, tars | folders)
    inputs = [(p, s) for p, s in files if p not in stats and p not in records]
    kind = fmt
    if kind == "auto":
        counts = Counter(container_kind(p) for p, _ in inputs)
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


def _noteimage_column(fs: pafs.FileSystem, path: str, settings: InputSettings) -> None:
    """Say which column a Parquet pool's images are read from when ``input.image_column`` is not the files' own (as
    in img2dataset's output: jpg, png or webp); the first file's footer tells. A file that cannot be read here gets
    its own ledger row from the reader."""
    try:
        with open(path, "rb") if is_local(fs) else fs.open_input_file(path) as f:
            file_schema = pq.read_schema(f)
    except Exception:  # noqa: BLE001 - the reader records what is wrong with the file
        return
    column, problem = image_column(file_schema, settings)
    if problem is None and column != settings.image_column:
        log.info(
            f"[score] the Parquet files hold no column {settings.image_column!r} (input.image_column): each file's "
            f"one binary column is read as its images ({column!r} in {printable(_split_name(path)[1])})"
        )


# --- the pinned listing of a run (driver) --------------------------------------------------------------------------

_LAYOUT_FIELDS = ("format", "files_per_shard", "image_column", "source_column")


def _layout(settings: InputSettings) -> dict[str, str]:
    return {name: str(getattr(settings, name)) for name in _LAYOUT_FIELDS}


def pin_listing(out: Output, shards: list[InputShard], settings: InputSettings) -> None:
    """Record the run's input shards beside its output (one row per file, a downloader's records marked), with the
    settings that formed them."""
    from common.storage import write_parquet_atomic

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
    write_parquet_atomic(out.fs, out.path(LAYOUT.listing), table, row_group_size=100_000)


def pinned_listing(out: Output, settings: InputSettings) -> list[InputShard] | None:
    """The shards pinned by the run in ``out``; None when it has none. Refuses input settings that would lay the
    pool out differently from the pin."""
    if not out.exists(LAYOUT.listing):
        return None
    table = pq.read_table(out.path(LAYOUT.listing), filesystem=out.fs)
    pinned = {
        k.decode()[len("input.") :]: v.decode()
        for k, v in (table.schema.metadata or {}).items()
        if k.startswith(b"input.")
    }
    changed = {k: (pinned.get(k), v) for k, v in _layout(settings).items() if pinned.get(k) != v}
    if changed:
        was = ", ".join(f"input.{k}={old} (this command: {new})" for k, (old, new) in changed.items())
        raise PoolError(
            f"{redact(out.uri)} was started with {was}; its input shards are pinned in {LAYOUT.listing}. Resume with "
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
