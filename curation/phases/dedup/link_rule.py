"""When two survivors are linked as copies of one picture: the link rule of dedup, plain numpy in and out.

A rule is a list of regions in the plane of the two signals, the pHash Hamming distance ``d`` (of 64 bits) and the
cosine similarity ``c`` of the embeddings; a pair is linked when it falls in any region:

- a region with ``min_cosine`` None links by the pHash alone (``d <= phash_radius``) and is searched over the whole
  pool (``phash_pairs``, exact);
- a region with ``min_cosine`` links when both hold (``c >= min_cosine`` and ``d <= phash_radius``) and is searched
  inside the embedding clusters (``embedding_pairs``): each signal confirms the other, so a pair must be close on
  two signals by chance to be linked by chance.

Why regions, and why both signals: at 10^9 survivors a rule that errs with probability p per pair links ~p N^2 / 2
unrelated pairs. pHash alone at radius 8 does that ~1.4e8 times with uniform bits, and real photos' bits are not
uniform; the lite embedding alone at cosine 0.95 gives ~11 chance neighbours per image inside a cluster. Real copies
differ by kind (``benchmarks/dedup_truth.py``, measured on real photos): re-encodes, resizes, tone and colour
changes keep the pHash within a few bits and the embedding above ~0.85; light crops move the pHash by 10-20 bits and
keep the embedding above ~0.95. So one region is pHash-led (small radius, a loose cosine) and one embedding-led (a
high cosine, a wide radius). Each region's radius is the most it may be: the dedup phase lowers it to what the
pool's N allows (``curation.phases.dedup.chance``), since the chance rate of a fixed rule grows with N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup.phash_bands import HASH_BITS, popcount64

NO_HASH = HASH_BITS + 1  # the distance given to a pair where either pHash is missing: never within a radius


@dataclass(frozen=True)
class Region:
    """``d <= phash_radius`` (and ``c >= min_cosine`` when set); a radius of -1 turns the region off."""

    phash_radius: int
    min_cosine: float | None = None

    def contains(self, distance: np.ndarray, cosine: np.ndarray | None) -> np.ndarray:
        inside = np.asarray(distance) <= self.phash_radius
        if self.min_cosine is not None:
            if cosine is None:
                raise ValueError("a region with min_cosine needs the pairs' cosine similarities")
            inside &= np.asarray(cosine) >= self.min_cosine
        return inside

    def describe(self) -> str:
        if self.phash_radius < 0:
            return f"off (cosine >= {self.min_cosine})" if self.min_cosine is not None else "off (pHash alone)"
        hashed = f"pHash <= {self.phash_radius}"
        return hashed if self.min_cosine is None else f"cosine >= {self.min_cosine:g} and {hashed}"


@dataclass(frozen=True)
class LinkRule:
    """The regions of a rule, in the order the settings list them."""

    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if sum(r.min_cosine is None for r in self.regions) > 1:
            raise ValueError("at most one region may link by the pHash alone (no min_cosine)")

    @classmethod
    def of(cls, regions: Sequence[tuple[int, float | None]]) -> LinkRule:
        return cls(tuple(Region(int(r), None if c is None else float(c)) for r, c in regions))

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

    def links(self, distance: np.ndarray, cosine: np.ndarray) -> np.ndarray:
        """Per pair: whether some region links it (``distance`` ``NO_HASH`` where a pHash is missing)."""
        distance = np.asarray(distance)
        out = np.zeros(distance.shape, bool)
        for region in self.regions:
            out |= region.contains(distance, cosine)
        return out

    def confirmed(self, distance: np.ndarray, cosine: np.ndarray) -> np.ndarray:
        """Per pair of the embedding search: whether a joint region links it."""
        out = np.zeros(np.shape(distance), bool)
        for region in self.joint:
            out |= region.contains(distance, cosine)
        return out

    def with_radii(self, radii: Sequence[int]) -> LinkRule:
        return LinkRule(tuple(Region(int(r), g.min_cosine) for g, r in zip(self.regions, radii, strict=True)))

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
