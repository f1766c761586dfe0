"""pHash pairs within Hamming radius ``r`` by multi-index hashing over bit bands, plain numpy in and out: the
kernel the pHash steps (``phash_pairs``, ``phash_plan``) and the single-process reference run.

``plan_bands`` cuts the 64 bits into bands; ``collapse_exact`` reduces the hashes to their distinct values;
``band_pairs`` finds the pairs one band's flip masks reach (the distributable unit: the outputs of all units are
disjoint, and together complete).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

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


# Why own code: faiss's binary hash indexes (IndexBinaryMultiHash with nflip) implement the same multi-index
# hashing, but probe a std::unordered_map per query and flip: on 200k random hashes at radius 8 (3 tables of 21
# bits, nflip=2) they took 5-11 s on this 2-core machine against 1.1-1.2 s for the vectorised band scan below
# (dense band tables, every flip mask applied to all bucket keys at once); 1M hashes take 9-10 s here. The plain
# pigeonhole split into r+1 bands does not scale either: 7-bit bands put N/128 hashes in every bucket (4e9
# comparisons per band at 1M).


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


def expand_blocks(a_start, a_len, b_start, b_len) -> tuple[np.ndarray, np.ndarray]:
    """All (a_start+x, b_start+y), x < a_len, y < b_len, of every block, as two flat position arrays."""
    size = a_len * b_len
    blk = np.repeat(np.arange(size.size), size)
    off = np.arange(blk.size) - np.repeat(np.cumsum(size) - size, size)
    width = b_len[blk]
    return a_start[blk] + off // width, b_start[blk] + off % width


def _block_chunks(a_start, a_len, b_start, b_len, cap: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``expand_blocks`` in pieces of about ``cap`` candidates, so a huge bucket cannot exhaust memory."""
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
        yield expand_blocks(a_start[lo:hi], a_len[lo:hi], b_start[lo:hi], b_len[lo:hi])


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
