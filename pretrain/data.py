"""Ray Data ingest of the curated shards: a deterministic, resumable sample order split over the workers.

The order of an epoch is a pure function of (seed, epoch, data index): the row groups of all shards in a seeded
random order, the rows of each row group in a seeded random order. That sequence is cut into global batches of
``samples_per_step`` samples; each worker reads only its own contiguous slice of every global batch. So the data
position is one number per run, not per worker: ``(epoch, consumed)``, where the first ``consumed`` samples of the
epoch's order have been trained on. A resume continues at that prefix with any worker count (resharding 2 -> 1
gives the same remaining samples) and whatever block layout Ray Data picks, and nothing before it is fed again.
The tail of an epoch shorter than one global batch is skipped (drop-last).

The index of row groups is made once per run (Parquet footers read on the driver) from the files the data
folder's ``manifest.json`` lists, and nothing else there: the curate job switches that manifest atomically, so a run
starting during a rewrite indexes the complete old set or the complete new one. The index is stored in the run
directory, so the order of a run cannot change when the data folder changes later, but for takedowns
(``pretrain.takedowns``): the images they remove leave the order, the others keep theirs. It holds file names
relative to the data folder; files are opened through the filesystem of the data URI as given (its query, e.g.
``?endpoint_override=...``, kept), never through a URI rebuilt from a path.

Each worker streams its plan through Ray Data: plan segments (runs of rows of one row group) -> read + decode +
person-centred crop to the model's aspect + resize, in Ray Data tasks -> micro-batches of uint8 images
[B, 3, H, W] as torch tensors with their sample keys. Only the original encoded bytes are read from the shards
(no pickles); decoding uses the project's reduced-size JPEG decode.

Reads without amplification. Parquet reads a row group's column chunks whole, so a row group split over workers or
steps is read once per piece. Where a row group holds R rows, R divides the rows a worker takes per step
(``data.batch_size x optim.grad_accum``) and every row group before it in the order is full, each row group falls
inside one worker's slice of one step: it is read once, wholly used, by one worker. The final shards' row groups are
``output.shard_row_group_size`` rows (16: any per-worker step of a multiple of 16 images) for this, apart from the
scored parts' ``output.row_group_size``. Row groups with fewer rows than most (a shard's last) come after the full
ones in each epoch's order, so none shifts a full one off that alignment (an index saved before version 3 keeps the
plain permutation, so a run resumed across this change keeps its order). A read task reads a row group once for
consecutive segments of it (a row group larger than a global batch, on older shards); a worker whose plan chunk
spans at most ``FOOTERS_KEPT`` shards fetches their footers once and hands them to its read tasks, else each read
process keeps the last ``FOOTERS_KEPT`` it fetched. Every batch carries the bytes read for it (the column chunks
of the row groups read and the footers fetched) and the bytes of its images; the metrics' ``read_amplification``
is their ratio over all workers. Randomness: a global batch of B holds the rows of about B / R row groups, and a
row group holds images that are neighbours in a shard (the write phase keeps them in source order), so a batch
mixes more sources the smaller R (the former 100-row groups put a batch of 32 in one or two); each epoch still
visits every sample once, in a new order of row groups and of rows within each.
"""

from __future__ import annotations

import logging
import math
import posixpath
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image

from common import folders, storage
from common.imageio import open_reduced
from common.layout import LAYOUT
from training.failures import Permanent

if TYPE_CHECKING:  # not imported at run time: Ray Data's decode tasks import this module and need neither
    import torch

    from pretrain.config import PretrainConfig


class RowRemovals(Protocol):
    """What the epoch order needs of the rows takedowns removed (``pretrain.takedowns.Removals``, which reads them
    from this module's index: a protocol here keeps the two modules from importing each other)."""

    rows: dict[int, np.ndarray]  # unit -> its removed rows, sorted
    count: int

    def locate(self, unit: int, rows: list[int]) -> list[tuple[str, int, list[int]]]: ...


INDEX_FILE = "data_index.parquet"
# 1: "file" held absolute paths or URIs; 2: names relative to the data folder, their sha256, the folder's name;
# 3: the same, its runs' epochs ordering full row groups first (``DataIndex.full_first``).
INDEX_VERSION = 3
_META_VERSION, _META_ROOT = b"humans1b.index_version", b"humans1b.data_root"
READ_COLUMNS = ("key", "image", "width", "height", "persons")


class DataError(Permanent, ValueError):
    """The data folder or index cannot be used; the message says what to do."""


class ShardGone(DataError):
    """A shard of the run's index is no longer there (a takedown may have replaced it: ``pretrain.takedowns``)."""


def shard_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (as a Ray Data read task's failure reaches the worker: wrapped) is a ``ShardGone``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ShardGone) or "ShardGone" in type(seen).__name__:
            return True
        seen = seen.__cause__ or seen.__context__
    return "ShardGone" in str(exc)


# --- the index of row groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataIndex:
    """Every row group of the run's shards: ``files[file[i]]``, row group ``row_group[i]`` holds ``rows[i]`` rows.

    ``files`` are names relative to ``root``, the data folder's URI as given; ``sha256`` is each file's digest from
    the manifest (None where an index of version 1 did not record it). ``full_first``: epochs order the full row
    groups before the others (False for an index saved before version 3).
    """

    files: list[str]
    file: np.ndarray  # int32 [U]
    row_group: np.ndarray  # int32 [U]
    rows: np.ndarray  # int64 [U]
    root: str = ""
    sha256: list[str | None] | None = None
    full_first: bool = True

    @property
    def num_samples(self) -> int:
        return int(self.rows.sum())

    @property
    def num_units(self) -> int:
        return len(self.rows)

    @property
    def full_rows(self) -> int:
        """The rows most row groups hold: the shards' row group size (a shard's last may hold fewer)."""
        counts, times = np.unique(self.rows, return_counts=True)
        return int(counts[np.argmax(times)]) if len(counts) else 0

    def open(self, name: str) -> pq.ParquetFile:
        return open_shard(self.root, name)

    def check_present(self, replaced: set[str] | frozenset[str] = frozenset()) -> None:
        """Raise ``DataError`` naming the index's files that are gone, from one listing per folder they are in (a run's
        start; at 1B images ~10^5 shards in a few folders); ``replaced``: files a takedown replaced, whose rows the
        run reads from their replacements (``pretrain.takedowns``)."""
        fs, root = storage.resolve(self.root)
        folders: dict[str, set[str]] = {}
        for name in self.files:
            if name in replaced:
                continue
            path = posixpath.normpath(storage.join(root, name))
            folders.setdefault(posixpath.dirname(path), set()).add(path)
        gone: list[str] = []
        for folder, paths in folders.items():
            listed = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
            gone += sorted(paths - {i.path for i in listed if i.type == pafs.FileType.File})
        if gone:
            first = posixpath.relpath(gone[0], root)
            raise DataError(
                f"{len(gone)} of the {len(self.files)} shards this run indexed under {storage.redact(self.root)} are "
                f"gone ({first}{', ...' if len(gone) > 1 else ''}): the data was rewritten or removed after the run "
                "started. Restore them, or start a new run (--name) on the current data"
            )

    def verify(self, threads: int = 16) -> None:
        """Raise ``DataError`` naming the files whose sha256 is not the manifest's (``data.verify_sha256=true``)."""
        shown = storage.redact(self.root)
        if self.sha256 is None or None in self.sha256:
            raise DataError(
                f"the data index of {shown} has no sha256 for its files (an index or manifest from before they were "
                "recorded): start a new run (--name) to verify them, or set data.verify_sha256=false"
            )
        fs, root = storage.resolve(self.root)

        def actual(name: str) -> str:
            try:
                return storage.file_sha256(fs, posixpath.normpath(storage.join(root, name)))
            except FileNotFoundError:
                return "missing"

        with ThreadPoolExecutor(threads) as pool:
            found = list(pool.map(actual, self.files))
        expected = cast(list[str], self.sha256)  # no None in it: refused above
        bad = [
            f"{name} (sha256 {a[:16]}, the manifest says {w[:16]})"
            for name, a, w in zip(self.files, found, expected)
            if a != w
        ]
        if bad:
            raise DataError(
                f"{len(bad)} shard(s) under {shown} are not the bytes the manifest lists: {'; '.join(bad[:5])}. "
                "Rewrite them (jobs.curate --phases write) or restore the originals"
            )

    def to_table(self) -> pa.Table:
        digests = self.sha256 or [None] * len(self.files)
        table = pa.table(
            {
                "file": pa.array([self.files[i] for i in self.file], pa.string()).dictionary_encode(),
                "row_group": pa.array(self.row_group, pa.int32()),
                "rows": pa.array(self.rows, pa.int64()),
                "sha256": pa.array([digests[i] for i in self.file], pa.string()).dictionary_encode(),
            }
        )
        # the folder's name without its query: credentials stay out of the run directory
        return table.replace_schema_metadata({_META_VERSION: str(INDEX_VERSION), _META_ROOT: storage.redact(self.root)})

    @classmethod
    def from_table(cls, table: pa.Table, data_uri: str | None = None) -> DataIndex:
        """The index saved by ``to_table``; ``data_uri`` (the data folder as given) opens its files, by default the
        folder's name it recorded."""
        meta = table.schema.metadata or {}
        version = int(meta.get(_META_VERSION, b"1"))
        if version > INDEX_VERSION:
            raise DataError(
                f"the run's {INDEX_FILE} has version {version}; this code reads up to {INDEX_VERSION}: update it"
            )
        names = table.column("file").to_pylist()
        digests = table.column("sha256").to_pylist() if "sha256" in table.column_names else [None] * len(names)
        if version == 1:
            data_uri, names = _relative_to_folder(names, data_uri)
        root = data_uri or meta[_META_ROOT].decode()
        sha_of = dict(zip(names, digests))
        files = sorted(sha_of)
        lookup = {f: i for i, f in enumerate(files)}
        return cls(
            files=files,
            file=np.array([lookup[f] for f in names], np.int32),
            row_group=table.column("row_group").to_numpy().astype(np.int32),
            rows=table.column("rows").to_numpy().astype(np.int64),
            root=root,
            sha256=[sha_of[f] for f in files],
            full_first=version >= 3,
        )

    @classmethod
    def scan(cls, data_uri: str, threads: int = 16, verify_sha256: bool = False) -> DataIndex:
        """Read the footers of the shards that ``data_uri``'s manifest lists (and, when asked, check their sha256)."""
        fs, root = storage.resolve(data_uri)
        shown = storage.redact(data_uri)
        manifest_path = storage.join(root, LAYOUT.manifest_name)
        if not storage.exists(fs, manifest_path):
            raise DataError(
                f"{shown} has no {LAYOUT.manifest_name}: training reads only the files a manifest lists (other files there may "
                "be half-written or left over). Pass the curate job's <out>/shards once its write phase has finished "
                f"(or a folder written by jobs.make_synthetic){folders.shards_hint(data_uri, '--data')}"
            )
        shards = _versions_shards(fs, root, storage.read_json(fs, manifest_path), shown)
        if not shards:
            raise DataError(f"the manifest of {shown} lists no shards")

        def row_groups(name: str) -> list[int]:
            meta = open_shard(data_uri, name).metadata
            missing = {"key", "image"} - set(meta.schema.to_arrow_schema().names)
            if missing:
                raise DataError(
                    f"{name} under {shown} lacks the {' and '.join(sorted(missing))} "
                    f"{'column' if len(missing) == 1 else 'columns'}: not a curated shard"
                )
            return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

        names = [s["file"] for s in shards]
        with ThreadPoolExecutor(threads) as pool:
            counts = list(pool.map(row_groups, names))
        for shard, c in zip(shards, counts):
            if sum(c) != shard["rows"]:
                raise DataError(f"{shard['file']} under {shown}: {sum(c)} rows, the manifest says {shard['rows']}")
        file_idx = [(i, g, n) for i, c in enumerate(counts) for g, n in enumerate(c) if n > 0]
        index = cls(
            files=names,
            file=np.array([u[0] for u in file_idx], np.int32),
            row_group=np.array([u[1] for u in file_idx], np.int32),
            rows=np.array([u[2] for u in file_idx], np.int64),
            root=data_uri,
            sha256=[s.get("sha256") for s in shards],
        )
        if verify_sha256:
            index.verify(threads)
        return index


def _versions_shards(fs, root: str, manifest: dict, shown: str) -> list[dict]:
    """The shards of a manifest and of every release it follows (``previous``: an output curated ``--against``
    another is its next version), the earlier ones named relative to ``root`` (``../../<release>/shards/...``). A
    release is read on the data's store, at its current version (a takedown there applies here too)."""
    shards = list(manifest["shards"])
    seen = {root}
    previous = manifest.get("previous")
    while previous:
        release = previous["release"]
        folder = storage.join(storage.path_on_store(release), LAYOUT.shards)
        if folder in seen:
            raise DataError(f"the manifests under {shown} follow each other in a circle (at {folder})")
        seen.add(folder)
        path = storage.join(folder, LAYOUT.manifest_name)
        if not storage.exists(fs, path):
            raise DataError(
                f"{shown} is the next version of {release}, whose {LAYOUT.manifest_name} is not on this store: a release "
                "and its next versions must live on one store"
            )
        earlier = storage.read_json(fs, path)
        prefix = posixpath.relpath(folder, root)
        shards += [{**s, "file": f"{prefix}/{s['file']}"} for s in earlier["shards"]]
        previous = earlier.get("previous")
    return shards


def open_shard(data_uri: str, name: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """The shard ``name`` (relative to the data folder ``data_uri``; a release's, ``../``), its footer read unless
    ``metadata`` is given; a clear error when it is gone."""
    fs, root = storage.resolve(data_uri)
    try:
        return pq.ParquetFile(fs.open_input_file(posixpath.normpath(storage.join(root, name))), metadata=metadata)
    except FileNotFoundError:
        raise ShardGone(
            f"{name} under {storage.redact(data_uri)} is gone: the data was rewritten or removed after this run indexed "
            "it. Restore it, or start a new run (--name) on the current data"
        ) from None


def _relative_to_folder(paths: list[str], data_uri: str | None) -> tuple[str, list[str]]:
    """A version-1 index's absolute paths or URIs as names relative to the data folder (by default their parent)."""
    scheme = paths[0].split("://", 1)[0] + "://" if "://" in paths[0] else ""
    bare = [p.split("://", 1)[-1] for p in paths]
    folder = storage.resolve(data_uri)[1] if data_uri else posixpath.commonpath([posixpath.dirname(p) for p in bare])
    if any(not p.startswith(folder.rstrip("/") + "/") for p in bare):
        raise DataError(
            f"the run's {INDEX_FILE} lists files outside {storage.redact(data_uri or folder)}: pass the run's --data"
        )
    return data_uri or scheme + folder, [p[len(folder.rstrip("/")) + 1 :] for p in bare]


def ensure_index(data_uri: str, run_uri: str, verify_sha256: bool = False) -> DataIndex:
    """The run's index: scanned from ``data_uri`` on the first start, read back from the run directory after (and
    its files' sha256 checked when asked, on every start)."""
    index, scanned = find_index(data_uri, run_uri, verify_sha256)
    if scanned:
        save_index(run_uri, index)
    return index


def find_index(data_uri: str, run_uri: str, verify_sha256: bool = False) -> tuple[DataIndex, bool]:
    """``ensure_index`` without its write: the index and whether it was scanned now (then ``save_index`` it), so a
    job refuses bad data before it writes anything."""
    fs, run = storage.resolve(run_uri)
    if storage.exists(fs, storage.join(run, INDEX_FILE)):
        index = load_index(run_uri, data_uri)
        if verify_sha256:
            index.verify()
        return index, False
    return DataIndex.scan(data_uri, verify_sha256=verify_sha256), True


def save_index(run_uri: str, index: DataIndex) -> None:
    fs, run = storage.resolve(run_uri)
    storage.write_parquet_atomic(fs, storage.join(run, INDEX_FILE), index.to_table(), row_group_size=1 << 20)


def load_index(run_uri: str, data_uri: str | None = None) -> DataIndex:
    """The run's saved index; ``data_uri`` is the data folder as given (needed where its URI carries a query)."""
    fs, run = storage.resolve(run_uri)
    with fs.open_input_file(storage.join(run, INDEX_FILE)) as f:
        return DataIndex.from_table(pq.read_table(f), data_uri)


# --- the sample order and the data position ---------------------------------------------------------------------


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's order already trained on (a prefix)

    def to_dict(self) -> dict:
        return asdict(self)


class EpochOrder:
    """The sample sequence of one epoch: row groups permuted, the full ones first (``DataIndex.full_first``), rows
    permuted inside each (both seeded); the rows takedowns removed (``removals``) left out, the others in the same
    order."""

    def __init__(
        self, index: DataIndex, seed: int, epoch: int, shuffle: bool = True, removals: RowRemovals | None = None
    ) -> None:
        self.index, self.seed, self.epoch, self.shuffle = index, seed, epoch, shuffle
        self.removals = removals
        n = index.num_units
        units = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        if index.full_first:  # a stable split: the full ones keep their drawn order, so do the others
            full = index.rows[units] == index.full_rows
            units = np.concatenate([units[full], units[~full]])
        self.units = units
        rows = index.rows[self.units].copy()
        for unit, removed in (removals.rows if removals else {}).items():
            rows[self._place(unit)] -= len(removed)
        self.starts = np.concatenate([[0], np.cumsum(rows)])

    def _place(self, unit: int) -> int:
        if not hasattr(self, "_places"):  # the inverse permutation: where each unit is in the order
            self._places = np.empty_like(self.units)
            self._places[self.units] = np.arange(len(self.units))
        return int(self._places[unit])

    def kept_rows(self, unit: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The unit's rows in order without the removed ones, and where each kept one is in ``rows_of`` (None:
        none removed)."""
        rows = self.rows_of(unit)
        removed = self.removals.rows.get(unit) if self.removals else None
        if removed is None:
            return rows, None
        at = np.flatnonzero(~np.isin(rows, removed))
        return rows[at], at

    def rows_of(self, unit: int) -> np.ndarray:
        rows = int(self.index.rows[unit])
        if not self.shuffle:
            return np.arange(rows)
        return np.random.default_rng([self.seed, self.epoch, unit]).permutation(rows)

    def segments(self, lo: int, hi: int) -> list[dict]:
        """Positions [lo, hi) of the sequence as runs of rows of one row group each, in order, where they are read
        (a replaced file's rows in its replacement), each run with the removed images whose places it took."""
        out = []
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        for k in range(first, len(self.units)):
            start = int(self.starts[k])
            if start >= hi:
                break
            unit = int(self.units[k])
            a, b = max(lo, start) - start, min(hi, int(self.starts[k + 1])) - start
            if a >= b:  # every row of it taken down
                continue
            rows, at = self.kept_rows(unit)
            skipped = 0
            if at is not None:  # the removed rows before each kept one (and after the last) count where they went
                since = int(at[a - 1]) + 1 if a else 0
                until = int(at[b - 1]) + 1 if b < len(at) else int(self.index.rows[unit])
                skipped = (until - since) - (b - a)
            where = (
                self.removals.locate(unit, rows[a:b].tolist())
                if self.removals
                else [(self.index.files[self.index.file[unit]], int(self.index.row_group[unit]), rows[a:b].tolist())]
            )
            for i, (name, group, part) in enumerate(where):
                out.append({"file": name, "row_group": group, "rows": part, "skipped": 0 if i else skipped})
        return out


def read_alignment(index: DataIndex, per_worker: int) -> str | None:
    """Why this split reads row groups more than once (None where each full one falls in one worker's step)."""
    rows = index.full_rows
    if not rows or per_worker % rows == 0:
        return None
    return (
        f"the shards' row groups hold {rows} images, which do not divide the {per_worker} each worker takes per step: "
        "a row group split over workers or steps is read once per piece (metrics: read_amplification). Shards "
        "written with output.shard_row_group_size dividing it are read once (jobs.curate --phases write)"
    )


def kept_samples(index: DataIndex, removals: RowRemovals | None) -> int:
    """The samples of an epoch: the index's without those takedowns removed."""
    return index.num_samples - (removals.count if removals else 0)


def rebase(
    position: DataPosition, index: DataIndex, seed: int, shuffle: bool, old: RowRemovals | None, new: RowRemovals
) -> DataPosition:
    """``position`` (a prefix of its epoch's order without ``old``'s rows) in the order without ``new``'s: the same
    next sample (or the next kept one, where ``new`` removes it); the rows removed since in the prefix leave it."""
    before, after = (EpochOrder(index, seed, position.epoch, shuffle, r) for r in (old, new))
    if position.consumed >= before.starts[-1]:
        return DataPosition(position.epoch, int(after.starts[-1]))
    k = int(np.searchsorted(before.starts, position.consumed, side="right")) - 1  # the next sample's row group
    unit, within = int(before.units[k]), position.consumed - int(before.starts[k])
    at = before.kept_rows(unit)[1]
    place = int(at[within]) if at is not None else within  # its place among all the row group's rows
    kept = after.kept_rows(unit)[1]
    return DataPosition(
        position.epoch, int(after.starts[k]) + (int(np.searchsorted(kept, place)) if kept is not None else place)
    )


def advance(position: DataPosition, per_step: int, num_samples: int) -> DataPosition:
    """The position after one more global batch is taken (a new epoch starts where the next batch would not fit)."""
    epoch, consumed = position.epoch, position.consumed
    if consumed + per_step > num_samples:
        epoch, consumed = epoch + 1, 0
    return DataPosition(epoch, consumed + per_step)


def worker_plan(
    index: DataIndex,
    *,
    seed: int,
    shuffle: bool,
    position: DataPosition,
    steps: int,
    per_worker: int,
    world: int,
    rank: int,
    removals: RowRemovals | None = None,
) -> tuple[list[dict], DataPosition]:
    """Segments this worker reads for the next ``steps`` global batches, and the position after them."""
    per_step = per_worker * world
    samples = kept_samples(index, removals)
    if per_step > samples:
        raise DataError(
            f"a global batch of {per_step} samples exceeds the {samples} in the data under "
            f"{storage.redact(index.root)}: lower the batch (data.global_batch or data.batch_size, ray.workers) or "
            "give more data"
        )
    segments: list[dict] = []
    order: EpochOrder | None = None
    for _ in range(steps):
        nxt = advance(position, per_step, samples)
        if order is None or order.epoch != nxt.epoch:
            order = EpochOrder(index, seed, nxt.epoch, shuffle, removals)
        lo = nxt.consumed - per_step + rank * per_worker
        segments += order.segments(lo, lo + per_worker)
        position = nxt
    return segments, position


# --- decode ---------------------------------------------------------------------------------------------------------


def person_centre(persons: list[dict] | None, width: float, height: float) -> tuple[float, float]:
    """Centre of the union of the prominent persons' boxes (of all persons if none is prominent; else the image)."""
    boxes = [p for p in persons or [] if p.get("prominent")] or list(persons or [])
    if not boxes:
        return width / 2, height / 2
    x0, y0 = min(b["x0"] for b in boxes), min(b["y0"] for b in boxes)
    x1, y1 = max(b["x1"] for b in boxes), max(b["y1"] for b in boxes)
    return (x0 + x1) / 2, (y0 + y1) / 2


def aspect_crop(
    width: float, height: float, out_hw: tuple[int, int], centre: tuple[float, float]
) -> tuple[float, float, float, float]:
    """The largest box of the output's aspect inside the image, centred on ``centre`` as far as it fits."""
    oh, ow = out_hw
    ch = min(height, width * oh / ow)
    cw = ch * ow / oh
    cx = min(max(centre[0], cw / 2), width - cw / 2)
    cy = min(max(centre[1], ch / 2), height - ch / 2)
    return cx - cw / 2, cy - ch / 2, cx + cw / 2, cy + ch / 2


def decode_crop(row: dict, out_hw: tuple[int, int], person_crop: bool = True) -> np.ndarray:
    """Original bytes -> [H, W, 3] uint8: reduced-size decode, crop of the output's aspect, antialiased resize."""
    data = row["image"]["bytes"]
    width, height = row.get("width"), row.get("height")
    max_side = None
    if width and height:  # decode no larger than the crop needs (JPEG draft mode)
        crop_h = min(height, width * out_hw[0] / out_hw[1])
        scale = out_hw[0] / crop_h
        max_side = math.ceil(max(width, height) * scale) if scale < 1 else None
    img = open_reduced(data, max_side, "RGB")
    w2, h2 = img.size
    width, height = width or w2, height or h2
    centre = person_centre(row.get("persons"), width, height) if person_crop else (width / 2, height / 2)
    x0, y0, x1, y1 = aspect_crop(width, height, out_hw, centre)
    sx, sy = w2 / width, h2 / height  # boxes are in the stored (full-size, oriented) pixels
    box = (x0 * sx, y0 * sy, x1 * sx, y1 * sy)
    return np.asarray(img.resize((out_hw[1], out_hw[0]), Image.Resampling.BILINEAR, box=box))


# Footers this process has read, newest last: with training-sized row groups a footer (~6 KB per row group of a
# curated shard) weighs as much as several row groups, so a reader fetches each one once, not once per task.
_FOOTERS: OrderedDict[tuple[str, str], pq.FileMetaData] = OrderedDict()
FOOTERS_KEPT = 64


def _open_counted(data_uri: str, name: str) -> tuple[pq.ParquetFile, int]:
    """The shard and the bytes fetched to open it: its footer's the first time this process opens it, else 0."""
    known = _FOOTERS.get((data_uri, name))
    pf = open_shard(data_uri, name, known)
    if known is not None:
        _FOOTERS.move_to_end((data_uri, name))
        return pf, 0
    _FOOTERS[(data_uri, name)] = pf.metadata
    while len(_FOOTERS) > FOOTERS_KEPT:
        _FOOTERS.popitem(last=False)
    return pf, pf.metadata.serialized_size + 8  # the footer and its length and magic


def chunk_bytes(meta: pq.FileMetaData, row_group: int, columns: list[str]) -> int:
    """Bytes of the column chunks of ``columns`` (top-level names) in one row group, as stored: what reading them
    fetches."""
    group = meta.row_group(row_group)
    chunks = (group.column(i) for i in range(group.num_columns))
    return sum(c.total_compressed_size for c in chunks if c.path_in_schema.split(".", 1)[0] in columns)


def read_segments(
    batch: pa.Table,
    data_uri: str,
    out_hw: tuple[int, int],
    person_crop: bool,
    footers: dict[str, pq.FileMetaData] | None = None,
) -> dict[str, np.ndarray]:
    """A Ray Data map_batches function: plan segments (files relative to ``data_uri``) -> decoded images and keys,
    in plan order, with the bytes read for each segment and the images taken down in its place (on its first row)
    and each image's encoded bytes. ``footers``: shards' footers the caller fetched (and counted) already."""
    files: dict[str, pq.ParquetFile] = {}
    images, keys, read_bytes, image_bytes, skipped = [], [], [], [], []
    # the row groups read: a later segment of one reads nothing (a replaced file's rows, ``pretrain.takedowns``,
    # alternate between two row groups); a task holds at most ``data.read_segments`` of them
    held: dict[tuple[str, int], pa.Table] = {}
    for seg in batch.to_pylist():
        pf, fetched = files.get(seg["file"]), 0
        if pf is None:
            given = (footers or {}).get(seg["file"])
            pf, fetched = (
                (open_shard(data_uri, seg["file"], given), 0) if given else _open_counted(data_uri, seg["file"])
            )
            files[seg["file"]] = pf
        unit = (seg["file"], seg["row_group"])
        if unit not in held:
            columns = [c for c in READ_COLUMNS if c in pf.schema_arrow.names]
            held[unit] = pf.read_row_group(seg["row_group"], columns=columns)
            fetched += chunk_bytes(pf.metadata, seg["row_group"], columns)
        table = held[unit].take(seg["rows"])
        read_bytes += [fetched] + [0] * (table.num_rows - 1)
        skipped += [seg.get("skipped") or 0] + [0] * (table.num_rows - 1)
        image_bytes += pc.binary_length(pc.struct_field(table.column("image"), "bytes")).to_pylist()
        for row in table.to_pylist():
            try:
                images.append(decode_crop(row, out_hw, person_crop))
            except Exception as exc:  # curated bytes always decoded once; say which sample broke
                raise DataError(f"cannot decode sample {row['key']} from {seg['file']}: {exc}") from exc
            keys.append(row["key"])
    empty = np.zeros((0, *out_hw, 3), np.uint8)
    return {
        "image": np.stack(images) if images else empty,
        "key": np.array(keys, dtype=object),
        "read_bytes": np.array(read_bytes, np.int64),
        "image_bytes": np.array(image_bytes, np.int64),
        "skipped": np.array(skipped, np.int64),
    }


# --- the worker's stream --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    images: torch.Tensor  # [B, 3, H, W] uint8 (a view of the NHWC array Ray Data delivered)
    keys: list[str]
    read_bytes: int = 0  # bytes read from the shards for these images (read_segments)
    image_bytes: int = 0  # their encoded bytes
    taken_down_skipped: int = 0  # images a takedown removed whose places these took


def read_amplification(read_bytes: int, image_bytes: int) -> float | None:
    """Bytes read per byte of the images used (None before any image)."""
    return read_bytes / image_bytes if image_bytes else None


def to_device(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device: on a GPU from page-locked memory, so the copy does not wait for the host."""
    if device.type == "cuda":
        images = images.pin_memory()
    return images.to(device, non_blocking=True)


def stream(
    index: DataIndex,
    cfg: PretrainConfig,
    *,
    position: DataPosition,
    steps: int,
    world: int,
    rank: int,
    removals: RowRemovals | None = None,
) -> Iterator[Batch]:
    """``steps * grad_accum`` micro-batches of ``data.batch_size`` images for this worker, from ``position`` on
    (without the rows ``removals`` says takedowns removed).

    One Ray Data dataset per ``plan_steps`` optimiser steps; order is preserved end to end, so micro-batch ``k``
    holds exactly the samples the plan assigns to it.
    """
    import ray.data
    import torch

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # one dataset per plan chunk: keep the job log quiet
    d = cfg.data
    done = 0
    while done < steps:
        chunk = min(d.plan_steps, steps - done)
        segments, position = worker_plan(
            index,
            seed=cfg.seed,
            shuffle=d.shuffle,
            position=position,
            steps=chunk,
            per_worker=d.batch_size * cfg.optim.grad_accum,
            world=world,
            rank=rank,
            removals=removals,
        )
        # A chunk over a few shards: their footers fetched once here and handed to every read task, which Ray Data
        # may run in several processes (each would fetch them again); over many, each process keeps its own.
        names = sorted({s["file"] for s in segments})
        footers: dict[str, pq.FileMetaData] = {}
        fetched = 0
        if len(names) <= FOOTERS_KEPT:
            for name in names:
                pf, n = _open_counted(index.root, name)
                footers[name], fetched = pf.metadata, fetched + n
        ds: ray.data.Dataset = ray.data.from_items(
            segments, override_num_blocks=max(1, math.ceil(len(segments) / d.read_segments))
        )
        ds = ds.map_batches(
            read_segments,  # type: ignore[arg-type]  # Ray's UDF type takes the batch alone, not fn_kwargs' arguments
            batch_size=d.read_segments,
            batch_format="pyarrow",
            num_cpus=d.read_cpus,
            fn_kwargs={
                "data_uri": index.root,
                "out_hw": tuple(cfg.image_size),
                "person_crop": d.person_crop,
                "footers": footers,
            },
        )
        batches = ds.iter_batches(batch_size=d.batch_size, batch_format="numpy", prefetch_batches=d.prefetch_batches)
        for batch in batches:
            with warnings.catch_warnings():  # a read-only view of the object store; training only reads it
                warnings.simplefilter("ignore", UserWarning)
                images = torch.from_numpy(batch["image"])
            yield Batch(
                images=images.permute(0, 3, 1, 2),
                keys=list(batch["key"]),
                read_bytes=int(batch["read_bytes"].sum()) + fetched,
                image_bytes=int(batch["image_bytes"].sum()),
                taken_down_skipped=int(batch["skipped"].sum()),
            )
            fetched = 0  # counted with the chunk's first batch
        done += chunk


def load_images(shards_uri: str, size: tuple[int, int]) -> torch.Tensor:
    """Every image of the curated shards decoded, person-cropped and resized as the stream does, as one uint8
    [N, 3, H, W] tensor: for in-process benchmarks and studies on a few hundred images, not for training at scale."""
    import torch

    index = DataIndex.scan(shards_uri)
    images = []
    for f in index.files:
        for row in index.open(f).read(columns=list(READ_COLUMNS)).to_pylist():
            images.append(torch.from_numpy(decode_crop(row, size)).permute(2, 0, 1))
    return torch.stack(images)
