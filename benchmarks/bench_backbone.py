"""Forward + backward throughput of a small backbone on CPU, and what the MAE encoder saves by skipping masked tokens.

    python benchmarks/bench_backbone.py [--size tiny] [--image 256 192] [--batch 8] [--repeats 10]

Side by side in one process, each a full forward + backward (gradients of a scalar of the output):

- all tokens: the backbone on every patch of the image (what the teacher and a fine-tuning run see);
- visible only: the student encoder on the 25 % of patches a 0.75 mask leaves (``keep=``), as pretraining runs it;
- joint step: ``JointObjective`` (global views + local crops, masks, MAE decoder, DINO head, EMA teacher forward),
  forward + backward, per image of the batch.

Prints images/s and tokens/s per path and the speed-up of the visible-only encoder over the full one (close to 4x
when attention is a small part of the cost, more when it dominates). These machines are shared and noisy: compare
the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from pretrain.backbone import build, count_params, flops
from pretrain.config import PretrainConfig
from pretrain.masking import generate_masks
from pretrain.objective import JointObjective

TINY = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "tiny.yaml"


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, autograd graph caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="backbone size (pretrain/backbone.py SIZES)")
    ap.add_argument("--image", type=int, nargs=2, default=(256, 192), metavar=("H", "W"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    (h, w), b = args.image, args.batch
    model = build(args.size)
    grid = model.token_grid(h, w)
    n_tokens = grid[0] * grid[1]
    images = torch.rand(b, 3, h, w)
    keep = generate_masks(b, grid, generator=torch.Generator().manual_seed(0)).keep
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"size {args.size} ({count_params(model.cfg) / 1e6:.2f}M parameters), image {h}x{w} "
        f"({n_tokens} patches, {keep.shape[1]} visible at ratio 0.75), batch {b}"
    )

    def fwd_bwd(keep_idx: torch.Tensor | None):
        def run() -> None:
            model.zero_grad(set_to_none=True)
            out = model(images, keep_idx)
            (out.patches.float().square().mean() + out.cls.float().square().mean()).backward()

        return run

    # the tiny run's objective (small heads and decoder), on this image size
    objective = load_config(PretrainConfig, TINY, [f"objective.views.global_size=[{h},{w}]"]).objective
    joint = JointObjective(build(args.size), objective, total_steps=100)
    uint8_images = (images * 255).to(torch.uint8)

    def joint_step() -> None:
        joint.zero_grad(set_to_none=True)
        joint(uint8_images, step=10, generator=torch.Generator().manual_seed(0))["loss"].backward()

    full_s = median_s(fwd_bwd(None), args.repeats)
    visible_s = median_s(fwd_bwd(keep), args.repeats)
    joint_s = median_s(joint_step, args.repeats)
    fwd_flops = flops(model.cfg, h, w, attention=True)  # multiply-adds of one image's forward
    rows = [
        ("all tokens", full_s, n_tokens),
        ("visible only (MAE encoder)", visible_s, keep.shape[1]),
        ("joint objective step", joint_s, None),
    ]
    for name, secs, tokens in rows:
        extra = f", {b * tokens / secs:,.0f} tokens/s" if tokens else ""
        print(f"{name:<28} {1000 * secs:8.1f} ms/batch  {b / secs:7.1f} images/s{extra}")
    achieved = 2 * 3 * fwd_flops * b / full_s / 1e9
    print(
        f"all tokens: {achieved:.1f} GFLOP/s (fwd + bwd = 3x the forward's {2 * fwd_flops / 1e9:.2f} GFLOP per image)"
    )
    print(
        f"visible-only encoder speed-up over all tokens: {full_s / visible_s:.2f}x (token ratio {n_tokens / keep.shape[1]:.1f}x)"
    )


if __name__ == "__main__":
    main()
