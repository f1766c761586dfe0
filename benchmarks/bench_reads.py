"""Read amplification of pretraining's data path: bytes read from the shards per byte of the images used.

    python benchmarks/bench_reads.py [--n 2000] [--size 256x192] [--global-batch 32] [--workers 2] [--work DIR]
        [--readme-shards out/curated/shards] [--train]

``--n`` renders (``generators.humanoids``, JPEG at quality 90 as ``jobs.make_synthetic --unlabelled`` writes a
pool; kept in ``--work`` for the next run; at 256x192 by default, about 11 KiB each, a third of a 512x384 pool
render's bytes, so the footers and the other columns read weigh more than on curated photos: a conservative figure,
and two minutes of rendering on 2 CPUs instead of twenty) become final shards as the curate job's write phase writes them
(``write_named_by_content`` with the lite profile's schema, ``write.rows_per_shard`` images per shard, one person box
each), once in the row groups of before (``output.row_group_size``, 100) and once in the training-sized ones of
``output.shard_row_group_size`` (16). One epoch of ``--global-batch`` over ``--workers`` workers is then read:

- before: today's read path before this change, counted from the shards' footers: the plain permutation of row
  groups, each plan segment a whole row group read (``read_row_group(...).take(rows)``), each read task opening its
  files (a footer each);
- the reader of now (``pretrain.data.read_segments``, run here) on the 100-row shards and on the 16-row ones.

The workers are emulated in this process, one after the other, each as one reader process (its footers read once);
in a run, Ray Data may spread a worker's read tasks over more processes, each reading the footers it needs once.
``--train`` also runs ``jobs.pretrain`` (the tiny model, 2 Ray workers, one epoch) on the 16-row shards and prints the
``read_amplification`` of its metrics. ``--readme-shards``: the figure of the README's tiny run (9 images, a
global batch of 8 on 2 workers, 60 steps) on those shards, before and now.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from hashlib import sha256
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import storage  # noqa: E402
from common.config import load_config  # noqa: E402
from common.layout import LAYOUT  # noqa: E402
from curation.config import CurateConfig  # noqa: E402
from curation.phases.write.shards import final_shard_schema, shard_encoding, write_named_by_content  # noqa: E402
from generators.humanoids import RenderConfig, render  # noqa: E402
from pretrain import data  # noqa: E402
from pretrain.config import DataSettings, PretrainConfig  # noqa: E402

LITE = REPO / "configs/curate/lite.yaml"
JPEG_QUALITY = 90  # jobs.make_synthetic's pool


def render_rows(height: int, width: int, lo: int, hi: int) -> list[dict]:
    """Renders ``lo .. hi - 1`` as curated rows: the JPEG, its size and the figure's box as its one person."""
    rows = []
    for i in range(lo, hi):
        r = render(RenderConfig(height=height, width=width, num_keypoints=17), np.random.default_rng([0, 2, i]))
        buf = io.BytesIO()
        Image.fromarray(r.image).save(buf, "JPEG", quality=JPEG_QUALITY)
        jpeg = buf.getvalue()
        ys, xs = np.nonzero(r.mask)
        box = {"x0": float(xs.min()), "y0": float(ys.min()), "x1": float(xs.max() + 1), "y1": float(ys.max() + 1)}
        person = {
            **box, "score": 0.9, "detector": "render", "height_frac": (box["y1"] - box["y0"]) / height,
            "area_frac": float(r.mask.mean()), "prominent": True,
            "keypoints": np.concatenate([r.keypoints, r.visibility[:, None]], 1).ravel().tolist(),
        }  # fmt: skip
        key = sha256(jpeg).hexdigest()
        rows.append(
            {
                "key": key, "source": f"render-{i:08d}.jpg", "shard_id": f"pool-{i // 50:05d}",
                "file_size": len(jpeg), "format": "JPEG", "mode": "RGB", "width": width, "height": height,
                "image": {"bytes": jpeg, "path": None}, "persons": [person], "person_count": 1, "prominent_count": 1,
            }
        )  # fmt: skip
    return rows


def renders(work: Path, n: int, height: int, width: int, processes: int) -> list[dict]:
    cached = work / f"renders-{n}-{height}x{width}.parquet"
    if cached.exists():
        return pq.read_table(cached).to_pylist()
    spans = [(lo, min(n, lo + 100)) for lo in range(0, n, 100)]
    with ProcessPoolExecutor(processes) as pool:
        parts = pool.map(render_rows, *zip(*[(height, width, lo, hi) for lo, hi in spans]))
        rows = [r for part in parts for r in part]
    pq.write_table(pa.Table.from_pylist(rows), cached)
    return rows


def write_shards(rows: list[dict], out: Path, row_group_size: int) -> str:
    """``rows`` as the write phase writes final shards (lite schema, ``write.rows_per_shard`` per shard, files named
    by content, a manifest); returns the shards' folder."""
    cfg = load_config(CurateConfig, str(LITE))
    target = final_shard_schema(cfg)
    fs, root = storage.resolve(str(out))
    per = cfg.write.rows_per_shard
    shards = []
    for k, lo in enumerate(range(0, len(rows), per)):
        part = rows[lo : lo + per]
        table = pa.table({n: pa.array([r.get(n) for r in part], target.field(n).type) for n in target.names}, target)
        encoding = {**shard_encoding(cfg), "row_group_size": row_group_size}
        shards.append(write_named_by_content(fs, root, LAYOUT.shards, f"part-{k:05d}", table, **encoding))
    storage.write_json_atomic(fs, storage.join(root, LAYOUT.shards, LAYOUT.manifest_name), {"shards": shards})
    return str(out / LAYOUT.shards)


def plans(index: data.DataIndex, steps: int, per_worker: int, workers: int) -> list[list[dict]]:
    return [
        data.worker_plan(
            index, seed=0, shuffle=True, position=data.DataPosition(), steps=steps, per_worker=per_worker,
            world=workers, rank=rank,
        )[0]
        for rank in range(workers)
    ]  # fmt: skip


def image_sizes(index: data.DataIndex) -> dict[tuple[str, int], list[int]]:
    """Each row group's images' encoded bytes."""
    out = {}
    for f, g in zip(index.file, index.row_group):
        column = index.open(index.files[f]).read_row_group(int(g), columns=["image"]).column("image")
        out[(index.files[f], int(g))] = pc.binary_length(pc.struct_field(column, "bytes")).to_pylist()
    return out


def before(index: data.DataIndex, steps: int, per_worker: int, workers: int, per_task: int) -> tuple[int, int]:
    """(bytes read, image bytes used) of the read path before this change: the plain permutation (no full row groups
    first), every segment a whole row group read, every task opening its files."""
    plain = dataclasses.replace(index, full_first=False)
    sizes, footers = image_sizes(index), {f: index.open(f).metadata for f in index.files}
    read = used = 0
    for segments in plans(plain, steps, per_worker, workers):
        for lo in range(0, len(segments), per_task):
            task = segments[lo : lo + per_task]
            read += sum(footers[f].serialized_size + 8 for f in {s["file"] for s in task})
            for s in task:
                meta = footers[s["file"]]
                columns = [c for c in data.READ_COLUMNS if c in meta.schema.to_arrow_schema().names]
                read += data.chunk_bytes(meta, s["row_group"], columns)
                used += sum(sizes[(s["file"], s["row_group"])][r] for r in s["rows"])
    return read, used


def now(index: data.DataIndex, steps: int, per_worker: int, workers: int, per_task: int) -> tuple[int, int]:
    """(bytes read, image bytes used) as ``pretrain.data.read_segments`` counts them, one reader process a worker."""
    read = used = 0
    for segments in plans(index, steps, per_worker, workers):
        data._FOOTERS.clear()
        for lo in range(0, len(segments), per_task):
            task = pa.Table.from_pylist(segments[lo : lo + per_task])
            out = data.read_segments(task, index.root, (64, 48), person_crop=True)
            read, used = read + int(out["read_bytes"].sum()), used + int(out["image_bytes"].sum())
    return read, used


def report(label: str, figures: tuple[int, int]) -> float:
    ratio = data.read_amplification(*figures) or float("nan")
    print(f"  {label:<52} {figures[0] / 2**20:8.2f} MiB read / {figures[1] / 2**20:7.2f} MiB used = {ratio:.3f}")
    return ratio


def train_figure(shards: str, work: Path, batch: int, workers: int, steps: int) -> list[tuple[int, float]]:
    """``jobs.pretrain`` (tiny) on ``shards`` for ``steps``: each metrics window's last step and read_amplification."""
    from jobs import pretrain
    from training.metrics import read_metrics

    runs = Path(tempfile.mkdtemp(dir=work))
    overrides = [
        f"steps={steps}", f"data.batch_size={batch // workers}", f"ray.workers={workers}", "log.every=10",
        "checkpoint.every=1000000", "objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]",
    ]  # fmt: skip
    argv = ["--config", str(REPO / "configs/pretrain/tiny.yaml"), "--data", shards, "--storage", str(runs)]
    assert pretrain.main([*argv, "--name", "reads", *overrides]) == 0
    return [(r["step"], r["read_amplification"]) for r in read_metrics(str(runs / "reads"))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="renders (default 2000)")
    p.add_argument("--size", default="256x192", help="render HxW (default 256x192)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--processes", type=int, default=2, help="rendering processes")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_reads")
    p.add_argument("--readme-shards", help="the README's curated shards (out/curated/shards): their figure")
    p.add_argument("--train", action="store_true", help="also one epoch of jobs.pretrain on the 16-row shards")
    args = p.parse_args()
    height, width = (int(v) for v in args.size.split("x"))
    args.work.mkdir(parents=True, exist_ok=True)
    per_task = DataSettings().read_segments
    cfg = load_config(CurateConfig, str(LITE))
    t = time.perf_counter()
    rows = renders(args.work, args.n, height, width, args.processes)
    mean = np.mean([len(r["image"]["bytes"]) for r in rows]) / 1024
    print(f"{len(rows)} renders at {height}x{width} ({mean:.1f} KiB each): {time.perf_counter() - t:.0f} s")
    per_worker = args.global_batch // args.workers
    steps = args.n // args.global_batch
    print(f"one epoch: {steps} steps of {args.global_batch} on {args.workers} workers ({per_worker} each)")
    for rows_per_group in (cfg.output.row_group_size, cfg.output.shard_row_group_size):
        out = args.work / f"shards-{args.n}-{args.size}-rg{rows_per_group}"
        shards = str(out / LAYOUT.shards) if (out / LAYOUT.shards).exists() else write_shards(rows, out, rows_per_group)
        index = data.DataIndex.scan(shards)
        footer = np.mean([index.open(f).metadata.serialized_size for f in index.files]) / 1024
        print(f"{len(index.files)} shards of {rows_per_group}-row groups (footer {footer:.0f} KiB each):")
        if rows_per_group == cfg.output.row_group_size:
            report("before: plain order, a whole row group per segment", before(index, steps, per_worker, args.workers, per_task))  # fmt: skip
        report("now: pretrain.data.read_segments", now(index, steps, per_worker, args.workers, per_task))
        if args.train and rows_per_group == cfg.output.shard_row_group_size:
            windows = train_figure(shards, args.work, args.global_batch, args.workers, steps)
            spans = np.diff([0] + [s for s, _ in windows])  # each window's steps: its share of the images
            epoch = float(np.average([a for _, a in windows], weights=spans))
            shown = ", ".join(f"{a:.2f}" for _, a in windows)
            print(
                f"  jobs.pretrain, {args.workers} Ray workers, {steps} steps: {epoch:.3f} (per 10-step window: {shown})"
            )
    if args.readme_shards:
        index = data.DataIndex.scan(args.readme_shards)
        tiny = load_config(PretrainConfig, str(REPO / "configs/pretrain/tiny.yaml"))
        per, world, task = tiny.data.batch_size * tiny.optim.grad_accum, tiny.ray.workers, tiny.data.read_segments
        print(f"README: {index.num_samples} images in {index.num_units} row group(s), {tiny.steps} steps of "
              f"{per * world} on {world} workers")  # fmt: skip
        report("before", before(index, tiny.steps, per, world, task))
        report("now", now(index, tiny.steps, per, world, task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
