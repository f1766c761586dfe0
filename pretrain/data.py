"""Ray Data ingest of the curated shards: a deterministic, resumable sample order split over the workers.

The order of an epoch is a pure function of (seed, epoch, data index): the row groups of all shards in a seeded
random order, the rows of each row group in a seeded random order. That sequence is cut into global batches of
``samples_per_step`` samples; each worker reads only its own contiguous slice of every global batch. So the data
position is one number per run, not per worker: ``(epoch, consumed)``, where the first ``consumed`` samples of the
epoch's order have been trained on. A resume continues at that prefix with any worker count (resharding 2 -> 1
gives the same remaining samples) and whatever block layout Ray Data picks, and nothing before it is fed again.
The tail of an epoch shorter than one global batch is skipped (drop-last).

The index of row groups is made once per run (Parquet footers read on the driver) and stored in the run
directory, so the order of a run cannot change when shards are added to the data folder later.

Each worker streams its plan through Ray Data: plan segments (runs of rows of one row group) -> read + decode +
person-centred crop to the model's aspect + resize, in Ray Data tasks -> micro-batches of uint8 images
[B, 3, H, W] as torch tensors with their sample keys. Only the original encoded bytes are read from the shards
(no pickles); decoding uses the project's reduced-size JPEG decode.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from common import storage
from curation.imageio import open_reduced

if TYPE_CHECKING:  # not imported at run time: Ray Data's decode tasks import this module and need neither
    import torch

    from pretrain.config import PretrainConfig

INDEX_FILE = "data_index.parquet"
READ_COLUMNS = ("key", "image", "width", "height", "persons")


class DataError(ValueError):
    """The data folder or index cannot be used; the message says what to do."""


# --- the index of row groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataIndex:
    """Every row group of the run's shards: ``files[file[i]]``, row group ``row_group[i]`` holds ``rows[i]`` rows."""

    files: list[str]
    file: np.ndarray  # int32 [U]
    row_group: np.ndarray  # int32 [U]
    rows: np.ndarray  # int64 [U]

    @property
    def num_samples(self) -> int:
        return int(self.rows.sum())

    @property
    def num_units(self) -> int:
        return len(self.rows)

    def to_table(self) -> pa.Table:
        return pa.table(
            {
                "file": pa.array([self.files[i] for i in self.file], pa.string()).dictionary_encode(),
                "row_group": pa.array(self.row_group, pa.int32()),
                "rows": pa.array(self.rows, pa.int64()),
            }
        )

    @classmethod
    def from_table(cls, table: pa.Table) -> DataIndex:
        names = table.column("file").to_pylist()
        files = sorted(set(names))
        lookup = {f: i for i, f in enumerate(files)}
        return cls(
            files=files,
            file=np.array([lookup[f] for f in names], np.int32),
            row_group=table.column("row_group").to_numpy().astype(np.int32),
            rows=table.column("rows").to_numpy().astype(np.int64),
        )

    @classmethod
    def scan(cls, data_uri: str, threads: int = 16) -> DataIndex:
        """Read the footers of the curated shards under ``data_uri`` (those its manifest lists, when it has one)."""
        fs, root = storage.resolve(data_uri)
        manifest_path = storage.join(root, "manifest.json")
        manifest = storage.read_json(fs, manifest_path) if storage.exists(fs, manifest_path) else None
        if manifest is not None:
            paths = [storage.join(root, s["file"]) for s in manifest["shards"]]
        else:
            paths = storage.list_files(fs, root, ".parquet")
        if not paths:
            raise DataError(f"no Parquet shards under {data_uri} (expected the curate job's <out>/shards)")
        scheme = data_uri.split("://", 1)[0] + "://" if "://" in data_uri else ""

        def row_groups(path: str) -> list[int]:
            with fs.open_input_file(path) as f:
                meta = pq.read_metadata(f)
            missing = {"key", "image"} - set(meta.schema.to_arrow_schema().names)
            if missing:
                raise DataError(f"{path} lacks column(s) {sorted(missing)}: not a curated shard")
            return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

        with ThreadPoolExecutor(threads) as pool:
            counts = list(pool.map(row_groups, paths))
        if manifest is not None:
            for shard, c in zip(manifest["shards"], counts):
                if sum(c) != shard["rows"]:
                    raise DataError(f"{shard['file']}: {sum(c)} rows, the manifest says {shard['rows']}")
        file_idx = [(i, g, n) for i, c in enumerate(counts) for g, n in enumerate(c) if n > 0]
        return cls(
            files=[scheme + p for p in paths],
            file=np.array([u[0] for u in file_idx], np.int32),
            row_group=np.array([u[1] for u in file_idx], np.int32),
            rows=np.array([u[2] for u in file_idx], np.int64),
        )


def ensure_index(data_uri: str, run_uri: str) -> DataIndex:
    """The run's index: scanned from ``data_uri`` on the first start, read back from the run directory after."""
    fs, run = storage.resolve(run_uri)
    path = storage.join(run, INDEX_FILE)
    if storage.exists(fs, path):
        return load_index(run_uri)
    index = DataIndex.scan(data_uri)
    storage.write_parquet_atomic(fs, path, index.to_table(), row_group_size=1 << 20)
    return index


def load_index(run_uri: str) -> DataIndex:
    fs, run = storage.resolve(run_uri)
    with fs.open_input_file(storage.join(run, INDEX_FILE)) as f:
        return DataIndex.from_table(pq.read_table(f))


# --- the sample order and the data position ---------------------------------------------------------------------


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's order already trained on (a prefix)

    def to_dict(self) -> dict:
        return asdict(self)


class EpochOrder:
    """The sample sequence of one epoch: row groups permuted, rows permuted inside each (both seeded)."""

    def __init__(self, index: DataIndex, seed: int, epoch: int, shuffle: bool = True) -> None:
        self.index, self.seed, self.epoch, self.shuffle = index, seed, epoch, shuffle
        n = index.num_units
        self.units = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        self.starts = np.concatenate([[0], np.cumsum(index.rows[self.units])])

    def rows_of(self, unit: int) -> np.ndarray:
        rows = int(self.index.rows[unit])
        if not self.shuffle:
            return np.arange(rows)
        return np.random.default_rng([self.seed, self.epoch, unit]).permutation(rows)

    def segments(self, lo: int, hi: int) -> list[dict]:
        """Positions [lo, hi) of the sequence as runs of rows of one row group each, in order."""
        out = []
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        for k in range(first, len(self.units)):
            start = int(self.starts[k])
            if start >= hi:
                break
            unit = int(self.units[k])
            a, b = max(lo, start) - start, min(hi, int(self.starts[k + 1])) - start
            out.append(
                {
                    "file": self.index.files[self.index.file[unit]],
                    "row_group": int(self.index.row_group[unit]),
                    "rows": self.rows_of(unit)[a:b].tolist(),
                }
            )
        return out


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
) -> tuple[list[dict], DataPosition]:
    """Segments this worker reads for the next ``steps`` global batches, and the position after them."""
    per_step = per_worker * world
    if per_step > index.num_samples:
        raise DataError(f"a global batch of {per_step} samples exceeds the {index.num_samples} in the data")
    segments: list[dict] = []
    order: EpochOrder | None = None
    for _ in range(steps):
        nxt = advance(position, per_step, index.num_samples)
        if order is None or order.epoch != nxt.epoch:
            order = EpochOrder(index, seed, nxt.epoch, shuffle)
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


def read_segments(batch: pa.Table, out_hw: tuple[int, int], person_crop: bool) -> dict[str, np.ndarray]:
    """A Ray Data map_batches function: plan segments -> decoded images and keys, in plan order."""
    files: dict[str, pq.ParquetFile] = {}
    images, keys = [], []
    for seg in batch.to_pylist():
        pf = files.get(seg["file"])
        if pf is None:
            fs, path = storage.resolve(seg["file"])
            pf = files[seg["file"]] = pq.ParquetFile(fs.open_input_file(path))
        columns = [c for c in READ_COLUMNS if c in pf.schema_arrow.names]
        table = pf.read_row_group(seg["row_group"], columns=columns).take(seg["rows"])
        for row in table.to_pylist():
            try:
                images.append(decode_crop(row, out_hw, person_crop))
            except Exception as exc:  # curated bytes always decoded once; say which sample broke
                raise DataError(f"cannot decode sample {row['key']} from {seg['file']}: {exc}") from exc
            keys.append(row["key"])
    empty = np.zeros((0, *out_hw, 3), np.uint8)
    return {"image": np.stack(images) if images else empty, "key": np.array(keys, dtype=object)}


# --- the worker's stream --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    images: "torch.Tensor"  # [B, 3, H, W] uint8 (a view of the NHWC array Ray Data delivered)
    keys: list[str]


def stream(
    index: DataIndex, cfg: PretrainConfig, *, position: DataPosition, steps: int, world: int, rank: int
) -> Iterator[Batch]:
    """``steps * grad_accum`` micro-batches of ``data.batch_size`` images for this worker, from ``position`` on.

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
            index, seed=cfg.seed, shuffle=d.shuffle, position=position, steps=chunk,
            per_worker=d.batch_size * cfg.optim.grad_accum, world=world, rank=rank,
        )
        ds = ray.data.from_items(segments, override_num_blocks=max(1, math.ceil(len(segments) / d.read_segments)))
        ds = ds.map_batches(
            read_segments,
            batch_size=d.read_segments,
            batch_format="pyarrow",
            num_cpus=d.read_cpus,
            fn_kwargs={"out_hw": tuple(cfg.image_size), "person_crop": d.person_crop},
        )
        batches = ds.iter_batches(batch_size=d.batch_size, batch_format="numpy", prefetch_batches=d.prefetch_batches)
        for batch in batches:
            with warnings.catch_warnings():  # a read-only view of the object store; training only reads it
                warnings.simplefilter("ignore", UserWarning)
                images = torch.from_numpy(batch["image"])
            yield Batch(images=images.permute(0, 3, 1, 2), keys=list(batch["key"]))
        done += chunk

