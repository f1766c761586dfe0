"""The plan of the distributed pHash search (curation.phases.dedup.phash_plan): bands, families, partitions, and a
family's search finding exactly the pairs it reports."""

from __future__ import annotations

import numpy as np

from curation.phases.dedup import phash_bands
from curation.phases.dedup.phash_plan import family_pairs, plan_pairs


def test_plan_caps_partitions_at_the_number_of_groups():
    plan = plan_pairs(10**9, 8)
    assert [b.width for b in plan.bands.bands] == [22, 21, 21] and len(plan.families) == 9
    assert plan.partitions == sum(1 << f.sub.width for f in plan.families) == 1280
    assert plan_pairs(10**6, 8).partitions == 9
    assert len(plan_pairs(10**6, 0).families) == 1


def test_each_pair_within_the_radius_is_reported_by_exactly_one_family():
    rng = np.random.default_rng(7)
    base = rng.integers(0, 2**63, 300, dtype=np.uint64)
    flips = np.uint64(1) << rng.integers(0, 64, (300, 3)).astype(np.uint64)
    near = base ^ flips[:, 0] ^ flips[:, 1] ^ flips[:, 2]  # within 3 bits of its base
    unique = np.unique(np.concatenate([base, near]))
    plan = plan_pairs(unique.size, 8)
    found: list[tuple[int, int]] = []
    for index in range(len(plan.families)):
        family = plan.partition_of(index, unique)
        for part in np.unique(family):
            members = unique[family == part]
            u, v, d = family_pairs(members, plan, index)
            assert np.all(d <= 8)
            found += [tuple(sorted((int(members[a]), int(members[b])))) for a, b in zip(u, v)]
    assert len(found) == len(set(found)), "a pair reported by two families"
    x = unique[:, None] ^ unique[None, :]
    distance = phash_bands.popcount64(x.ravel()).reshape(x.shape)
    i, j = np.nonzero(np.triu(distance <= 8, k=1))
    assert set(found) == {tuple(sorted((int(unique[a]), int(unique[b])))) for a, b in zip(i, j)}
