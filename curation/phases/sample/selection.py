"""The arithmetic of the partitioned sample phase (``curation.phases.sample.cluster_sampling``), pure numpy: cluster
counts and targets from the settings, a fixed pseudo-random value per uid, the hierarchy as a Parquet table and as
per-leaf counts, the leaf budgets, and the selection inside a bucket's leaves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from curation.phases.sample import kmeans
from curation.settings import SampleSettings

TRAIN_STREAM, PRIORITY_STREAM = 1, 2  # independent hash streams under one seed

# --- settings -----------------------------------------------------------------------------------------------------


def cluster_counts(n: int, clusters: Sequence[int] | None) -> list[int]:
    """Clusters per level for ``n`` items, as the single-process phase chooses them (``kmeans.balanced_sample``'s
    default of about sqrt(n) leaves and a tenth of that above)."""
    if clusters is not None:
        return [max(1, min(k, n)) for k in clusters]
    if n < 8:
        return [1]
    k1 = max(2, round(np.sqrt(n)))
    return [k1, max(2, k1 // 10)]


def target_count(n: int, settings: SampleSettings) -> int:
    size = settings.target_count
    return kmeans.target_size(n, size, None if size is not None else (settings.target_fraction or 1.0))


# --- per-item pseudo-randomness, independent of where an item is stored ------------------------------------------

_MASK = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uid_uniform(uid: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """A fixed value in [0, 1) per uid, seed and stream (splitmix64 of the uid keyed by both)."""
    z = uid.astype(np.int64).view(np.uint64) ^ np.uint64(_splitmix(_splitmix(seed & _MASK) ^ stream))
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``np.isin`` for a sorted, duplicate-free ``sorted_set``."""
    pos = np.minimum(np.searchsorted(sorted_set, values), max(sorted_set.size - 1, 0))
    return sorted_set[pos] == values if sorted_set.size else np.zeros(values.shape, bool)


# --- the hierarchy, known by per-leaf counts ----------------------------------------------------------------------


@dataclass(frozen=True)
class LeafCountHierarchy(kmeans.ClusterHierarchy):
    """A ``ClusterHierarchy`` whose rows are the leaves, each weighing its number of items: what
    ``kmeans.leaf_budgets`` needs, without per-item assignments. ``assignments[c]`` is leaf c's cluster per level."""

    leaf_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def sizes(self, level: int) -> np.ndarray:
        k = self.centroids[level].shape[0]
        return np.bincount(self.assignments[:, level], weights=self.leaf_counts, minlength=k).astype(np.int64)


def hierarchy_table(h: kmeans.ClusterHierarchy) -> pa.Table:
    """``sample/hierarchy.parquet``: (level, cluster, parent, centroid) per cluster of every level."""
    dim = h.centroids[0].shape[1]
    columns: dict[str, list] = {"level": [], "cluster": [], "parent": [], "centroid": []}
    for level, c in enumerate(h.centroids):
        k = c.shape[0]
        columns["level"].append(np.full(k, level, np.int32))
        columns["cluster"].append(np.arange(k, dtype=np.int32))
        top = level == len(h.parents)
        columns["parent"].append(np.full(k, -1, np.int32) if top else h.parents[level].astype(np.int32))
        columns["centroid"].append(c.astype(np.float32).ravel())
    return pa.table(
        {
            "level": pa.array(np.concatenate(columns["level"])),
            "cluster": pa.array(np.concatenate(columns["cluster"])),
            "parent": pa.array(np.concatenate(columns["parent"])),
            "centroid": pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(columns["centroid"])), dim),
        }
    )


def hierarchy_from_table(t: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Centroids per level and parents per level (level l cluster -> level l+1 cluster) from hierarchy.parquet."""
    level = t.column("level").to_numpy()
    flat = t.column("centroid").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    parent = t.column("parent").to_numpy()
    order = np.lexsort((t.column("cluster").to_numpy(), level))
    centroids, parents = [], []
    for lv in range(int(level.max()) + 1):
        rows = order[level[order] == lv]
        centroids.append(np.ascontiguousarray(flat[rows]))
        parents.append(parent[rows])
    return centroids, parents[:-1]


def leaf_cluster_ids(parents: Sequence[np.ndarray], n_leaves: int) -> np.ndarray:
    """(K1, levels) int32: each leaf's cluster at every level, leaf first."""
    columns = [np.arange(n_leaves, dtype=np.int32)]
    for parent in parents:
        columns.append(parent[columns[-1]].astype(np.int32))
    return np.stack(columns, axis=1)


def leaf_budgets(
    centroids: Sequence[np.ndarray],
    parents: Sequence[np.ndarray],
    counts: np.ndarray,
    chosen: np.ndarray,
    settings: SampleSettings,
) -> np.ndarray:
    """Each leaf's number of new picks, from its items (``counts``) and those chosen before (``chosen``): the target
    split top-down (``kmeans.leaf_budgets``: a cluster smaller than its share is taken whole, the rest goes to its
    siblings); the chosen fill their leaves' shares first and the new picks what is left, as evenly as it goes."""
    hierarchy = LeafCountHierarchy(
        assignments=leaf_cluster_ids(parents, centroids[0].shape[0]),
        centroids=tuple(centroids),
        parents=tuple(parents),
        leaf_distance=np.zeros(0, np.float32),
        leaf_counts=counts,
    )
    rng = np.random.default_rng(settings.seed)
    new = target_count(int(counts.sum()) - int(chosen.sum()), settings)
    budget = kmeans.leaf_budgets(hierarchy, int(chosen.sum()) + new, rng)
    if chosen.any():
        budget = kmeans.water_fill(np.maximum(budget - chosen, 0), new, rng)
    return budget


# --- selection inside leaves (the select tasks run it on a bucket) -----------------------------------------------


def select_in_leaves(
    leaf: np.ndarray, priority: np.ndarray, budget: np.ndarray, balance: np.ndarray | None, seed: int
) -> np.ndarray:
    """Mask of exactly ``budget[l]`` items of each leaf ``l`` (capped at its size), lowest ``priority`` first.

    With ``balance`` values, each leaf's budget is first water-filled over the values present in it (in sorted
    order, random tie-breaks seeded by (seed, leaf)), as ``kmeans.balanced_select`` does. Equal priorities go to
    the earlier item, so items should come in uid order. Each leaf's result depends on its own items only.
    """
    leaf = leaf.astype(np.int64)
    if leaf.size == 0:  # a bucket of a release's images only
        return np.zeros(0, bool)
    if balance is None:
        group, group_budget = leaf, budget.astype(np.int64)
    else:
        values, code = np.unique(balance, return_inverse=True)
        pair = leaf * values.size + code.ravel()  # (leaf, value)
        group_ids, group, group_size = np.unique(pair, return_inverse=True, return_counts=True)
        group = group.ravel()
        group_leaf = group_ids // values.size
        group_budget = np.zeros(group_ids.size, np.int64)
        starts = np.flatnonzero(np.concatenate([[True], group_leaf[1:] != group_leaf[:-1]]))
        for s, e in zip(starts, np.append(starts[1:], group_ids.size)):
            c = int(group_leaf[s])
            want, sizes = int(budget[c]), group_size[s:e]
            if want >= sizes.sum() or e - s == 1:
                group_budget[s:e] = np.minimum(sizes, want)
            elif want > 0:
                group_budget[s:e] = kmeans.water_fill(sizes, want, np.random.default_rng([seed, c]))
    order, rank = kmeans.ranked_groups(group, priority)
    mask = np.zeros(leaf.size, bool)
    mask[order[rank < group_budget[group[order]]]] = True
    return mask


def value_ranks(values: pa.ChunkedArray) -> np.ndarray:
    """Each value's rank among the distinct values (null counts as "None", as the single-process phase has it)."""
    encoded = pc.fill_null(values, "None").combine_chunks().dictionary_encode()
    names = np.asarray(encoded.dictionary.to_pylist(), object)
    rank = np.empty(names.size, np.int64)
    rank[np.argsort(names)] = np.arange(names.size)
    return rank[encoded.indices.to_numpy(zero_copy_only=False)]


def leaf_counts(uid: np.ndarray, leaf: np.ndarray, chosen_from: int | None) -> pa.Table:
    """(leaf, items, chosen) for each leaf present: its items, and those of uid ``chosen_from`` on."""
    leaves, inverse = np.unique(leaf.astype(np.int64), return_inverse=True)
    inverse = inverse.ravel()
    chosen = inverse[uid >= chosen_from] if chosen_from is not None else np.zeros(0, np.int64)
    return pa.table(
        {
            "leaf": leaves,
            "items": np.bincount(inverse, minlength=leaves.size).astype(np.int64),
            "chosen": np.bincount(chosen, minlength=leaves.size).astype(np.int64),
        }
    )
