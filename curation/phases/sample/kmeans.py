"""Phase 3 "sample": balanced selection by hierarchical k-means (Vo et al. 2024, "Automatic data curation for
self-supervised learning: a clustering-based approach").

Web data is long-tailed: a few concepts (one pose, one kind of scene) fill most of the pool. Plain k-means puts
most centroids where the data is dense, so sampling "the same number per cluster" still follows the density.
The paper's remedy, reproduced here:

- ``hierarchical_kmeans``: a tree of clusters fitted top-down: the top level on a uniform share of the items,
  then each cluster's children on that cluster's own items, in fits of at most ``max_fanout`` clusters, so that no
  fit grows with the pool and an item finds its leaf by descending the tree (``descend``). Above the leaves, a fit
  clusters the centroids of a finer k-means of its items, unweighted, as the paper clusters each level's centroids
  into the next: dense regions stop dominating the upper levels. Resampling steps per level refit the centroids
  on the ``r`` points closest to each centroid, which spreads them more uniformly over the support of the data.
- ``balanced_select``: walk the hierarchy top-down, splitting each cluster's budget as evenly as possible over
  its children (a child smaller than its share is taken whole and the rest goes to the others), and at the
  leaves pick items at random or closest to the centroid. An optional balancing key (e.g. head-pose class)
  spreads each leaf's picks over its values the same way.

faiss does the k-means (OpenMP: its threads are the caller's setting). Everything is deterministic under a seed.
"""

from __future__ import annotations

import math
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


def routing_levels(n_clusters: Sequence[int], max_fanout: int) -> list[int]:
    """Clusters per level, fine to coarse: ``n_clusters`` with levels added where a cluster would otherwise have more
    than ``max_fanout`` children on average, and on top until the top level has at most ``max_fanout`` clusters.
    An added level has a cluster per ``max_fanout / 2`` below it: room for denser clusters to take more children."""
    if max_fanout < 4:
        raise ValueError(f"max_fanout must be at least 4, got {max_fanout}")
    half = max_fanout // 2
    levels = [int(n_clusters[0])]
    for k in n_clusters[1:]:
        k = min(int(k), levels[-1])
        while math.ceil(levels[-1] / k) > max_fanout:
            levels.append(math.ceil(levels[-1] / half))
        levels.append(k)
    while levels[-1] > max_fanout:
        levels.append(math.ceil(levels[-1] / half))
    return levels


def training_fraction(k: int, training_points_per_cluster: int, n: int) -> float:
    """The share of the items (those of lowest training key) that a level of ``k`` clusters is trained on."""
    return min(1.0, k * training_points_per_cluster / max(n, 1))


def allocate_children(weight: np.ndarray, total: int, cap: int) -> np.ndarray:
    """Children per parent: one each, the rest of ``total`` in proportion to ``weight`` (largest shares first), at
    most ``cap`` each. Dense parents get more children, as the leaves of a flat k-means follow the density. What a
    parent above ``cap`` cannot take goes to the others, each up to twice its own share (its children keep at least
    half the training items a child has on average); beyond that the level has fewer clusters than ``total``."""
    w = np.asarray(weight, np.float64)
    ideal = w * (total / w.sum()) if w.sum() > 0 else np.full(w.size, total / max(w.size, 1))
    capacity = np.minimum(cap, np.maximum(1, np.ceil(2 * ideal))).astype(np.int64)
    alloc = np.ones(w.size, np.int64)
    free = min(int(total), int(capacity.sum())) - w.size
    while free > 0:
        open_ = np.flatnonzero(alloc < capacity)
        share = w[open_] * free / w[open_].sum() if w[open_].sum() > 0 else np.full(open_.size, free / open_.size)
        add = np.minimum(np.floor(share).astype(np.int64), capacity[open_] - alloc[open_])
        if not add.any():  # every share below one: the largest get one each
            alloc[open_[np.argsort(-share, kind="stable")[:free]]] += 1
            break
        alloc[open_] += add
        free -= int(add.sum())
    return alloc


def nearest(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``assign_nearest``, whose result for a row does not depend on the other rows searched with it: faiss computes
    fewer than 20 queries another way (distances that differ in the last bits), so fewer are padded to 20."""
    n = x.shape[0]
    if 0 < n < 20:
        assign, dist = assign_nearest(np.concatenate([x, np.repeat(x[:1], 20 - n, axis=0)]), centroids)
        return assign[:n], dist[:n]
    return assign_nearest(x, centroids)


def descend(
    x: np.ndarray, centroids: Sequence[np.ndarray], parents: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Each item's cluster at every level (fine to coarse, as ``ClusterHierarchy.assignments``) and its squared
    distance to the finest one: the nearest top centroid, then the nearest of that cluster's children, and so on.
    Work per item: the sum of the fan-outs on its path, not the number of leaves."""
    n_levels = len(centroids)
    columns: list[np.ndarray] = [np.empty(0, np.int32)] * n_levels
    cur, dist = nearest(x, centroids[-1])
    columns[-1] = cur
    for level in range(n_levels - 2, -1, -1):
        kids_order, kids_bounds = _groups(parents[level], centroids[level + 1].shape[0])
        rows_order, rows_bounds = _groups(cur, centroids[level + 1].shape[0])
        nxt, dist = np.empty(x.shape[0], np.int32), np.empty(x.shape[0], np.float32)
        for p in np.flatnonzero(np.diff(rows_bounds)):
            rows = rows_order[rows_bounds[p] : rows_bounds[p + 1]]
            kids = kids_order[kids_bounds[p] : kids_bounds[p + 1]]
            a, d = nearest(x[rows], centroids[level][kids])
            nxt[rows], dist[rows] = kids[a], d
        columns[level] = cur = nxt
    return np.stack(columns, axis=1), dist


def _groups(label: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices grouped by label (stable) and the bounds of each label's group."""
    order = np.argsort(label, kind="stable")
    return order, np.searchsorted(label[order], np.arange(k + 1))


@dataclass(frozen=True)
class Children:
    """The clusters fitted under consecutive parents, in parent order (each parent's children consecutive)."""

    centroids: np.ndarray  # (k, D) float32
    parent: np.ndarray  # (k,) int32
    weight: np.ndarray  # (k,) float64: items of the level's training set estimated in each
    points: int  # training points the k-means ran on


def fit_children(
    x: np.ndarray,
    key: np.ndarray,
    parent: np.ndarray,
    first_parent: int,
    children: np.ndarray,
    parent_centroids: np.ndarray | None,
    *,
    level: int,
    seed: int,
    n_iter: int = 20,
    resample_steps: int = 0,
    grandchildren: int = 0,
    max_points_per_centroid: int = 256,
) -> Children:
    """k-means of each parent's items (``parent[i]``, parents ``first_parent`` on) into ``children[j]`` clusters.

    ``x`` holds the level's training items in a fixed order (by uid); a parent with more than ``children[j]`` x
    ``max_points_per_centroid`` of them trains on those of lowest ``key``. Above the leaves (``grandchildren``: the
    level below's clusters per cluster of this one), the children cluster the centroids of a finer k-means of the
    items (about ``grandchildren`` per child, at least 4 items each), unweighted, as the paper clusters the level
    below's centroids: dense regions stop dominating the upper levels. Each parent's k-means is seeded by
    (seed, level, parent) and sees its own items only, so that parents can be fitted in any grouping. A parent
    without items keeps one child: its own centroid (``parent_centroids[j]``; None for the top level's one parent,
    which must have items).
    """
    order, bounds = _groups(parent - first_parent, len(children))
    centroids, parents, points = [], [], 0
    weights: list[np.ndarray] = []
    for j, k in enumerate(children):
        rows = np.sort(order[bounds[j] : bounds[j + 1]])
        p = first_parent + j
        if rows.size == 0:
            if parent_centroids is None:
                raise ValueError(f"no training items for level {level}: raise training_points_per_cluster")
            centroids.append(parent_centroids[j : j + 1].astype(np.float32))
            parents.append(np.full(1, p, np.int32))
            weights.append(np.zeros(1))
            continue
        cap = int(k) * max_points_per_centroid
        used = rows if rows.size <= cap else np.sort(rows[np.argpartition(key[rows], cap - 1)[:cap]])
        kk = min(int(k), used.size)
        p_seed = int(np.random.SeedSequence([seed & 0xFFFFFFFF, level, p]).generate_state(1)[0] >> 1)
        points_x = x[used]
        fine = min(kk * grandchildren, used.size // 4)
        if fine > kk:  # cluster a finer, density-following clustering's centroids, unweighted (the paper's levels)
            points_x = _kmeans(points_x, fine, p_seed + 7919, n_iter, max_points_per_centroid)
        c, _, _ = _fit_level(
            points_x,
            kk,
            seed=p_seed,
            n_iter=n_iter,
            resample_steps=resample_steps,
            resample_size=max(2, points_x.shape[0] // kk // 2),
            mpc=max_points_per_centroid,
        )
        assign = nearest(x[used], c)[0]
        centroids.append(c)
        parents.append(np.full(kk, p, np.int32))
        weights.append(np.bincount(assign, minlength=kk) * (rows.size / used.size))
        points += used.size
    return Children(np.concatenate(centroids), np.concatenate(parents), np.concatenate(weights), points)


def grandchildren(levels: Sequence[int], level: int) -> int:
    """Clusters of the level below per cluster of ``level`` (0 at the leaves)."""
    return math.ceil(levels[level - 1] / levels[level]) if level else 0


def default_resample_steps(n_levels: int) -> list[int]:
    """0 at the leaves (the costly level; the paper skips it there too), 10 above."""
    return [0] + [10] * (n_levels - 1)


def hierarchical_kmeans(
    x: np.ndarray,
    n_clusters: Sequence[int],
    *,
    seed: int = 0,
    n_iter: int = 20,
    resample_steps: Sequence[int] | None = None,
    max_fanout: int = 256,
    training_points_per_cluster: int = 64,
    max_points_per_centroid: int = 256,
    train_key: np.ndarray | None = None,
) -> ClusterHierarchy:
    """Cluster ``x`` (N x D float32) into about ``n_clusters[0]`` leaves under ``n_clusters[1]`` clusters, ...,
    top-down, in fits of at most ``max_fanout`` clusters each (levels added by ``routing_levels`` where needed).

    The top level is trained on the items of lowest ``train_key`` (default: random under ``seed``), about
    ``training_points_per_cluster`` per cluster (``training_fraction``); each level below on its own such share,
    routed down the levels above (``descend``), each parent's children fitted on its own items (``fit_children``),
    their number allocated over the parents in proportion to the parent's items (``allocate_children``). Every item
    then descends the tree. ``resample_steps`` (per level of the result) refit each fit on the items closest to its
    centroids (``_fit_level``). The partitioned phase (``curation.phases.sample.cluster_sampling``) runs the same
    fits, a group of parents per task.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    if len(n_clusters) < 1 or any(k < 1 for k in n_clusters):
        raise ValueError(f"n_clusters must be positive cluster counts per level, got {list(n_clusters)}")
    levels = routing_levels([min(k, max(n, 1)) for k in n_clusters], max_fanout)
    steps = list(resample_steps) if resample_steps is not None else default_resample_steps(len(levels))
    if len(steps) != len(levels):
        raise ValueError(f"resample_steps needs one entry per level of {levels}")
    key = np.asarray(train_key if train_key is not None else np.random.default_rng(seed).random(n))
    centroids: list[np.ndarray] = [np.empty(0)] * len(levels)
    parents: list[np.ndarray] = [np.empty(0)] * (len(levels) - 1)
    weight, above = np.array([float(n)]), None
    for level in range(len(levels) - 1, -1, -1):
        fit = np.flatnonzero(key < training_fraction(levels[level], training_points_per_cluster, n))
        route = np.zeros(fit.size, np.int32)  # the top level's one parent
        if level + 1 < len(levels):
            route = descend(x[fit], centroids[level + 1 :], parents[level + 1 :])[0][:, 0]
        children = allocate_children(weight, levels[level], max_fanout)
        fitted = fit_children(
            x[fit], key[fit], route, 0, children, above, level=level, seed=seed, n_iter=n_iter,
            resample_steps=steps[level], grandchildren=grandchildren(levels, level),
            max_points_per_centroid=max_points_per_centroid,
        )  # fmt: skip
        centroids[level] = above = fitted.centroids
        if level + 1 < len(levels):
            parents[level] = fitted.parent
        weight = fitted.weight
    assignments, leaf_distance = descend(x, centroids, parents)
    return ClusterHierarchy(assignments, tuple(centroids), tuple(parents), leaf_distance)


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
