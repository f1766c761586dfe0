"""Part ``data_wait``: the pretraining step streaming lite-curated shards through Ray Data in a Ray Train run, at
part ``pretrain``'s fastest setting: the share of the step spent waiting for the next batch; where it is over the
goal, measured again with a wider decode path (``Sizes.data_paths``: smaller read tasks, so more of them run at
once, and a deeper prefetch)."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.gpu.curation_throughput import web_sized_photos
from benchmarks.gpu.harness import REPO, Deadline, PartReport
from benchmarks.gpu.pretrain_step import pretrain_config, setting_overrides
from benchmarks.gpu.sizes import Sizes

PERSON_PHOTOS = ("bus", "zidane", "grace_hopper", "astronaut")  # kept by the lite profile


def pool_photos(sz: Sizes, at_least: int) -> list[bytes]:
    """The person photos at each web size of ``sz``, and, where that is fewer than ``at_least``, more copies of them
    re-encoded at lower JPEG qualities (other bytes, the same picture): a pool that holds a few global batches."""
    import io

    from PIL import Image

    base = web_sized_photos(PERSON_PHOTOS[: sz.data_photos], sz.data_sizes)
    out = list(base)
    for copy in range(1, math.ceil(at_least / len(base))):
        for data in base:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).convert("RGB").save(buf, "JPEG", quality=92 - 4 * copy)
            out.append(buf.getvalue())
    return out


def curate_for_training(root: Path, sz: Sizes, at_least: int) -> Path:
    """Curated shards the way the README makes them: the lite profile's curate job over a folder pool of at least
    ``at_least`` person photos at web sizes (pHash / embedding dedup off: the resized copies are the pool)."""
    from jobs import curate

    pool = root / "pool"
    pool.mkdir()
    for i, data in enumerate(pool_photos(sz, at_least)):
        (pool / f"{i:05d}.jpg").write_bytes(data)
    out = root / "curated"
    args = [
        "--config",
        str(REPO / "configs/curate/lite.yaml"),
        "--input",
        str(pool),
        "--output",
        str(out),
        "dedup.links=[]",
        "stages.text_overlay.enabled=false",
        "stages.nsfw.enabled=false",
    ]
    if sz.ray_cpus:
        args.append(f"ray.num_cpus={sz.ray_cpus}")
    if curate.main(args) != 0:
        raise RuntimeError("the curate job failed (its log says why)")
    return out / "shards"


def run_figures(run_uri: str, warmup: int, steps: int) -> dict | None:
    """The data wait and step figures of a run from its metrics past ``warmup``; None until step ``steps`` is in."""
    from training.metrics import read_metrics

    try:
        records = [r for r in read_metrics(run_uri) if r["step"] > warmup]
    except (OSError, ValueError):
        return None
    if not records or records[-1]["step"] < steps:
        return None
    records = [r for r in records if r["step"] <= steps]  # the steps after carry an async save (save_figures)
    frac = [r["data_wait_frac"] for r in records]
    return {
        "data_wait_frac_mean": round(statistics.mean(frac), 4),
        "data_wait_frac_max": round(max(frac), 4),
        "step_s": round(statistics.median(r["step_s"] for r in records), 4),
        "images_per_s": round(statistics.median(r["images_per_s"] for r in records), 2),
        "mfu": round(statistics.median(r["mfu"] for r in records), 4) if all("mfu" in r for r in records) else None,
        "windows": len(records),
    }


def save_figures(run_uri: str, steps: int, save_steps: int) -> dict | None:
    """Step time over the ``save_steps`` steps after the async checkpoint of step ``steps`` started, and that save's
    seconds (``stage_s`` on the step path, ``write_s`` beside it) and commit step, from the run's metrics; None until
    the last of those steps is in."""
    from training.metrics import read_metrics

    try:
        train = [r for r in read_metrics(run_uri) if r["step"] > steps]
        saved = next((r for r in read_metrics(run_uri, "checkpoint") if r["step"] == steps), None)
    except (OSError, ValueError):
        return None
    if not train or train[-1]["step"] < steps + save_steps:
        return None
    return {
        "step_s_during_async_save": round(statistics.median(r["step_s"] for r in train), 4),
        "async_save": {k: round(saved[k], 2) for k in ("stage_s", "write_s", "summary_s")} if saved else None,
        "async_save_committed_at": saved["at_step"] if saved else None,
    }


def measure_path(
    cfg, root: Path, name: str, shards: Path, path: tuple[str, ...], sz: Sizes, report: PartReport, last: bool
) -> None:
    """One training run (``name``, under ``root/runs``) of ``shards`` on decode path ``path``, its figures appended to the report's ``runs`` (the lowest wait's
    also at the top level). Where no other path is to follow (``last``, or the wait within the goal) the part ends
    at the run's last metrics line: its final checkpoint (GBs for 0.4B) is not waited for. The run's last
    ``sz.save_steps`` steps follow an async checkpoint of step ``data_warmup + data_steps`` (``save_figures``)."""
    from pretrain import data
    from pretrain.train import fit
    from training.runner import run_uri_for

    run_uri = run_uri_for(str(root / "runs"), name)
    Path(run_uri).mkdir(parents=True)
    index = data.ensure_index(str(shards), run_uri)
    report.set(shards_images=index.num_samples, batch=cfg.data.batch_size)
    steps = sz.data_warmup + sz.data_steps  # the timed ones; the run goes on sz.save_steps more
    seen = threading.Event()

    def watch() -> None:
        while (row := run_figures(run_uri, sz.data_warmup, steps)) is None:
            time.sleep(0.5)
        while (during := save_figures(run_uri, steps, sz.save_steps)) is None:
            time.sleep(0.5)
        report.append("runs", {"decode_path": list(path), **row, **during})
        best = min(report.data["runs"], key=lambda r: r["data_wait_frac_mean"])
        report.set(**{k: v for k, v in best.items() if k != "decode_path"}, best_decode_path=best["decode_path"])
        if last or row["data_wait_frac_mean"] <= sz.data_wait_retry_above:
            report.set(status="ok")
            shutil.rmtree(root, ignore_errors=True)
            os._exit(0)
        seen.set()

    threading.Thread(target=watch, daemon=True).start()
    fit(cfg, str(root / "runs"), name)
    if not seen.wait(30):  # the watcher reads the run's last metrics line
        raise RuntimeError(f"the training run {name} ended without metrics past its warm-up")


def part_data_wait(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    """A training run per decode path of ``sz.data_paths`` in order, the next only while the wait is over
    ``sz.data_wait_retry_above`` and time is left."""
    import torch

    from common.ray_utils import init_ray

    setting = context.get("setting") or {axis: values[0] for axis, values in sz.pretrain_sweep.items()}
    steps = sz.data_warmup + sz.data_steps
    base = [  # after the timed steps an async checkpoint and the steps that go on while it is written
        f"steps={steps + sz.save_steps}",
        f"checkpoint.every={steps}",
        "checkpoint.async_save=true",
        "checkpoint.on_preemption=false",
        f"ray.use_gpu={str(torch.cuda.is_available()).lower()}",
        *setting_overrides(setting),
        *sz.data_overrides,
        *([f"ray.num_cpus={sz.ray_cpus}"] if sz.ray_cpus else []),
    ]
    cfg = pretrain_config(sz, context, *base)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    try:
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        # two global batches at the setting's batch: what the lite curation drops leaves one at least
        shards = curate_for_training(root, sz, at_least=2 * cfg.data.batch_size)
        report.set(setting=setting, image=list(cfg.image_size), warmup_steps=sz.data_warmup)
        for i, path in enumerate(sz.data_paths):
            if i and deadline.left() < 60:
                report.append("skipped", {"decode_path": list(path), "why": f"{deadline.left():.0f} s left"})
                break
            cfg = pretrain_config(sz, context, *base, *path)
            last = i == len(sz.data_paths) - 1
            measure_path(cfg, root, f"gpu-check-{i}", shards, path, sz, report, last)
    finally:
        shutil.rmtree(root, ignore_errors=True)
