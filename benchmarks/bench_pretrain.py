"""Step time of pretraining on Ray Train + Ray Data versus a plain single-process torch loop.

    python benchmarks/bench_pretrain.py --data out/curated/shards [--steps 40] [--warmup 10] [--workers 1]

Both train the same tiny model with the same objective and optimiser on the same images at the same size:

- plain: one process, no process group, no FSDP; the images decoded up front and held in memory as uint8
  batches, cycled; the worker's own step (``pretrain.train.Trainer.train_step``: objective, learning-rate and
  weight-decay schedules, clipping, AdamW, teacher update).
- local FSDP2: the same loop on the worker's FSDP2 model (world 1, in this process): separates what FSDP2 costs
  from what Ray Train and Ray Data cost.
- ray: ``pretrain.train.fit`` (Ray Train V2 worker group, FSDP2, Ray Data read + decode + crop tasks streaming
  from the shards, metrics and checkpointing as configured), ``--workers`` workers, timed from its own
  per-step metrics.

Steps after ``--warmup`` count. Prints median and best step times, their ratios (goal: ray / plain <= 1.15 at one
worker) and the Ray path's data-wait fraction (the share of the step spent waiting for the next batch).
Both use ``--threads`` intra-op threads per training process, so on a 2-CPU machine Ray Data has a CPU to decode on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import timed
from common.config import load_config
from common.ray_utils import init_ray
from pretrain import data
from pretrain.backbone import build
from pretrain.config import PretrainConfig
from pretrain.objective import JointObjective
from pretrain.train import Trainer, build_model, fit
from training.metrics import read_metrics
from training.runner import run_uri_for

CONFIG = Path(__file__).resolve().parents[1] / "configs/pretrain/tiny.yaml"


def in_memory_batches(cfg: PretrainConfig, shards: str, batch: int) -> list[torch.Tensor]:
    """The shards' images decoded, cropped and resized once, as uint8 [B, 3, H, W] batches."""
    stacked = data.load_images(shards, cfg.image_size)
    return [stacked[i : i + batch] for i in range(0, len(stacked) - batch + 1, batch)]


def local_loop(cfg: PretrainConfig, batches: list[torch.Tensor], steps: int, warmup: int, fsdp: bool) -> list[float]:
    """Step times of the worker's step (``pretrain.train.Trainer.train_step``) in this process: on the plain model
    or its FSDP2 form (world 1)."""
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    if fsdp:
        model = build_model(cfg, device)
    else:
        model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    trainer = Trainer(model, cfg, device)
    accum, times = cfg.optim.grad_accum, []
    for step in range(warmup + steps):
        micro_batches = [batches[(step * accum + micro) % len(batches)] for micro in range(accum)]
        times.append(timed(lambda step=step, micro_batches=micro_batches: trainer.train_step(step, micro_batches))[0])
    return times[warmup:]


def ray_loop(cfg: PretrainConfig, shards: str, warmup: int) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as root:
        run_uri = run_uri_for(root, "bench")
        Path(run_uri).mkdir(parents=True)
        data.ensure_index(shards, run_uri)
        fit(cfg, root, "bench")
        records = [r for r in read_metrics(run_uri) if r["step"] > warmup]
    return [r["step_s"] for r in records], [r["data_wait_frac"] for r in records]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="out/curated/shards", help="curated shards (the curate job's <out>/shards)")
    p.add_argument("--steps", type=int, default=40, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per training process")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="tiny config overrides")
    args = p.parse_args(argv)

    total = args.warmup + args.steps
    cfg = load_config(
        PretrainConfig,
        CONFIG,
        [
            f"steps={total}",
            "log.every=5",
            f"checkpoint.every={total}",  # one checkpoint, at the end (outside the timed steps' metrics)
            f"ray.workers={args.workers}",
            f"ray.torch_threads={args.threads}",
            *args.overrides,
        ],
    )
    torch.set_num_threads(args.threads)
    per_step = cfg.data.batch_size * args.workers  # the plain loop takes the global batch in one process
    batches = in_memory_batches(cfg, args.data, per_step)
    ray_steps: list[float] = []
    print(
        f"config: tiny, images {cfg.image_size}, global batch {cfg.samples_per_step()}, {args.steps} timed steps "
        f"after {args.warmup}, {args.threads} thread(s) per process"
    )

    # The local loops run before and after the Ray run: on a shared machine the load drifts; the two bracket it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    plain, local_fsdp = [], []
    for _ in range(2):
        plain += local_loop(cfg, batches, args.steps, args.warmup, fsdp=False)
        local_fsdp += local_loop(cfg, batches, args.steps, args.warmup, fsdp=True)
        if not ray_steps:
            init_ray(cfg.ray.address, cfg.ray.num_cpus)
            ray_steps, wait_frac = ray_loop(cfg, args.data, args.warmup)
    dist.destroy_process_group()

    rows = {
        "plain loop, one process, in-memory batches": plain,
        "same step with FSDP2 (world 1), one process, in-memory batches": local_fsdp,
        f"Ray Train + Ray Data + FSDP2, {args.workers} worker(s), streamed from the shards": ray_steps,
    }
    for label, times in rows.items():
        print(f"{label}: median {statistics.median(times) * 1000:.1f} ms/step, best {min(times) * 1000:.1f} ms/step")
    ratios = (
        ("ray / plain", ray_steps, plain),
        ("ray / local FSDP2 (Ray Train + Ray Data alone)", ray_steps, local_fsdp),
        ("local FSDP2 / plain (FSDP2 alone)", local_fsdp, plain),
    )
    for label, a, b in ratios:
        by_median, by_best = statistics.median(a) / statistics.median(b), min(a) / min(b)
        print(f"{label}: {by_median:.3f}x by median, {by_best:.3f}x by best step")
    print("goal: ray / plain <= 1.15x")
    print(f"data-wait fraction of the Ray step: {statistics.mean(wait_frac):.2%} (mean), {max(wait_frac):.2%} (max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
