"""Global dedup and balanced sampling at pool scale, on synthetic data with planted duplicates.

    python benchmarks/bench_dedup_sampling.py            # 1M hashes, 1M x 256 embeddings, k-means 1M -> 1024
    python benchmarks/bench_dedup_sampling.py --quick    # the same at about a tenth of the size
    python benchmarks/bench_dedup_sampling.py --only phash --n-hash 2000000

(a) pHash near-duplicate pairs over N random 64-bit hashes with copies planted at radius 0..10, radius 8
    (goal < 60 s for 1M); exactness and speed-up against brute force on a subset (50k), and faiss's
    IndexBinaryMultiHash (the library alternative) on a subset for comparison;
(b) embedding near-duplicate pairs over N x 256 float32 (goal < 5 min for 1M): recall of the IVF path against
    the exact search on a 100k subset (goal >= 0.95), and the share of planted copies found at full size;
(c) hierarchical k-means N x 256 into 1024 leaves and 32 top clusters (goal < 3 min for 1M), then balanced
    selection of 10% of the items.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import timed
from curation.phases.dedup.phash_bands import plan_bands
from curation.phases.reference import (
    brute_force_hash_pairs,
    build_ivf_partition,
    embedding_pairs,
    ivf_block_pairs,
    phash_pairs,
)
from curation.phases.sample.kmeans import balanced_select, hierarchical_kmeans


def pair_keys(i: np.ndarray, j: np.ndarray, n: int) -> np.ndarray:
    return np.asarray(i, np.int64) * n + np.asarray(j, np.int64)


# ----------------------------------------------------------------------------------------------------------- (a)


def planted_hashes(n: int, rng: np.random.Generator, copies: float = 0.01) -> np.ndarray:
    """Random hashes; ``copies`` of them replaced by copies of others with 0..10 bits flipped.

    A copy's source is at most 1000 positions before it, so a prefix subset holds its share of the copies.
    """
    h = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    m = int(n * copies)
    dst = rng.integers(0, n, m)
    src = (dst - rng.integers(1, 1000, m)) % n
    flips = rng.integers(0, 11, m)
    masks = np.zeros(m, np.uint64)
    for f in range(1, 11):  # distinct bit positions per copy: sample without replacement row-wise
        rows = np.flatnonzero(flips >= f)
        masks[rows] |= np.uint64(1) << rng.integers(0, 64, rows.size).astype(np.uint64)
    h[dst] = h[src] ^ masks  # collisions of bit positions make some copies closer than planned: harmless
    return h


def faiss_multihash_pairs(h: np.ndarray, radius: int) -> int:
    """The same pairs with faiss's binary multi-index hashing (3 tables, nflip = radius // 3)."""
    x = np.ascontiguousarray(h).view(np.uint8).reshape(-1, 8)
    index = faiss.IndexBinaryMultiHash(64, 3, 21)
    index.nflip = radius // 3
    index.add(x)
    lims, _, ids = index.range_search(x, radius + 1)  # faiss keeps distances < radius
    q = np.repeat(np.arange(h.size), np.diff(lims).astype(np.int64))
    return int((q < ids).sum())


def bench_phash(n: int, subset: int, faiss_n: int, threads: int, rng: np.random.Generator) -> None:
    print(f"\n(a) pHash pairs, radius 8, {n:,} hashes ({threads} threads)")
    h = planted_hashes(n, rng)
    plan = plan_bands(np.unique(h).size, 8)
    widths = ", ".join(str(b.width) for b in plan.bands)
    print(f"    plan: {len(plan.bands)} bands of {widths} bits, {plan.max_flips} flips")
    seconds, pairs = timed(lambda: phash_pairs(h, 8, threads=threads))
    print(f"    {seconds:.1f} s, {len(pairs):,} pairs (spanning set)   goal < 60 s for 1M")

    sub = h[:subset]
    t_ours, ours = timed(lambda: phash_pairs(sub, 8, spanning=False, threads=threads))
    t_brute, brute = timed(lambda: brute_force_hash_pairs(sub, 8))
    exact = np.array_equal(pair_keys(ours.i, ours.j, subset), pair_keys(brute.i, brute.j, subset))
    print(
        f"    subset {subset:,}: ours {t_ours:.2f} s, brute force {t_brute:.1f} s, ratio {t_brute / t_ours:.0f}x, "
        f"{len(brute):,} pairs, identical: {exact}"
    )
    if faiss_n:
        part = h[:faiss_n]
        t_f, n_f = timed(lambda: faiss_multihash_pairs(part, 8))
        t_o, o = timed(lambda: phash_pairs(part, 8, spanning=False, threads=threads))
        print(
            f"    subset {faiss_n:,}: faiss IndexBinaryMultiHash {t_f:.1f} s ({n_f:,} pairs) vs ours {t_o:.1f} s "
            f"({len(o):,} pairs): {t_f / t_o:.1f}x"
        )


# ----------------------------------------------------------------------------------------------------------- (b)


def planted_embeddings(n: int, d: int, rng: np.random.Generator, copies: float = 0.05) -> tuple[np.ndarray, ...]:
    """A clustered cloud (4096 centres) with ``copies`` of the items replaced by perturbed copies of others.

    Built in blocks so the peak memory stays near the output (N x D float32). A copy's source is at most 1000
    positions before it, so a prefix subset holds its share of the copies. Returns x, copy, source.
    """
    centres = rng.standard_normal((4096, d)).astype(np.float32)
    x = np.empty((n, d), np.float32)
    for start in range(0, n, 65536):
        stop = min(n, start + 65536)
        block = centres[rng.integers(0, 4096, stop - start)]
        block += rng.standard_normal(block.shape, dtype=np.float32)  # same-centre items: cosine about 0.5
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        x[start:stop] = block
    m = int(n * copies)
    dst = rng.choice(n, m, replace=False)
    src = (dst - rng.integers(1, 1000, m)) % n
    for start in range(0, m, 65536):
        d_, s_ = dst[start : start + 65536], src[start : start + 65536]
        noise = rng.standard_normal((d_.size, d), dtype=np.float32)
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        y = x[s_] + rng.uniform(0.05, 0.45, (d_.size, 1)).astype(np.float32) * noise  # cosine 0.9..0.999
        x[d_] = y / np.linalg.norm(y, axis=1, keepdims=True)
    return x, dst, src


def bench_embeddings(n: int, d: int, subset: int, rng: np.random.Generator) -> None:
    print(f"\n(b) embedding pairs, cosine >= 0.95, k = 10, {n:,} x {d}")
    x, dst, src = planted_embeddings(n, d, rng)

    xs = x[:subset]
    t_exact, exact = timed(lambda: embedding_pairs(xs, 0.95, 10, flat_max=subset))
    t_ivf, approx = timed(lambda: embedding_pairs(xs, 0.95, 10, flat_max=0))
    recall = np.isin(pair_keys(exact.i, exact.j, subset), pair_keys(approx.i, approx.j, subset)).mean()
    print(
        f"    subset {subset:,}: exact (flat) {t_exact:.1f} s {len(exact):,} pairs; IVF {t_ivf:.1f} s "
        f"{len(approx):,} pairs; recall {recall:.4f}   goal >= 0.95"
    )

    t_part, part = timed(lambda: build_ivf_partition(x, None, lists_per_item=2))
    t_search, found = timed(lambda: ivf_block_pairs(x, part, range(part.nlist), 10, 0.95))
    sizes = np.diff(part.offsets)
    print(
        f"    full {n:,}: IVF with {part.nlist} lists (sizes {sizes.min()}..{sizes.max()}), 2 lists per item: "
        f"k-means + assign {t_part:.1f} s, search {t_search:.1f} s, total {t_part + t_search:.1f} s   "
        f"goal < 300 s for 1M"
    )
    # recall at full size on the planted copies whose exact similarity clears the threshold
    sim = np.sum(x[dst] * x[src], axis=1)
    lo, hi = np.minimum(dst, src), np.maximum(dst, src)
    planted = np.unique(pair_keys(lo, hi, n)[sim >= 0.95])
    found_keys = np.unique(pair_keys(found[0], found[1], n))
    # a planted copy can also be crowded out of the k = 10 list by 10 closer items: rare, counted as missed
    share = np.isin(planted, found_keys).mean()
    print(f"    planted copies >= 0.95 found at full size: {share:.4f} of {planted.size:,}")


# ----------------------------------------------------------------------------------------------------------- (c)


def bench_kmeans(n: int, d: int, k1: int, k2: int, rng: np.random.Generator) -> None:
    print(f"\n(c) hierarchical k-means {n:,} x {d} -> {k1} leaves -> {k2} top clusters, then 10% balanced")
    x, _, _ = planted_embeddings(n, d, rng, copies=0.0)
    t_h, h = timed(lambda: hierarchical_kmeans(x, (k1, k2), seed=0))
    levels = [c.shape[0] for c in h.centroids]
    print(f"    every fit of the tree (levels {levels}, top-down) in {t_h:.1f} s   goal < 180 s for 1M into 1024")
    t_sel, sel = timed(lambda: balanced_select(h, n // 10, seed=0))
    leaf_sizes = h.sizes(0)
    print(f"    selection of {sel.size:,} in {t_sel:.2f} s; leaf sizes {leaf_sizes.min()}..{leaf_sizes.max()}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about a tenth of the default sizes")
    ap.add_argument("--only", choices=("phash", "embedding", "kmeans"), action="append")
    ap.add_argument("--n-hash", type=int)
    ap.add_argument("--hash-subset", type=int)
    ap.add_argument("--faiss-subset", type=int, help="hashes for the faiss comparison (0: skip)")
    ap.add_argument("--n-emb", type=int)
    ap.add_argument("--emb-subset", type=int)
    ap.add_argument("--n-kmeans", type=int)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--k1", type=int, default=1024)
    ap.add_argument("--k2", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    scale = 10 if args.quick else 1
    n_hash = args.n_hash or 1_000_000 // scale
    hash_subset = args.hash_subset or 50_000 // scale
    faiss_subset = 200_000 // scale if args.faiss_subset is None else args.faiss_subset
    n_emb = args.n_emb or 1_000_000 // scale
    emb_subset = args.emb_subset or 100_000 // scale
    n_km = args.n_kmeans or 1_000_000 // scale
    k1 = args.k1 if not args.quick else args.k1 // 4

    faiss.omp_set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, faiss {faiss.__version__}, "
        f"numpy {np.__version__}, threads {args.threads}"
    )
    rng = np.random.default_rng(args.seed)
    parts = args.only or ["phash", "embedding", "kmeans"]
    if "phash" in parts:
        bench_phash(n_hash, min(hash_subset, n_hash), min(faiss_subset, n_hash), args.threads, rng)
    if "embedding" in parts:
        bench_embeddings(n_emb, args.dim, min(emb_subset, n_emb), rng)
    if "kmeans" in parts:
        bench_kmeans(n_km, args.dim, k1, args.k2, rng)


if __name__ == "__main__":
    main()
