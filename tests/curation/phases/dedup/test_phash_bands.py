"""pHash pairs by multi-index hashing over bit bands: exact against brute force, disjoint across tasks, bounded on
crowded buckets, and exact duplicates collapsed to a star."""

from __future__ import annotations

import numpy as np
import pytest

from curation.phases.dedup import phash_bands
from curation.phases.dedup.phash_bands import band_pairs, build_band_table, collapse_exact, plan_bands
from curation.phases.reference import HashPairs, brute_force_hash_pairs, pairs_from_unique, phash_pairs


def flip_bits(h: np.uint64, n_bits: int, rng: np.random.Generator) -> np.uint64:
    bits = rng.choice(64, n_bits, replace=False)
    return np.uint64(h ^ np.uint64(sum(1 << int(b) for b in bits)))


@pytest.fixture(scope="module")
def planted_hashes() -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """3000 random hashes with 40 planted copies at every distance 0..12 (some chained through earlier copies)."""
    rng = np.random.default_rng(7)
    h = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True)
    planted = []
    for dist in range(13):
        for _ in range(40):
            a, b = rng.choice(h.size, 2, replace=False)
            h[b] = flip_bits(h[a], dist, rng)
            planted.append((int(a), int(b), dist))
    return h, planted


def as_sets(p: HashPairs) -> set[tuple[int, int, int]]:
    return set(zip(p.i.tolist(), p.j.tolist(), p.distance.tolist()))


@pytest.mark.parametrize("n_bands", [None, 3, 4, 5, 9])
@pytest.mark.parametrize("radius", [4, 8])
def test_phash_pairs_equal_brute_force(planted_hashes, n_bands, radius):
    h, planted = planted_hashes
    ref = brute_force_hash_pairs(h, radius)
    got = phash_pairs(h, radius, spanning=False, n_bands=n_bands)
    assert as_sets(got) == as_sets(ref)
    assert len(got) == len(ref)  # no pair listed twice
    assert np.all(got.i < got.j)
    # the planted copies that survived later overwrites: inside the radius found, outside it absent
    found = set(zip(got.i.tolist(), got.j.tolist()))
    for a, b, _ in planted:
        distance = bin(int(h[a]) ^ int(h[b])).count("1")
        assert ((min(a, b), max(a, b)) in found) == (distance <= radius)


def test_phash_threads_and_tasks_are_disjoint_and_complete(planted_hashes):
    h, _ = planted_hashes
    ref = as_sets(brute_force_hash_pairs(h, 8))
    assert as_sets(phash_pairs(h, 8, spanning=False, threads=2, n_bands=3)) == ref
    # the distributed path: every task on its own, results concatenated
    groups = collapse_exact(h)
    plan = plan_bands(groups.unique.size, 8, n_bands=3)
    parts = [band_pairs(groups.unique, plan, t.band_index, (t.mask_start, t.mask_stop)) for t in plan.tasks(4)]
    u, v, d = (np.concatenate(p) for p in zip(*parts))
    keys = u * groups.unique.size + v
    assert np.unique(keys).size == keys.size  # every pair reported by exactly one task
    assert as_sets(pairs_from_unique(groups, u, v, d, spanning=False)) == ref


def test_band_plan_is_exact_by_pigeonhole_and_adapts_to_size():
    for n in (1_000, 1_000_000):
        plan = plan_bands(n, 8)
        assert sum(b.width for b in plan.bands) == 64
        assert plan.max_flips == 8 // len(plan.bands)
        assert max(b.width for b in plan.bands) <= phash_bands.MAX_BAND_WIDTH
    assert len(plan_bands(1_000_000, 8).bands) < len(plan_bands(1_000, 8).bands)  # wide bands pay off at scale
    masks = plan_bands(10, 8, n_bands=3).masks(0)
    assert masks[0] == 0 and len(masks) == len(set(masks.tolist())) == 1 + 22 + 22 * 21 // 2


def test_exact_duplicate_clique_becomes_a_star(components, same_partition):
    rng = np.random.default_rng(3)
    h = rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64, endpoint=True)
    h[100:600] = h[100]  # one image uploaded 500 times
    h[700] = flip_bits(h[100], 3, rng)  # and a near copy of it
    ref = brute_force_hash_pairs(h, 8)
    full = phash_pairs(h, 8, spanning=False)
    assert as_sets(full) == as_sets(ref)
    assert len(full) >= 500 * 499 // 2  # the clique
    star = phash_pairs(h, 8)
    # spanning set: 499 star edges, and each near pair of distinct hashes once, from the group's first item
    assert len(star) == 499 + len(brute_force_hash_pairs(np.unique(h), 8))
    assert {(100, j, 0) for j in range(101, 600)} <= as_sets(star)
    assert (100, 700, 3) in as_sets(star)
    assert same_partition(components(h.size, star.i, star.j), components(h.size, ref.i, ref.j))


def test_huge_bucket_is_scanned_in_bounded_steps(monkeypatch):
    """Hashes that share their high bits pile into one bucket: the scan cuts it into pieces, still exact."""
    rng = np.random.default_rng(5)
    low = rng.integers(0, 2**20, 1500, dtype=np.uint64)
    h = np.concatenate([np.uint64(0xABCDE) << np.uint64(40) | low, rng.integers(0, 2**63, 500, dtype=np.uint64)])
    monkeypatch.setattr(phash_bands, "MAX_CANDIDATES_PER_STEP", 1000)
    plan = plan_bands(h.size, 8, n_bands=3)
    table = build_band_table(np.unique(h), plan.bands[2])
    assert table.counts.max() * (table.counts.max() - 1) > 1000  # the crowded bucket needs several steps
    assert as_sets(phash_pairs(h, 8, spanning=False, n_bands=3)) == as_sets(brute_force_hash_pairs(h, 8))


def test_phash_inputs_and_edge_cases():
    h = np.array([5, 5, 7, 1 << 40], dtype=np.uint64)
    assert as_sets(phash_pairs(h.view(np.int64), 2, spanning=False)) == {(0, 1, 0), (0, 2, 1), (1, 2, 1)}
    assert as_sets(phash_pairs(h, 0)) == {(0, 1, 0)}
    assert len(phash_pairs(np.empty(0, np.uint64), 8)) == 0
    with pytest.raises(TypeError):
        phash_pairs(h.astype(np.float64), 8)
