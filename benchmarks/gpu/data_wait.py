"""Part ``data_wait``: the pretraining step streaming lite-curated shards through Ray Data in a Ray Train run, at
part ``pretrain``'s fastest setting: the share of the step spent waiting for the next batch."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.gpu.curation_throughput import web_sized_photos
from benchmarks.gpu.harness import REPO, Deadline, PartReport
from benchmarks.gpu.pretrain_step import pretrain_config
from benchmarks.gpu.sizes import Sizes

PERSON_PHOTOS = ("bus", "zidane", "grace_hopper", "astronaut")  # kept by the lite profile


def curate_for_training(root: Path, sz: Sizes) -> Path:
    """Curated shards the way the README makes them: the lite profile's curate job over a folder pool of person
    photos at web sizes (pHash / embedding dedup off: the resized copies are the pool)."""
    from jobs import curate

    pool = root / "pool"
    pool.mkdir()
    for i, data in enumerate(web_sized_photos(PERSON_PHOTOS[: sz.data_photos], sz.data_sizes)):
        (pool / f"{i:05d}.jpg").write_bytes(data)
    out = root / "curated"
    args = [
        "--config",
        str(REPO / "configs/curate/lite.yaml"),
        "--input",
        str(pool),
        "--output",
        str(out),
        "dedup.signals=[]",
        "stages.text_overlay.enabled=false",
    ]
    if sz.ray_cpus:
        args.append(f"ray.num_cpus={sz.ray_cpus}")
    if curate.main(args) != 0:
        raise RuntimeError("the curate job failed (its log says why)")
    return out / "shards"


def part_data_wait(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from common.ray_utils import init_ray
    from pretrain import data
    from pretrain.train import fit
    from training.metrics import read_metrics
    from training.runner import run_uri_for

    setting = context.get("setting") or {"compile": False, "activation_checkpointing": True}
    steps = sz.data_warmup + sz.data_steps
    gpu = torch.cuda.is_available()
    cfg = pretrain_config(
        sz,
        context,
        f"steps={steps}",
        f"checkpoint.every={steps}",
        "checkpoint.on_preemption=false",
        f"ray.use_gpu={str(gpu).lower()}",
        f"model.compile={str(setting['compile']).lower()}",
        f"model.activation_checkpointing={str(setting['activation_checkpointing']).lower()}",
        *sz.data_overrides,
        *([f"ray.num_cpus={sz.ray_cpus}"] if sz.ray_cpus else []),
    )
    root = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    try:
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        shards = curate_for_training(root, sz)
        run_uri = run_uri_for(str(root / "runs"), "gpu-check")
        Path(run_uri).mkdir(parents=True)
        index = data.ensure_index(str(shards), run_uri)
        report.set(
            setting=setting,
            shards_images=index.num_samples,
            batch=cfg.data.batch_size,
            image=list(cfg.image_size),
            warmup_steps=sz.data_warmup,
        )

        def measured() -> bool:
            try:
                records = [r for r in read_metrics(run_uri) if r["step"] > sz.data_warmup]
            except (OSError, ValueError):
                return False
            if not records or records[-1]["step"] < steps:
                return False
            frac = [r["data_wait_frac"] for r in records]
            report.set(
                data_wait_frac_mean=round(statistics.mean(frac), 4),
                data_wait_frac_max=round(max(frac), 4),
                step_s=round(statistics.median(r["step_s"] for r in records), 4),
                images_per_s=round(statistics.median(r["images_per_s"] for r in records), 2),
                mfu=round(statistics.median(r["mfu"] for r in records), 4)
                if all("mfu" in r for r in records)
                else None,
                windows=len(records),
            )
            return True

        def watch() -> None:
            # The run's last metrics line is the measurement: its final checkpoint (GBs for 0.4B) is not waited for.
            while not measured():
                time.sleep(0.5)
            report.set(status="ok")
            shutil.rmtree(root, ignore_errors=True)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
        fit(cfg, str(root / "runs"), "gpu-check")
        if not measured():
            raise RuntimeError("the training run ended without metrics past its warm-up")
    finally:
        shutil.rmtree(root, ignore_errors=True)
