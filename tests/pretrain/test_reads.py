"""Reads without amplification (pretrain/data.py): row groups that divide a worker's step are read once, wholly
used, by one worker, at any world size; the bytes read are counted against the bytes of the images used."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from pretrain import data


def write_shards(folder: Path, shards: int, rows: int, row_group_size: int) -> data.DataIndex:
    """``shards`` files of ``rows`` noise JPEGs (64x64, ~10 KB) in ``row_group_size``-row groups, with a manifest."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    listed = []
    for s in range(shards):
        images = []
        for _ in range(rows):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
            images.append(buf.getvalue())
        table = pa.table(
            {
                "key": [hashlib.sha256(b).hexdigest() for b in images],
                "image": [{"bytes": b, "path": None} for b in images],
                "width": pa.array([64] * rows, pa.int32()),
                "height": pa.array([64] * rows, pa.int32()),
            }
        )
        name = f"part-{s:05d}.parquet"
        pq.write_table(table, folder / name, row_group_size=row_group_size, compression="zstd")
        listed.append({"file": name, "rows": rows})
    (folder / "manifest.json").write_text(json.dumps({"shards": listed}))
    return data.DataIndex.scan(str(folder))


def epoch_reads(index: data.DataIndex, per_worker: int, world: int) -> tuple[int, int]:
    """(bytes read, bytes of the images used) by every worker over one epoch's steps, each worker a process of its
    own (its footers read once)."""
    steps = index.num_samples // (per_worker * world)
    read = used = 0
    for rank in range(world):
        data._FOOTERS.clear()
        segments, _ = data.worker_plan(
            index, seed=0, shuffle=True, position=data.DataPosition(), steps=steps, per_worker=per_worker,
            world=world, rank=rank,
        )  # fmt: skip
        for lo in range(0, len(segments), 8):  # read tasks of data.read_segments=8
            task = pa.Table.from_pylist(segments[lo : lo + 8])
            out = data.read_segments(task, index.root, (32, 32), person_crop=False)
            read, used = read + int(out["read_bytes"].sum()), used + int(out["image_bytes"].sum())
    return read, used


def test_training_sized_row_groups_are_read_once_and_older_ones_are_counted(tmp_path):
    # 2 shards of 40 rows: groups of 8 (the last of each 8, none short) read by 2 workers of 8 images per step
    aligned = write_shards(tmp_path / "aligned", shards=2, rows=40, row_group_size=8)
    assert data.read_alignment(aligned, 8) is None
    ratio = data.read_amplification(*epoch_reads(aligned, per_worker=8, world=2))
    assert ratio is not None and ratio <= 1.1, ratio  # below 1 where zstd shrinks the JPEGs a little
    # the same images in 40-row groups: both workers read each group (a task reads it once for its consecutive
    # pieces of it)
    whole = write_shards(tmp_path / "whole", shards=2, rows=40, row_group_size=40)
    assert "do not divide" in (data.read_alignment(whole, 8) or "")
    before = data.read_amplification(*epoch_reads(whole, per_worker=8, world=2))
    assert before is not None and before > 1.5, before


def test_the_full_row_groups_come_first_and_each_falls_in_one_workers_step_at_any_world_size():
    files, rows = ["a", "b", "c"], [[8, 8, 8, 3], [8, 8, 5], [8, 8]]  # 3 short groups: each shard's last
    units = [(f, g, n) for f, groups in enumerate(rows) for g, n in enumerate(groups)]
    index = data.DataIndex(
        files=files,
        file=np.array([u[0] for u in units], np.int32),
        row_group=np.array([u[1] for u in units], np.int32),
        rows=np.array([u[2] for u in units], np.int64),
    )
    order = data.EpochOrder(index, seed=5, epoch=2)
    drawn = index.rows[order.units]
    assert index.full_rows == 8 and (drawn[:7] == 8).all() and (drawn[7:] < 8).all()
    # 2 workers x 8, then (resumed) 1 worker x 16 at the same global batch: every segment a whole full group
    pos, taken = data.DataPosition(), []
    for world, per_worker in ((2, 8), (1, 16)):
        for rank in range(world):
            segs, nxt = data.worker_plan(
                index, seed=5, shuffle=True, position=pos, steps=1, per_worker=per_worker, world=world, rank=rank
            )
            assert all(len(s["rows"]) == 8 for s in segs)
            taken += [(s["file"], s["row_group"], r) for s in segs for r in s["rows"]]
        pos = nxt
    assert len(set(taken)) == 32
    # an index saved before version 3 keeps the plain permutation (a run resumed across the change keeps its order)
    old = data.DataIndex.from_table(
        index.to_table().replace_schema_metadata({b"humans1b.index_version": b"2", b"humans1b.data_root": b"x"})
    )
    assert not old.full_first
    plain = np.random.default_rng([5, 2]).permutation(index.num_units)
    assert list(data.EpochOrder(old, seed=5, epoch=2).units) == list(plain)


def test_a_batch_goes_to_a_cpu_device_unpinned():
    import torch

    images = torch.arange(24, dtype=torch.uint8).view(1, 2, 3, 4).permute(0, 3, 1, 2)  # a view, as stream yields
    moved = data.to_device(images, torch.device("cpu"))
    assert torch.equal(moved, images) and not moved.is_pinned()  # page-locking is for CUDA copies only
