"""Balanced sampling by hierarchical k-means: flat selections on imbalanced data, exact sizes, determinism."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from curation.phases.reference import balanced_sample
from curation.phases.sample.kmeans import (
    ClusterHierarchy,
    allocate_children,
    balanced_select,
    descend,
    hierarchical_kmeans,
    leaf_budgets,
    routing_levels,
    target_size,
    water_fill,
)

faiss.omp_set_num_threads(2)

N_TRUE = 20
TARGET = 2000


@pytest.fixture(scope="module")
def mixture() -> tuple[np.ndarray, np.ndarray]:
    """20 gaussian clusters in 32-d with sizes from 10 to 5000 (geometric), normalised like embeddings."""
    rng = np.random.default_rng(0)
    sizes = np.geomspace(10, 5000, N_TRUE).astype(int)
    centres = rng.standard_normal((N_TRUE, 32))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.repeat(np.arange(N_TRUE), sizes)
    x = (centres[labels] + 0.12 * rng.standard_normal((labels.size, 32))).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    perm = rng.permutation(labels.size)
    return x[perm], labels[perm]


@pytest.fixture(scope="module")
def hierarchy(mixture) -> ClusterHierarchy:
    return hierarchical_kmeans(mixture[0], (100, N_TRUE), seed=1)


def entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_balanced_selection_is_far_flatter_than_random(mixture):
    x, labels = mixture
    sel = balanced_sample(x, size=TARGET, n_clusters=(100, N_TRUE), seed=1)
    assert sel.indices.size == TARGET and np.unique(sel.indices).size == TARGET
    balanced = np.bincount(labels[sel.indices], minlength=N_TRUE)
    rng = np.random.default_rng(1)
    uniform = np.bincount(labels[rng.choice(labels.size, TARGET, replace=False)], minlength=N_TRUE)
    assert entropy(balanced) > entropy(uniform) + 0.4  # max possible: log(20) = 3.0; uniform gives about 2.1
    assert balanced.max() < 0.5 * uniform.max()  # the dominant concept no longer dominates
    # the five rarest concepts (10..37 items, below a fair share of 100) are largely taken whole; uniform
    # sampling takes about a tenth of them
    sizes = np.bincount(labels, minlength=N_TRUE)
    rare = np.argsort(sizes)[:5]
    assert balanced[rare].sum() >= 0.5 * sizes[rare].sum()
    assert uniform[rare].sum() < 0.25 * sizes[rare].sum()


def test_same_seed_same_selection_other_seed_other_selection(mixture):
    x, _ = mixture
    kw = dict(size=500, n_clusters=(60, 10))
    a = balanced_sample(x, seed=5, **kw)
    b = balanced_sample(x, seed=5, **kw)
    c = balanced_sample(x, seed=6, **kw)
    assert np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.cluster_ids, b.cluster_ids)
    assert not np.array_equal(a.indices, c.indices)
    assert c.indices.size == 500


def test_hierarchy_is_consistent(mixture, hierarchy):
    x, _ = mixture
    assert hierarchy.assignments.shape == (x.shape[0], 2)
    assert hierarchy.centroids[0].shape == (100, 32) and hierarchy.centroids[1].shape == (N_TRUE, 32)
    leaf, top = hierarchy.assignments.T
    assert np.array_equal(top, hierarchy.parents[0][leaf])
    # leaf_distance is the squared distance to the own leaf centroid, which is the nearest centroid
    d = np.sum((x - hierarchy.centroids[0][leaf]) ** 2, axis=1)
    np.testing.assert_allclose(hierarchy.leaf_distance, d, rtol=1e-3, atol=1e-4)
    nearest = np.argmin(((x[:500, None, :] - hierarchy.centroids[0][None]) ** 2).sum(-1), axis=1)
    assert np.mean(nearest == leaf[:500]) > 0.99


def test_three_levels_and_resampling(mixture):
    x, labels = mixture
    h = hierarchical_kmeans(x, (120, 40, 10), seed=2, resample_steps=(1, 5, 5))
    assert h.n_levels == 3 and h.assignments.shape[1] == 3
    for level in range(2):
        assert np.array_equal(h.assignments[:, level + 1], h.parents[level][h.assignments[:, level]])
    sel = balanced_select(h, TARGET, seed=2)
    assert sel.size == TARGET
    counts = np.bincount(labels[sel], minlength=N_TRUE)
    assert entropy(counts) > 2.5


def test_water_fill_is_as_even_as_capacities_allow():
    rng = np.random.default_rng(0)
    for _ in range(300):
        cap = rng.integers(0, 50, rng.integers(1, 30))
        budget = int(rng.integers(0, cap.sum() + 20))
        alloc = water_fill(cap, budget, rng)
        assert alloc.sum() == min(budget, cap.sum())
        assert np.all((alloc >= 0) & (alloc <= cap))
        open_bins = alloc < cap  # a bin below capacity is never more than 1 below the fullest bin
        if open_bins.any():
            assert alloc[open_bins].min() >= alloc.max() - 1
    assert water_fill(np.array([2, 100, 100]), 52, rng).tolist() == [2, 25, 25]


def test_leaf_budgets_split_evenly_top_down(hierarchy):
    rng = np.random.default_rng(0)
    budget = leaf_budgets(hierarchy, TARGET, rng)
    sizes = hierarchy.sizes(0)
    assert budget.sum() == TARGET and np.all(budget <= sizes)
    top = hierarchy.parents[0]
    per_top = np.bincount(top, weights=budget, minlength=N_TRUE)
    top_sizes = hierarchy.sizes(1)
    unsaturated = per_top < top_sizes
    assert per_top[unsaturated].min() >= per_top.max() - 1


def test_closest_mode_takes_the_most_central_items(hierarchy):
    chosen = balanced_select(hierarchy, TARGET, mode="closest", seed=0)
    leaf = hierarchy.assignments[:, 0]
    picked = np.zeros(leaf.size, bool)
    picked[chosen] = True
    for c in np.unique(leaf[chosen]):
        members = leaf == c
        if picked[members].all():
            continue
        # inside a leaf, every chosen item is at least as close as every item left out
        assert hierarchy.leaf_distance[members & picked].max() <= hierarchy.leaf_distance[members & ~picked].min()


def test_balance_key_spreads_picks_over_its_values(mixture, hierarchy):
    x, _ = mixture
    rng = np.random.default_rng(3)
    # a rare value, spread over all clusters: 8% of the items (like profile views among mostly frontal faces)
    key = np.where(rng.random(x.shape[0]) < 0.08, "profile", "frontal")
    plain = balanced_select(hierarchy, TARGET, seed=0)
    keyed = balanced_select(hierarchy, TARGET, seed=0, balance_key=key)
    assert keyed.size == TARGET
    assert np.mean(key[plain] == "profile") < 0.15
    assert np.mean(key[keyed] == "profile") > 0.28  # leaves taken whole keep their 8%, the others reach up to 50%
    # the leaf budgets do not change: the key only moves picks inside leaves
    leaf = hierarchy.assignments[:, 0]
    assert np.array_equal(np.bincount(leaf[plain], minlength=100), np.bincount(leaf[keyed], minlength=100))
    # inside every leaf the picks are as even over the key values as their availability allows
    for c in np.unique(leaf[keyed]):
        available = np.array([np.sum((leaf == c) & (key == v)) for v in ("frontal", "profile")])
        picked = np.array([np.sum((leaf[keyed] == c) & (key[keyed] == v)) for v in ("frontal", "profile")])
        short = picked < available
        assert not short.any() or picked[short].min() >= picked.max() - 1


def test_sizes_fractions_and_limits(mixture, hierarchy):
    x, _ = mixture
    n = x.shape[0]
    assert balanced_select(hierarchy, n + 10, seed=0).size == n  # more than there is: everything
    assert balanced_select(hierarchy, 0, seed=0).size == 0
    assert target_size(n, fraction=0.1) == round(0.1 * n)
    assert target_size(5, fraction=0.5) == 3 and target_size(3, fraction=0.5) == 2  # halves round up
    with pytest.raises(ValueError):
        target_size(n, size=10, fraction=0.1)
    with pytest.raises(ValueError):
        balanced_select(hierarchy, 10, mode="nearest")
    sel = balanced_sample(x[:3000], fraction=0.25, n_clusters=(30, 5), mode="closest", seed=0)
    assert sel.indices.size == 750


def test_the_tree_is_bounded_by_the_fan_out_and_items_descend_it(mixture, hierarchy):
    # at 10^9 items the default levels get one on top; the fan-out never needs more than F children per parent
    assert routing_levels([31623, 3162], 256) == [31623, 3162, 25]
    assert routing_levels([100, 2], 8) == [100, 25, 7, 2] and routing_levels([5], 8) == [5]
    assert allocate_children(np.array([1.0, 2, 3, 4]), 20, 16).tolist() == [2, 4, 6, 8]
    assert allocate_children(np.array([1.0, 1, 1]), 4, 16).sum() == 4
    # a parent above the cap keeps the cap; its excess goes to the others up to twice their share, then is dropped
    assert allocate_children(np.array([10.0, 10, 60]), 20, 8).tolist() == [5, 5, 8]
    assert allocate_children(np.array([0.0, 1, 10, 1000]), 40, 16).tolist() == [1, 1, 1, 16]
    # an item's leaf is the nearest of the children of its nearest top cluster
    x, _ = mixture
    top = np.argmin(((x[:300, None, :] - hierarchy.centroids[1][None]) ** 2).sum(-1), axis=1)
    assert np.array_equal(hierarchy.assignments[:300, 1], top)
    d = ((x[:300, None, :] - hierarchy.centroids[0][None]) ** 2).sum(-1)
    d[hierarchy.parents[0][None, :] != top[:, None]] = np.inf
    assert np.array_equal(hierarchy.assignments[:300, 0], np.argmin(d, axis=1))
    again, _ = descend(x[:300], hierarchy.centroids, hierarchy.parents)
    assert np.array_equal(again, hierarchy.assignments[:300])
