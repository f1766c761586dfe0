"""What every reader of a pool shares: the pool's files as a reader reaches them, and the rows it yields.

A reader yields one row ``{source, image, reason}`` per input (``input_row``): bytes, or none and the reason they were not
read. Reasons of inputs never read start with a code of ``READ_CODES``; the decode stage records them as given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.storage import display_uri, is_local, is_store_failure, resolve
from curation.score.metadata import InputMetadata
from curation.score.sources import path_bytes, printable

if TYPE_CHECKING:  # only: the config imports the stages, and the decode stage imports this module
    from curation.settings import InputSettings

# Members of a WebDataset sample that describe its picture (labels, captions, URLs, features): not inputs. Every other
# regular member is an input, whatever its suffix: the decode stage tells a picture from the rest.
SIDECAR_SUFFIXES = (
    ".json", ".txt", ".cls", ".cls2", ".caption", ".url", ".key", ".id", ".idx", ".index", ".meta", ".xml", ".yaml",
    ".yml", ".csv", ".tsv", ".md5", ".sha1", ".sha256", ".npy", ".npz", ".pickle", ".pkl", ".pth",
)  # fmt: skip
PARQUET_BUFFER = 8 << 20  # bytes a Parquet reader buffers: column chunks are streamed, never read whole

# Reason codes of inputs that were never read; the decode stage records them as given.
READ_CODES = ("unreadable", "file_too_large", "empty_shard", "link_outside_pool", "linked_folder", "not_a_file")


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


def is_sidecar(name: str) -> bool:
    return name.lower().endswith(SIDECAR_SUFFIXES)


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def input_row(source: str, data: bytes | None, error: str | None = None) -> dict:
    image = None if data is None else {"bytes": data, "path": source.rsplit("/", 1)[-1]}
    return {"source": source, "image": image, "reason": error}


def with_metadata(rows: list[dict], meta: InputMetadata) -> Iterator[dict]:
    """A sample's rows, each with the sample's metadata."""
    if not rows:
        return
    text, note = meta.result()
    for r in rows:
        r.update(metadata_json=text, metadata_note=note)
        yield r


def split_read_reason(reason: str | None) -> tuple[str, str]:
    """(code, detail) of the reason a reader gave an unread input; unknown reasons are ``unreadable``."""
    code, _, detail = (reason or "").partition(": ")
    if code in READ_CODES:
        return code, detail
    return "unreadable", reason or "no bytes could be read"


class PoolAccess:
    """The pool's files as a reader reaches them: opened, sized and named, and a store's passing failures told from
    what is wrong with an input. The readers of each format build on it."""

    def __init__(self, input_uri: str, settings: InputSettings, max_file_bytes: int):
        self.input_uri, self.settings, self.max_file_bytes = input_uri, settings, max_file_bytes
        self.fs, self.root = resolve(input_uri)
        self.real_root = os.path.realpath(self.root) if is_local(self.fs) else None
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

    def _metadata(self) -> InputMetadata:
        return InputMetadata(self.settings.metadata, self.settings.max_metadata_kb)
