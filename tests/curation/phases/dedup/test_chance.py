"""The chance estimate (curation.phases.dedup.chance): against chance links counted where they are observable, blind
to the copies inside a region, and the radii it fits as N grows."""

import itertools

import numpy as np
import pytest

from curation.phases.dedup import chance
from curation.phases.dedup.link_rule import LinkRule, Region, crop_distances, pair_distances


def _sample(n: int, bits: int, seed: int = 0, dim: int = 16, clusters: int = 20):
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**bits, n, dtype=np.uint64)
    centres = rng.normal(0, 1, (clusters, dim))
    home = rng.integers(0, clusters, n)
    x = (centres[home] + rng.normal(0, 0.6, (n, dim))).astype(np.float32)
    return hashes, x / np.linalg.norm(x, axis=1, keepdims=True), home


def _count_within(hashes: np.ndarray, radius: int) -> int:
    """Pairs within ``radius``, by brute force."""
    total = 0
    for start in range(0, hashes.size, 1000):
        d = pair_distances(hashes[start : start + 1000, None], hashes[None, :])
        i = np.arange(start, min(start + 1000, hashes.size))[:, None]
        total += int(((d <= radius) & (np.arange(hashes.size)[None, :] > i)).sum())
    return total


@pytest.mark.parametrize("radius", [2, 4])
def test_the_estimate_stays_above_the_chance_links_counted_and_near_them(radius):
    # 24 random bits over 6000 hashes: chance pairs within a few bits are common enough to count
    hashes, x, home = _sample(6000, 24)
    measured = chance.measure(len(hashes), hashes, np.ones(len(hashes), bool), x, home, 1.0, 10**6, seed=0)
    counted = _count_within(hashes, radius)
    estimated = chance.region_estimate(measured, Region(radius)).expected(radius)
    assert counted > 20
    assert counted <= estimated <= 8 * counted, (counted, estimated)


@pytest.mark.parametrize("radius", [2, 4])
def test_hashes_with_as_many_ones_as_zeros_are_estimated_on_even_distances(radius):
    # as imagehash's pHash (32 ones of 64): every distance is even, each takes two bits of the normal's mass
    rng = np.random.default_rng(4)
    bits = np.argsort(rng.random((6000, 24)), axis=1) < 12
    hashes = (bits.astype(np.uint64) << np.arange(24, dtype=np.uint64)).sum(axis=1).astype(np.uint64)
    _, x, home = _sample(6000, 24)
    measured = chance.measure(6000, hashes, np.ones(6000, bool), x, home, 1.0, 10**6, seed=0)
    assert measured.global_hist[1::2].sum() == 0
    estimate = chance.region_estimate(measured, Region(radius))
    counted = _count_within(hashes, radius)
    assert estimate.tail.step == 2 and estimate.expected(radius + 1) == estimate.expected(radius)
    assert counted > 20 and counted <= estimate.expected(radius) <= 8 * counted, (counted, estimate.expected(radius))
    # radii are fitted on the distances that occur: an odd one would read wider than it links
    fitted = chance.decide(measured, LinkRule.of([(8, None)]), estimate.expected(radius) * 1.5 / 6000).rule
    assert fitted.regions[0].radius == radius
    random = chance.measure(6000, *[_sample(6000, 24)[0], np.ones(6000, bool)], x, home, 1.0, 10**6, seed=0)
    assert chance.region_estimate(random, Region(radius)).tail.step == 1


@pytest.mark.parametrize("radius", [1, 3])
def test_the_crop_distance_estimate_stays_above_its_chance_links_counted(radius):
    # PDQs varying in 24 random bits, and 8 sub-crop PDQs per item a few bits off its own (as a real sub-crop's is):
    # the union bound counts each comparison as independent, so it may only err high
    hashes, x, home = _sample(3000, 24, clusters=1)
    rng = np.random.default_rng(2)
    flips = np.zeros((3000, 8), np.uint64)
    for _ in range(3):
        flips |= np.uint64(1) << rng.integers(0, 24, (3000, 8)).astype(np.uint64)
    pdq = np.zeros((3000, 4), np.uint64)
    pdq[:, 1] = hashes
    crops = np.repeat(pdq[:, None], 8, axis=1)
    crops[:, :, 1] ^= flips
    sample = chance.PdqSample(pdq, np.ones(3000, bool), 8)
    measured = chance.measure(3000, hashes, np.ones(3000, bool), x, home, 1.0, 10**6, seed=0, pdq=sample)
    assert chance.ChanceSample.from_json(measured.to_json()).crop_count == 8
    i, j = np.triu_indices(3000, 1)
    counted = int((crop_distances(pdq[i], crops[i], pdq[j], crops[j]) <= radius).sum())
    plain = chance.region_estimate(measured, Region(radius, -1.0)).expected(radius)
    estimated = chance.region_estimate(measured, Region(radius, -1.0, crops=True)).expected(radius)
    assert estimated == pytest.approx(17 * plain)
    assert counted > 20 and counted <= estimated, (counted, estimated)


def test_copies_inside_a_region_are_not_counted_as_chance():
    hashes, x, home = _sample(4000, 48)
    rng = np.random.default_rng(1)
    before = chance.measure(4000, hashes, np.ones(4000, bool), x, home, 1.0, 10**6, seed=0)
    # a third of the items become copies of another item of their cluster: a few pHash bits off, at cosine ~0.98
    dst = rng.choice(4000, 1300, replace=False)
    src = np.array([rng.choice(np.flatnonzero(home == home[d])) for d in dst])
    hashes, x = hashes.copy(), x.copy()
    hashes[dst] = hashes[src] ^ np.uint64(0b1011)
    x[dst] = x[src] + 0.03 * rng.normal(0, 1, x[src].shape)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    after = chance.measure(4000, hashes, np.ones(4000, bool), x, home, 1.0, 10**6, seed=0)
    for region in (Region(3), Region(12, 0.8), Region(24, 0.95)):
        a, b = chance.region_estimate(before, region), chance.region_estimate(after, region)
        assert abs(a.tail.mean - b.tail.mean) < 1.5, region
        assert b.expected(region.radius) < 3 * a.expected(region.radius) + 1, region


def test_radii_shrink_as_the_pool_grows_and_the_estimate_stays_within_the_bound():
    hashes, x, home = _sample(4000, 48)
    rule = LinkRule.of([(8, None), (12, 0.8), (24, 0.5)])
    radii = []
    for n in (10**2, 10**5, 10**9):
        measured = chance.measure(n, hashes, np.ones(4000, bool), x, home, 3.0, 10**6, seed=0)
        result = chance.decide(measured, rule, 1e-4)
        assert result.expected <= result.bound
        radii.append([r.radius for r in result.rule.regions])
        assert result.summary()["regions"][0]["configured_radius"] == 8
    assert radii[0][:2] == [8, 12]  # a small pool affords those as configured
    for small, large in itertools.pairwise(radii):
        assert all(b <= a for a, b in zip(small, large)) and small != large


def test_fixed_radii_over_the_bound_stop_with_the_setting_to_change_or_go_on_when_allowed():
    hashes, x, home = _sample(4000, 48)
    measured = chance.measure(10**9, hashes, np.ones(4000, bool), x, home, 3.0, 10**6, seed=0)
    rule = LinkRule.of([(8, None), (12, 0.8)])
    with pytest.raises(chance.ChanceBoundError, match=r"lower dedup\.links\[\d\]\.radius \((to \d+|or remove)"):
        chance.decide(measured, rule, 1e-4, fit_radii=False)
    allowed = chance.decide(measured, rule, 1e-4, fit_radii=False, allow=True)
    assert allowed.allowed and allowed.expected > allowed.bound and allowed.summary()["allowed_over_bound"]
    assert chance.ChanceSample.from_json(measured.to_json()).global_hist.tolist() == measured.global_hist.tolist()


def test_a_region_wide_enough_to_hold_its_whole_population_counts_every_pair():
    hashes, x, home = _sample(3000, 48)
    measured = chance.measure(3000, hashes, np.ones(3000, bool), x, home, 1.0, 10**6, seed=0)
    wide = chance.region_estimate(measured, Region(64, 0.5))  # no pair lies beyond 64 bits
    at_least = measured.cluster_weighted[chance._bin_of_threshold(0.5) :].sum()
    assert at_least > 100 and wide.expected(64) >= at_least
    assert chance.region_estimate(measured, Region(32)).expected(32) >= 0.95 * measured.hashed_pairs


def test_one_cluster_holding_the_whole_sample_is_measured_in_bounded_memory():
    hashes, x, _ = _sample(30_000, 48)
    measured = chance.measure(10**6, hashes, np.ones(30_000, bool), x, np.zeros(30_000, int), 1.0, 10**5, seed=0)
    assert measured.cluster_raw.sum() == chance.MAX_PAIRS_PER_CLUSTER  # of 4.5e8 pairs, a sample
