"""The original bytes of inputs, read again from the pool by their ledger ``source`` and checked against their key.

An output keeps the bytes of each image once: in its final shards. Phase 1's scored parts hold the survivors' bytes
only while a run needs them; once the final shards are written (``curation.phases.write.shards``) the scored
parts keep every column but the bytes. So whatever needs a survivor's bytes after that (the write phase run again
with other settings, the report's thumbnails), and the report's rejected images, whose bytes were never kept, read
them here from the pool: a folder's file, a tar member, a Parquet row, named as the pool's readers named them
(``curation.score.sources``). The key is the sha256 of the original bytes, so bytes that no longer hash to it are
a changed pool, never used. A ledger names an object-store input without the query that reaches its store, so
such sources are opened on the pool's filesystem (``pool``: the pool's URI as a job was given it, or the run
record's ``input_store``).

Sources are read a container at a time: a tar is streamed once for all the members asked of it, a Parquet file
reads each row group asked of it once.
"""

from __future__ import annotations

import bisect
import hashlib
import tarfile
from collections import defaultdict
from collections.abc import Iterable

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.storage import resolve
from curation.score.read_parquet import image_column
from curation.score.sources import Source, parse_source, printable
from curation.settings import InputSettings


class SourceUnreadable(OSError):
    """A ledger ``source`` cannot be read back; the message says why in words fit for a placeholder."""


class OriginalsMissing(RuntimeError):
    """Images whose bytes the output no longer holds cannot be read from the pool as it was curated."""


CHANGED = "source changed since curation (its sha256 is not the ledger's key)"


class SourceReader:
    """The original bytes of inputs named by ledger ``source``; ``settings``: the run's ``input`` settings (the
    image and name columns of Parquet pools); ``pool``: the pool's URI (with the query that reaches its store),
    whose filesystem opens sources of its scheme by their path."""

    def __init__(self, settings: InputSettings | None = None, max_bytes: int = 64 * 2**20, pool: str | None = None):
        self.settings, self.max_bytes, self.pool = settings or InputSettings(), max_bytes, pool

    def _locate(self, name: str) -> tuple[pafs.FileSystem, str]:
        """The filesystem and path of a ledger name: ``<scheme>://<path>`` is ``display_uri``'s name of a path on
        the pool's filesystem; anything else is opened as it is."""
        if self.pool and "://" in self.pool:
            prefix = self.pool.split("://", 1)[0] + "://"
            if name.startswith(prefix):
                return resolve(self.pool)[0], name[len(prefix) :]
        return resolve(name)

    def read(self, source: str) -> bytes:
        found = self.read_many([source])[source]
        if isinstance(found, SourceUnreadable):
            raise found
        return found

    def read_many(self, sources: Iterable[str]) -> dict[str, bytes | SourceUnreadable]:
        """Each source's bytes, or why it cannot be read; each container opened once."""
        parts: dict[str, list[tuple[str, Source]]] = defaultdict(list)
        out: dict[str, bytes | SourceUnreadable] = {}
        for source in sources:
            name = parse_source(source)
            if name.unread:
                out[source] = SourceUnreadable(
                    f"source not read: it names a part of {name.container} that could not be read"
                )
            elif name.part is not None and name.kind in ("parquet", "webdataset"):
                parts[name.container].append((source, name))
            else:
                out[source] = self._guarded(lambda s=source: self._file(s))
        for container, named in parts.items():
            read = self._parquet_rows if named[0][1].kind == "parquet" else self._tar_members
            try:
                out.update(read(container, named))
            except Exception as exc:  # noqa: BLE001 - the container as a whole failed: every part says so
                why = exc if isinstance(exc, SourceUnreadable) else _unreadable(exc)
                out.update({source: why for source, _ in named})
        return out

    def read_verified(self, keys: dict[str, str]) -> tuple[dict[str, bytes], dict[str, str]]:
        """The bytes of each ``source -> key`` that still hash to its key, and why each other one is not given."""
        found, problems = {}, {}
        for source, data in self.read_many(keys).items():
            if isinstance(data, SourceUnreadable):
                problems[source] = str(data)
            elif hashlib.sha256(data).hexdigest() != keys[source]:
                problems[source] = CHANGED
            else:
                found[source] = data
        return found, problems

    @staticmethod
    def _guarded(read) -> bytes | SourceUnreadable:
        try:
            return read()
        except SourceUnreadable as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - any failure is the reason given for the source
            return _unreadable(exc)

    def _check_size(self, size: int | None) -> None:
        if size is not None and size > self.max_bytes:
            raise SourceUnreadable(f"source not read: {size} bytes is over filters.max_file_bytes")

    def _file(self, source: str) -> bytes:
        fs, path = self._locate(source)
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            what = "missing" if info.type == pafs.FileType.NotFound else "not a file"
            raise SourceUnreadable(f"source not readable: {source} is {what}")
        self._check_size(info.size)
        with fs.open_input_stream(path) as f:
            return f.read()

    def _parquet_rows(self, uri: str, named: list[tuple[str, Source]]) -> dict[str, bytes | SourceUnreadable]:
        """Rows by their index (``#row=<i>``) or by their value of ``input.source_column`` (its ``dup``-th)."""
        fs, path = self._locate(uri)
        with fs.open_input_file(path) as f:
            return self._rows_of(pq.ParquetFile(f), uri, named)

    def _rows_of(self, pf: pq.ParquetFile, uri: str, named: list[tuple[str, Source]]) -> dict:
        column, problem = image_column(pf.schema_arrow, self.settings)
        if problem:
            raise SourceUnreadable(f"source not readable: {problem}")
        by_value: dict[tuple[str, int], int] = {}
        if self.settings.source_column:  # what the reader named each row: its value, repeated ones counted
            seen: dict[str, int] = defaultdict(int)
            values = pf.read(columns=[self.settings.source_column]).column(0).to_pylist()
            for i, value in enumerate(values):
                if value is not None:
                    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
                    seen[text] += 1
                    by_value[text, seen[text]] = i
        starts = [0]
        for rg in range(pf.num_row_groups):
            starts.append(starts[-1] + pf.metadata.row_group(rg).num_rows)
        wanted: dict[int, list[tuple[str, int]]] = defaultdict(list)  # row group -> (source, row in it)
        out: dict[str, bytes | SourceUnreadable] = {}
        for source, name in named:
            index = by_value.get((name.part or "", name.dup), name.row)
            if index is None:
                out[source] = SourceUnreadable(
                    f"source not readable: no row {name.part!r} in {uri}"
                    if self.settings.source_column
                    else f"source not read: {name.part!r} names the row by input.source_column, which is not set"
                )
                continue
            if index >= starts[-1]:
                out[source] = SourceUnreadable(f"source not readable: {uri} has {starts[-1]} rows, no row {index}")
                continue
            rg = bisect.bisect_right(starts, index) - 1
            wanted[rg].append((source, index - starts[rg]))
        for rg, rows in sorted(wanted.items()):
            cells = pf.read_row_group(rg, columns=[column]).column(0)
            for source, row in rows:
                value = cells[row].as_py()
                data = value.get("bytes") if isinstance(value, dict) else value
                out[source] = self._guarded(lambda d=data: self._sized(d))
        return out

    def _sized(self, data: bytes | None) -> bytes:
        if data is None:
            raise SourceUnreadable("source not readable: the Parquet row's image is null")
        self._check_size(len(data))
        return data

    def _tar_members(self, uri: str, named: list[tuple[str, Source]]) -> dict[str, bytes | SourceUnreadable]:
        """Members as the pool's reader named them: the ``dup``-th regular member of a name (a tar may repeat one),
        the tar streamed once."""
        fs, path = self._locate(uri)
        wanted = {(name.part, name.dup): source for source, name in named}
        out: dict[str, bytes | SourceUnreadable] = {}
        seen: dict[str, int] = defaultdict(int)
        with fs.open_input_stream(path) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                name = printable(member.name)
                seen[name] += 1
                source = wanted.get((name, seen[name]))
                if source is None:
                    continue
                if not member.isfile():  # a link or device entry
                    out[source] = SourceUnreadable(f"source not readable: {name} is not a regular file in {uri}")
                elif member.size > self.max_bytes:
                    out[source] = SourceUnreadable(
                        f"source not read: {member.size} bytes is over filters.max_file_bytes"
                    )
                else:
                    data = tar.extractfile(member)
                    out[source] = data.read() if data is not None else SourceUnreadable("not a regular file")
                if len(out) == len(wanted):
                    break
        for (part, _), source in wanted.items():
            out.setdefault(source, SourceUnreadable(f"source not readable: no member {part!r} in {uri}"))
        return out


def _unreadable(exc: Exception) -> SourceUnreadable:
    return SourceUnreadable(f"source not readable: {type(exc).__name__}: {exc}")
