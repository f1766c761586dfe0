"""Part ``curation``: the full profile's phase 1 on Ray Data over package photos at web sizes, a sweep over the model
stages' batch size, then where a batch's time goes (``benchmarks/gpu_check.py`` says what it measures)."""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu.harness import MARGIN_S, Deadline, GpuSampler, PartReport
from benchmarks.gpu.sizes import Sizes
from benchmarks.timing import timed


def web_sized_photos(names: tuple[str, ...] | None, long_sides: tuple[int, ...]) -> list[bytes]:
    """The package photos (or the named ones) as JPEGs at each long side (0: the shipped bytes)."""
    from PIL import Image

    from generators.sample_pool import load_photos

    photos = load_photos()
    out = []
    for name, photo in photos.items():
        if names is not None and name not in names:
            continue
        for side in long_sides:
            if not side:
                out.append(photo.data)
                continue
            img = photo.image.convert("RGB")
            s = side / max(img.size)
            buf = io.BytesIO()
            img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BICUBIC).save(
                buf, "JPEG", quality=90
            )
            out.append(buf.getvalue())
    return out


def write_parquet_pool(out: Path, images: list[bytes], n: int, rows_per_file: int = 128) -> None:
    """``n`` images cycled from ``images`` as a Parquet pool (the binary ``image`` column jobs.curate reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True)
    cycled = [images[i % len(images)] for i in range(n)]
    for k, start in enumerate(range(0, n, rows_per_file)):
        pq.write_table(
            pa.table({"image": pa.array(cycled[start : start + rows_per_file], pa.binary())}),
            out / f"pool-{k:05d}.parquet",
        )


def curation_config(store: list[str], sz: Sizes, batch: int):
    from benchmarks.bench_full_profile import FULL, OPEN_FILTERS
    from common.config import load_config
    from curation.config import CurateConfig

    def stage(name: str, actors: tuple[int, float, float]) -> list[str]:
        n, cpus, gpus = actors
        return [
            f"stages.{name}.batch_size={batch}",
            f"stages.{name}.actors=[{n},{n}]",
            f"stages.{name}.num_cpus={cpus}",
            f"stages.{name}.num_gpus={gpus}",
        ]

    overrides = [
        # At the stage's own threshold (OPEN_FILTERS' 0.25) the random detectors pass 20 boxes on the median photo
        # (generators.random_models.calibrate_detector), none on flat ones and a few hundred at most on busy ones:
        # NMS gets a photo's worth, not all 8400 anchors. It keeps most of them (random boxes overlap little) where a
        # trained detector's collapse to the few persons a photo holds: max_det keeps that few, so the head-pose fit
        # does a real photo's work
        *store,
        *OPEN_FILTERS,
        "models.yolo.max_det=10",
        f"models.yolo.imgsz={sz.imgsz}",
        "stages.text_overlay.enabled=false",
        "stages.nsfw.enabled=false",
        "input.format=parquet",
        f"input.files_per_shard={sz.receipt_rows}",
        *stage("yolo_person", sz.yolo_actors),
        *stage("clip", sz.clip_actors),
    ]
    if sz.ray_cpus:
        overrides.append(f"ray.num_cpus={sz.ray_cpus}")
    return load_config(CurateConfig, FULL, overrides)


def run_score_phase(cfg, pool: Path, out: Path, sampler: GpuSampler) -> dict:
    """Phase 1 of the curate job over the pool. The running rate is read over the middle half of the images (from
    the result that completes a quarter of them to the one that completes three quarters), where the pipeline is
    full and not yet draining; it is left out when those results came in a burst (under a quarter of the wall
    time: a pool too small to stream, as in the smoke mode)."""
    from curation.score.phase import ScorePhase
    from curation.score.pool import Pool, list_shards
    from curation.steps.output import Output

    shards = list_shards(Pool.at(str(pool)), cfg.input)
    phase = ScorePhase(cfg, Output.at(str(out)), Pool.at(str(pool)))
    start, arrivals, rows, kept = time.monotonic(), [], 0, 0  # arrivals: (time, images done)
    for receipt in phase.build(shards).iter_rows():
        rows += receipt["rows"]
        kept += receipt["kept"]
        arrivals.append((time.monotonic(), rows))
    wall = arrivals[-1][0] - start
    t0, n0 = next(a for a in arrivals if a[1] >= rows / 4)
    t1, n1 = next(a for a in arrivals if a[1] >= 3 * rows / 4)
    steady = t1 - t0 >= wall / 4
    return {
        "images": rows,
        "kept": kept,
        "wall_s": round(wall, 2),
        "images_per_s_running": round((n1 - n0) / (t1 - t0), 1) if steady else None,
        "images_per_s_from_start": round(rows / wall, 1),
        "gpu_util_pct": sampler.mean_between(t0, t1) if steady else sampler.mean_between(start, start + wall),
        "gpu_mem_mib_max": max((m for _, _, m in sampler.samples), default=None),
    }


def time_split(cfg, images: list[bytes], batch: int) -> dict[str, float]:
    """Milliseconds per image of each piece of the two model stages' work on a batch, in this process."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    from PIL import Image
    from ultralytics.data.augment import LetterBox

    from common.imageio import decode
    from curation.stages.clip import ClipStage, clip_input
    from curation.stages.yolo import YoloPersonStage

    rows = []
    for i in range(batch):
        data = images[i % len(images)]
        with Image.open(io.BytesIO(data)) as im:
            rows.append({"image": {"bytes": data, "path": f"{i}.jpg"}, "width": im.width, "height": im.height})
    yolo, clip = YoloPersonStage(cfg), ClipStage(cfg)
    yolo.setup()
    clip.setup()
    m, repeats = cfg.models.yolo, 3

    def seconds(fn: Callable[[], object]) -> float:  # median of the repeats after a warm-up call
        return timed(fn, repeats, warmup=1)[0]

    pool = ThreadPoolExecutor(yolo.threads)  # as the stages decode: a thread pool of the stage's CPU share
    decoded = list(pool.map(lambda r: decode(r["image"]["bytes"], max_side=m.imgsz), rows))
    letterbox = LetterBox((m.imgsz, m.imgsz), auto=False, stride=32)
    yolo_host = torch.from_numpy(np.stack([letterbox(image=im) for im in decoded]))
    yolo_in = yolo_host.to(yolo.device).permute(0, 3, 1, 2).to(yolo.dtype).div_(255)

    def clip_decode() -> list:
        return list(
            pool.map(
                lambda r: clip_input(
                    r["image"]["bytes"], r["width"], r["height"], clip.size, clip.resize_mode, clip.interpolation
                ),
                rows,
            )
        )

    clip_host = torch.from_numpy(np.stack(clip_decode()))
    with torch.inference_mode():
        clip_in = ((clip_host.to(clip.device).permute(0, 3, 1, 2).float() - clip.mean) / clip.std).to(clip.dtype)
        emb = torch.nn.functional.normalize(clip.clip.model.encode_image(clip_in).float(), dim=-1)
        parts = {
            "yolo: decode (CPU threads)": seconds(
                lambda: list(pool.map(lambda r: decode(r["image"]["bytes"], max_side=m.imgsz), rows))
            ),
            "yolo: host-to-device copy": seconds(lambda: yolo_host.to(yolo.device)),
            **({"yolo: detector forward": seconds(lambda: yolo.det(yolo_in))} if yolo.det is not None else {}),
            "yolo: pose forward": seconds(lambda: yolo.pose(yolo_in)),
            "yolo: whole stage call": seconds(lambda: yolo.process_batch(rows)),
            "clip: decode + resize (CPU threads)": seconds(clip_decode),
            "clip: host-to-device copy": seconds(lambda: clip_host.to(clip.device)),
            "clip: image tower forward": seconds(lambda: clip.clip.model.encode_image(clip_in)),
            "clip: aesthetic head": seconds(lambda: clip.head(emb)),
            "clip: whole stage call": seconds(lambda: clip.process_batch(rows)),
        }
        if torch.cuda.is_available():  # what pinned host buffers would save on the copies
            for name, host, device in (("yolo", yolo_host, yolo.device), ("clip", clip_host, clip.device)):
                pinned = host.pin_memory()
                parts[f"{name}: host-to-device copy, pinned"] = seconds(
                    lambda pinned=pinned, device=device: pinned.to(device, non_blocking=True)
                )
    return {name: round(1000 * s / batch, 3) for name, s in parts.items()}


def rate(point: dict) -> float:
    return point["images_per_s_running"] or point["images_per_s_from_start"]


def part_curation(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from common.ray_utils import init_ray
    from generators.random_models import build_random_store

    with tempfile.TemporaryDirectory(prefix="gpu-check-curation-") as tmp:
        root = Path(tmp)
        images = web_sized_photos(None, sz.long_sides)
        write_parquet_pool(root / "pool", images, sz.images)
        store = build_random_store(
            root / "store", yolo=sz.yolo, clip_arch=sz.clip, clip_cfg=sz.clip_cfg, imgsz=sz.imgsz
        )
        report.set(
            pool=f"{sz.images} images cycled from {len(images)} package photos at long sides {sz.long_sides}",
            models=f"{sz.yolo} + {sz.yolo}-pose at {sz.imgsz}, OpenCLIP {sz.clip} + aesthetic MLP (random init)",
            actors=f"yolo_person {sz.yolo_actors[0]} x ({sz.yolo_actors[1]} CPU, {sz.yolo_actors[2]} GPU), "
            f"clip {sz.clip_actors[0]} x ({sz.clip_actors[1]} CPU, {sz.clip_actors[2]} GPU)",
            gpus=torch.cuda.device_count(),
        )
        init_ray(None, sz.ray_cpus)
        best, per_point_s = None, 0.0
        for batch in sz.batches:
            if deadline.left() < per_point_s + MARGIN_S:
                report.append("skipped", {"batch": batch, "why": f"{deadline.left():.0f} s left"})
                continue
            started = time.monotonic()
            with GpuSampler() as sampler:
                point = run_score_phase(
                    curation_config(store, sz, batch), root / "pool", root / f"out-{batch}", sampler
                )
            per_point_s = time.monotonic() - started
            report.append("sweep", {"batch": batch, **point})
            if best is None or rate(point) > rate(best):
                best = {"batch": batch, **point}
        if best is None:
            raise RuntimeError("no batch size of the sweep ran in the time there was")
        # the actor pools hold one GPU's worth of GPU shares, so the pipeline's rate is the rate per GPU
        report.set(best=best, images_per_s_per_gpu=rate(best))
        if deadline.left() > MARGIN_S:
            batch = best["batch"]
            report.set(ms_per_image=time_split(curation_config(store, sz, batch), images, batch), split_batch=batch)
