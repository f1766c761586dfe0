"""The link rule (curation.phases.dedup.link_rule): which pairs its regions link, and what each search is given."""

import numpy as np
import pyarrow as pa
import pytest

from curation.phases.dedup import link_rule
from curation.phases.dedup.link_rule import (
    NO_HASH,
    NO_PDQ,
    LinkRule,
    Region,
    comparisons,
    crop_distances,
    pair_distances,
    pdq_words,
)
from curation.settings import DedupSettings, LinkRegionSettings


def test_a_pair_is_linked_by_any_region_and_a_joint_region_needs_both_signals():
    rule = LinkRule.of([(3, None), (12, 0.8), (24, 0.95)])
    d = np.array([2, 10, 10, 20, 20, 30, NO_HASH])
    c = np.array([0.1, 0.85, 0.7, 0.96, 0.9, 0.99, 0.99])
    assert rule.links(d, c).tolist() == [True, True, False, True, False, False, False]
    # the embedding search's pairs: only the joint regions count (the pHash-alone region has its own search)
    assert rule.confirmed(d, c).tolist() == [False, True, False, True, False, False, False]


def test_what_each_search_is_given():
    rule = LinkRule.of([(3, None), (12, 0.8), (24, 0.95)])
    assert rule.hash_radius == 3 and rule.search_threshold == 0.8
    narrowed = rule.with_radii([-1, -1, 20])  # a region turned off by its radius
    assert narrowed.hash_radius == -1 and narrowed.search_threshold == 0.95
    assert [r.radius for r in narrowed.joint] == [20]
    assert LinkRule.of([(8, None)]).search_threshold is None
    assert "off" in narrowed.describe() and "cosine >= 0.95 and pHash <= 20" in narrowed.describe()


def test_one_phash_alone_region_at_most():
    with pytest.raises(ValueError, match="at most one region"):
        LinkRule.of([(3, None), (5, None)])


def test_a_missing_phash_never_confirms():
    hashes = np.array([0, 0b111, 0], np.uint64)
    d = pair_distances(hashes[[0, 0]], hashes[[1, 2]], np.array([True, True]), np.array([True, False]))
    assert d.tolist() == [3, NO_HASH]
    assert not LinkRule.of([(64, 0.0)]).links(np.array([NO_HASH]), np.array([1.0]))[0]


def test_the_settings_give_the_rule_in_order_and_refuse_a_whole_pool_search_too_wide():
    rule = DedupSettings().rule()
    assert rule.regions[0].min_cosine is None and all(r.min_cosine is not None for r in rule.regions[1:])
    with pytest.raises(ValueError, match="radius <= 32"):
        DedupSettings(links=[{"radius": 40}])


def test_the_crop_distance_is_the_least_of_its_comparisons(monkeypatch):
    rng = np.random.default_rng(0)
    n, k = 300, 5

    def words(*shape):  # PDQs as the stage stores them, read back as uint64 words
        digests = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(int(np.prod(shape)))]
        column = pa.array([b"".join(digests[i : i + shape[-1]]) for i in range(0, len(digests), shape[-1])])
        return pdq_words(column.cast(pa.binary(32 * shape[-1])))[0].reshape(*shape, 4)

    a, b = words(n, 1).reshape(n, 4), words(n, 1).reshape(n, 4)
    ca, cb = words(n, k), words(n, k)
    cb[:100, 2] = a[:100] ^ np.array([0b101, 0, 0, 0], np.uint64)  # b is a crop of a, framed like a's window 2
    valid = rng.random(n) < 0.9
    got = crop_distances(a, ca, b, cb, valid, None)
    whole = lambda x, y: sum(int(u ^ v).bit_count() for u, v in zip(x, y))  # noqa: E731
    for p in range(n):
        hashes = [(a[p], b[p])] + [(a[p], c) for c in cb[p]] + [(b[p], c) for c in ca[p]]
        want = min(whole(x, y) for x, y in hashes) if valid[p] else NO_PDQ
        assert got[p] == want
    assert (got[:100][valid[:100]] <= 2).all() and comparisons(k) == 11
    # unrelated PDQs differ in about half their 256 bits
    assert 100 < np.median(crop_distances(a, ca[:, :0], b, cb[:, :0])) < 156
    monkeypatch.setattr(link_rule, "CHUNK_PAIRS", 7)  # in slices, as a bucket's millions of pairs are
    assert crop_distances(a, ca, b, cb, valid, None).tolist() == got.tolist()
    # no sub-crop hashes (an output scored before them): the PDQ distance
    assert crop_distances(a, np.zeros((n, 0, 4), np.uint64), b, cb).tolist() == [whole(x, y) for x, y in zip(a, b)]


def test_a_crop_region_links_on_the_crop_distance_and_needs_a_cosine():
    rule = LinkRule.of([(3, None), (12, 0.8), (6, 0.85, True)])
    d, c, crop = np.array([20, 20, 20, 5]), np.array([0.9, 0.8, 0.9, 0.9]), np.array([4, 4, 7, 5])
    assert rule.links(d, c, crop).tolist() == [True, False, False, True]
    assert rule.needs_crops and not LinkRule.of([(3, None), (12, 0.8)]).needs_crops
    assert "PDQ crop distance <= 6" in rule.describe()
    assert rule.with_radii([3, 12, -1]).needs_crops is False  # a region turned off reads no crops
    with pytest.raises(ValueError, match="crop distances"):
        rule.links(d, c)
    with pytest.raises(ValueError, match="min_cosine"):
        Region(5, None, True)
    with pytest.raises(ValueError, match="set min_cosine"):
        LinkRegionSettings(radius=5, crops=True)
    assert DedupSettings().rule().needs_crops
