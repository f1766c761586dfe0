"""Phase 2 "dedup": global near-duplicate detection over every phase-1 survivor at once.

Three parts, each plain numpy in and numpy out so the dedup job can run them in one process or spread them over
Ray tasks:

1. ``phash_pairs``: every pair of items whose 64-bit pHashes are within Hamming radius ``r`` (exact), by
   multi-index hashing over bit bands (``plan_bands`` / ``band_pairs`` are the distributable units).
2. ``embedding_pairs``: pairs of items whose L2-normalised embeddings have cosine similarity >= a threshold
   among each item's ``k`` nearest neighbours: exact (faiss flat inner product) for small N, an inverted file
   searched cluster by cluster above ``flat_max`` (``build_ivf_partition`` / ``ivf_block_pairs`` are the units).
3. ``resolve_duplicates``: connected components over the pairs of both signals (scipy.sparse.csgraph), one item
   kept per component (highest score, then larger resolution, then smallest key); every dropped item gets the
   kept item of its component and the signal that linked it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

HASH_BITS = 64
# Band tables are dense arrays indexed by the band value (2**width int32 entries): 22 bits = 16 MiB.
MAX_BAND_WIDTH = 22
# Candidate pairs expanded at once while scanning a band; bounds memory when a bucket is huge.
MAX_CANDIDATES_PER_STEP = 1 << 22


def popcount64(x: np.ndarray) -> np.ndarray:
    """Bits set in each uint64 (numpy >= 2 has a native ufunc; older numpy goes through a byte table)."""
    x = np.asarray(x, dtype=np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.uint8)
    table = np.array([bin(v).count("1") for v in range(256)], dtype=np.uint8)
    return table[x.view(np.uint8).reshape(*x.shape, 8)].sum(axis=-1, dtype=np.uint8)


def as_hashes(hashes: np.ndarray) -> np.ndarray:
    """The ``phash`` column as uint64 (an int64 view of the same bits is accepted too)."""
    h = np.asarray(hashes)
    if h.dtype == np.int64:
        return h.view(np.uint64)
    if h.dtype != np.uint64:
        raise TypeError(f"pHashes must be uint64 (or int64 bits), got {h.dtype}")
    return h


# ---------------------------------------------------------------------------------------------------------------
# pHash pairs
#
# Why own code: faiss's binary hash indexes (IndexBinaryMultiHash with nflip) implement the same multi-index
# hashing, but probe a std::unordered_map per query and flip: on 200k random hashes at radius 8 (3 tables of 21
# bits, nflip=2) they took 5-11 s on this 2-core machine against 1.1-1.2 s for the vectorised band scan below
# (dense band tables, every flip mask applied to all bucket keys at once); 1M hashes take 9-10 s here. The plain
# pigeonhole split into r+1 bands does not scale either: 7-bit bands put N/128 hashes in every bucket (4e9
# comparisons per band at 1M).
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HashPairs:
    """Near-duplicate pairs from pHashes: item indices with ``i < j`` and their Hamming distance."""

    i: np.ndarray  # int64
    j: np.ndarray  # int64
    distance: np.ndarray  # uint8

    def __len__(self) -> int:
        return int(self.i.size)


@dataclass(frozen=True)
class Band:
    """A contiguous run of bits of the hash: bits ``shift .. shift+width-1`` (bit 0 = least significant)."""

    shift: int
    width: int

    @property
    def bit_mask(self) -> np.uint64:
        return np.uint64(((1 << self.width) - 1) << self.shift)

    def values(self, hashes: np.ndarray) -> np.ndarray:
        return ((hashes >> np.uint64(self.shift)) & np.uint64((1 << self.width) - 1)).astype(np.int64)


@dataclass(frozen=True)
class BandPlan:
    """How to cut 64 bits into bands for radius ``radius``.

    Pigeonhole: if two hashes differ in at most ``radius`` bits, then over ``len(bands)`` disjoint bands at least
    one band differs in at most ``max_flips = radius // len(bands)`` bits. Scanning every band for pairs whose
    band values are within ``max_flips`` bits therefore finds every pair (exact), and verifying the full distance
    removes the false candidates.
    """

    bands: tuple[Band, ...]
    radius: int

    @property
    def max_flips(self) -> int:
        return self.radius // len(self.bands)

    def masks(self, band_index: int) -> np.ndarray:
        """Every XOR mask of at most ``max_flips`` bits within the band (mask 0 first)."""
        width = self.bands[band_index].width
        masks = [0]
        for flips in range(1, self.max_flips + 1):
            masks.extend(sum(1 << b for b in bits) for bits in itertools.combinations(range(width), flips))
        return np.asarray(masks, dtype=np.int64)

    def tasks(self, splits_per_band: int = 1) -> list[HashTask]:
        """Units of work: each band's masks cut into ``splits_per_band`` slices (e.g. one Ray task each)."""
        out: list[HashTask] = []
        for b in range(len(self.bands)):
            n_masks = len(self.masks(b))
            edges = np.linspace(0, n_masks, min(splits_per_band, n_masks) + 1).astype(int)
            out.extend(HashTask(b, int(lo), int(hi)) for lo, hi in itertools.pairwise(edges) if hi > lo)
        return out


@dataclass(frozen=True)
class HashTask:
    band_index: int
    mask_start: int
    mask_stop: int


def _split_bits(n_bands: int) -> tuple[Band, ...]:
    widths = [HASH_BITS // n_bands + (1 if b < HASH_BITS % n_bands else 0) for b in range(n_bands)]
    shifts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    return tuple(Band(int(s), int(w)) for s, w in zip(shifts, widths))


def _plan_cost(n: int, radius: int, n_bands: int) -> float:
    """Rough work of a plan: probes (one per bucket key per mask) plus candidates (pairs sharing a probed bucket)."""
    plan = BandPlan(_split_bits(n_bands), radius)
    cost = 0.0
    for band in plan.bands:
        n_masks = sum(math.comb(band.width, f) for f in range(plan.max_flips + 1))
        keys = min(n, 1 << band.width)
        candidates = n * n * n_masks / (1 << band.width) / 2
        cost += keys * n_masks + 3 * candidates  # a candidate costs a few more numpy passes than a probe
    return cost


def plan_bands(n: int, radius: int, n_bands: int | None = None) -> BandPlan:
    """The cheapest band plan for ``n`` distinct hashes (or the one with ``n_bands`` bands).

    Few wide bands mean many flip masks per band but near-empty buckets; many narrow bands mean no flips but
    crowded buckets. For radius 8 the cost model picks 3 bands with 2 flips at 1M hashes and 5+ narrow bands for a
    few thousand.
    """
    if not 0 <= radius < HASH_BITS:
        raise ValueError(f"radius must be in [0, {HASH_BITS}), got {radius}")
    lo = -(-HASH_BITS // MAX_BAND_WIDTH)  # bands must fit a dense table
    if n_bands is None:
        candidates = range(lo, max(lo, radius + 1) + 1)  # beyond radius+1 bands max_flips stays 0: only worse
        n_bands = min(candidates, key=lambda b: _plan_cost(max(n, 1), radius, b))
    if not lo <= n_bands <= HASH_BITS:
        raise ValueError(f"n_bands must be in [{lo}, {HASH_BITS}], got {n_bands}")
    return BandPlan(_split_bits(n_bands), radius)


@dataclass(frozen=True)
class ExactGroups:
    """Hashes collapsed to their distinct values: exact duplicates are handled once, as a star (see below)."""

    unique: np.ndarray  # sorted distinct hashes
    first: np.ndarray  # smallest item index holding each distinct hash
    inverse: np.ndarray  # item -> index into ``unique``


def collapse_exact(hashes: np.ndarray) -> ExactGroups:
    unique, first, inverse = np.unique(as_hashes(hashes), return_index=True, return_inverse=True)
    return ExactGroups(unique, first.astype(np.int64), inverse.astype(np.int64).ravel())


@dataclass(frozen=True)
class BandTable:
    """One band's buckets over the distinct hashes: bucket keys, their members and a dense key -> bucket table."""

    keys: np.ndarray  # sorted distinct band values
    starts: np.ndarray  # bucket b holds members[starts[b] : starts[b] + counts[b]]
    counts: np.ndarray
    members: np.ndarray  # indices into the distinct hashes, grouped by bucket
    slot: np.ndarray  # int32[2**width]: bucket of a band value, -1 when empty


def build_band_table(unique: np.ndarray, band: Band) -> BandTable:
    values = band.values(unique)
    members = np.argsort(values, kind="stable")
    keys, starts, counts = np.unique(values[members], return_index=True, return_counts=True)
    slot = np.full(1 << band.width, -1, dtype=np.int32)
    slot[keys] = np.arange(keys.size, dtype=np.int32)
    return BandTable(keys, starts.astype(np.int64), counts.astype(np.int64), members, slot)


def _expand_blocks(a_start, a_len, b_start, b_len) -> tuple[np.ndarray, np.ndarray]:
    """All (a_start+x, b_start+y), x < a_len, y < b_len, of every block, as two flat position arrays."""
    size = a_len * b_len
    blk = np.repeat(np.arange(size.size), size)
    off = np.arange(blk.size) - np.repeat(np.cumsum(size) - size, size)
    width = b_len[blk]
    return a_start[blk] + off // width, b_start[blk] + off % width


def _block_chunks(a_start, a_len, b_start, b_len, cap: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``_expand_blocks`` in pieces of about ``cap`` candidates, so a huge bucket cannot exhaust memory."""
    size = a_len * b_len
    big = size > cap
    if big.any():  # cut oversized blocks into slices of rows
        rows = np.maximum(1, cap // b_len[big])
        n_slices = -(-a_len[big] // rows)
        src = np.repeat(np.flatnonzero(big), n_slices)
        k = np.arange(src.size) - np.repeat(np.cumsum(n_slices) - n_slices, n_slices)
        step = np.repeat(rows, n_slices)
        sliced_start = a_start[src] + k * step
        sliced_len = np.minimum(step, a_len[src] - k * step)
        keep = ~big
        a_start = np.concatenate([a_start[keep], sliced_start])
        a_len = np.concatenate([a_len[keep], sliced_len])
        b_start = np.concatenate([b_start[keep], b_start[src]])
        b_len = np.concatenate([b_len[keep], b_len[src]])
        size = a_len * b_len
    group = np.cumsum(size) // cap  # consecutive blocks with the same quotient form one chunk
    edges = np.flatnonzero(np.diff(group)) + 1
    for lo, hi in itertools.pairwise([0, *edges.tolist(), size.size]):
        yield _expand_blocks(a_start[lo:hi], a_len[lo:hi], b_start[lo:hi], b_len[lo:hi])


def band_pairs(
    unique: np.ndarray,
    plan: BandPlan,
    band_index: int,
    mask_range: tuple[int, int] | None = None,
    table: BandTable | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (u < v, distance) of distinct hashes within ``plan.radius``, found through one band's masks.

    The distributable unit: ``unique`` are the distinct hashes (``collapse_exact``), ``mask_range`` a slice of
    ``plan.masks(band_index)``. A pair is reported only by the first band in which it is within ``max_flips``
    bits, and within a band only by one mask and one direction, so the outputs of all tasks are disjoint and
    their concatenation is the complete pair list.
    """
    band = plan.bands[band_index]
    table = table if table is not None else build_band_table(unique, band)
    masks = plan.masks(band_index)
    if mask_range is not None:
        masks = masks[mask_range[0] : mask_range[1]]
    own = np.arange(table.keys.size)
    earlier = [b.bit_mask for b in plan.bands[:band_index]]
    out_u, out_v, out_d = [], [], []
    for mask in masks.tolist():
        if mask == 0:  # pairs inside one bucket
            src = np.flatnonzero(table.counts > 1)
            dst = src
        else:  # bucket pairs (key, key ^ mask), each visited once from its smaller key
            other = table.slot[table.keys ^ mask]
            src = np.flatnonzero(other > own)
            dst = other[src].astype(np.int64)
        if src.size == 0:
            continue
        chunks = _block_chunks(
            table.starts[src], table.counts[src], table.starts[dst], table.counts[dst], MAX_CANDIDATES_PER_STEP
        )
        for pa, pb in chunks:
            if mask == 0:
                upper = pa < pb
                pa, pb = pa[upper], pb[upper]
            u, v = table.members[pa], table.members[pb]
            diff = unique[u] ^ unique[v]
            dist = popcount64(diff)
            ok = dist <= plan.radius
            for bit_mask in earlier:  # found by an earlier band already: that band reports it
                ok &= popcount64(diff & bit_mask) > plan.max_flips
            u, v, dist = u[ok], v[ok], dist[ok]
            out_u.append(np.minimum(u, v))
            out_v.append(np.maximum(u, v))
            out_d.append(dist)
    if not out_u:
        empty = np.empty(0, np.int64)
        return empty, empty.copy(), np.empty(0, np.uint8)
    return np.concatenate(out_u), np.concatenate(out_v), np.concatenate(out_d)


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
    same_a, same_b = _expand_blocks(starts, counts, starts, counts)
    upper = same_a < same_b
    ia, ib = order[same_a[upper]], order[same_b[upper]]
    # across a near pair of distinct hashes: every item of one with every item of the other
    xa, xb = _expand_blocks(starts[u], counts[u], starts[v], counts[v])
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


# ---------------------------------------------------------------------------------------------------------------
# Embedding pairs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddingPairs:
    """Near-duplicate pairs from embeddings: ``i < j``, their cosine similarity and the search used."""

    i: np.ndarray  # int64
    j: np.ndarray  # int64
    similarity: np.ndarray  # float32
    method: str  # "flat" (exact) or "ivf" (approximate)

    def __len__(self) -> int:
        return int(self.i.size)


def threshold_neighbours(
    query_ids: np.ndarray, sims: np.ndarray, ids: np.ndarray, k: int, threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From k+1 search results per query: drop the query itself and padding, keep the first k at >= threshold."""
    valid = (ids >= 0) & (ids != query_ids[:, None])
    valid &= np.cumsum(valid, axis=1) <= k  # self may be missing from the list when vectors tie
    valid &= sims >= threshold
    r, c = np.nonzero(valid)
    q, n = query_ids[r], ids[r, c]
    return np.minimum(q, n), np.maximum(q, n), sims[r, c]


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


# ---------------------------------------------------------------------------------------------------------------
# Components and the keep rule
# ---------------------------------------------------------------------------------------------------------------


class PairLike(Protocol):
    @property
    def i(self) -> np.ndarray: ...
    @property
    def j(self) -> np.ndarray: ...


@dataclass(frozen=True)
class DedupResult:
    """Per item: its component, whether it is kept, and for dropped items who they duplicate and why."""

    component: np.ndarray  # int64 label; items without any pair are singleton components
    keep: np.ndarray  # bool
    duplicate_of: np.ndarray  # int64: the kept item of the component, -1 for kept items
    linked_by: np.ndarray  # int8: index into ``signals`` of the edge that links it, -1 for kept items
    signals: tuple[str, ...]

    @property
    def n_dropped(self) -> int:
        return int((~self.keep).sum())

    def linked_by_name(self) -> list[str | None]:
        """``linked_by`` as signal names (None for kept items), e.g. for the ledger's reason column."""
        names = np.asarray([*self.signals, None], dtype=object)
        return names[self.linked_by].tolist()  # -1 picks the trailing None


def _canonical_edges(n: int, pairs: Mapping[str, PairLike]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted edge keys (lo * n + hi) and the signal of each; a pair in several signals gets the first one."""
    keys, codes = [], []
    for signal, p in enumerate(pairs.values()):
        i, j = np.asarray(p.i, np.int64), np.asarray(p.j, np.int64)
        if i.size and (min(i.min(), j.min()) < 0 or max(i.max(), j.max()) >= n):
            raise ValueError(f"pair indices of signal {list(pairs)[signal]!r} out of range [0, {n})")
        not_loop = i != j
        i, j = i[not_loop], j[not_loop]
        keys.append(np.minimum(i, j) * n + np.maximum(i, j))
        codes.append(np.full(i.size, signal, np.int8))
    key = np.concatenate(keys) if keys else np.empty(0, np.int64)
    code = np.concatenate(codes) if codes else np.empty(0, np.int8)
    order = np.lexsort((code, key))
    key, code = key[order], code[order]
    first = np.concatenate([[True], key[1:] != key[:-1]]) if key.size else np.empty(0, bool)
    return key[first], code[first]


def _keep_order(
    n: int,
    component: np.ndarray,
    score: np.ndarray | None,
    width: np.ndarray | None,
    height: np.ndarray | None,
    keys: np.ndarray | None,
) -> np.ndarray:
    """Items sorted by component, then best first: higher score, larger resolution, smaller key."""
    s = np.zeros(n) if score is None else np.asarray(score, dtype=np.float64)
    s = np.where(np.isnan(s), -np.inf, s)  # an item without a score never beats one with a score
    res = np.zeros(n, np.int64)
    if width is not None and height is not None:
        res = np.asarray(width, np.int64) * np.asarray(height, np.int64)
    key_rank = np.arange(n) if keys is None else np.argsort(np.argsort(np.asarray(keys), kind="stable"))
    return np.lexsort((key_rank, -res, -s, component))


def resolve_duplicates(
    n: int,
    pairs: Mapping[str, PairLike],
    *,
    score: np.ndarray | None = None,
    width: np.ndarray | None = None,
    height: np.ndarray | None = None,
    keys: np.ndarray | None = None,
) -> DedupResult:
    """Group the ``n`` items by the pairs of every signal and keep one item per group.

    ``pairs`` maps a signal name ("phash", "embedding") to its pairs, in priority order: when both signals link
    the same two items the edge counts as the first signal's. The kept item of a component has the highest
    ``score`` (NaN counts lowest), then the largest ``width * height``, then the smallest ``keys`` value (the
    item index when ``keys`` is None), so the choice is deterministic.

    ``linked_by`` of a dropped item is the signal of the first edge on its path to the kept item: a breadth-first
    search from the kept items gives every dropped item a shortest path to its kept item, and the edge from the
    item to its parent on that path is reported. A ``duplicate_of`` therefore may be reached through other
    dropped items (A~B by pHash, B~C by embedding: C is "embedding", duplicate_of A).
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, connected_components

    signals = tuple(pairs)
    if n == 0:
        empty = np.empty(0, np.int64)
        return DedupResult(empty, np.empty(0, bool), empty.copy(), np.empty(0, np.int8), signals)
    edge_key, edge_code = _canonical_edges(n, pairs)
    lo, hi = edge_key // n, edge_key % n
    graph = csr_matrix((np.ones(lo.size, np.int8), (lo, hi)), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    component = component.astype(np.int64)

    order = _keep_order(n, component, score, width, height, keys)
    first = np.concatenate([[True], component[order][1:] != component[order][:-1]])
    kept_of = np.empty(component.max() + 1, np.int64)
    kept_of[component[order][first]] = order[first]
    keep = np.zeros(n, bool)
    keep[order[first]] = True

    duplicate_of = np.where(keep, -1, kept_of[component])
    linked_by = np.full(n, -1, np.int8)
    dropped = np.flatnonzero(~keep)
    if dropped.size:
        # BFS from a virtual root joined to every kept item: each dropped item's predecessor is the next item
        # on a shortest path towards its own component's kept item.
        roots = np.unique(duplicate_of[dropped])
        rows = np.concatenate([lo, np.full(roots.size, n)])
        cols = np.concatenate([hi, roots])
        tree = csr_matrix((np.ones(rows.size, np.int8), (rows, cols)), shape=(n + 1, n + 1))
        _, pred = breadth_first_order(tree, n, directed=False, return_predecessors=True)
        parent = pred[dropped].astype(np.int64)
        query = np.minimum(dropped, parent) * n + np.maximum(dropped, parent)
        linked_by[dropped] = edge_code[np.searchsorted(edge_key, query)]
    return DedupResult(component, keep, duplicate_of.astype(np.int64), linked_by, signals)
