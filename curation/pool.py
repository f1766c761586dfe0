"""Image pools: find the input shards of a pool and read one shard into working-schema rows.

A pool is a folder of image files (recursive), Parquet files with an image-bytes column, or WebDataset tar shards,
on a local disk or an object store. The unit of work and of resume is the *input shard*: a fixed group of files of
a folder pool, one Parquet file, or one tar. Its id is derived from the pool's own names, so reruns see the same
shards whatever Ray's block layout.

Naming of inputs (the ledger's ``source``): a file's path or URI; ``<file.parquet>#row=<i>`` (or the value of
``input.source_column``); ``<shard.tar>#<member>``. Names starting with ``_`` or ``.`` are not inputs (manifests,
commit records, hidden files), as in Spark and pyarrow datasets.
"""

from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema
from common.storage import StorageError, is_local, resolve, safe_name
from curation.config import InputSettings

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".jfif")


class PoolError(ValueError):
    """The pool cannot be used as given; the message names the input and what to do."""


@dataclass(frozen=True)
class InputShard:
    shard_id: str
    kind: str  # "files" | "parquet" | "webdataset"
    uris: tuple[str, ...]

    def to_row(self) -> dict:
        return {**asdict(self), "uris": list(self.uris)}


def _uri(root_uri: str, root_path: str, path: str) -> str:
    """Re-attach the scheme of ``root_uri`` to a listed path."""
    if "://" not in root_uri:
        return path
    scheme = root_uri.split("://", 1)[0]
    return f"{scheme}://{path}" if scheme != "file" else f"file://{path}"


def _list_local(root: str) -> list[str]:
    """Walk a local folder; unlike pyarrow's listing this keeps broken symlinks, which must reach the ledger."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        found.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith(("_", ".")))
    return sorted(found)


def _list(fs: pafs.FileSystem, root: str) -> list[str]:
    if is_local(fs):
        return _list_local(root)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    out = []
    for info in infos:
        rel = info.path[len(root) :].lstrip("/")
        if info.type == pafs.FileType.File and not any(p.startswith(("_", ".")) for p in rel.split("/")):
            out.append(info.path)
    return sorted(out)


def list_shards(input_uri: str, settings: InputSettings) -> list[InputShard]:
    """The input shards of a pool, in a stable order. Fails fast with a clear message on a wrong ``--input``."""
    try:
        fs, root = resolve(input_uri)
    except StorageError as exc:
        raise PoolError(f"--input {exc}") from None
    try:
        info = fs.get_file_info(root)
    except OSError as exc:
        raise PoolError(f"--input {input_uri}: cannot be listed: {exc}") from None
    if info.type == pafs.FileType.NotFound:
        raise PoolError(f"--input {input_uri}: no such file or folder")
    files = [root] if info.type == pafs.FileType.File else _list(fs, root)
    if not files:
        raise PoolError(f"--input {input_uri}: the folder holds no files (names starting with '_' or '.' are skipped)")
    kind = settings.format
    if kind == "auto":
        if all(f.endswith(".parquet") for f in files):
            kind = "parquet"
        elif all(f.endswith(".tar") for f in files):
            kind = "webdataset"
        else:
            kind = "folder"
    uris = [_uri(input_uri, root, f) for f in files]
    if kind == "folder":
        step = settings.files_per_shard
        return [InputShard(f"files-{i // step:06d}", "files", tuple(uris[i : i + step])) for i in range(0, len(uris), step)]
    suffix = ".parquet" if kind == "parquet" else ".tar"
    wrong = [u for u in uris if not u.endswith(suffix)]
    if wrong:
        raise PoolError(f"--input {input_uri}: input.format={kind} but {len(wrong)} file(s) are not {suffix}, e.g. {wrong[0]}")
    base = root if info.type == pafs.FileType.Directory else os.path.dirname(root)
    return [
        InputShard(safe_name(f"{kind}-{f[len(base):].lstrip('/').rsplit('.', 1)[0]}"), kind, (u,))
        for f, u in zip(files, uris)
    ]


# --- reading one shard (runs inside Ray tasks) -------------------------------------------------------------------


def _row(source: str, data: bytes | None, error: str | None = None) -> dict:
    image = None if data is None else {"bytes": data, "path": source.rsplit("/", 1)[-1]}
    return {"source": source, "image": image, "reason": error}


def _read_file(uri: str) -> dict:
    try:
        fs, path = resolve(uri)
        if is_local(fs):
            mode = os.stat(path).st_mode  # follows links; raises on broken ones and link loops
            if not stat.S_ISREG(mode):  # a FIFO or device would block or never end
                kind = "fifo" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
                return _row(uri, None, f"cannot read {uri}: not a regular file ({kind})")
        with fs.open_input_stream(path) as f:
            return _row(uri, f.read())
    except Exception as exc:  # noqa: BLE001 - any read failure becomes a ledger reason
        return _row(uri, None, f"cannot read {uri}: {type(exc).__name__}: {exc}")


def _read_parquet(uri: str, settings: InputSettings) -> list[dict]:
    try:
        fs, path = resolve(uri)
        pf = pq.ParquetFile(fs.open_input_file(path))
        names = pf.schema_arrow.names
        column = settings.image_column
        if column not in names:
            raise PoolError(f"no column {column!r} (columns: {names}); set input.image_column")
        columns = [column] + ([settings.source_column] if settings.source_column else [])
        rows, index = [], 0
        for batch in pf.iter_batches(batch_size=256, columns=columns):
            images = batch.column(column)
            if pa.types.is_struct(images.type):
                images = images.field("bytes")
            sources = batch.column(settings.source_column).to_pylist() if settings.source_column else None
            for j, data in enumerate(images.to_pylist()):
                source = f"{uri}#{sources[j]}" if sources else f"{uri}#row={index}"
                rows.append(_row(source, data, None if data is not None else "image bytes are null in the Parquet row"))
                index += 1
        return rows
    except Exception as exc:  # noqa: BLE001 - the whole file becomes one ledger row with the reason
        return [_row(uri, None, f"cannot read Parquet pool file {uri}: {type(exc).__name__}: {exc}")]


def _read_tar(uri: str) -> list[dict]:
    rows: list[dict] = []
    try:
        fs, path = resolve(uri)
        with fs.open_input_stream(path) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                if not member.isfile() or not member.name.lower().endswith(IMAGE_SUFFIXES):
                    continue  # sidecars (json, txt, cls) of WebDataset samples are not inputs
                source = f"{uri}#{member.name}"
                data = tar.extractfile(member).read()
                if len(data) < member.size:
                    raise tarfile.ReadError(f"member {member.name} truncated at {len(data)} of {member.size} bytes")
                rows.append(_row(source, data))
            # tarfile ends quietly at a cut-off header; a complete archive ends with two zero blocks.
            size = fs.get_file_info(path).size
            if size is not None and size - tar.offset < 2 * tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"archive cut off at byte {size} (no end-of-archive marker)")
    except Exception as exc:  # noqa: BLE001 - a damaged tar keeps what was read plus one row for the rest
        rows.append(_row(f"{uri}#<after {len(rows)} members>", None, f"tar shard unreadable from here: {type(exc).__name__}: {exc}"))
    return rows


def read_shard(shard: dict, settings: InputSettings, embedding_dim: int) -> pa.Table:
    """Rows of one input shard in the working schema, status pending; unreadable inputs carry their reason."""
    if shard["kind"] == "files":
        rows = [_read_file(u) for u in shard["uris"]]
    elif shard["kind"] == "parquet":
        rows = _read_parquet(shard["uris"][0], settings)
    else:
        rows = _read_tar(shard["uris"][0])
    for row in rows:
        row.update(shard_id=shard["shard_id"], shard_size=len(rows), status=schema.PENDING)
    return pa.Table.from_pylist(rows, schema=schema.working_schema(embedding_dim))
