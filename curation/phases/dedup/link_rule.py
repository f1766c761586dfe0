"""When two survivors are linked as copies of one picture: the link rule of dedup, plain numpy in and out.

A rule is a list of regions in the plane of the two signals, the pHash Hamming distance ``d`` (of 64 bits) and the
cosine similarity ``c`` of the embeddings; a pair is linked when it falls in any region:

- a region with ``min_cosine`` None links by the pHash alone (``d <= radius``) and is searched over the whole
  pool (``phash_pairs``, exact);
- a region with ``min_cosine`` links when both hold (``c >= min_cosine`` and ``d <= radius``) and is searched
  inside the embedding clusters (``embedding_pairs``): each signal confirms the other, so a pair must be close on
  two signals by chance to be linked by chance;
- a region with ``crops`` measures ``d`` as the *crop distance* (``crop_distances``), on PDQ's 256 bits rather
  than the pHash's 64: the least distance between either image's PDQ and the other's, or the PDQ of one of the
  other's sub-crops (``stages.phash.crop_boxes``). A copy cropped from the original sits close to the window of the
  original that frames it alike. Its chance rate is that of ``comparisons(K)`` = 2K + 1 PDQ comparisons for K
  sub-crops (a union bound: each sub-crop's hash is spread like the whole image's over unrelated pairs).

Why regions, and why both signals: at 10^9 survivors a rule that errs with probability p per pair links ~p N^2 / 2
unrelated pairs. pHash alone at radius 8 does that ~1.4e8 times with uniform bits, and real photos' bits are not
uniform; the lite embedding alone at cosine 0.95 gives ~11 chance neighbours per image inside a cluster. Real copies
differ by kind (``benchmarks/dedup_truth.py``, measured on real photos): re-encodes, resizes, tone and colour
changes keep the pHash within a few bits and the embedding above ~0.85; light crops move the pHash by 10-20 bits and
keep the embedding above ~0.89. So one region is pHash-led (small radius, a loose cosine), one embedding-led (a
high cosine, a wide radius) and one crop-led. The crop-led region is on PDQ because a 64-bit crop distance runs out
of room at 10^9: crops sit at 2-8 bits of pHash crop distance, and on real pHashes' even lattice each 2 bits there
cost ~100x in chance links, so the bound left 2-4 bits (82% of crops). On 256 bits unrelated photos' PDQs differ by
128 +- 8.5 and their crop distances by 111 +- 5, while 99% of crops, reposts, resizes and re-encodes are within
~60 (``benchmarks/dedup_truth.py``): ~7 standard deviations of room. Each region's radius is the most it may be: the
dedup phase lowers it to what the pool's N allows (``curation.phases.dedup.chance``), since the chance rate of a
fixed rule grows with N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from curation.phases.dedup.phash_bands import HASH_BITS, popcount64

NO_HASH = HASH_BITS + 1  # the distance given to a pair where either pHash is missing: never within a radius
PDQ_BITS = 256
PDQ_WORDS = PDQ_BITS // 64  # a PDQ hash as uint64 words (``pdq_words``)
NO_PDQ = PDQ_BITS + 1  # the crop distance of a pair where either side lacks its PDQ or sub-crop hashes
# pairs whose crop distances are computed at once: their (pairs, K, 4) temporaries stay in cache (2048: 8x faster
# than 2^18 on a bucket's million pairs)
CHUNK_PAIRS = 2048


@dataclass(frozen=True)
class Region:
    """``d <= radius`` (and ``c >= min_cosine`` when set); a radius of -1 turns the region off."""

    radius: int
    min_cosine: float | None = None
    crops: bool = False  # ``d`` is the PDQ crop distance (needs min_cosine: searched inside the embedding clusters)

    def __post_init__(self) -> None:
        if self.crops and self.min_cosine is None:
            raise ValueError("a region on the crop distance needs min_cosine (it is searched inside the clusters)")

    def contains(self, distance: np.ndarray, cosine: np.ndarray | None, crop: np.ndarray | None = None) -> np.ndarray:
        if self.crops and crop is None:
            raise ValueError("a region on the crop distance needs the pairs' crop distances")
        inside = np.asarray(crop if self.crops else distance) <= self.radius
        if self.min_cosine is not None:
            if cosine is None:
                raise ValueError("a region with min_cosine needs the pairs' cosine similarities")
            inside &= np.asarray(cosine) >= self.min_cosine
        return inside

    def describe(self) -> str:
        if self.radius < 0:
            return f"off (cosine >= {self.min_cosine})" if self.min_cosine is not None else "off (pHash alone)"
        hashed = f"{'PDQ crop distance' if self.crops else 'pHash'} <= {self.radius}"
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
        """From ``(radius, min_cosine)`` or ``(radius, min_cosine, crops)`` tuples."""
        return cls(
            tuple(Region(int(r[0]), None if r[1] is None else float(r[1]), bool(r[2:] and r[2])) for r in regions)
        )

    @property
    def needs_crops(self) -> bool:
        """Whether a joint region measures the crop distance (the search then reads the PDQ hashes)."""
        return any(r.crops for r in self.joint)

    @property
    def hash_radius(self) -> int:
        """The radius of the whole-pool pHash search: the pHash-alone region's (-1: none, no search)."""
        return max((r.radius for r in self.regions if r.min_cosine is None), default=-1)

    @property
    def joint(self) -> tuple[Region, ...]:
        """The regions searched inside the embedding clusters, those that are on."""
        return tuple(r for r in self.regions if r.min_cosine is not None and r.radius >= 0)

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


def pdq_words(column) -> tuple[np.ndarray, np.ndarray]:
    """A ``pdq`` (``binary(32)``) or ``pdq_crops`` (``binary(32 K)``) Arrow column as (rows, [K,] 4) uint64 words (0
    where null) and whether each row is set. Distances count differing bits, so any fixed grouping of the bytes into
    words serves."""
    import pyarrow as pa

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = column.type.byte_width
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    words = np.zeros((len(column), width // 8), np.uint64)
    if len(column) and column.buffers()[1] is not None:
        at = column.offset * width
        words[:] = (
            np.frombuffer(column.buffers()[1], np.uint8)[at : at + len(column) * width]
            .view(np.uint64)
            .reshape(len(column), -1)
        )
        words[~valid] = 0
    return (words if width == PDQ_BITS // 8 else words.reshape(len(column), -1, PDQ_WORDS)), valid


def _pdq_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamming distances of PDQs given as (..., 4) words, broadcast; summed a word at a time (numpy's reduction over
    a last axis of 4 took 2.4x as long)."""
    d = popcount64(a[..., 0] ^ b[..., 0]).astype(np.int16)
    for w in range(1, PDQ_WORDS):
        d += popcount64(a[..., w] ^ b[..., w])
    return d


def crop_distances(pdq_a, crops_a, pdq_b, crops_b, valid_a=None, valid_b=None) -> np.ndarray:
    """Per pair, the least PDQ Hamming distance of ``comparisons(K)``: the two PDQs (``pdq_*``: (pairs, 4) uint64
    words), and each PDQ against each of the other's sub-crop hashes (``crops_*``: (pairs, K, 4)); ``NO_PDQ`` where
    either side is marked invalid (no PDQ, or no sub-crop hashes)."""
    a, b = np.asarray(pdq_a, np.uint64), np.asarray(pdq_b, np.uint64)
    ca, cb = np.asarray(crops_a, np.uint64), np.asarray(crops_b, np.uint64)
    d = _pdq_distance(a, b)
    if d.size and ca.ndim == cb.ndim == 3 and ca.shape[1] and cb.shape[1]:
        for at in range(0, d.size, CHUNK_PAIRS):  # (pairs, K, 4) temporaries: a bucket's millions of pairs in slices
            s = slice(at, at + CHUNK_PAIRS)
            d[s] = np.minimum(d[s], _pdq_distance(a[s, None], cb[s]).min(axis=1))
            d[s] = np.minimum(d[s], _pdq_distance(b[s, None], ca[s]).min(axis=1))
    if valid_a is not None:
        d = np.where(valid_a, d, NO_PDQ)
    if valid_b is not None:
        d = np.where(valid_b, d, NO_PDQ)
    return d


def crop_distances_of(
    pdq: np.ndarray, crops: np.ndarray, valid: np.ndarray, a: np.ndarray, b: np.ndarray
) -> np.ndarray:
    """``crop_distances`` of the pairs (``a[i]``, ``b[i]``) of rows of ``pdq`` ((rows, 4) words), ``crops`` ((rows,
    K, 4)) and ``valid``, gathered a slice of pairs at a time (never a (pairs, K, 4) copy of a bucket's million
    pairs)."""
    out = np.empty(len(a), np.int16)
    for at in range(0, len(a), CHUNK_PAIRS):
        i, j = a[at : at + CHUNK_PAIRS], b[at : at + CHUNK_PAIRS]
        out[at : at + CHUNK_PAIRS] = crop_distances(pdq[i], crops[i], pdq[j], crops[j], valid[i], valid[j])
    return out
