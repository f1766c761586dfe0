"""Labelled shards: the label codec (PNG / .npy bytes, never pickles) and the fine-tuning input streams.

The table is ``common.schema.labelled_schema``. Training reads it with the pretraining data plan
(``pretrain.data``: the row groups' index, a seeded epoch order, each worker's contiguous slice of every global
batch), so the sample order is a pure function of (seed, step) and a resumed run continues where it stopped.
Labelled sets are small next to pretraining data and their rows decode in well under a millisecond, so each
training worker reads its own plan from the Parquet files in a background thread instead of through Ray Data.
Evaluation reads the validation set in file order, split evenly over the workers and padded so that every worker
runs the same number of forward passes (FSDP needs that); padded rows are marked invalid.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from common import schema, storage
from finetune.augment import Augmenter
from pretrain.data import DataError, DataIndex, DataPosition, advance, worker_plan

TASKS = ("pose", "seg", "pointmap", "normal", "albedo")
# Label columns each task reads (besides the image).
TASK_COLUMNS = {
    "pose": ("keypoints", "keypoint_visibility", "area"),
    "seg": ("parts",),
    "pointmap": ("pointmap", "mask"),
    "normal": ("normal", "mask"),
    "albedo": ("albedo", "mask"),
}
PLAN_STEPS = 1000  # steps planned at a time (the plan of a long run is never held whole)


# --- codec ------------------------------------------------------------------------------------------------------


def png_bytes(array: np.ndarray) -> bytes:
    """uint8 [H, W] or [H, W, 3] -> PNG bytes (lossless)."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img)


def decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_image(data: bytes) -> np.ndarray:
    """Any encoded image -> [H, W, 3] uint8 RGB."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def encode_row(
    image: np.ndarray,
    *,
    source: str,
    mask: np.ndarray | None = None,
    parts: np.ndarray | None = None,
    pointmap: np.ndarray | None = None,
    normal: np.ndarray | None = None,
    albedo: np.ndarray | None = None,
    keypoints: np.ndarray | None = None,
    visibility: np.ndarray | None = None,
    area: float | None = None,
    camera: dict | None = None,
) -> dict:
    """A row of the labelled table from arrays; any label may be None. The image is stored as PNG bytes."""
    data = png_bytes(image)
    return {
        "key": sha256(data).hexdigest(),
        "source": source,
        "image": {"bytes": data, "path": None},
        "width": image.shape[1],
        "height": image.shape[0],
        "mask": None if mask is None else png_bytes(mask.astype(np.uint8) * 255),
        "parts": None if parts is None else png_bytes(parts.astype(np.uint8)),
        "pointmap": None if pointmap is None else npy_bytes(pointmap.astype(np.float16)),
        "normal": None if normal is None else npy_bytes(normal.astype(np.float16)),
        "albedo": None if albedo is None else png_bytes((np.clip(albedo, 0, 1) * 255 + 0.5).astype(np.uint8)),
        "keypoints": None if keypoints is None else keypoints.astype(np.float32).tolist(),
        "keypoint_visibility": None if visibility is None else visibility.astype(np.uint8).tolist(),
        "area": area,
        "camera": camera,
    }


# --- what a dataset labels --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabelInfo:
    parts: tuple[str, ...]
    keypoint_names: tuple[str, ...]
    keypoint_sigmas: tuple[float, ...]
    image_size: tuple[int, int]  # (H, W)
    keypoint_groups: tuple[str, ...] = ()  # per keypoint (body, hands, face); none: no per-group metrics

    @property
    def num_classes(self) -> int:
        return len(self.parts)

    @property
    def num_keypoints(self) -> int:
        return len(self.keypoint_names)


def read_info(index: DataIndex, data_uri: str) -> LabelInfo:
    """The label vocabulary and image size from the first shard's metadata (every shard must agree)."""
    infos = []
    for name in index.files[:1] + index.files[-1:]:
        meta = schema.read_metadata(index.open(name).schema_arrow)
        if meta.get("table") != schema.LABELLED_TABLE or "extra" not in meta:
            raise DataError(
                f"{name} under {storage.redact(data_uri)} is not a labelled shard (table {meta.get('table')!r}); make "
                "one with `python -m jobs.make_synthetic --out <dir> --n N` or write common.schema.labelled_schema()"
            )
        e = meta["extra"]
        infos.append(
            LabelInfo(
                parts=tuple(e.get("parts", ())),
                keypoint_names=tuple(e.get("keypoint_names", ())),
                keypoint_sigmas=tuple(float(s) for s in e.get("keypoint_sigmas", ())),
                image_size=tuple(e["image_size"]),
                keypoint_groups=tuple(e.get("keypoint_groups", ())),
            )
        )
    if infos[0] != infos[-1]:
        raise DataError(
            f"shards under {storage.redact(data_uri)} disagree on their labels or image size: {infos[0]} vs {infos[-1]}"
        )
    return infos[0]


# --- decoding samples ---------------------------------------------------------------------------------------------


def decode_sample(row: dict, task: str, image_size: tuple[int, int]) -> dict[str, np.ndarray]:
    """One row -> arrays for ``task``: ``image`` [3, H, W] uint8 and the task's targets."""
    for col in TASK_COLUMNS[task]:
        if row.get(col) is None:
            raise DataError(f"sample {row.get('key')} has no {col!r} label, which task {task!r} needs")
    image = decode_image(row["image"]["bytes"])
    if image.shape[:2] != tuple(image_size):
        raise DataError(
            f"sample {row.get('key')} is {image.shape[0]}x{image.shape[1]}, the data's image_size is "
            f"{image_size[0]}x{image_size[1]}; every image of a labelled set must have the same size"
        )
    out: dict[str, np.ndarray] = {"image": image.transpose(2, 0, 1)}
    if task == "pose":
        out["keypoints"] = np.asarray(row["keypoints"], np.float32).reshape(-1, 2)
        out["visibility"] = np.asarray(row["keypoint_visibility"], np.uint8)
        out["area"] = np.asarray(row["area"], np.float32)
    elif task == "seg":
        out["parts"] = decode_png(row["parts"]).astype(np.int64)
    else:
        out["mask"] = decode_png(row["mask"]) > 127
        if task == "albedo":
            out["target"] = decode_png(row["albedo"]).astype(np.float32) / 255
        else:
            out["target"] = decode_npy(row[task]).astype(np.float32)
    return out


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


class SegmentReader:
    """Reads plan segments (runs of rows of one row group of ``index``) with the task's columns; keeps files open."""

    def __init__(self, index: DataIndex, task: str, image_size: tuple[int, int]) -> None:
        self.index, self.task, self.image_size = index, task, image_size
        self.columns = ["key", "image", *TASK_COLUMNS[task]]
        self.files: dict[str, pq.ParquetFile] = {}

    def read(self, seg: dict) -> list[dict[str, np.ndarray]]:
        pf = self.files.get(seg["file"])
        if pf is None:
            pf = self.files[seg["file"]] = self.index.open(seg["file"])
        table = pf.read_row_group(seg["row_group"], columns=self.columns).take(seg["rows"])
        return [decode_sample(row, self.task, self.image_size) for row in table.to_pylist()]


def _prefetch(items: Iterator, depth: int) -> Iterator:
    """Run ``items`` in a background thread, ``depth`` ahead; its exceptions surface here."""
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    done = object()

    def work() -> None:
        try:
            for item in items:
                q.put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(exc)
        q.put(done)

    threading.Thread(target=work, daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def position_after(steps: int, per_step: int, num_samples: int) -> DataPosition:
    position = DataPosition()
    for _ in range(steps):
        position = advance(position, per_step, num_samples)
    return position


def train_batches(
    index: DataIndex,
    task: str,
    image_size: tuple[int, int],
    *,
    seed: int,
    batch_size: int,
    start_step: int,
    steps: int,
    world: int,
    rank: int,
    shuffle: bool = True,
    prefetch: int = 4,
    augment: Augmenter | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's batches for steps ``start_step`` .. ``steps - 1`` of the run, augmented where ``augment`` is
    given (each sample's draw seeded by seed, step, rank and its slot in the batch)."""

    def collate_step(samples: list[dict[str, np.ndarray]], step: int) -> dict[str, torch.Tensor]:
        if augment is not None:
            samples = [augment(s, np.random.default_rng([seed, step, rank, i])) for i, s in enumerate(samples)]
        return collate(samples)

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        reader = SegmentReader(index, task, image_size)
        position = position_after(start_step, batch_size * world, index.num_samples)
        left, pending, step = steps - start_step, [], start_step
        while left > 0:
            chunk = min(PLAN_STEPS, left)
            segments, position = worker_plan(
                index, seed=seed, shuffle=shuffle, position=position, steps=chunk,
                per_worker=batch_size, world=world, rank=rank,
            )  # fmt: skip
            for seg in segments:
                pending += reader.read(seg)
                while len(pending) >= batch_size:
                    yield collate_step(pending[:batch_size], step)
                    pending, step = pending[batch_size:], step + 1
            left -= chunk

    return _prefetch(batches(), prefetch)


def eval_batches(
    index: DataIndex,
    task: str,
    image_size: tuple[int, int],
    *,
    batch_size: int,
    world: int,
    rank: int,
    limit: int | None = None,
) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(batch, valid [B] bool) over this worker's share of the first ``limit`` samples, in file order.

    Every worker yields the same number of batches of ``batch_size``; rows past its share repeat its last sample
    and are marked invalid.
    """
    total = index.num_samples if limit is None else min(limit, index.num_samples)
    per_rank = -(-total // world)
    lo, hi = min(total, rank * per_rank), min(total, (rank + 1) * per_rank)
    n_batches = -(-per_rank // batch_size)
    starts = np.concatenate([[0], np.cumsum(index.rows)])

    def segments() -> Iterator[dict]:
        for u in range(index.num_units):
            a, b = max(lo, int(starts[u])), min(hi, int(starts[u + 1]))
            if a < b:
                rows = list(range(a - int(starts[u]), b - int(starts[u])))
                yield {"file": index.files[index.file[u]], "row_group": int(index.row_group[u]), "rows": rows}

    def batches() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        reader = SegmentReader(index, task, image_size)
        samples = [s for seg in segments() for s in reader.read(seg)]
        if not samples:  # this worker has no share (more workers than samples): run on a placeholder
            first = {"file": index.files[index.file[0]], "row_group": int(index.row_group[0]), "rows": [0]}
            samples = reader.read(first)
            valid_count = 0
        else:
            valid_count = len(samples)
        padded = samples + [samples[-1]] * (n_batches * batch_size - len(samples))
        for b in range(n_batches):
            valid = torch.arange(b * batch_size, (b + 1) * batch_size) < valid_count
            yield collate(padded[b * batch_size : (b + 1) * batch_size]), valid

    return _prefetch(batches(), 2)


def class_pixel_counts(index: DataIndex, info: LabelInfo, limit: int = 256) -> np.ndarray:
    """Pixels per body-part class [C] over the first ``limit`` samples (file order): what ``auto`` class weights
    are made of. A sample of the set is enough to tell a frequent class from a rare one."""
    counts = np.zeros(info.num_classes, np.int64)
    for batch, valid in eval_batches(index, "seg", info.image_size, batch_size=32, world=1, rank=0, limit=limit):
        labels = batch["parts"][valid].numpy().ravel()
        counts += np.bincount(labels[labels < info.num_classes], minlength=info.num_classes)
    return counts
