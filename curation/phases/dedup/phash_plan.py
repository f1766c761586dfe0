"""The plan of the distributed pHash pair search (``curation.phases.dedup.phash_pairs`` explains it): bands cut into
sub-bands (families), the shuffle partition of each group, and the search of one family's hashes of one partition.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup import phash_bands

ROWS_PER_PARTITION = 1_000_000  # shuffle rows per reduce task (17 bytes each before decoding)
MAX_KERNEL_HASHES = 2_000_000  # distinct hashes given to one band_pairs call


@dataclass(frozen=True)
class Family:
    """A sub-band of band ``band_index``; the hashes sharing one value of it form a group."""

    band_index: int
    sub: phash_bands.Band  # absolute bit positions


@dataclass(frozen=True)
class SubBandPlan(phash_bands.BandPlan):
    """A band plan whose flip masks leave ``fixed`` (a sub-band of the scanned band) alone.

    ``band_pairs`` then only pairs bucket keys that agree on ``fixed``: hashes of one group, however many groups
    share the table.
    """

    fixed: phash_bands.Band

    def masks(self, band_index: int) -> np.ndarray:
        band = self.bands[band_index]
        fixed_bits = range(self.fixed.shift - band.shift, self.fixed.shift - band.shift + self.fixed.width)
        free = [bit for bit in range(band.width) if bit not in fixed_bits]
        masks = [0]
        for flips in range(1, self.max_flips + 1):
            masks.extend(sum(1 << b for b in bits) for bits in itertools.combinations(free, flips))
        return np.asarray(masks, dtype=np.int64)


@dataclass(frozen=True)
class PairPlan:
    """Everything a task needs: the band plan, the families in reporting order, the number of partitions."""

    bands: phash_bands.BandPlan
    families: tuple[Family, ...]
    partitions: int

    @property
    def radius(self) -> int:
        return self.bands.radius

    def partition_of(self, family_index: int, hashes: np.ndarray) -> np.ndarray:
        """Shuffle partition of each hash's group in a family (a fixed integer mix of family and sub-band value)."""
        value = self.families[family_index].sub.values(hashes).astype(np.uint64)
        x = (value << np.uint64(8)) | np.uint64(family_index)
        x ^= x >> np.uint64(30)  # splitmix64's finaliser
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return (x % np.uint64(self.partitions)).astype(np.int64)

    def describe(self) -> dict:
        return {
            "radius": self.radius,
            "bands": [[b.shift, b.width] for b in self.bands.bands],
            "families": len(self.families),
            "partitions": self.partitions,
        }


def _sub_bands(band: phash_bands.Band, parts: int) -> list[phash_bands.Band]:
    """``band`` cut into ``parts`` contiguous sub-bands, as even as possible (zero-width when parts > width: such
    a sub-band always agrees, which keeps the pigeonhole true)."""
    widths = [band.width // parts + (1 if k < band.width % parts else 0) for k in range(parts)]
    shifts = band.shift + np.concatenate([[0], np.cumsum(widths)[:-1]])
    return [phash_bands.Band(int(s), int(w)) for s, w in zip(shifts, widths)]


def plan_pairs(
    n_hashes: int,
    radius: int,
    partitions: int | None = None,
    *,
    n_bands: int | None = None,
    rows_per_partition: int = ROWS_PER_PARTITION,
) -> PairPlan:
    """The plan for about ``n_hashes`` hashes: ``phash_bands.plan_bands``'s bands, each cut into ``max_flips + 1``
    families; by default as many partitions as give ``rows_per_partition`` shuffle rows each, at most one per
    group (a group is never split). Radius 0 needs one family only (the one that lists exact duplicates)."""
    bands = phash_bands.plan_bands(max(n_hashes, 1), radius, n_bands)
    families = tuple(
        Family(b, sub) for b, band in enumerate(bands.bands) for sub in _sub_bands(band, bands.max_flips + 1)
    )
    if radius == 0:
        families = families[:1]
    if partitions is None:
        groups = sum(1 << f.sub.width for f in families)
        partitions = min(groups, max(1, math.ceil(len(families) * n_hashes / rows_per_partition)))
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return PairPlan(bands, families, int(partitions))


# ---------------------------------------------------------------------------------------------------------------
# The kernel: one family's hashes of one partition
# ---------------------------------------------------------------------------------------------------------------


def family_pairs(
    unique: np.ndarray, plan: PairPlan, family_index: int, max_hashes: int = MAX_KERNEL_HASHES
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (u < v, distance) of the sorted distinct hashes ``unique`` that this family reports.

    Above ``max_hashes`` hashes the search runs on blocks of ``max_hashes // 2``: each block alone, then each two
    blocks together keeping only the pairs across them, so every pair is found once in bounded memory.
    """
    family = plan.families[family_index]
    sub_plan = SubBandPlan(plan.bands.bands, plan.radius, family.sub)
    block = max(1, max_hashes // 2) if unique.size > max_hashes else max(1, unique.size)
    starts = range(0, unique.size, block)
    out_u, out_v, out_d = [], [], []
    for first, second in itertools.combinations_with_replacement(starts, 2):
        idx = np.arange(first, min(first + block, unique.size))
        if second != first:
            idx = np.concatenate([idx, np.arange(second, min(second + block, unique.size))])
        u, v, d = phash_bands.band_pairs(unique[idx], sub_plan, family.band_index)
        if second != first:  # pairs inside one block are its own call's
            across = (u < block) & (v >= block)
            u, v, d = u[across], v[across], d[across]
        out_u.append(idx[u])
        out_v.append(idx[v])
        out_d.append(d)
    if not out_u:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.uint8)
    u, v, d = np.concatenate(out_u), np.concatenate(out_v), np.concatenate(out_d)
    # a pair that agrees on an earlier sub-band of this band is that sub-band's family's to report
    diff = unique[u] ^ unique[v]
    keep = np.ones(u.size, bool)
    for earlier in plan.families[:family_index]:
        if earlier.band_index == family.band_index:
            keep &= (diff & earlier.sub.bit_mask) != 0
    return u[keep], v[keep], d[keep]
