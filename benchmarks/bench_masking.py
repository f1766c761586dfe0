"""Mask generation for a pretraining batch: the batched generator against a per-sample Python loop.

    python benchmarks/bench_masking.py [--batch 256] [--grid 64 48] [--repeats 30]

Batch 256 on the 64x48 grid (1024x768 images, patch 16), ratio 0.75, block probability 0.4 (goal <= 5 ms on
CPU). The reference is the sequential generator of BEiT / DINOv2 (blocks placed one at a time, each accepted only
if it does not overshoot; block writes as numpy slices rather than their per-patch loops), one sample at a time,
with a random top-up to the exact count, and ``rng.permutation`` for the patchwise samples. Both run side by side
in one process; compare the ratio, these machines are shared and noisy. Also prints the statistics both produce.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import numpy as np
import torch

from pretrain.masking import MaskingConfig, generate_masks, num_masked


def reference_masks(batch: int, grid: tuple[int, int], cfg: MaskingConfig, rng: np.random.Generator) -> np.ndarray:
    gh, gw = grid
    n = gh * gw
    n_mask = num_masked(n, cfg.ratio)
    max_area = max(cfg.min_block_patches, cfg.max_block_frac * n)
    log_lo, log_hi = math.log(cfg.aspect[0]), math.log(cfg.aspect[1])
    out = np.zeros((batch, n), dtype=bool)
    for i in range(batch):
        if rng.random() >= cfg.block_prob:
            out[i, rng.permutation(n)[:n_mask]] = True
            continue
        mask = np.zeros((gh, gw), dtype=bool)
        count = 0
        while count < n_mask:
            budget = min(n_mask - count, max_area)
            delta = 0
            for _ in range(10):  # attempts per block, as in BEiT / DINOv2
                area = rng.uniform(cfg.min_block_patches, max(budget, cfg.min_block_patches))
                aspect = math.exp(rng.uniform(log_lo, log_hi))
                h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
                if 1 <= h < gh and 1 <= w < gw:
                    top, left = rng.integers(0, gh - h + 1), rng.integers(0, gw - w + 1)
                    block = mask[top : top + h, left : left + w]
                    new = h * w - int(block.sum())
                    if 0 < new <= budget:
                        block[:] = True
                        delta = new
                        break
            if delta == 0:
                break
            count += delta
        flat = mask.reshape(-1)
        if count < n_mask:
            flat[rng.choice(np.flatnonzero(~flat), n_mask - count, replace=False)] = True
        out[i] = flat
    return out


def timings_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, best) wall-clock milliseconds over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), min(times)


def neighbours_masked(mask: np.ndarray, grid: tuple[int, int]) -> float:
    m = mask.reshape(-1, *grid).astype(np.float32)
    inner = m[:, 1:-1, 1:-1]
    around = m[:, :-2, 1:-1] * m[:, 2:, 1:-1] * m[:, 1:-1, :-2] * m[:, 1:-1, 2:]
    return float(((inner * around).sum((1, 2)) / inner.sum((1, 2))).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--grid", type=int, nargs=2, default=(64, 48))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    grid = tuple(args.grid)
    cfg = MaskingConfig()
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"batch {args.batch}, grid {grid[0]}x{grid[1]}, ratio {cfg.ratio}, block prob {cfg.block_prob}")

    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    rows = []
    for n_threads in sorted({1, threads}):
        torch.set_num_threads(n_threads)
        timing = timings_ms(lambda: generate_masks(args.batch, grid, cfg, generator=gen), args.repeats)
        rows.append((f"batched, {n_threads} thread(s)", timing))
    torch.set_num_threads(threads)
    ref = timings_ms(lambda: reference_masks(args.batch, grid, cfg, rng), max(3, args.repeats // 3))
    rows.append(("per-sample loop", ref))
    if torch.cuda.is_available():
        cuda_gen = torch.Generator("cuda").manual_seed(0)

        def on_gpu() -> None:
            generate_masks(args.batch, grid, cfg, generator=cuda_gen)
            torch.cuda.synchronize()

        rows.append((f"batched, {torch.cuda.get_device_name()}", timings_ms(on_gpu, args.repeats)))
    print(f"{'':28s} {'median ms':>10s} {'best ms':>10s} {'loop / this (median)':>22s}   goal <= 5 ms")
    for name, (median, best) in rows:
        print(f"{name:28s} {median:10.2f} {best:10.2f} {ref[0] / median:22.1f}")

    big = 4096
    ours_m = generate_masks(big, grid, cfg, generator=gen)
    ref_m = reference_masks(big // 4, grid, cfg, rng)
    block = ours_m.blockwise.numpy()
    mask = ours_m.mask.numpy()
    print(f"statistics over {big} masks (reference: {big // 4}):")
    ours, theirs = (", ".join(map(str, sorted(set(m.sum(1).tolist())))) for m in (mask, ref_m))
    print(f"  masked per image: {ours} (reference {theirs})")
    print(f"  blockwise share: {block.mean():.3f}")
    print(
        f"  masked patches with 4 masked neighbours: blockwise {neighbours_masked(mask[block], grid):.3f}, "
        f"patchwise {neighbours_masked(mask[~block], grid):.3f}, all {neighbours_masked(mask, grid):.3f} "
        f"(reference all {neighbours_masked(ref_m, grid):.3f})"
    )


if __name__ == "__main__":
    main()
