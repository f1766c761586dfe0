"""Curation speed, measured side by side in one run on the same pool.

    python benchmarks/bench_curation.py [--n 160]

(a) the scoring pipeline on a local Ray with 2 CPUs vs the same stages called in a plain one-core loop (goal >= 1.8x);
(b) the pHash stage (draft decode) vs a naive ``imagehash.phash(Image.open(f))`` loop (goal >= 2.5x, hashes within
    2 bits);
(c) cheap rejections first: a pool where half the images are tiny vs one with none (goal >= 1.7x).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import imagehash
import numpy as np
from PIL import Image

from common.config import load_config
from common.ray_utils import init_ray
from curation.config import CurateConfig
from curation.pool import list_shards
from curation.score import ScorePhase, claim_output, score_in_process
from curation.stage import StageRunner
from jobs import make_sample_pool

REPO = Path(__file__).resolve().parents[1]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def ray_score(cfg: CurateConfig, pool: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    claim_output(str(out), cfg.results_hash(), str(pool), new_run=True)
    shards = list_shards(str(pool), cfg.input)
    seconds, _ = timed(lambda: ScorePhase(cfg, str(out), str(pool), log=lambda _: None).run(shards))
    return seconds


def person_photos(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "people").glob("*.jpg"))


def build_pools(work: Path, n: int) -> tuple[Path, Path, Path]:
    """A pool of realistic images, and one of the same size whose second half is tiny thumbnails."""
    source = work / "sample"
    make_sample_pool.main(["--out", str(source), "--n", str(max(n, 60)), "--seed", "0"])
    photos = person_photos(source) + sorted((source / "no_person").glob("*.jpg")) + sorted((source / "text").glob("*.jpg"))
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
    ap.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these parts (repeatable)")
    args = ap.parse_args()
    parts = set(args.only or "abc")
    cfg = load_config(CurateConfig, REPO / "configs/curate/lite.yaml")
    work = Path(tempfile.mkdtemp(prefix="bench-curation-"))
    try:
        source, normal, half_tiny = build_pools(work, args.n)
        print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}; pool of {args.n}")

        # (b) runs first, before Ray's processes share the machine
        if "b" in parts:
            bench_phash(cfg, source)
        if parts & {"a", "c"}:
            init_ray(num_cpus=2)
        if "a" in parts:
            # (a) plain one-core loop vs Ray with 2 CPUs, same stages, same pool
            shards = list_shards(str(normal), cfg.input)
            loop_s, table = timed(lambda: score_in_process(cfg, shards, str(normal)))
            ray_s = ray_score(cfg, normal, work / "out_a")
            kept = sum(s == "kept" for s in table.column("status").to_pylist())
            print(f"(a) one-core loop {loop_s:.1f} s ({args.n / loop_s:.2f} img/s), Ray 2 CPUs {ray_s:.1f} s "
                  f"({args.n / ray_s:.2f} img/s): {loop_s / ray_s:.2f}x  [goal >= 1.8x; {kept} kept]")
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
    phash_stage = StageRunner("phash", cfg.model_dump_json()).stage
    naive_s, naive = timed(lambda: [imagehash.phash(Image.open(f)) for f in files])
    ours_s, ours = timed(lambda: phash_stage.process_batch(rows))
    dist = [h - imagehash.hex_to_hash(f"{u['phash']:016x}") for h, u in zip(naive, ours)]
    print(f"(b) naive phash loop {naive_s * 1e3 / len(files):.1f} ms/img, phash stage {ours_s * 1e3 / len(files):.1f}"
          f" ms/img: {naive_s / ours_s:.2f}x, max distance {max(dist)} bits, mean {np.mean(dist):.2f}"
          f"  [goal >= 2.5x within 2 bits]")


if __name__ == "__main__":
    main()
