"""Single-process reference implementations of dedup and balanced sampling, over arrays that fit one machine.

The distributed phases (``curation.phases.dedup``, ``curation.phases.sample``) never call these: tests check the
phases' decisions against them, and the benchmarks time the kernels through them. Both are built from the same
kernels the phases run (``dedup.phash_bands``, ``dedup.embedding_clusters.threshold_neighbours``,
``sample.kmeans``), so a reference and a phase differ only in how the work is partitioned.

- ``phash_pairs``: every pair of items whose 64-bit pHashes are within Hamming radius ``r`` (exact), by
  multi-index hashing over bit bands; ``brute_force_hash_pairs`` checks it.
- ``embedding_pairs``: pairs of L2-normalised embeddings with cosine similarity >= a threshold among each item's
  ``k`` nearest neighbours: exact (flat inner product) for small N, an inverted file searched cluster by cluster
  above ``flat_max``.
- ``balanced_sample``: hierarchical k-means (top-down, every fit of the tree in turn) then balanced selection, in
  one process; given the phase's training keys (``train_key``), the phase's selection exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup.embedding_clusters import threshold_neighbours
from curation.phases.dedup.phash_bands import (
    ExactGroups,
    HashTask,
    as_hashes,
    band_pairs,
    build_band_table,
    collapse_exact,
    expand_blocks,
    plan_bands,
    popcount64,
)
from curation.phases.sample.kmeans import ClusterHierarchy, Mode, balanced_select, hierarchical_kmeans, target_size


@dataclass(frozen=True)
class HashPairs:
    """Near-duplicate pairs from pHashes: item indices with ``i < j`` and their Hamming distance."""

    i: np.ndarray  # int64
    j: np.ndarray  # int64
    distance: np.ndarray  # uint8

    def __len__(self) -> int:
        return int(self.i.size)


def pairs_from_unique(
    groups: ExactGroups, u: np.ndarray, v: np.ndarray, dist: np.ndarray, *, spanning: bool = True
) -> HashPairs:
    """Turn pairs of distinct hashes back into pairs of items.

    ``spanning=True`` (the default) never lists a clique of exact duplicates: every item whose hash occurs more
    than once is linked to the first item with that hash (a star, distance 0), and a pair of distinct hashes
    links only those first items. The list is then a spanning set: it connects exactly the items brute force
    connects (same components), with O(N) pairs for a hash repeated N times. ``spanning=False`` lists every pair
    of items within the radius, identical to brute force (quadratic in the size of duplicate groups).
    """
    if spanning:
        members = np.flatnonzero(groups.first[groups.inverse] != np.arange(groups.inverse.size))
        star_i = groups.first[groups.inverse[members]]
        star_j = members
        near_i, near_j = groups.first[u], groups.first[v]
        i = np.concatenate([star_i, np.minimum(near_i, near_j)])
        j = np.concatenate([star_j, np.maximum(near_i, near_j)])
        d = np.concatenate([np.zeros(star_i.size, np.uint8), dist.astype(np.uint8)])
        return _sorted_pairs(i, j, d)
    order = np.argsort(groups.inverse, kind="stable")
    counts = np.bincount(groups.inverse, minlength=groups.unique.size)
    starts = np.cumsum(counts) - counts
    # within each group of identical hashes: every pair of its items
    same_a, same_b = expand_blocks(starts, counts, starts, counts)
    upper = same_a < same_b
    ia, ib = order[same_a[upper]], order[same_b[upper]]
    # across a near pair of distinct hashes: every item of one with every item of the other
    xa, xb = expand_blocks(starts[u], counts[u], starts[v], counts[v])
    dx = np.repeat(dist.astype(np.uint8), counts[u] * counts[v])
    ja, jb = order[xa], order[xb]
    i = np.concatenate([np.minimum(ia, ib), np.minimum(ja, jb)])
    j = np.concatenate([np.maximum(ia, ib), np.maximum(ja, jb)])
    d = np.concatenate([np.zeros(ia.size, np.uint8), dx])
    return _sorted_pairs(i, j, d)


def _sorted_pairs(i: np.ndarray, j: np.ndarray, d: np.ndarray) -> HashPairs:
    order = np.lexsort((j, i))
    return HashPairs(i[order].astype(np.int64), j[order].astype(np.int64), d[order])


def phash_pairs(
    hashes: np.ndarray,
    radius: int = 8,
    *,
    spanning: bool = True,
    n_bands: int | None = None,
    threads: int = 1,
) -> HashPairs:
    """Every pair of items whose pHashes differ in at most ``radius`` bits (exact; single process).

    ``hashes`` is the ``phash`` column as uint64 (rows without a hash must be left out by the caller). See
    ``pairs_from_unique`` for ``spanning``. ``threads`` runs the band/mask tasks in a thread pool (numpy
    releases the GIL in the heavy loops). To distribute instead: ``collapse_exact`` once, ``plan_bands``,
    then one ``band_pairs`` per ``plan.tasks(k)`` entry anywhere, and ``pairs_from_unique`` on the union.
    """
    groups = collapse_exact(hashes)
    if radius == 0 or groups.unique.size < 2:  # distinct hashes are never within radius 0 of each other
        empty = np.empty(0, np.int64)
        return pairs_from_unique(groups, empty, empty, np.empty(0, np.uint8), spanning=spanning)
    plan = plan_bands(groups.unique.size, radius, n_bands)
    tables = [build_band_table(groups.unique, band) for band in plan.bands]
    tasks = plan.tasks(splits_per_band=max(1, threads) * 2 if threads > 1 else 1)

    def run(task: HashTask):
        return band_pairs(
            groups.unique, plan, task.band_index, (task.mask_start, task.mask_stop), tables[task.band_index]
        )

    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(run, tasks))
    else:
        results = [run(t) for t in tasks]
    u, v, d = (np.concatenate(parts) for parts in zip(*results))
    return pairs_from_unique(groups, u, v, d, spanning=spanning)


def brute_force_hash_pairs(hashes: np.ndarray, radius: int, block_elements: int = 1 << 24) -> HashPairs:
    """All pairs within ``radius`` by comparing every pair (O(N^2)): the reference for tests and benchmarks."""
    h = as_hashes(hashes)
    block = max(1, block_elements // max(h.size, 1))  # rows per step: about 128 MiB of XORs
    out_i, out_j, out_d = [], [], []
    for start in range(0, h.size, block):
        rows = h[start : start + block]
        dist = popcount64(rows[:, None] ^ h[None, start:])  # only columns >= start: the upper triangle
        ri, cj = np.nonzero(dist <= radius)
        gi, gj = ri + start, cj + start
        upper = gi < gj
        out_i.append(gi[upper])
        out_j.append(gj[upper])
        out_d.append(dist[ri[upper], cj[upper]])
    return _sorted_pairs(np.concatenate(out_i), np.concatenate(out_j), np.concatenate(out_d))


@dataclass(frozen=True)
class EmbeddingPairs:
    """Near-duplicate pairs from embeddings: ``i < j``, their cosine similarity and the search used."""

    i: np.ndarray  # int64
    j: np.ndarray  # int64
    similarity: np.ndarray  # float32
    method: str  # "flat" (exact) or "ivf" (approximate)

    def __len__(self) -> int:
        return int(self.i.size)


def unique_embedding_pairs(i: np.ndarray, j: np.ndarray, s: np.ndarray, n: int, method: str) -> EmbeddingPairs:
    """Pairs found from both ends (or from two probed lists) listed once."""
    if i.size == 0:
        return EmbeddingPairs(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32), method)
    key = i.astype(np.int64) * n + j
    key, first = np.unique(key, return_index=True)
    return EmbeddingPairs(key // n, key % n, s[first].astype(np.float32), method)


def flat_pairs(
    x: np.ndarray, k: int, threshold: float, query_block: int = 16384
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact k-NN pairs by brute-force inner product (faiss uses BLAS for it)."""
    import faiss

    out = []
    kk = min(k + 1, x.shape[0])
    for start in range(0, x.shape[0], query_block):
        q = np.arange(start, min(start + query_block, x.shape[0]))
        sims, ids = faiss.knn(x[q], x, kk, metric=faiss.METRIC_INNER_PRODUCT)
        out.append(threshold_neighbours(q, sims, ids, k, threshold))
    i, j, s = (np.concatenate(parts) for parts in zip(*out))
    return i, j, s


@dataclass(frozen=True)
class IvfPartition:
    """An inverted file over the embeddings in which every item joins its ``lists_per_item`` nearest lists.

    The search then runs list by list: the members of a list against each other, as dense inner products on
    BLAS. Two items are compared when they share a list, i.e. when one of either's nearest lists is among the
    other's; near duplicates, being close, almost always do (with 2 lists per item, 99.7% of the planted pairs at
    cosine >= 0.95 of the benchmark's 256-d cloud share a list; 3 lists: 99.97%).

    Why not faiss's IndexIVFFlat: its search scans the probed lists query by query, which is memory bound; for
    the all-items self-join at 100k x 256 it was about 10x slower here than the list-by-list products. Probing
    the lists nearest a list's centroid (instead of each item's own nearest lists) was tried too: its recall
    levels off near 0.97 on diffuse high-dimensional embeddings, whatever the number of probes.
    """

    centroids: np.ndarray  # (nlist, D) float32
    order: np.ndarray  # item ids grouped by list; an item appears once per list it joins
    offsets: np.ndarray  # list l holds order[offsets[l] : offsets[l + 1]]

    @property
    def nlist(self) -> int:
        return int(self.centroids.shape[0])

    def members(self, lst: int) -> np.ndarray:
        return self.order[self.offsets[lst] : self.offsets[lst + 1]]


def default_nlist(n: int) -> int:
    """About 2 sqrt(N) lists: lists of a few hundred items keep the per-list products BLAS-sized."""
    return int(max(1, min(n // 32, round(2 * math.sqrt(n)))))


def build_ivf_partition(
    x: np.ndarray,
    nlist: int | None = None,
    lists_per_item: int = 2,
    *,
    seed: int = 0,
    n_iter: int = 10,
    max_points_per_centroid: int = 64,
) -> IvfPartition:
    """Train the coarse k-means (faiss, on a sample of ``max_points_per_centroid`` per list) and assign all."""
    import faiss

    n, d = x.shape
    nlist = min(nlist or default_nlist(n), n)
    km = faiss.Kmeans(
        d,
        nlist,
        niter=n_iter,
        seed=seed,
        max_points_per_centroid=max_points_per_centroid,
        min_points_per_centroid=1,  # small lists are fine here; silences faiss's sample-size warning
    )
    km.train(x)
    assert km.centroids is not None  # train() sets them
    _, assign = km.index.search(x, min(lists_per_item, nlist))
    item = np.repeat(np.arange(n), assign.shape[1])
    lst = assign.ravel()
    order = np.argsort(lst, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(lst, minlength=nlist))])
    return IvfPartition(km.centroids, item[order], offsets)


def _top_k_within(x: np.ndarray, ids: np.ndarray, kk: int, max_candidates: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``kk`` inner products of every item of ``ids`` among ``ids`` (positions into ``ids``).

    Beyond ``max_candidates`` (a list made huge by many identical embeddings) the candidates are searched in
    pieces and merged with faiss's ResultHeap, so memory stays bounded.
    """
    import faiss

    xq = x[ids]
    if ids.size <= max_candidates:
        return faiss.knn(xq, xq, kk, metric=faiss.METRIC_INNER_PRODUCT)
    heap = faiss.ResultHeap(ids.size, kk, keep_max=True)
    for start in range(0, ids.size, max_candidates):
        piece = xq[start : start + max_candidates]
        sims, pos = faiss.knn(xq, piece, min(kk, piece.shape[0]), metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(sims, pos + start)
    heap.finalize()
    return heap.D, heap.I


def ivf_block_pairs(
    x: np.ndarray,
    part: IvfPartition,
    lists: Sequence[int] | np.ndarray,
    k: int,
    threshold: float,
    max_candidates: int = 1 << 17,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs found inside the given lists (the distributable unit: a range of lists).

    Each member keeps its ``k`` nearest co-members at >= ``threshold``; an item in several lists may so get up
    to ``lists_per_item * k`` neighbours, and a pair found in two lists is listed twice (``embedding_pairs``
    removes repeats).
    """
    out_i, out_j, out_s = [], [], []
    for lst in lists:
        members = part.members(int(lst))
        if members.size < 2:
            continue
        sims, pos = _top_k_within(x, members, min(k + 1, members.size), max_candidates)
        ids = np.where(pos >= 0, members[np.maximum(pos, 0)], -1)
        i, j, s = threshold_neighbours(members, sims, ids, k, threshold)
        out_i.append(i)
        out_j.append(j)
        out_s.append(s)
    if not out_i:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)
    return np.concatenate(out_i), np.concatenate(out_j), np.concatenate(out_s)


def embedding_pairs(
    x: np.ndarray,
    threshold: float = 0.95,
    k: int = 10,
    *,
    flat_max: int = 50_000,
    nlist: int | None = None,
    lists_per_item: int = 2,
    seed: int = 0,
) -> EmbeddingPairs:
    """Pairs (i < j) with cosine similarity >= ``threshold`` among each item's ``k`` nearest neighbours.

    ``x`` holds L2-normalised float32 embeddings (N x D). Up to ``flat_max`` items the search is exact; above,
    the inverted file of ``build_ivf_partition`` is used (``nlist`` lists, default about 2 sqrt(N); each item
    in its ``lists_per_item`` nearest), whose recall against the exact search the tests and the benchmark
    measure. Similarities of returned pairs are always exact. To distribute the IVF path: build the partition
    once, then ``ivf_block_pairs`` over ranges of lists anywhere, and ``unique_embedding_pairs`` on the union.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    if n < 2:
        return unique_embedding_pairs(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32), n, "flat")
    if n <= flat_max:
        return unique_embedding_pairs(*flat_pairs(x, k, threshold), n, "flat")
    part = build_ivf_partition(x, nlist, lists_per_item, seed=seed)
    return unique_embedding_pairs(*ivf_block_pairs(x, part, range(part.nlist), k, threshold), n, "ivf")


@dataclass(frozen=True)
class Selection:
    """Selected item indices (sorted) and the hierarchy they were drawn from (per-item cluster ids per level)."""

    indices: np.ndarray
    hierarchy: ClusterHierarchy

    @property
    def cluster_ids(self) -> np.ndarray:
        return self.hierarchy.assignments


def balanced_sample(
    x: np.ndarray,
    *,
    size: int | None = None,
    fraction: float | None = None,
    n_clusters: Sequence[int] | None = None,
    mode: Mode = "random",
    balance_key: np.ndarray | None = None,
    seed: int = 0,
    **kmeans_kwargs,
) -> Selection:
    """Hierarchical k-means on the embeddings ``x`` followed by balanced selection of ``size`` (or ``fraction``).

    ``n_clusters`` defaults to two levels: about sqrt(N) leaves and a tenth of that on top (at least 2 each).
    Remaining keyword arguments go to ``hierarchical_kmeans`` (``train_key``, ``max_fanout``, ...).
    """
    n = x.shape[0]
    count = target_size(n, size, fraction)
    if n_clusters is None:
        k1 = max(2, round(np.sqrt(n)))
        n_clusters = (k1, max(2, k1 // 10))
    hierarchy = hierarchical_kmeans(x, n_clusters, seed=seed, **kmeans_kwargs)
    return Selection(balanced_select(hierarchy, count, mode=mode, balance_key=balance_key, seed=seed), hierarchy)
