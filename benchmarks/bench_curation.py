"""Curation speed, measured side by side in one run on the same pool.

    python benchmarks/bench_curation.py [--n 160]

(a) the scoring pipeline on a local Ray with 2 CPUs vs the same stages called in a plain one-core loop (goal >= 1.8x);
(b) the pHash stage (draft decode) vs a naive ``imagehash.phash(Image.open(f))`` loop (goal >= 2.5x, hashes within
    2 bits);
(c) cheap rejections first: a pool where half the images are tiny vs one with none (goal >= 1.7x);
(d) the stage runner's merge of a stage's updates into its table, on Arrow columns vs through Python lists (the
    merge before it worked on Arrow columns, kept here as the baseline), on the same tables: 10,000 rows with 90%
    of them pending (an early stage) or 25% (after the person filter), and a Ray Data batch of 32; 2 written
    columns, a fifth of the pending rows rejected.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import timeit
from pathlib import Path

import imagehash
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import timed
from common import schema
from common.config import load_config
from common.ray_utils import init_ray
from curation.config import CurateConfig
from curation.score.chain import score_in_process, stage_runner
from curation.score.phase import ScorePhase
from curation.score.pool import Pool, list_shards
from curation.score.stage import REJECT, Update
from curation.score.stage_runner import _FAULT, StageRunner
from curation.steps.output import Output, claim_output
from jobs import make_sample_pool

REPO = Path(__file__).resolve().parents[1]


def ray_score(cfg: CurateConfig, pool: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    output = Output.at(str(out))
    claim_output(output, cfg.results_hash(), str(pool), new_run=True)
    shards = list_shards(Pool.at(str(pool)), cfg.input)
    seconds, _ = timed(lambda: ScorePhase(cfg, output, Pool.at(str(pool))).run(shards))
    return seconds


def person_photos(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "people").glob("*.jpg"))


def build_pools(work: Path, n: int) -> tuple[Path, Path, Path]:
    """A pool of realistic images, and one of the same size whose second half is tiny thumbnails."""
    source = work / "sample"
    make_sample_pool.main(["--out", str(source), "--n", str(max(n, 60)), "--seed", "0"])
    photos = (
        person_photos(source) + sorted((source / "no_person").glob("*.jpg")) + sorted((source / "text").glob("*.jpg"))
    )
    normal, half_tiny = work / "normal", work / "half_tiny"
    normal.mkdir()
    half_tiny.mkdir()
    for i in range(n):
        photo = photos[i % len(photos)]
        shutil.copy(photo, normal / f"{i:05d}.jpg")
        if i % 2 == 0:
            shutil.copy(photo, half_tiny / f"{i:05d}.jpg")
        else:
            with Image.open(photo) as img:
                img.convert("RGB").resize((160, 120)).save(half_tiny / f"{i:05d}.jpg", quality=90)
    return source, normal, half_tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=160, help="images per benchmark pool")
    ap.add_argument("--only", choices=["a", "b", "c", "d"], action="append", help="run only these parts (repeatable)")
    args = ap.parse_args()
    parts = set(args.only or "abcd")
    cfg = load_config(CurateConfig, REPO / "configs/curate/lite.yaml")
    if "d" in parts:  # needs no pool
        for rows, pending_share, repeats in ((10_000, 0.9, 10), (10_000, 0.25, 10), (32, 0.9, 500)):
            bench_merge(cfg, rows, pending_share, repeats)
    if not parts & set("abc"):
        return
    work = Path(tempfile.mkdtemp(prefix="bench-curation-"))
    try:
        source, normal, half_tiny = build_pools(work, args.n)
        print(
            f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}; pool of {args.n}"
        )

        # (b) runs first, before Ray's processes share the machine
        if "b" in parts:
            bench_phash(cfg, source)
        if parts & {"a", "c"}:
            init_ray(num_cpus=2)
        if "a" in parts:
            # (a) plain one-core loop vs Ray with 2 CPUs, same stages, same pool
            shards = list_shards(Pool.at(str(normal)), cfg.input)
            loop_s, table = timed(lambda: score_in_process(cfg, shards, str(normal)))
            ray_s = ray_score(cfg, normal, work / "out_a")
            kept = sum(s == "kept" for s in table.column("status").to_pylist())
            print(
                f"(a) one-core loop {loop_s:.1f} s ({args.n / loop_s:.2f} img/s), Ray 2 CPUs {ray_s:.1f} s "
                f"({args.n / ray_s:.2f} img/s): {loop_s / ray_s:.2f}x  [goal >= 1.8x; {kept} kept]"
            )
        if "c" in parts:
            # (c) cheap-first: the same Ray pipeline on a pool with half tiny images vs none
            normal_s = ray_score(cfg, normal, work / "out_c0")
            tiny_s = ray_score(cfg, half_tiny, work / "out_c1")
            print(f"(c) no tiny {normal_s:.1f} s, half tiny {tiny_s:.1f} s: {normal_s / tiny_s:.2f}x  [goal >= 1.7x]")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_phash(cfg: CurateConfig, source: Path) -> None:
    """(b) the pHash stage vs the naive loop on the pool's person photos."""
    files = person_photos(source) * 4
    rows = [{"image": {"bytes": f.read_bytes(), "path": f.name}} for f in files]
    phash_stage = stage_runner("phash", cfg).stage
    naive_s, naive = timed(lambda: [imagehash.phash(Image.open(f)) for f in files])
    ours_s, ours = timed(lambda: phash_stage.process_batch(rows))
    dist = [h - imagehash.hex_to_hash(f"{u['phash']:016x}") for h, u in zip(naive, ours)]
    print(
        f"(b) naive phash loop {naive_s * 1e3 / len(files):.1f} ms/img, phash stage {ours_s * 1e3 / len(files):.1f}"
        f" ms/img: {naive_s / ours_s:.2f}x, max distance {max(dist)} bits, mean {np.mean(dist):.2f}"
        f"  [goal >= 2.5x within 2 bits]"
    )


def merge_by_lists(runner: StageRunner, table: pa.Table, pending: list[int], updates: list[Update]) -> pa.Table:
    """The baseline for (d): the runner's merge as it was, turning whole columns into Python lists and back."""
    n = table.num_rows
    for column in runner.stage.writes:
        values = table.column(column).to_pylist()
        for i, update in zip(pending, updates):
            if column in update:
                values[i] = update[column]
        table = table.set_column(
            table.schema.get_field_index(column),
            runner.schema.field(column),
            pa.array(values, runner.schema.field(column).type),
        )
    status = table.column("status").to_pylist()
    stage = table.column("stage").to_pylist()
    reason = table.column("reason").to_pylist()
    stopped = np.zeros(n, dtype=bool)
    for i, update in zip(pending, updates):
        if _FAULT in update:
            status[i], reason[i] = schema.ERROR, update[_FAULT]
        elif REJECT in update:
            status[i], reason[i] = schema.REJECTED, update[REJECT]
        else:
            stage[i] = runner.stage.name
            continue
        stage[i] = runner.stage.name
        stopped[i] = True
    for name, values in (("status", status), ("stage", stage), ("reason", reason)):
        table = table.set_column(
            table.schema.get_field_index(name), runner.schema.field(name), pa.array(values, pa.string())
        )
    if stopped.any():
        image_index = table.schema.get_field_index("image")
        image = pc.if_else(pa.array(stopped), pa.nulls(n, schema.IMAGE_TYPE), table.column("image"))
        table = table.set_column(image_index, runner.schema.field("image"), image)
    return table


def merge_case(runner: StageRunner, rows: int, pending_share: float) -> tuple[pa.Table, np.ndarray, list[Update]]:
    """A working-schema table of ``rows`` 1 KB images, ``pending_share`` of them pending, and the quality stage's
    updates of the pending ones (score and parts; a fifth of them rejected)."""
    rng = np.random.default_rng(0)
    working = runner.schema
    columns = {f.name: pa.nulls(rows, f.type) for f in working}
    columns |= {
        "source": pa.array([f"pool/{i:06d}.jpg" for i in range(rows)]),
        "shard_id": pa.array(["shard-000000"] * rows),
        "image": pa.array([{"bytes": rng.bytes(1024), "path": f"{i:06d}.jpg"} for i in range(rows)], schema.IMAGE_TYPE),
        "status": pa.array(np.where(rng.random(rows) < pending_share, schema.PENDING, schema.REJECTED)),
    }
    table = pa.table(columns, schema=working)
    pending = np.flatnonzero(pc.equal(table.column("status"), schema.PENDING).to_numpy())
    parts = [field.name for field in schema.QUALITY_PARTS_TYPE]
    updates: list[Update] = []
    for score in rng.random(len(pending)):
        update: Update = {"quality": float(score), "quality_parts": dict(zip(parts, rng.random(len(parts)).tolist()))}
        updates.append({**update, REJECT: f"low_quality: {score:.2f}"} if score < 0.2 else update)
    return table, pending, updates


def bench_merge(cfg: CurateConfig, rows: int, pending_share: float, repeats: int) -> None:
    """(d) the quality stage's merge (it writes quality and quality_parts) both ways on the same table."""
    runner = stage_runner("quality", cfg)
    table, pending, updates = merge_case(runner, rows, pending_share)
    assert runner._merge(table, pending, updates).equals(merge_by_lists(runner, table, pending.tolist(), updates))

    def best_s(merge) -> float:
        return min(timeit.repeat(merge, number=1, repeat=repeats))

    lists_s = best_s(lambda: merge_by_lists(runner, table, pending.tolist(), updates))
    arrow_s = best_s(lambda: runner._merge(table, pending, updates))
    print(
        f"(d) merge of {len(pending)} pending of {rows} rows, 2 written columns: Python lists {lists_s * 1e3:.2f} ms,"
        f" Arrow {arrow_s * 1e3:.2f} ms: {lists_s / arrow_s:.1f}x  [best of {repeats}; same table out]"
    )


if __name__ == "__main__":
    main()
