"""Embedding near-duplicate pairs over the partitioned survivors, cluster by cluster (as SemDeDup and Vo et al. 2024
do at scale): k-means cuts the embedding space into clusters of about ``cluster_size`` survivors, and each cluster is
searched exactly (faiss inner product) inside one Ray task.

Steps (``run_embedding_pairs``):

1. Plan (one Ray task). N from the survivor files' Parquet metadata; K = ceil(N / cluster_size) centroids trained by
   faiss k-means on a deterministic uniform sample (one Ray task per file draws its share with a seeded RNG; the plan
   task holds at most ``sample_size`` x D floats and K x D centroids). A centroid whose share of held-out sample rows
   predicts more than ``max_cluster`` members is replaced by a k-means of its own sample rows, so clusters are
   bounded before any data moves. Clusters are packed into buckets by their predicted rows (largest first into
   the lightest bucket). Written: ``dedup/embedding_centroids.npy``, then ``dedup/embedding_plan.json`` (bucket of
   each cluster, a fingerprint of inputs and settings; a plan with another fingerprint is cleared together with
   everything made from it).
2. Assign (one task per survivor file). Each survivor's nearest centroid is its *home*; the clusters just across
   a nearby boundary are its *probes* (``ProbeRule``). It is written once per cluster (home and probes) to that
   cluster's bucket: ``dedup/embedding_buckets/b<bucket>/part-<file>.arrow`` (Arrow IPC, deleted once searched)
   with columns ``cluster``, ``uid``, ``home``, ``ranked`` (its home, then its probes) and ``embedding``.
3. Search (one task per bucket). In each cluster every row, home or probe, takes its ``k`` nearest *home* rows;
   pairs at >= ``threshold`` are kept (``dedup.threshold_neighbours``). Two survivors are compared when they
   share a home or one probes the other's home. Written: ``dedup/pairs/embedding/part-<bucket>.parquet`` (``a`` <
   ``b`` uids, int64; ``similarity`` float32, their inner product; sorted by (a, b)).
4. Cap. A cluster with more than ``max_cluster`` home rows (a prediction that was off, or a region denser than
   the sample showed) is split inside its task by a local k-means into sub-clusters of about ``cluster_size``,
   with the same home/probe rule, recursively; rows k-means cannot split (identical embeddings) are searched whole.

Each pair is listed once over all files, with no second shuffle: a pair (a, b) with different homes A and B sits
in cluster A only if b probes A, and in cluster B only if a probes B. When both hold, the cluster holding the
home of the smaller uid owns the pair; the other cluster's task sees this in the rows' ``ranked`` column and drops
it. Repeats within a cluster (found from both ends, or through two sub-clusters) are merged there.

Approximate like any inverted file: a pair is missed when neither survivor probes the other's home; and, as with
``dedup.ivf_block_pairs``, each survivor's k nearest are taken per cluster, so a pair beyond a survivor's global k
nearest can be listed. Every listed pair is at >= ``threshold``. Against the exact search (``dedup.flat_pairs``)
on a 384-d Gaussian mixture with planted copies at cosine 0.96-0.99: recall 0.998 at 100k survivors, 0.994 of the
planted pairs at 1M.

Sizes (defaults: cluster_size sqrt(N / 2), balancing the assignment's N K D against the search's ~3 N cluster_size
D; up to 7 probes, ~2.5-3.5 rows per survivor on that mixture). At 10^6 survivors: 1,415 clusters of ~710, a
113k x D sample, 10 buckets (one per survivor file) of ~330k rows. At 10^9 survivors: ~44,700 clusters of ~22,400
(split above ~89,000), centroids 44,700 x D (69 MB at D = 384); the sample capped at ``sample_size`` (500k x D,
0.8 GB in the plan task); ~3.5 x 10^9 rows in ~7,000 buckets of ``bucket_rows`` = 500k rows (a search task holds one
bucket: ~0.8 GB at D = 384, plus one cluster's rows; an assign task one survivor file and its rows, at most
1 + max_probes per survivor); F x 7,000 intermediate files for F survivor files (raise ``bucket_rows`` where
workers have the memory, to write fewer). The driver holds the centroids, the bucket of each cluster and one small
receipt per task.
"""

from __future__ import annotations

import functools
import heapq
import io
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from hashlib import sha256

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.progress import progress
from common.storage import (
    delete_quietly,
    exists,
    join,
    list_files,
    read_json,
    resolve,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)
from curation.phases.dedup import kernels as dd
from curation.phases.runtime import parquet_rows, run_tasks, task_window
from curation.records import step_advice

log = logging.getLogger(__name__)

PAIRS_DIR, BUCKETS_DIR = LAYOUT.embedding_pairs, LAYOUT.embedding_buckets
CENTROIDS_FILE, PLAN_FILE = LAYOUT.embedding_centroids, LAYOUT.embedding_plan
PAIRS_SCHEMA = pa.schema(
    [
        pa.field("a", pa.int64(), nullable=False),
        pa.field("b", pa.int64(), nullable=False),
        pa.field("similarity", pa.float32(), nullable=False),
    ]
)
POINTS_PER_CENTROID = 64  # k-means training rows per centroid
KMEANS_ITERATIONS = 10
HOLDOUT_EVERY = 5  # every 5th sample row predicts cluster sizes: training rows sit closer to their centroids
SATURATED_WARNING = 0.2  # see ProbeRule


def pairs_path(bucket: int) -> str:
    return LAYOUT.pair_part(PAIRS_DIR, bucket)


def bucket_path(bucket: int, file_index: int) -> str:
    return f"{BUCKETS_DIR}/b{bucket:05d}/part-{file_index:06d}.arrow"


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


# --- small helpers ------------------------------------------------------------------------------------------------


def _kmeans(x: np.ndarray, k: int, seed: int) -> np.ndarray:
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


def _nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The nearest centroid of each row (L2, as k-means assigns)."""
    import faiss

    _, nearest = faiss.knn(np.ascontiguousarray(x, dtype=np.float32), centroids, 1, metric=faiss.METRIC_L2)
    return nearest[:, 0]


def _matrix(column: pa.ChunkedArray) -> np.ndarray:
    """A fixed-size list column as an (rows, size) array."""
    column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)


def _write_arrow(fs, path: str, table: pa.Table) -> None:
    """An intermediate as an Arrow IPC file: written and read at memory speed (Parquet's encoding of the float
    embeddings cost more than the search, for files deleted minutes later)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    write_bytes_atomic(fs, path, sink.getvalue())


def _read_arrow(fs, path: str) -> pa.Table:
    with fs.open_input_file(path) as f:
        return pa.ipc.open_file(f).read_all()


def _empty_pairs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)


def _concat(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(p) for p in zip(*parts)) if parts else _empty_pairs()


# --- plan -----------------------------------------------------------------------------------------------------------


def sample_quotas(counts: np.ndarray, sample_size: int) -> np.ndarray:
    """Rows to sample from each file: proportional to its rows (floors of the cumulative shares), summing to
    ``min(sample_size, N)``."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros_like(counts)
    edges = np.concatenate([[0], np.cumsum(counts)]) * min(sample_size, total) // total
    return np.diff(edges)


@ray.remote(num_cpus=1)
def _sample_file(out_uri: str, path: str, file_index: int, quota: int, seed: int) -> tuple[int, np.ndarray]:
    fs, root = resolve(out_uri)
    table = pq.read_table(join(root, path), columns=["embedding"], filesystem=fs)
    rows = np.sort(np.random.default_rng([seed, file_index]).choice(table.num_rows, quota, replace=False))
    return file_index, _matrix(table.column("embedding").take(pa.array(rows, pa.int64())))


def _draw_sample(out_uri: str, files: list[str], counts: np.ndarray, size: int, seed: int) -> np.ndarray:
    fs, root = resolve(out_uri)
    quotas = sample_quotas(counts, size)
    dim = pq.read_schema(join(root, files[0]), filesystem=fs).field("embedding").type.list_size
    sample = np.empty((int(quotas.sum()), dim), np.float32)
    offsets = np.concatenate([[0], np.cumsum(quotas)])
    calls = [
        (lambda i=i, f=f, q=q: _sample_file.remote(out_uri, f, i, int(q), seed))
        for i, (f, q) in enumerate(zip(files, quotas))
        if q
    ]
    for i, rows in run_tasks(calls, task_window()):
        sample[offsets[i] : offsets[i + 1]] = rows
    return sample


def _split_oversized(
    sample: np.ndarray, held_out: np.ndarray, centroids: np.ndarray, n: int, layout: Layout
) -> tuple[np.ndarray, int]:
    """Centroids whose share of the held-out rows predicts more than ``max_cluster`` members, replaced by a
    k-means of their sample rows into clusters of about ``cluster_size``; returns the centroids and how many were
    split."""
    home = _nearest(sample, centroids)
    predicted = np.bincount(home[held_out], minlength=len(centroids)) * (n / held_out.sum())
    big = np.flatnonzero(predicted > layout.max_cluster)
    if big.size == 0:
        return centroids, 0
    parts = [np.delete(centroids, big, axis=0)]
    for c in big.tolist():
        members = sample[home == c]
        k = min(len(members), math.ceil(predicted[c] / layout.cluster_size))
        parts.append(_kmeans(members, k, layout.seed + 1 + c))
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


@ray.remote(num_cpus=1)
def _make_plan(out_uri: str, files: list[str], counts: np.ndarray, layout: Layout, probes: ProbeRule) -> dict:
    """Sample, train the centroids (written to ``CENTROIDS_FILE``), pack the clusters into buckets; returns the plan
    and its log lines, (level, message) pairs. A Ray task, so that the driver never holds the training sample."""
    lines: list[tuple[int, str]] = []
    n = int(counts.sum())
    k = math.ceil(n / layout.cluster_size)
    size = min(layout.sample_size, POINTS_PER_CENTROID * k * HOLDOUT_EVERY // (HOLDOUT_EVERY - 1))  # + held out
    sample = _draw_sample(out_uri, files, counts, size, layout.seed)
    held_out = np.arange(len(sample)) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
    training = sample[~held_out] if held_out.any() else sample
    held_out |= not held_out.any()  # a sample too small to hold any out: predict on the training rows
    centroids = _kmeans(training, max(1, min(len(training), k)), layout.seed)
    centroids, split = _split_oversized(sample, held_out, centroids, n, layout)
    ranked = probes.ranked(sample[held_out], probes.centroids(centroids))
    rows_per_survivor = float((ranked >= 0).sum() / len(ranked))
    saturated = float((ranked[:, -1] >= 0).mean()) if probes.max_probes else 0.0  # see ProbeRule
    predicted_rows = np.bincount(ranked[ranked >= 0], minlength=len(centroids)) * (n / len(ranked))
    n_buckets = layout.buckets or max(len(files), math.ceil(n * rows_per_survivor / layout.bucket_rows))
    bucket_of = balance_buckets(predicted_rows, max(1, min(n_buckets, len(centroids))))
    lines.append(
        (
            logging.INFO,
            f"[embedding pairs] {n} survivors: {len(centroids)} clusters ({split} split by the plan) from a sample of "
            f"{len(sample)}, {rows_per_survivor:.2f} rows per survivor predicted, {int(bucket_of.max()) + 1} buckets",
        )
    )
    if saturated > SATURATED_WARNING:
        lines.append(
            (
                logging.WARNING,
                f"[embedding pairs] warning: {saturated:.0%} of the survivors probe {probes.max_probes} clusters and "
                "would probe more: the clusters are small against the near-duplicate radius and recall suffers; raise "
                "cluster_size (or max_probes)",
            )
        )
    fs, root = resolve(out_uri)
    buf = io.BytesIO()
    np.save(buf, centroids)
    write_bytes_atomic(fs, join(root, CENTROIDS_FILE), buf.getvalue())
    return {
        "clusters": len(centroids),
        "bucket_of": bucket_of.tolist(),
        "sample": len(sample),
        "split_by_plan": split,
        "rows_per_survivor": round(rows_per_survivor, 3),
        "saturated": round(saturated, 4),
        "log": lines,
    }


def _load_centroids(fs, root: str) -> np.ndarray:
    with fs.open_input_stream(join(root, CENTROIDS_FILE)) as f:
        return np.load(io.BytesIO(f.read()))


# --- assign ---------------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=1)
def _assign_file(
    out_uri: str, path: str, file_index: int, shared: tuple[Centroids, np.ndarray], probes: ProbeRule, needed: list[int]
) -> dict:
    """Write this file's rows to the buckets in ``needed`` (ascending), in that order; returns rows written.

    Skipped when the last one exists: an earlier attempt wrote it after the others, and buckets only ever leave
    ``needed`` (once searched), so every needed file is there."""
    centroids, bucket_of = shared
    fs, root = resolve(out_uri)
    if exists(fs, join(root, bucket_path(needed[-1], file_index))):
        return {"rows": 0, "cpu_s": 0.0}
    start = time.process_time()
    table = pq.read_table(join(root, path), columns=["uid", "embedding"], filesystem=fs)
    uid = table.column("uid").to_numpy()
    ranked = probes.ranked(_matrix(table.column("embedding")), centroids)
    item, rank = np.nonzero(ranked >= 0)  # one row per (survivor, cluster it is searched in)
    cluster = ranked[item, rank]
    order = np.lexsort((uid[item], cluster, bucket_of[cluster]))
    item, rank, cluster = item[order], rank[order], cluster[order]
    bounds = np.searchsorted(bucket_of[cluster], np.arange(int(bucket_of.max()) + 2))
    rows = pa.table(
        {
            "cluster": pa.array(cluster, pa.int32()),
            "uid": pa.array(uid[item], pa.int64()),
            "home": pa.array(rank == 0),
            "ranked": pa.FixedSizeListArray.from_arrays(pa.array(ranked[item].ravel()), ranked.shape[1]),
            "embedding": table.column("embedding").take(pa.array(item, pa.int64())),
        }
    )
    for b in needed:  # bucket b holds rows [bounds[b], bounds[b + 1])
        _write_arrow(fs, join(root, bucket_path(b, file_index)), rows.slice(bounds[b], bounds[b + 1] - bounds[b]))
    return {"rows": int(sum(bounds[b + 1] - bounds[b] for b in needed)), "cpu_s": time.process_time() - start}


# --- search ---------------------------------------------------------------------------------------------------------


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
        sub_centroids = _kmeans(x[home], math.ceil(home.size / s.layout.cluster_size), s.layout.seed + depth)
        ranked = s.probes.ranked(x[rows], s.probes.centroids(sub_centroids))
        sub_home = ranked[:, 0]
        if np.bincount(sub_home[is_home]).max() < home.size:  # k-means could split them
            member, rank = np.nonzero(ranked >= 0)
            sub = ranked[member, rank]
            order = np.argsort(sub, kind="stable")
            member, sub = member[order], sub[order]
            edges = np.flatnonzero(np.diff(sub)) + 1
            return _concat(
                [
                    _search(x, rows[g], is_home[g] & (sub_home[g] == sub[lo]), s, depth + 1)
                    for lo, g in zip([0, *edges.tolist()], np.split(member, edges))
                ]
            )
    sims, pos = faiss.knn(x[rows], x[home], min(s.k + 1, home.size), metric=faiss.METRIC_INNER_PRODUCT)
    ids = np.where(pos >= 0, home[np.maximum(pos, 0)], -1)
    return dd.threshold_neighbours(rows, sims, ids, s.k, s.threshold)


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


def _read_bucket(fs, root: str, bucket: int, n_files: int) -> tuple[np.ndarray, pa.Table]:
    """A bucket's embeddings as one array and its other columns, holding the embeddings about once in memory."""
    files = [_read_arrow(fs, join(root, bucket_path(bucket, f))) for f in range(n_files)]
    rows = pa.concat_tables([t.drop_columns(["embedding"]) for t in files])
    x = np.empty((rows.num_rows, files[0].schema.field("embedding").type.list_size), np.float32)
    at = 0
    while files:  # each file's buffers are freed once copied
        embedding = files.pop(0).column("embedding")
        x[at : at + len(embedding)] = _matrix(embedding)
        at += len(embedding)
    return x, rows


@ray.remote(num_cpus=1)
def _search_bucket(out_uri: str, bucket: int, n_files: int, s: SearchSettings) -> dict:
    fs, root = resolve(out_uri)
    out = join(root, pairs_path(bucket))
    if exists(fs, out):
        return {"pairs": pq.read_metadata(out, filesystem=fs).num_rows, "skipped": True}
    start = time.process_time()
    x, rows = _read_bucket(fs, root, bucket, n_files)
    cluster, uid = rows.column("cluster").to_numpy(), rows.column("uid").to_numpy()
    home, ranked = rows.column("home").to_numpy(zero_copy_only=False), _matrix(rows.column("ranked"))
    order = np.lexsort((uid, ~home, cluster))  # per cluster: home rows, then probe rows, by uid (a fixed order)
    found, largest = [], 0
    for part in np.split(order, np.flatnonzero(np.diff(cluster[order])) + 1) if order.size else []:
        found.append(cluster_pairs(x[part], uid[part], home[part], ranked[part], s))  # gathered while searched
        largest = max(largest, int(home[part].sum()))
    a, b, sim = _concat(found)
    order = np.lexsort((b, a))  # clusters own disjoint pairs: sorting is all that is left
    pairs = pa.table({"a": a[order], "b": b[order], "similarity": sim[order]}, schema=PAIRS_SCHEMA)
    write_parquet_atomic(fs, out, pairs, row_group_size=1 << 20)
    delete_quietly(fs, join(root, BUCKETS_DIR, f"b{bucket:05d}"))
    return {
        "pairs": pairs.num_rows,
        "skipped": False,
        "rows": len(x),
        "largest_cluster": largest,
        "cpu_s": time.process_time() - start,
    }


# --- driver ---------------------------------------------------------------------------------------------------------


def run_embedding_pairs(
    out_uri: str,
    survivor_files: list[str],
    threshold: float,
    k: int,
    cluster_size: int | None = None,
    sample_size: int = 500_000,
    buckets: int | None = None,
    seed: int = 0,
    *,
    max_cluster: int | None = None,
    max_probes: int = 7,
    probe_z: float = 1.0,
    bucket_rows: int = 500_000,
) -> dict:
    """Write ``dedup/pairs/embedding/part-<bucket>.parquet``: the embedding near-duplicate pairs of the survivors.

    ``survivor_files``: paths relative to ``out_uri`` in the survivors schema (``uid``, ``embedding`` are read).
    ``cluster_size``: mean survivors per cluster (None: ``default_cluster_size``); ``max_cluster``: home rows above
    which a cluster is split (None: 4 x cluster_size); ``sample_size``: most k-means sample rows held by the plan task;
    ``buckets``: search tasks (None: the predicted (survivor, cluster) rows / ``bucket_rows``, at least one per
    survivor file); ``max_probes``, ``probe_z``: see ``ProbeRule``. Files written by an earlier run with the same
    inputs and settings are kept: a rerun does only what is missing. Returns a summary for the phase's record.
    """
    fs, root = resolve(out_uri)
    counts = np.asarray(parquet_rows(fs, [join(root, f) for f in survivor_files]), np.int64)
    n = int(counts.sum())
    cluster_size = cluster_size or default_cluster_size(n)
    layout = Layout(
        cluster_size, max(max_cluster or 4 * cluster_size, cluster_size), sample_size, buckets, bucket_rows, seed
    )
    probes = ProbeRule(max_probes, probe_z, threshold)
    fingerprint = sha256(
        json.dumps(
            {"files": list(survivor_files), "counts": counts.tolist(), "k": k, **asdict(layout), **asdict(probes)},
            sort_keys=True,
        ).encode()
    ).hexdigest()
    plan = (
        read_json(
            fs,
            join(root, PLAN_FILE),
            fields={"fingerprint": str, "bucket_of": list},
            advice=step_advice(fs, root, "dedup"),
        )
        if exists(fs, join(root, PLAN_FILE))
        else None
    )
    if plan is None or plan["fingerprint"] != fingerprint:
        for path in (PAIRS_DIR, BUCKETS_DIR, CENTROIDS_FILE, PLAN_FILE):  # never mix with other inputs' outputs
            delete_quietly(fs, join(root, path))
        if n < 2:
            write_parquet_atomic(fs, join(root, pairs_path(0)), PAIRS_SCHEMA.empty_table(), row_group_size=1)
            return {"survivors": n, "clusters": 0, "buckets": 1, "pairs": 0}
        made = ray.get(_make_plan.remote(out_uri, survivor_files, counts, layout, probes))
        plan = {"fingerprint": fingerprint, **made}
        for level, line in plan.pop("log"):
            log.log(level, line)
        write_json_atomic(fs, join(root, PLAN_FILE), plan)  # the plan's commit point: the centroids come first
    bucket_of = np.asarray(plan["bucket_of"], np.int32)
    n_buckets = int(bucket_of.max()) + 1
    done = set(list_files(fs, join(root, PAIRS_DIR), ".parquet"))  # one listing, not a request per bucket
    missing = [b for b in range(n_buckets) if join(root, pairs_path(b)) not in done]
    assigned: list[dict] = []
    if missing:
        shared = ray.put((probes.centroids(_load_centroids(fs, root)), bucket_of))
        assigned = list(
            progress(
                run_tasks(
                    (
                        functools.partial(_assign_file.remote, out_uri, f, i, shared, probes, missing)
                        for i, f in enumerate(survivor_files)
                    ),
                    task_window(),
                ),
                "[embedding pairs] assign",
                len(survivor_files),
                log.info,
                unit="survivor files",
            )
        )
        log.info(
            f"[embedding pairs] {sum(r['rows'] for r in assigned)} (survivor, cluster) rows written to "
            f"{len(missing)} buckets"
        )
    settings = SearchSettings(k, threshold, probes, layout)
    receipts = list(
        progress(
            run_tasks(
                (
                    functools.partial(_search_bucket.remote, out_uri, b, len(survivor_files), settings)
                    for b in range(n_buckets)
                ),
                task_window(),
            ),
            "[embedding pairs] search",
            n_buckets,
            log.info,
            unit="buckets",
        )
    )
    delete_quietly(fs, join(root, BUCKETS_DIR))
    searched = [r for r in receipts if not r["skipped"]]
    pairs = sum(r["pairs"] for r in receipts)
    log.info(f"[embedding pairs] {pairs} pairs at >= {threshold} in {n_buckets} buckets ({len(searched)} searched now)")
    return {
        "survivors": n,
        "clusters": plan["clusters"],
        "buckets": n_buckets,
        "sample": plan["sample"],
        "split_by_plan": plan["split_by_plan"],
        "rows_per_survivor": plan["rows_per_survivor"],
        "saturated": plan["saturated"],
        "pairs": pairs,
        "buckets_searched": len(searched),
        "rows_assigned": sum(r["rows"] for r in assigned),
        "largest_cluster": max((r["largest_cluster"] for r in searched), default=None),
        "cpu_s": {
            "assign": round(sum(r["cpu_s"] for r in assigned), 1),
            "search": round(sum(r["cpu_s"] for r in searched), 1),
        },
    }
