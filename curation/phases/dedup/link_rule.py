"""When two survivors are linked as copies of one picture: the link rule of dedup, plain numpy in and out.

A rule is a list of regions in the plane of the two signals, the pHash Hamming distance ``d`` (of 64 bits) and the
cosine similarity ``c`` of the embeddings; a pair is linked when it falls in any region:

- a region with ``min_cosine`` None links by the pHash alone (``d <= phash_radius``) and is searched over the whole
  pool (``phash_pairs``, exact);
- a region with ``min_cosine`` links when both hold (``c >= min_cosine`` and ``d <= phash_radius``) and is searched
  inside the embedding clusters (``embedding_pairs``): each signal confirms the other, so a pair must be close on
  two signals by chance to be linked by chance;
- a region with ``crops`` measures ``d`` as the *crop distance* (``crop_distances``): the least distance between
  either image's pHash and the other's, or the pHash of one of the other's sub-crops (``stages.phash.crop_boxes``).
  A copy cropped from the original sits close to the window of the original that frames it alike. Its chance rate
  is that of ``comparisons(K)`` = 2K + 1 pHash comparisons for K sub-crops (a union bound: each sub-crop's hash is
  spread like the whole image's over unrelated pairs, 31.5 +- 4.2 bits against 31.4 +- 4.2 on real photos).

Why regions, and why both signals: at 10^9 survivors a rule that errs with probability p per pair links ~p N^2 / 2
unrelated pairs. pHash alone at radius 8 does that ~1.4e8 times with uniform bits, and real photos' bits are not
uniform; the lite embedding alone at cosine 0.95 gives ~11 chance neighbours per image inside a cluster. Real copies
differ by kind (``benchmarks/dedup_truth.py``, measured on real photos): re-encodes, resizes, tone and colour
changes keep the pHash within a few bits and the embedding above ~0.85; light crops move the pHash by 10-20 bits and
keep the embedding above ~0.89 (their crop distance: 2 bits at the median). So one region is pHash-led (small
radius, a loose cosine), one embedding-led (a high cosine, a wide radius) and two crop-led (the crop distance: at a
cosine every real crop reaches, and above 0.95, where fewer unrelated pairs reach and a large pool affords a wider
radius). Each region's radius is the most it may be: the dedup phase lowers it to what the
pool's N allows (``curation.phases.dedup.chance``), since the chance rate of a fixed rule grows with N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup.phash_bands import HASH_BITS, popcount64

NO_HASH = HASH_BITS + 1  # the distance given to a pair where either pHash is missing: never within a radius
CHUNK_PAIRS = 1 << 18  # pairs whose crop distances are computed at once


@dataclass(frozen=True)
class Region:
    """``d <= phash_radius`` (and ``c >= min_cosine`` when set); a radius of -1 turns the region off."""

    phash_radius: int
    min_cosine: float | None = None
    crops: bool = False  # ``d`` is the crop distance (needs min_cosine: searched inside the embedding clusters)

    def __post_init__(self) -> None:
        if self.crops and self.min_cosine is None:
            raise ValueError("a region on the crop distance needs min_cosine (it is searched inside the clusters)")

    def contains(self, distance: np.ndarray, cosine: np.ndarray | None, crop: np.ndarray | None = None) -> np.ndarray:
        if self.crops and crop is None:
            raise ValueError("a region on the crop distance needs the pairs' crop distances")
        inside = np.asarray(crop if self.crops else distance) <= self.phash_radius
        if self.min_cosine is not None:
            if cosine is None:
                raise ValueError("a region with min_cosine needs the pairs' cosine similarities")
            inside &= np.asarray(cosine) >= self.min_cosine
        return inside

    def describe(self) -> str:
        if self.phash_radius < 0:
            return f"off (cosine >= {self.min_cosine})" if self.min_cosine is not None else "off (pHash alone)"
        hashed = f"{'crop distance' if self.crops else 'pHash'} <= {self.phash_radius}"
        return hashed if self.min_cosine is None else f"cosine >= {self.min_cosine:g} and {hashed}"


@dataclass(frozen=True)
class LinkRule:
    """The regions of a rule, in the order the settings list them."""

    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if sum(r.min_cosine is None for r in self.regions) > 1:
            raise ValueError("at most one region may link by the pHash alone (no min_cosine)")

    @classmethod
    def of(cls, regions: Sequence[tuple]) -> LinkRule:
        """From ``(phash_radius, min_cosine)`` or ``(phash_radius, min_cosine, crops)`` tuples."""
        return cls(
            tuple(Region(int(r[0]), None if r[1] is None else float(r[1]), bool(r[2:] and r[2])) for r in regions)
        )

    @property
    def needs_crops(self) -> bool:
        """Whether a joint region measures the crop distance (the search then reads the sub-crop hashes)."""
        return any(r.crops for r in self.joint)

    @property
    def hash_radius(self) -> int:
        """The radius of the whole-pool pHash search: the pHash-alone region's (-1: none, no search)."""
        return max((r.phash_radius for r in self.regions if r.min_cosine is None), default=-1)

    @property
    def joint(self) -> tuple[Region, ...]:
        """The regions searched inside the embedding clusters, those that are on."""
        return tuple(r for r in self.regions if r.min_cosine is not None and r.phash_radius >= 0)

    @property
    def search_threshold(self) -> float | None:
        """The cosine the embedding search lists pairs from: the lowest of the joint regions (None: no search)."""
        return min((r.min_cosine for r in self.joint if r.min_cosine is not None), default=None)

    def links(self, distance: np.ndarray, cosine: np.ndarray, crop: np.ndarray | None = None) -> np.ndarray:
        """Per pair: whether some region links it (``distance`` ``NO_HASH`` where a pHash is missing; ``crop`` the
        crop distances, needed where a region measures them)."""
        distance = np.asarray(distance)
        out = np.zeros(distance.shape, bool)
        for region in self.regions:
            out |= region.contains(distance, cosine, crop)
        return out

    def confirmed(self, distance: np.ndarray, cosine: np.ndarray, crop: np.ndarray | None = None) -> np.ndarray:
        """Per pair of the embedding search: whether a joint region links it."""
        out = np.zeros(np.shape(distance), bool)
        for region in self.joint:
            out |= region.contains(distance, cosine, crop)
        return out

    def with_radii(self, radii: Sequence[int]) -> LinkRule:
        return LinkRule(tuple(Region(int(r), g.min_cosine, g.crops) for g, r in zip(self.regions, radii, strict=True)))

    def describe(self) -> str:
        return " or ".join(r.describe() for r in self.regions) or "no links"


def pair_distances(hashes_a: np.ndarray, hashes_b: np.ndarray, valid_a=None, valid_b=None) -> np.ndarray:
    """Hamming distances of two uint64 hash arrays, ``NO_HASH`` where either side is marked invalid."""
    d = popcount64(np.asarray(hashes_a, np.uint64) ^ np.asarray(hashes_b, np.uint64)).astype(np.int16)
    if valid_a is not None:
        d = np.where(valid_a, d, NO_HASH)
    if valid_b is not None:
        d = np.where(valid_b, d, NO_HASH)
    return d


def comparisons(crop_count: int) -> int:
    """The hash pairs one crop distance compares with ``crop_count`` sub-crops a side: whole-whole, and each whole
    with each of the other's crops."""
    return 2 * crop_count + 1


def crop_distances(hashes_a, crops_a, hashes_b, crops_b, valid_a=None, valid_b=None) -> np.ndarray:
    """Per pair, the least Hamming distance of ``comparisons(K)``: the two pHashes, and each pHash against each of the
    other's sub-crop hashes (``crops_*``: (pairs, K) uint64); ``NO_HASH`` where either side is marked
    invalid (no pHash, or no sub-crop hashes)."""
    a, b = np.asarray(hashes_a, np.uint64), np.asarray(hashes_b, np.uint64)
    ca, cb = np.asarray(crops_a, np.uint64), np.asarray(crops_b, np.uint64)
    d = popcount64(a ^ b).astype(np.int16)
    if d.size and ca.ndim == cb.ndim == 2 and ca.shape[1] and cb.shape[1]:
        for at in range(0, d.size, CHUNK_PAIRS):  # (pairs, K) temporaries: a bucket's millions of pairs in slices
            s = slice(at, at + CHUNK_PAIRS)
            d[s] = np.minimum(d[s], popcount64(a[s, None] ^ cb[s]).min(axis=1))
            d[s] = np.minimum(d[s], popcount64(b[s, None] ^ ca[s]).min(axis=1))
    if valid_a is not None:
        d = np.where(valid_a, d, NO_HASH)
    if valid_b is not None:
        d = np.where(valid_b, d, NO_HASH)
    return d
