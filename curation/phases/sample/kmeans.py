"""Phase 3 "sample": balanced selection by hierarchical k-means (Vo et al. 2024, "Automatic data curation for
self-supervised learning: a clustering-based approach").

Web data is long-tailed: a few concepts (one pose, one kind of scene) fill most of the pool. Plain k-means puts
most centroids where the data is dense, so sampling "the same number per cluster" still follows the density.
The paper's remedy, reproduced here:

- ``hierarchical_kmeans``: k-means on the embeddings (level 1), then k-means on the level-1 centroids (level 2),
  and so on; each level clusters the previous level's centroids, unweighted, so dense regions stop dominating.
  Optional resampling steps per level refit the centroids on the ``r`` points closest to each centroid, which
  spreads them more uniformly over the support of the data.
- ``balanced_select``: walk the hierarchy top-down, splitting each cluster's budget as evenly as possible over
  its children (a child smaller than its share is taken whole and the rest goes to the others), and at the
  leaves pick items at random or closest to the centroid. An optional balancing key (e.g. head-pose class)
  spreads each leaf's picks over its values the same way.

faiss does the k-means (OpenMP: its threads are the caller's setting). Everything is deterministic under a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Mode = Literal["random", "closest"]


@dataclass(frozen=True)
class ClusterHierarchy:
    """The result of hierarchical k-means. Level 0 is the leaves (clusters of items)."""

    assignments: np.ndarray  # (N, n_levels) int32: the item's cluster at each level
    centroids: tuple[np.ndarray, ...]  # per level, (k_level, D) float32
    parents: tuple[np.ndarray, ...]  # parents[l][c]: the level-(l+1) cluster holding level-l cluster c
    leaf_distance: np.ndarray  # (N,) float32: squared L2 distance of each item to its leaf centroid

    @property
    def n_levels(self) -> int:
        return len(self.centroids)

    def sizes(self, level: int) -> np.ndarray:
        """Number of items under each cluster of ``level``."""
        return np.bincount(self.assignments[:, level], minlength=self.centroids[level].shape[0])


def _kmeans(
    x: np.ndarray, k: int, seed: int, n_iter: int, max_points_per_centroid: int, init_centroids=None
) -> np.ndarray:
    import faiss

    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=n_iter,
        seed=seed,
        max_points_per_centroid=max_points_per_centroid,
        min_points_per_centroid=1,  # upper levels cluster few centroids; silences faiss's warning
        init_method=faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS,  # as the paper: better spread than random init
    )
    km.train(x, init_centroids=init_centroids)
    assert km.centroids is not None  # train() sets them
    return km.centroids


def assign_nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import faiss

    index = faiss.IndexFlatL2(centroids.shape[1])
    index.add(centroids)
    dist, assign = index.search(x, 1)
    return assign.ravel().astype(np.int32), dist.ravel().astype(np.float32)


def _closest_per_cluster(assign: np.ndarray, dist: np.ndarray, r: int) -> np.ndarray:
    """Indices of the ``r`` points of each cluster nearest its centroid."""
    order = np.lexsort((dist, assign))
    sorted_assign = assign[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_assign[1:] != sorted_assign[:-1]]))
    rank = np.arange(order.size) - np.repeat(starts, np.diff(np.concatenate([starts, [order.size]])))
    return np.sort(order[rank < r])


def _fit_level(
    x: np.ndarray, k: int, *, seed: int, n_iter: int, resample_steps: int, resample_size: int, mpc: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One level: k-means, then ``resample_steps`` refits on the points closest to each centroid.

    Each refit starts afresh (k-means++ on the subset, as the paper's code does): started from the current
    centroids it stays in the same local optimum and the resampling changes little.
    """
    centroids = _kmeans(x, k, seed, n_iter, mpc)
    assign, dist = assign_nearest(x, centroids)
    for step in range(resample_steps):
        subset = _closest_per_cluster(assign, dist, resample_size)
        if subset.size < k:  # too few points to refit k centroids
            break
        centroids = _kmeans(x[subset], k, seed + 1 + step, n_iter, mpc)
        assign, dist = assign_nearest(x, centroids)
    return centroids, assign, dist


def hierarchical_kmeans(
    x: np.ndarray,
    n_clusters: Sequence[int],
    *,
    seed: int = 0,
    n_iter: int = 20,
    resample_steps: Sequence[int] | None = None,
    resample_size: Sequence[int] | None = None,
    max_points_per_centroid: int = 256,
) -> ClusterHierarchy:
    """Cluster ``x`` (N x D float32) into ``n_clusters[0]`` leaves, their centroids into ``n_clusters[1]``, ...

    ``resample_steps`` per level defaults to 0 at level 1 (the costly level; the paper skips it there too) and 10
    above; ``resample_size`` (points kept per cluster when refitting) defaults to half the level's mean cluster
    size, as the paper's configurations do. Level 1 k-means trains on at most ``max_points_per_centroid`` points
    per centroid (faiss subsamples), then assigns every item.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_levels = len(n_clusters)
    if n_levels < 1 or any(k < 1 for k in n_clusters):
        raise ValueError(f"n_clusters must be positive cluster counts per level, got {list(n_clusters)}")
    steps = list(resample_steps) if resample_steps is not None else [0] + [10] * (n_levels - 1)
    if len(steps) != n_levels or (resample_size is not None and len(resample_size) != n_levels):
        raise ValueError("resample_steps and resample_size need one entry per level")

    level_x = x
    centroids, parents, columns = [], [], []
    leaf_distance = np.empty(0, np.float32)
    for level, k_wanted in enumerate(n_clusters):
        k = min(k_wanted, level_x.shape[0])
        size = resample_size[level] if resample_size is not None else max(2, level_x.shape[0] // k // 2)
        c, assign, dist = _fit_level(
            level_x,
            k,
            seed=seed + 1000 * level,
            n_iter=n_iter,
            resample_steps=steps[level],
            resample_size=size,
            mpc=max_points_per_centroid,
        )
        centroids.append(c)
        if level == 0:
            columns.append(assign)
            leaf_distance = dist
        else:
            parents.append(assign)  # level-(l-1) cluster -> level-l cluster
            columns.append(assign[columns[-1]])
        level_x = c
    return ClusterHierarchy(np.stack(columns, axis=1), tuple(centroids), tuple(parents), leaf_distance)


def water_fill(capacity: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``budget`` over bins as evenly as their capacities allow (sum == min(budget, capacity.sum())).

    Every bin gets ``min(capacity, t)`` for the largest level ``t`` that fits; the few units left over go one
    each to randomly chosen bins that still have room (the paper breaks the tie at random too).
    """
    capacity = np.asarray(capacity, dtype=np.int64)
    if budget >= capacity.sum():
        return capacity.copy()
    if budget <= 0:
        return np.zeros_like(capacity)
    cs = np.sort(capacity)
    n = cs.size
    prefix = np.concatenate([[0], np.cumsum(cs)[:-1]])  # sum of the bins below position i
    filled = prefix + cs * (n - np.arange(n))  # total taken if the level were cs[i]
    i = int(np.searchsorted(filled, budget))  # first position whose level reaches the budget
    level = (budget - prefix[i]) // (n - i)
    alloc = np.minimum(capacity, level)
    remainder = budget - int(alloc.sum())
    if remainder:
        room = np.flatnonzero(capacity > level)
        alloc[rng.choice(room, remainder, replace=False)] += 1
    return alloc


def _split_among_children(
    budget: np.ndarray, parent: np.ndarray, child_capacity: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Each parent's budget water-filled over its children (``parent[c]`` is child c's parent)."""
    child_budget = np.zeros(parent.size, np.int64)
    order = np.argsort(parent, kind="stable")
    bounds = np.searchsorted(parent[order], np.arange(budget.size + 1))
    for p in np.flatnonzero(budget):
        children = order[bounds[p] : bounds[p + 1]]
        child_budget[children] = water_fill(child_capacity[children], int(budget[p]), rng)
    return child_budget


def leaf_budgets(hierarchy: ClusterHierarchy, size: int, rng: np.random.Generator) -> np.ndarray:
    """How many items each leaf gives, allocating ``size`` top-down through the hierarchy."""
    capacity = [hierarchy.sizes(0)]
    for level, parent in enumerate(hierarchy.parents, start=1):
        k = hierarchy.centroids[level].shape[0]
        capacity.append(np.bincount(parent, weights=capacity[-1], minlength=k).astype(np.int64))
    budget = water_fill(capacity[-1], size, rng)
    for level in range(hierarchy.n_levels - 1, 0, -1):
        budget = _split_among_children(budget, hierarchy.parents[level - 1], capacity[level - 1], rng)
    return budget


def ranked_groups(group: np.ndarray, priority: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items sorted by group then priority, and each one's rank inside its group."""
    order = np.lexsort((priority, group))
    g = group[order]
    starts = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1]]))
    lengths = np.diff(np.concatenate([starts, [g.size]]))
    rank = np.arange(g.size) - np.repeat(starts, lengths)
    return order, rank


def balanced_select(
    hierarchy: ClusterHierarchy,
    size: int,
    *,
    mode: Mode = "random",
    balance_key: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Indices (sorted) of ``min(size, N)`` items chosen by hierarchical balanced sampling.

    ``mode`` picks inside a leaf: "random" (what the paper found best) or "closest" to the leaf centroid (most
    typical first). ``balance_key`` (one integer or string per item) spreads each leaf's picks evenly over the
    key's values before picking inside each value by ``mode``.
    """
    n = len(hierarchy.assignments)
    rng = np.random.default_rng(seed)
    leaf = hierarchy.assignments[:, 0].astype(np.int64)
    budget = leaf_budgets(hierarchy, int(size), rng)
    if mode == "random":
        priority = rng.random(n)
    elif mode == "closest":
        priority = hierarchy.leaf_distance
    else:
        raise ValueError(f"mode must be 'random' or 'closest', got {mode!r}")

    if balance_key is None:
        order, rank = ranked_groups(leaf, priority)
        chosen = order[rank < budget[leaf[order]]]
    else:
        _, code = np.unique(np.asarray(balance_key), return_inverse=True)
        n_values = int(code.max()) + 1 if n else 1
        group = leaf * n_values + code.ravel()  # (leaf, key value) pairs
        group_ids, group_of, group_size = np.unique(group, return_inverse=True, return_counts=True)
        group_budget = _split_among_children(budget, group_ids // n_values, group_size, rng)
        order, rank = ranked_groups(group_of.ravel(), priority)
        chosen = order[rank < group_budget[group_of.ravel()[order]]]
    return np.sort(chosen)


def target_size(n: int, size: int | None = None, fraction: float | None = None) -> int:
    """The number of items to select: an absolute ``size`` or a ``fraction`` of ``n`` (exactly one of them)."""
    if (size is None) == (fraction is None):
        raise ValueError("give exactly one of size and fraction")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        return min(n, int(np.floor(fraction * n + 0.5)))  # half rounds up (Python's round() goes to even)
    assert size is not None  # exactly one of them was given
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    return min(int(size), n)
