"""Thumbnails of the images a report shows, read from where the output keeps them.

An output keeps each image's bytes once: kept images are read from the final shards (or from the scored parts'
image files while a run has not written them yet), the other survivors of phase 1 (duplicate, unsampled) from
those image files while they exist; the rest, and rejected images, whose bytes are not in the output, are read again from
the ledger's ``source`` (``curation.score.originals``) when it is still readable and unchanged, and shown as a
placeholder that says why otherwise. Thumbnails are small JPEGs named by the image's key: made
once, shared by every section that shows the image, and reused by later reports of the same output.
"""

from __future__ import annotations

import io
import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from common.imageio import BOMB_ERRORS, open_image, open_reduced, safe_error
from common.layout import LAYOUT
from common.progress import progress
from common.storage import exists, join, resolve, write_bytes_atomic
from curation.config import CurateConfig
from curation.records import read_commits, read_manifest
from curation.score.originals import SourceReader

if TYPE_CHECKING:
    from curation.audit.report_data import ReportOptions

log = logging.getLogger(__name__)


@dataclass
class Tile:
    """One image on a sheet: where its bytes are, what to write under it, how to mark it."""

    source: str
    key: str | None
    shard_id: str
    scored: bool  # it passed phase 1: its bytes may be in the output rather than only at the source
    caption: str
    note: str = ""  # a line of detail (reason, scores)
    mark: str = ""  # "kept" / "dropped" / "unsampled": a coloured label on the tile
    skip: str | None = None  # a placeholder text chosen without reading anything
    thumb: str | None = field(default=None, repr=False)  # filled in: relative path of the thumbnail
    why: str | None = field(default=None, repr=False)  # filled in: placeholder text when there is no thumbnail


class Thumbnails:
    """Makes each thumbnail once (named by key), reading survivors from the output where it has their bytes and the
    others from source."""

    def __init__(
        self,
        out_uri: str,
        cfg: CurateConfig,
        options: ReportOptions,
        reader: SourceReader | None = None,
    ):
        self.out_uri, self.cfg, self.options = out_uri, cfg, options
        self.fs, self.root = resolve(out_uri)
        self.reader = reader or SourceReader(cfg.input, cfg.filters.max_file_bytes)
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
        held = self._output_bytes([t for t in todo.values() if t.scored])
        with ThreadPoolExecutor(max_workers=max(1, self.options.workers)) as pool:
            jpegs = pool.map(lambda t: self._jpeg(t, held.get(t.source)), todo.values())
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

    def _output_bytes(self, tiles: list[Tile]) -> dict[str, bytes]:
        """The bytes the output holds of ``tiles``, by source: the scored parts' image files (deleted once the final
        shards are written; in the scored parts themselves for an output scored before them), then the final
        shards'."""
        by_shard: dict[str, set[str]] = defaultdict(set)
        for t in tiles:
            by_shard[t.shard_id].add(t.source)
        records = read_commits(*resolve(self.out_uri)) if by_shard else {}
        found: dict[str, bytes] = {}
        for shard_id, sources in by_shard.items():
            for rel in records.get(shard_id, {}).get("scored_files", []):
                images = LAYOUT.images_of(rel)
                table = pq.read_table(
                    join(self.root, images if exists(self.fs, join(self.root, images)) else rel),
                    columns=["source", "image"],
                    filesystem=self.fs,
                    filters=pc.field("source").isin(sorted(sources)),
                )
                for source, image in zip(table.column("source").to_pylist(), table.column("image").to_pylist()):
                    if image["bytes"] is not None:
                        found[source] = image["bytes"]
        rest = [t for t in tiles if t.source not in found]
        manifest = join(self.root, LAYOUT.manifest)
        if rest and exists(self.fs, manifest):
            files = [join(self.root, LAYOUT.shards, s["file"]) for s in read_manifest(self.fs, self.root)["shards"]]
            # the shards are in (shard_id, source) order: their row groups' statistics skip all but the tiles'
            wanted = pc.field("shard_id").isin(sorted({t.shard_id for t in rest})) & pc.field("source").isin(
                sorted({t.source for t in rest})
            )
            table = pads.dataset(files, filesystem=self.fs).to_table(columns=["source", "image"], filter=wanted)
            for source, image in zip(table.column("source").to_pylist(), table.column("image").to_pylist()):
                found[source] = image["bytes"]
        return found

    def _jpeg(self, t: Tile, data: bytes | None) -> bytes | str:
        """The thumbnail's JPEG bytes, or why there is none."""
        if data is None:
            assert t.key is not None  # fill gives a tile without a key its placeholder
            found, problems = self.reader.read_verified({t.source: t.key})
            if t.source in problems:
                return problems[t.source]
            data = found[t.source]
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
