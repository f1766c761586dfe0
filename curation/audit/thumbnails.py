"""Thumbnails of the images a report shows, read from where the output keeps them.

Survivors of phase 1 (kept, duplicate, unsampled) are read from the scored files; rejected images' bytes are not in
the output, so they are read again from the ledger's ``source`` (``curation.score.sources`` names them) when it is
still readable and unchanged, and shown as a placeholder that says why otherwise. A ledger names an object-store
input without the query that reaches its store (an endpoint, a region), so such sources are opened on the pool's
filesystem, which the run record keeps (``input_store``). Thumbnails are small JPEGs named by the image's key: made
once, shared by every section that shows the image, and reused by later reports of the same output.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from common.imageio import BOMB_ERRORS, open_image, open_reduced, safe_error
from common.layout import LAYOUT
from common.progress import progress
from common.storage import exists, join, resolve, write_bytes_atomic
from curation.config import CurateConfig
from curation.records import read_commits
from curation.score.sources import Source, parse_source

if TYPE_CHECKING:
    from curation.audit.report_data import ReportOptions

log = logging.getLogger(__name__)


class SourceUnreadable(OSError):
    """A ledger ``source`` cannot be read back; the message says why in words fit for a placeholder."""


class SourceReader:
    """The original bytes of an input named by a ledger ``source``; ``pool``: the pool's URI (with the query that
    reaches its store), whose filesystem opens sources of its scheme by their path."""

    def __init__(self, image_column: str = "image", max_bytes: int = 64 * 2**20, pool: str | None = None):
        self.image_column, self.max_bytes, self.pool = image_column, max_bytes, pool

    def _locate(self, name: str) -> tuple[pafs.FileSystem, str]:
        """The filesystem and path of a ledger name: ``<scheme>://<path>`` is ``display_uri``'s name of a path on
        the pool's filesystem; anything else is opened as it is."""
        if self.pool and "://" in self.pool:
            prefix = self.pool.split("://", 1)[0] + "://"
            if name.startswith(prefix):
                return resolve(self.pool)[0], name[len(prefix) :]
        return resolve(name)

    def read(self, source: str) -> bytes:
        name = parse_source(source)
        try:
            if name.unread:
                raise SourceUnreadable(f"source not read: it names a part of {name.container} that could not be read")
            if name.part is not None and name.kind == "parquet":
                return self._parquet_row(name)
            if name.part is not None and name.kind == "webdataset":
                return self._tar_member(name)
            fs, path = self._locate(source)
            info = fs.get_file_info(path)
            if info.type != pafs.FileType.File:
                what = "missing" if info.type == pafs.FileType.NotFound else "not a file"
                raise SourceUnreadable(f"source not readable: {source} is {what}")
            self._check_size(info.size)
            with fs.open_input_stream(path) as f:
                return f.read()
        except SourceUnreadable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is the placeholder's text
            raise SourceUnreadable(f"source not readable: {type(exc).__name__}: {exc}") from None

    def _check_size(self, size: int | None) -> None:
        if size is not None and size > self.max_bytes:
            raise SourceUnreadable(f"source not read: {size} bytes is over filters.max_file_bytes")

    def _parquet_row(self, name: Source) -> bytes:
        uri, index = name.container, name.row
        if index is None:
            raise SourceUnreadable(
                f"source not read: {name.part!r} names the row by input.source_column, not by its index"
            )
        fs, path = self._locate(uri)
        pf = pq.ParquetFile(fs.open_input_file(path))
        start = 0
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if index < start + n:
                value = pf.read_row_group(rg, columns=[self.image_column]).column(0)[index - start].as_py()
                data = value.get("bytes") if isinstance(value, dict) else value
                if data is None:
                    raise SourceUnreadable("source not readable: the Parquet row's image is null")
                self._check_size(len(data))
                return data
            start += n
        raise SourceUnreadable(f"source not readable: {uri} has {start} rows, no row {index}")

    def _tar_member(self, name: Source) -> bytes:
        """The member as the pool's reader named it: the ``dup``-th regular member of its name (a tar may repeat
        one)."""
        uri, member = name.container, name.part
        fs, path = self._locate(uri)
        with fs.open_input_file(path) as f, tarfile.open(fileobj=f, mode="r:*") as tar:
            same = [m for m in tar.getmembers() if m.name == member and not m.isdir()]
            if len(same) < name.dup:
                raise SourceUnreadable(f"source not readable: no member {member!r} in {uri}")
            info = same[name.dup - 1]
            self._check_size(info.size)
            data = tar.extractfile(info)
            if data is None:  # a link or device entry
                raise SourceUnreadable(f"source not readable: {member} is not a regular file in {uri}")
            return data.read()


@dataclass
class Tile:
    """One image on a sheet: where its bytes are, what to write under it, how to mark it."""

    source: str
    key: str | None
    shard_id: str
    scored: bool  # bytes in the scored files (it passed phase 1) rather than only at the source
    caption: str
    note: str = ""  # a line of detail (reason, scores)
    mark: str = ""  # "kept" / "dropped" / "unsampled": a coloured label on the tile
    skip: str | None = None  # a placeholder text chosen without reading anything
    thumb: str | None = field(default=None, repr=False)  # filled in: relative path of the thumbnail
    why: str | None = field(default=None, repr=False)  # filled in: placeholder text when there is no thumbnail


class Thumbnails:
    """Makes each thumbnail once (named by key), reading survivors from the scored files and others from source."""

    def __init__(
        self,
        out_uri: str,
        cfg: CurateConfig,
        options: ReportOptions,
        reader: SourceReader | None = None,
    ):
        self.out_uri, self.cfg, self.options = out_uri, cfg, options
        self.fs, self.root = resolve(out_uri)
        self.reader = reader or SourceReader(cfg.input.image_column, cfg.filters.max_file_bytes)
        self.dir = join(self.root, LAYOUT.report, "thumbs")
        self.made = 0  # thumbnails written by this instance
        self._existing: set[str] | None = None

    @staticmethod
    def name(key: str) -> str:
        return f"thumbs/{key[:32]}.jpg"

    def existing(self) -> set[str]:
        if self._existing is None:
            self._existing = set()
            if exists(self.fs, self.dir):
                infos = self.fs.get_file_info(pafs.FileSelector(self.dir))
                self._existing = {f"thumbs/{i.base_name}" for i in infos if i.type == pafs.FileType.File}
        return self._existing

    def fill(self, tiles: Sequence[Tile]) -> None:
        """Set ``thumb`` or ``why`` on every tile, making the thumbnails that do not exist yet."""
        todo: dict[str, Tile] = {}
        for t in tiles:
            if t.skip:
                t.why = t.skip
            elif t.key is None:
                t.why = "no bytes were read for this input"
            elif self.name(t.key) in self.existing():
                t.thumb = self.name(t.key)
            else:
                todo.setdefault(t.key, t)
        scored_bytes = self._scored_bytes([t for t in todo.values() if t.scored])
        with ThreadPoolExecutor(max_workers=max(1, self.options.workers)) as pool:
            jpegs = pool.map(lambda t: self._jpeg(t, scored_bytes.get(t.source)), todo.values())
            made = dict(zip(todo, progress(jpegs, "[report] thumbnails", len(todo), log.info, unit="images")))
        results: dict[str, tuple[str | None, str | None]] = {}
        for key, jpeg in made.items():  # written from one thread: object stores take one upload at a time best
            if isinstance(jpeg, str):
                results[key] = (None, jpeg)
            else:
                write_bytes_atomic(self.fs, join(self.root, LAYOUT.report, self.name(key)), jpeg)
                self.made += 1
                results[key] = (self.name(key), None)
        for t in tiles:
            if t.thumb is None and t.why is None:
                assert t.key is not None  # a tile without a key got its why above
                t.thumb, t.why = results[t.key]

    def _scored_bytes(self, tiles: list[Tile]) -> dict[str, bytes]:
        by_shard: dict[str, set[str]] = defaultdict(set)
        for t in tiles:
            by_shard[t.shard_id].add(t.source)
        records = read_commits(*resolve(self.out_uri)) if by_shard else {}
        found: dict[str, bytes] = {}
        for shard_id, sources in by_shard.items():
            for rel in records.get(shard_id, {}).get("scored_files", []):
                table = pq.read_table(
                    join(self.root, rel),
                    columns=["source", "image"],
                    filesystem=self.fs,
                    filters=pc.field("source").isin(sorted(sources)),
                )
                for source, image in zip(table.column("source").to_pylist(), table.column("image").to_pylist()):
                    found[source] = image["bytes"]
        return found

    def _jpeg(self, t: Tile, data: bytes | None) -> bytes | str:
        """The thumbnail's JPEG bytes, or why there is none."""
        if data is None:
            if t.scored:
                return "not found in the scored files"
            try:
                data = self.reader.read(t.source)
            except SourceUnreadable as exc:
                return str(exc)
            if hashlib.sha256(data).hexdigest() != t.key:
                return "source changed since curation (its sha256 is not the ledger's key)"
        try:
            limit = self.cfg.filters.max_pixels
            w, h = open_image(data, max_pixels=limit).size
            if w * h > limit:
                return f"not decoded: {w}x{h} is over filters.max_pixels"
            img = open_reduced(data, max_side=self.options.thumb_side, max_pixels=limit)
            img.thumbnail((self.options.thumb_side, self.options.thumb_side), Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=75, optimize=True)
        except UnidentifiedImageError:
            return "does not decode: not an image format PIL knows"
        except BOMB_ERRORS:
            return "not decoded: a picture inside the file is over filters.max_pixels"
        except Exception as exc:  # noqa: BLE001 - an image that does not decode gets a placeholder saying so
            return f"does not decode: {safe_error(exc, data)}"
        return buf.getvalue()
