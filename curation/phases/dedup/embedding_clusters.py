"""The maths of the embedding pair search, free of storage and Ray: the k-means centroids and the probe rule that
cut the embedding space into clusters, the plan that packs clusters into buckets, and the exact search inside one
cluster, whose k-NN results ``threshold_neighbours`` turns into pairs (as the single-process reference's do).
``curation.phases.dedup.embedding_pairs`` describes the whole method and its sizes."""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass

import numpy as np

from common.console import plural
from curation.phases.dedup.link_rule import Region

POINTS_PER_CENTROID = 64  # k-means training rows per centroid
KMEANS_ITERATIONS = 10
HOLDOUT_EVERY = 5  # every 5th sample row predicts cluster sizes: training rows sit closer to their centroids
SATURATED_WARNING = 0.2  # see ProbeRule


def default_cluster_size(n: int) -> int:
    """sqrt(N / 2): about equal work in the assignment (N K D) and the search (~3 N cluster_size D)."""
    return max(16, round(math.sqrt(n / 2)))


@dataclass(frozen=True)
class Centroids:
    """Cluster centres and the local spacing of each: its mean distance to its nearest other centres."""

    points: np.ndarray  # (K, D) float32
    spacing: np.ndarray  # (K,) float32

    @classmethod
    def of(cls, points: np.ndarray, neighbours: int) -> Centroids:
        import faiss

        points = np.ascontiguousarray(points, dtype=np.float32)
        d2, _ = faiss.knn(points, points, min(neighbours + 1, len(points)), metric=faiss.METRIC_L2)
        spacing = np.sqrt(np.maximum(d2[:, 1:], 0)).mean(axis=1) if d2.shape[1] > 1 else np.zeros(len(points))
        return cls(points, spacing.astype(np.float32))


@dataclass(frozen=True)
class ProbeRule:
    """The clusters besides its home in which a survivor is searched (its probes).

    For a pair (a, b) with homes A and B (centroids c_A, c_B) and δ = |b - a| <= √(2 - 2 t) at threshold t:
    d²(b, A) - d²(b, B) = d²(a, A) - d²(a, B) + 2 (b - a)·(c_B - c_A) <= 2 δ |c_A - c_B|. Probing every cluster
    within that margin of the home finds every pair, but in high dimension the bound is loose by about √D and takes
    in nearly every cluster. An offset in a random direction projects on c_A - c_B by about δ |c_A - c_B| / √D: a
    cluster is probed when its squared distance exceeds the home's by at most ``z`` times that (|c_A - c_B| taken
    as the home's spacing), and at most ``max_probes`` of the nearest are.
    Survivors deep inside their cluster probe none, those near a boundary several. On a 384-d Gaussian mixture
    (100k survivors in 447 clusters), z = 1 and up to 7 probes found 99.8% of the exact pairs with 2.5 rows per
    survivor, where a fixed 1, 2 or 3 probes found 96%, 98.6% and 99.5% with 2, 3 and 4 rows per survivor.

    The rule fails where clusters are small against the near-duplicate radius (a tight region, such as thousands of
    near-identical images, cut into many clusters): pairs then straddle boundaries more often than the margin
    allows, and many survivors would probe more than ``max_probes`` clusters. The plan measures that share
    (``saturated``) on held-out sample rows and warns above 20%. Seen: 6-10% on the mixture above (recall
    0.994-0.998); 44-65% on a tight blob holding most survivors (recall 0.98-0.82), 0% and recall 1.0 there once
    ``cluster_size`` was raised.
    """

    max_probes: int
    z: float
    threshold: float

    def centroids(self, points: np.ndarray) -> Centroids:
        return Centroids.of(points, self.max_probes)

    def ranked(self, x: np.ndarray, centroids: Centroids) -> np.ndarray:
        """(rows, 1 + max_probes) int32: each row's home, then its probed clusters (nearest first), -1 padded."""
        import faiss

        x = np.ascontiguousarray(x, dtype=np.float32)
        nearest = min(1 + self.max_probes, len(centroids.points))
        d2, near = faiss.knn(x, centroids.points, nearest, metric=faiss.METRIC_L2)  # as k-means assigns
        reach = 2 * self.z * math.sqrt(max(0.0, 2 - 2 * self.threshold)) / math.sqrt(x.shape[1])
        probed = d2 - d2[:, :1] <= (reach * centroids.spacing[near[:, 0]])[:, None]
        out = np.full((len(x), 1 + self.max_probes), -1, np.int32)
        out[:, :nearest] = np.where(probed, near, -1)
        return out


@dataclass(frozen=True)
class Layout:
    """How the survivors are cut into clusters, and the clusters packed into buckets (search tasks)."""

    cluster_size: int  # mean home rows of a cluster, and of a sub-cluster when one is split
    max_cluster: int  # home rows above which a cluster is split
    sample_size: int  # most sample rows the plan task holds to train the centroids
    buckets: int | None  # None: predicted rows / bucket_rows, at least one per survivor file
    bucket_rows: int
    seed: int


@dataclass(frozen=True)
class SearchSettings:
    """What a search task needs besides its rows."""

    k: int
    threshold: float
    probes: ProbeRule
    layout: Layout
    confirm: tuple[Region, ...] = ()  # the link rule's joint regions a listed pair must fall in (none: every pair)


def kmeans(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    import faiss

    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=KMEANS_ITERATIONS,
        seed=seed,
        max_points_per_centroid=POINTS_PER_CENTROID,
        min_points_per_centroid=1,  # clusters of few sample rows are fine; silences faiss's warning
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    assert km.centroids is not None  # train() sets them
    return km.centroids


def nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The nearest centroid of each row (L2, as k-means assigns)."""
    import faiss

    _, nearest = faiss.knn(np.ascontiguousarray(x, dtype=np.float32), centroids, 1, metric=faiss.METRIC_L2)
    return nearest[:, 0]


# --- plan -----------------------------------------------------------------------------------------------------------


def sample_rows(n: int, layout: Layout) -> int:
    """Sample rows to draw for N survivors: enough to train K = ceil(N / cluster_size) centroids, plus those held out."""
    k = math.ceil(n / layout.cluster_size)
    return min(layout.sample_size, POINTS_PER_CENTROID * k * HOLDOUT_EVERY // (HOLDOUT_EVERY - 1))


def sample_quotas(counts: np.ndarray, sample_size: int) -> np.ndarray:
    """Rows to sample from each file: proportional to its rows (floors of the cumulative shares), summing to
    ``min(sample_size, N)``."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros_like(counts)
    edges = np.concatenate([[0], np.cumsum(counts)]) * min(sample_size, total) // total
    return np.diff(edges)


def _split_oversized(
    sample: np.ndarray, held_out: np.ndarray, centroids: np.ndarray, n: int, layout: Layout
) -> tuple[np.ndarray, int]:
    """Centroids whose share of the held-out rows predicts more than ``max_cluster`` members, replaced by a
    k-means of their sample rows into clusters of about ``cluster_size``; returns the centroids and how many were
    split."""
    home = nearest(sample, centroids)
    predicted = np.bincount(home[held_out], minlength=len(centroids)) * (n / held_out.sum())
    big = np.flatnonzero(predicted > layout.max_cluster)
    if big.size == 0:
        return centroids, 0
    parts = [np.delete(centroids, big, axis=0)]
    for c in big.tolist():
        members = sample[home == c]
        k = min(len(members), math.ceil(predicted[c] / layout.cluster_size))
        parts.append(kmeans(members, k, layout.seed + 1 + c))
    return np.concatenate(parts), int(big.size)


def balance_buckets(rows: np.ndarray, buckets: int) -> np.ndarray:
    """Bucket of each cluster: largest first into the lightest bucket (ties by index), so buckets hold similar rows."""
    bucket_of = np.empty(len(rows), np.int32)
    heap = [(0.0, b) for b in range(buckets)]
    for c in np.lexsort((np.arange(len(rows)), -np.asarray(rows, np.float64))).tolist():
        load, b = heapq.heappop(heap)
        bucket_of[c] = b
        heapq.heappush(heap, (load + float(rows[c]), b))
    return bucket_of


def plan_clusters(
    sample: np.ndarray, n: int, files: int, layout: Layout, probes: ProbeRule
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The centroids of N survivors in ``files`` files, trained on ``sample`` (drawn uniformly, ``sample_rows``
    rows), and the bucket of each cluster; returns them and the plan's stats, with its log lines ((level, message)
    pairs under ``log``)."""
    k = math.ceil(n / layout.cluster_size)
    held_out = np.arange(len(sample)) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
    training = sample[~held_out] if held_out.any() else sample
    held_out |= not held_out.any()  # a sample too small to hold any out: predict on the training rows
    centroids = kmeans(training, max(1, min(len(training), k)), layout.seed)
    centroids, split = _split_oversized(sample, held_out, centroids, n, layout)
    ranked = probes.ranked(sample[held_out], probes.centroids(centroids))
    rows_per_survivor = float((ranked >= 0).sum() / len(ranked))
    saturated = float((ranked[:, -1] >= 0).mean()) if probes.max_probes else 0.0  # see ProbeRule
    predicted_rows = np.bincount(ranked[ranked >= 0], minlength=len(centroids)) * (n / len(ranked))
    n_buckets = layout.buckets or max(files, math.ceil(n * rows_per_survivor / layout.bucket_rows))
    bucket_of = balance_buckets(predicted_rows, max(1, min(n_buckets, len(centroids))))
    lines = [
        (
            logging.INFO,
            f"[embedding pairs] {plural(n, 'survivor')}: {plural(len(centroids), 'cluster')} ({split} split by the "
            f"plan) from a sample of {len(sample)}, {rows_per_survivor:.2f} rows per survivor predicted, "
            f"{plural(int(bucket_of.max()) + 1, 'bucket')}",
        )
    ]
    if saturated > SATURATED_WARNING:
        lines.append(
            (
                logging.WARNING,
                f"[embedding pairs] warning: {saturated:.0%} of the survivors probe {probes.max_probes} clusters and "
                "would probe more: the clusters are small against the near-duplicate radius and recall suffers; raise "
                "cluster_size (or max_probes)",
            )
        )
    stats = {
        "clusters": len(centroids),
        "buckets": int(bucket_of.max()) + 1,
        "sample": len(sample),
        "split_by_plan": split,
        "rows_per_survivor": round(rows_per_survivor, 3),
        "saturated": round(saturated, 4),
        "log": lines,
    }
    return centroids, bucket_of, stats


# --- search ---------------------------------------------------------------------------------------------------------


def _empty_pairs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)


def concat_pairs(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(p) for p in zip(*parts)) if parts else _empty_pairs()


def threshold_neighbours(
    query_ids: np.ndarray, sims: np.ndarray, ids: np.ndarray, k: int, threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From k+1 search results per query: drop the query itself and padding, keep the first k at >= threshold."""
    valid = (ids >= 0) & (ids != query_ids[:, None])
    valid &= np.cumsum(valid, axis=1) <= k  # self may be missing from the list when vectors tie
    valid &= sims >= threshold
    r, c = np.nonzero(valid)
    q, n = query_ids[r], ids[r, c]
    return np.minimum(q, n), np.maximum(q, n), sims[r, c]


def _search(
    x: np.ndarray, rows: np.ndarray, is_home: np.ndarray, s: SearchSettings, depth: int = 0
) -> tuple[np.ndarray, ...]:
    """Pairs (positions lo < hi into ``x``, similarity) among each of ``rows``' k nearest home rows at >= threshold.

    Above ``max_cluster`` home rows, a local k-means splits the home rows into sub-clusters of about
    ``cluster_size``; each row then searches its sub-home and sub-probes (the same ``ProbeRule``), recursively.
    """
    import faiss

    home = rows[is_home]
    if home.size == 0:
        return _empty_pairs()
    if home.size > s.layout.max_cluster:
        sub_centroids = kmeans(x[home], math.ceil(home.size / s.layout.cluster_size), s.layout.seed + depth)
        ranked = s.probes.ranked(x[rows], s.probes.centroids(sub_centroids))
        sub_home = ranked[:, 0]
        if np.bincount(sub_home[is_home]).max() < home.size:  # k-means could split them
            member, rank = np.nonzero(ranked >= 0)
            sub = ranked[member, rank]
            order = np.argsort(sub, kind="stable")
            member, sub = member[order], sub[order]
            edges = np.flatnonzero(np.diff(sub)) + 1
            return concat_pairs(
                [
                    _search(x, rows[g], is_home[g] & (sub_home[g] == sub[lo]), s, depth + 1)
                    for lo, g in zip([0, *edges.tolist()], np.split(member, edges))
                ]
            )
    sims, pos = faiss.knn(x[rows], x[home], min(s.k + 1, home.size), metric=faiss.METRIC_INNER_PRODUCT)
    ids = np.where(pos >= 0, home[np.maximum(pos, 0)], -1)
    return threshold_neighbours(rows, sims, ids, s.k, s.threshold)


def cluster_pairs(
    x: np.ndarray, uid: np.ndarray, home: np.ndarray, ranked: np.ndarray, s: SearchSettings
) -> tuple[np.ndarray, ...]:
    """The pairs one cluster owns: (a < b uids, similarity), each once.

    ``home`` tells the cluster's home rows from its probe rows; ``ranked`` is each row's home cluster, then its
    probes (-1 padded). A pair of a home row h and a probe row q is dropped when h also probes q's home and q's
    uid is the smaller: q's home cluster owns that pair (and finds it there, with h as the probe).
    """
    lo, hi, sim = _search(x, np.arange(len(x)), home, s)
    crossing = home[lo] != home[hi]  # a home row and a probe row (two probe rows are never compared)
    probe_row, home_row = np.where(home[hi], lo, hi), np.where(home[hi], hi, lo)
    reciprocal = (ranked[probe_row, :1] == ranked[home_row, 1:]).any(axis=1)
    keep = ~(crossing & reciprocal & (uid[probe_row] < uid[home_row]))
    a, b = uid[lo[keep]], uid[hi[keep]]
    return _unique_pairs(np.minimum(a, b), np.maximum(a, b), sim[keep])


def _unique_pairs(a: np.ndarray, b: np.ndarray, sim: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sorted by (a, b), each pair once."""
    order = np.lexsort((b, a))
    a, b, sim = a[order], b[order], sim[order]
    first = np.ones(a.size, bool)
    first[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return a[first], b[first], sim[first].astype(np.float32)
