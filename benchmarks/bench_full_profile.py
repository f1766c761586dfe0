"""Full-profile model stages (YOLO person + pose, OpenCLIP + aesthetic + realism + prompt filters): images/s with
batched inference against one image per call, side by side in one run.

    python benchmarks/bench_full_profile.py [--n 64] [--yolo yolo11n] [--clip ViT-B-32] [--threads 2]
    python benchmarks/bench_full_profile.py --yolo yolo11m --clip ViT-L-14 --n 512   # the cluster models, on a GPU

The models are the real architectures with random weights, saved into a temporary store and loaded through the
store's loading code (no weights can be downloaded here): their cost is real, their scores are not, so every
filter threshold is opened and each image runs through both stages. The images are the shipped sample photos,
cycled to ``--n``. Both stages decode their batch themselves (as in the pipeline), so decode is included.

Prints images/s of each stage and of the two together at batch 1 and at ``--batch`` (goal on CPU: batched >= 3x).
On a GPU (precision auto: fp16) the figure is images/s per GPU for detection + CLIP + aesthetic.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from curation.config import CurateConfig
from curation.stages.clip import ClipStage
from curation.stages.yolo import YoloPersonStage
from generators.random_models import build_random_store
from generators.sample_pool import load_photos

FULL = Path(__file__).resolve().parents[1] / "configs" / "curate" / "full.yaml"
OPEN_FILTERS = [
    "models.yolo.min_candidate_score=0.25",
    "filters.person_min_score=0",
    "filters.person_min_height_frac=0",
    "filters.person_min_area_frac=0",
    "filters.min_aesthetic=null",
    "filters.min_realism=null",
    "filters.prompt_filters.not_a_person.max_reject=1",
    "filters.prompt_filters.collage.max_reject=1",
]


def rows_of(n: int) -> list[dict]:
    photos = list(load_photos().values())
    rows = []
    for i in range(n):
        data = photos[i % len(photos)].data
        with Image.open(io.BytesIO(data)) as im:
            rows.append({"image": {"bytes": data, "path": f"{i}.jpg"}, "width": im.width, "height": im.height})
    return rows


def images_per_s(stage, rows: list[dict], batch: int) -> float:
    stage.process_batch(rows[:batch])  # warm-up: allocator, kernels, thread pools
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(rows), batch):
        stage.process_batch(rows[i : i + batch])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(rows) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64, help="images per measurement")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--yolo", default="yolo11n", help="ultralytics architecture (yolo11n ... yolo11x)")
    ap.add_argument("--clip", default="ViT-B-32", help="OpenCLIP architecture (ViT-L-14 on the cluster)")
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per stage (decode and torch)")
    args = ap.parse_args()
    rows = rows_of(args.n)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {args.threads} threads"
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {device}")
    with tempfile.TemporaryDirectory() as tmp:
        store = build_random_store(Path(tmp), yolo=args.yolo, clip_arch=args.clip, clip_cfg={}, imgsz=args.imgsz)
        cfg = load_config(
            CurateConfig,
            FULL,
            [
                *store,
                *OPEN_FILTERS,
                f"models.yolo.imgsz={args.imgsz}",
                f"stages.yolo_person.num_cpus={args.threads}",
                f"stages.clip.num_cpus={args.threads}",
            ],
        )
        stages = [YoloPersonStage(cfg), ClipStage(cfg)]
        for stage in stages:
            stage.setup()
        print(
            f"models: {args.yolo} detector + {args.yolo}-pose at {args.imgsz}, OpenCLIP {args.clip} + aesthetic "
            f"MLP; {args.n} images (the sample photos, cycled)"
        )
        results = {}
        for batch in (1, args.batch):
            per_stage = [images_per_s(stage, rows, batch) for stage in stages]
            both = 1 / sum(1 / r for r in per_stage)  # one image through both stages, one after the other
            results[batch] = both
            print(
                f"batch {batch:>3}: person+pose {per_stage[0]:7.1f} img/s | clip+heads {per_stage[1]:7.1f} img/s "
                f"| both {both:7.1f} img/s"
            )
        print(f"batched / one image per call: {results[args.batch] / results[1]:.2f}x (goal >= 3x)")


if __name__ == "__main__":
    main()
