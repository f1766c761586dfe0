"""Phase 3 "sample" as Ray tasks over the survivors' partitions: the hierarchical balanced sampling of
``curation.phases.sample.kmeans`` (Vo et al. 2024) with a driver that never holds per-item data.

Inputs: the survivors files (``curation.phases.survivors``) and, per survivors file, the dedup decisions file listing the
uids it dropped (absent: none dropped). The survivors that are not dropped are the "alive" ones. Steps:

1. train: the training set is the ``sample_size`` alive items of lowest hash of (uid, seed): uniform, and
   independent of how items are partitioned. Ray tasks return their files' items below a hash threshold; one
   training task keeps the lowest, trains the leaf centroids on them with faiss k-means and the upper levels on
   the leaf centroids (``sampling.hierarchical_kmeans`` does both), ``sample.training_points_per_cluster`` points
   per leaf (faiss subsamples a larger set to at most 256 per centroid anyway). Written to
   ``sample/hierarchy.parquet`` (level, cluster, parent, centroid), which later steps and reruns read.
2. assign: a task per survivors file gives each alive item its leaf and squared distance to the leaf centroid and
   writes the rows (uid, leaf, distance, balance) routed to buckets by leaf (``leaf % buckets``) into
   ``sample/work/buckets/part-<i>.parquet`` (``curation.phases.routed``: one file per task); it returns its per-leaf
   counts.
3. budget: the driver splits the target over the leaves top-down (``sampling.leaf_budgets`` on the per-leaf counts:
   a cluster smaller than its share is taken whole, the rest goes to its siblings).
4. select: a task per bucket picks exactly each of its leaves' budget, closest to the centroid or at random (a
   fixed per-uid hash), spread over the balance key's values as ``sampling.balanced_select`` does, and writes
   (uid, leaf, selected) routed back to the survivors files (they hold disjoint, increasing uid ranges, read from
   Parquet statistics by the driver) into ``sample/work/selected/bucket-<b>.parquet``.
5. assemble: a task per survivors file writes ``sample/decisions/part-<i>.parquet``: every alive survivor of file
   ``i`` in uid order with uid, source, shard_id, key, cluster_ids (leaf first, then each upper level), selected.

Guarantees: exactly ``min(target, alive)`` items selected; the selection depends on the alive items, the settings
and ``sample_size`` only, not on the number of files or buckets; same inputs give the same bytes. A task whose
output exists is skipped (every task writes one file, atomically).
``sample/run.json`` fingerprints the settings and inputs (paths, sizes, modification times): a run that finds a
different fingerprint clears this step's outputs first, so a resumed run never mixes two configurations.

Memory, and what it becomes at 1B survivors on a cluster (1M-row survivors files, 384-d, sqrt(N) = 31.6k leaves):
- training task: the training sample (``sample_size`` x D float32; default 64 per leaf, at most
  ``MAX_TRAINING_POINTS`` = 1M points = 1.5 GB, i.e. 32 per leaf at 1B: set ``sample.clusters`` for such runs);
- driver: the leaf centroids (K1 x D: 49 MB), per-leaf counts and budgets (K1 int64), per-file row counts and uid
  ranges (M = 1000 files);
- train and assign tasks: one row group of a survivors file (its embeddings, ~4x in decoding buffers) plus, for
  assign, ~28 bytes per row of the file (uid, leaf, distance, balance: 28 MB); the survey should keep row groups
  at tens of thousands of rows;
- select task: ~30 bytes per row of its bucket (``BUCKET_ROWS`` = 4M: ~120 MB, plus sorting; 250 buckets);
- assemble task: the uid, source, shard_id and key columns of one survivors file (~100 MB at 1M rows).
Files: M under buckets/, one per bucket under selected/, M decisions; every select task reads the M bucket-file
footers and every assemble task the bucket-count selected-file footers. ``sample/work/`` can be deleted once every
decisions file is written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.progress import progress
from common.storage import delete_quietly, exists, join, read_json, resolve, write_json_atomic, write_parquet_atomic
from curation.phases import routed
from curation.phases.runtime import map_footers, run_tasks, task_window
from curation.phases.sample import kmeans as sampling
from curation.records import step_advice
from curation.settings import SampleSettings

log = logging.getLogger(__name__)

RUN_FILE, HIERARCHY_FILE = LAYOUT.sample_run, LAYOUT.sample_hierarchy
DECISIONS_DIR, WORK_DIR = LAYOUT.sample_decisions, LAYOUT.sample_work

MIN_TRAINING_POINTS_PER_LEAF = 39  # below this faiss warns that k-means is poorly conditioned
MAX_TRAINING_POINTS = 1_000_000  # default cap of the training task's sample
BUCKET_ROWS = 4_000_000  # default rows per select task
_TRAIN_STREAM, _PRIORITY_STREAM = 1, 2  # independent hash streams under one seed

DECISIONS_SCHEMA = pa.schema(
    [
        pa.field("uid", pa.int64(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("shard_id", pa.string(), nullable=False),
        pa.field("key", pa.string()),
        pa.field("cluster_ids", pa.list_(pa.int32())),  # per level, leaf first
        pa.field("selected", pa.bool_(), nullable=False),
    ]
)
_BUCKET_SCHEMA = pa.schema(
    [("uid", pa.int64()), ("leaf", pa.int32()), ("distance", pa.float32()), ("balance", pa.string())]
)
_SELECTED_SCHEMA = pa.schema([("uid", pa.int64()), ("leaf", pa.int32()), ("selected", pa.bool_())])


def _buckets_path(index: int) -> str:
    return f"{WORK_DIR}/buckets/part-{index:06d}.parquet"


def _selected_path(bucket: int) -> str:
    return f"{WORK_DIR}/selected/bucket-{bucket:05d}.parquet"


# --- settings -----------------------------------------------------------------------------------------------------


def cluster_counts(n: int, clusters: Sequence[int] | None) -> list[int]:
    """Clusters per level for ``n`` items, as the single-process phase chooses them (``sampling.balanced_sample``'s
    default of about sqrt(n) leaves and a tenth of that above)."""
    if clusters is not None:
        return [max(1, min(k, n)) for k in clusters]
    if n < 8:
        return [1]
    k1 = max(2, round(np.sqrt(n)))
    return [k1, max(2, k1 // 10)]


def target_count(n: int, settings: SampleSettings) -> int:
    size = settings.target_count
    return sampling.target_size(n, size, None if size is not None else (settings.target_fraction or 1.0))


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


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``np.isin`` for a sorted, duplicate-free ``sorted_set``."""
    pos = np.minimum(np.searchsorted(sorted_set, values), max(sorted_set.size - 1, 0))
    return sorted_set[pos] == values if sorted_set.size else np.zeros(values.shape, bool)


# --- the hierarchy, known by per-leaf counts ----------------------------------------------------------------------


@dataclass(frozen=True)
class LeafCountHierarchy(sampling.ClusterHierarchy):
    """A ``ClusterHierarchy`` whose rows are the leaves, each weighing its number of items: what
    ``sampling.leaf_budgets`` needs, without per-item assignments. ``assignments[c]`` is leaf c's cluster per level."""

    leaf_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def sizes(self, level: int) -> np.ndarray:
        k = self.centroids[level].shape[0]
        return np.bincount(self.assignments[:, level], weights=self.leaf_counts, minlength=k).astype(np.int64)


def _hierarchy_table(h: sampling.ClusterHierarchy) -> pa.Table:
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


def _hierarchy_from_table(t: pa.Table) -> tuple[list[np.ndarray], list[np.ndarray]]:
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


# --- selection inside leaves (pure numpy; the select tasks run it on a bucket) ------------------------------------


def select_in_leaves(
    leaf: np.ndarray, priority: np.ndarray, budget: np.ndarray, balance: np.ndarray | None, seed: int
) -> np.ndarray:
    """Mask of exactly ``budget[l]`` items of each leaf ``l`` (capped at its size), lowest ``priority`` first.

    With ``balance`` values, each leaf's budget is first water-filled over the values present in it (in sorted
    order, random tie-breaks seeded by (seed, leaf)), as ``sampling.balanced_select`` does. Equal priorities go to
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
                group_budget[s:e] = sampling.water_fill(sizes, want, np.random.default_rng([seed, c]))
    order, rank = sampling.ranked_groups(group, priority)
    mask = np.zeros(leaf.size, bool)
    mask[order[rank < group_budget[group[order]]]] = True
    return mask


# --- files -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FileFacts:
    rows: int
    uid_min: int
    uid_max: int
    size: int
    mtime_ns: int


def _file_facts(fs: pafs.FileSystem, path: str, stats_column: str | None) -> _FileFacts | None:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return None
    with fs.open_input_file(path) as f:
        meta = pq.ParquetFile(f).metadata
    lo, hi = 0, -1
    if stats_column and meta.num_rows:
        col = meta.schema.to_arrow_schema().get_field_index(stats_column)
        stats = [meta.row_group(g).column(col).statistics for g in range(meta.num_row_groups)]
        if all(s is not None and s.has_min_max for s in stats):
            lo, hi = min(s.min for s in stats), max(s.max for s in stats)
        else:
            uid = pq.read_table(path, columns=[stats_column], filesystem=fs).column(0)
            lo, hi = pc.min(uid).as_py(), pc.max(uid).as_py()
    return _FileFacts(meta.num_rows, int(lo), int(hi), int(info.size), int(info.mtime_ns or 0))


def _read_dropped(fs: pafs.FileSystem, path: str) -> np.ndarray:
    if not exists(fs, path):
        return np.zeros(0, np.int64)
    return np.unique(pq.read_table(path, columns=["uid"], filesystem=fs).column("uid").to_numpy())


def _alive_row_groups(fs: pafs.FileSystem, root: str, survivor_file: str, decision_file: str, columns: list[str]):
    """The file's alive rows, one row group at a time, in the given columns (with uid); checks the decisions file.

    Row group by row group: pyarrow's ``iter_batches`` holds memory that grows with the file, this does not.
    """
    dropped = _read_dropped(fs, join(root, decision_file))
    found = 0
    with fs.open_input_file(join(root, survivor_file)) as f:
        reader = pq.ParquetFile(f)
        for group in range(reader.num_row_groups):
            rows = reader.read_row_group(group, columns=columns, use_threads=False)
            gone = _member(rows.column("uid").to_numpy(), dropped)
            found += int(gone.sum())
            yield rows.filter(pa.array(~gone))
    if found != dropped.size:
        raise ValueError(f"{decision_file} lists {dropped.size - found} uids that are not survivors of {survivor_file}")


def _embeddings(rows: pa.Table) -> np.ndarray:
    col = rows.column("embedding").combine_chunks()
    if col.null_count:
        raise ValueError("survivors without an embedding: the sample phase needs the embedding stage")
    return np.ascontiguousarray(col.flatten().to_numpy(zero_copy_only=False).reshape(len(rows), col.type.list_size))


def _write(fs: pafs.FileSystem, root: str, rel: str, table: pa.Table, row_group_size: int = 65_536) -> None:
    write_parquet_atomic(fs, join(root, rel), table, row_group_size=row_group_size)


# --- Ray tasks ------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=1)
def _training_sample_task(
    out_uri: str, survivor_file: str, decision_file: str, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The alive items whose hash falls below ``fraction``: (hash values, embeddings)."""
    fs, root = resolve(out_uri)
    keys, pieces = [np.zeros(0)], []
    for rows in _alive_row_groups(fs, root, survivor_file, decision_file, ["uid", "embedding"]):
        key = uid_uniform(rows.column("uid").to_numpy(), seed, _TRAIN_STREAM)
        take = key < fraction
        if take.any():
            keys.append(key[take])
            pieces.append(_embeddings(rows.filter(pa.array(take))))
    return np.concatenate(keys), (np.concatenate(pieces) if pieces else np.zeros((0, 0), np.float32))


@ray.remote(num_cpus=1)
def _assign_task(
    out_uri: str,
    index: int,
    survivor_file: str,
    decision_file: str,
    centroids: np.ndarray,
    buckets: int,
    balance: bool,
    chosen_from: int | None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per-leaf counts (leaves, counts) of the file's alive survivors, and whether the work was already done; with
    ``chosen_from``, the leaves of the chosen ones (uids from it on) come once more, as negative leaf numbers
    (``-1 - leaf``)."""
    fs, root = resolve(out_uri)
    path = join(root, _buckets_path(index))
    if exists(fs, path):  # counts from the file: as a footer receipt they would cost every reader K1 entries
        done = pq.read_table(path, columns=["uid", "leaf"], filesystem=fs)
        return *_leaf_counts(done.column("uid").to_numpy(), done.column("leaf").to_numpy(), chosen_from), True
    columns = ["uid", "embedding"] + (["balance"] if balance else [])
    uids, leaves, dists = [], [], []
    values: list[pa.Array] = []  # the balance key's chunks
    for rows in _alive_row_groups(fs, root, survivor_file, decision_file, columns):
        leaf, dist = sampling.assign_nearest(_embeddings(rows), centroids)
        uids.append(rows.column("uid").to_numpy())
        leaves.append(leaf)
        dists.append(dist)
        values.extend(rows.column("balance").chunks if balance else [pa.nulls(len(rows), pa.string())])
    uid = np.concatenate(uids) if uids else np.zeros(0, np.int64)
    leaf = np.concatenate(leaves) if leaves else np.zeros(0, np.int32)
    rows = pa.table(
        {
            "uid": uid,
            "leaf": leaf,
            "distance": np.concatenate(dists) if dists else np.zeros(0, np.float32),
            "balance": pa.chunked_array(values, pa.string()),
        },
        schema=_BUCKET_SCHEMA,
    )
    routed.write_routed(fs, path, rows, leaf % buckets, buckets)
    return *_leaf_counts(uid, leaf, chosen_from), False


def _leaf_counts(uid: np.ndarray, leaf: np.ndarray, chosen_from: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(leaves, counts) of every item, then of the chosen ones as ``-1 - leaf``."""
    leaf = leaf.astype(np.int64)
    if chosen_from is not None:
        leaf = np.concatenate([leaf, -1 - leaf[uid >= chosen_from]])
    return np.unique(leaf, return_counts=True)


def _value_ranks(values: pa.ChunkedArray) -> np.ndarray:
    """Each value's rank among the distinct values (null counts as "None", as the single-process phase has it)."""
    encoded = pc.fill_null(values, "None").combine_chunks().dictionary_encode()
    names = np.asarray(encoded.dictionary.to_pylist(), object)
    rank = np.empty(names.size, np.int64)
    rank[np.argsort(names)] = np.arange(names.size)
    return rank[encoded.indices.to_numpy(zero_copy_only=False)]


@ray.remote(num_cpus=1)
def _select_task(
    out_uri: str,
    bucket: int,
    n_files: int,
    budget: np.ndarray,
    route_min: np.ndarray,
    route_index: np.ndarray,
    mode: str,
    balance: bool,
    seed: int,
    chosen_from: int | None,
) -> bool:
    """Selects inside the bucket's leaves and routes (uid, leaf, selected) back to the survivors files; returns
    whether it was done before. Items from ``chosen_from`` on are selected before (a release's), and ``budget``
    counts the others only."""
    fs, root = resolve(out_uri)
    path = join(root, _selected_path(bucket))
    if exists(fs, path):
        return True
    t = routed.read_routed(fs, [join(root, _buckets_path(i)) for i in range(n_files)], bucket, _BUCKET_SCHEMA)
    uid = t.column("uid").to_numpy()
    order = np.argsort(uid, kind="stable")
    uid, leaf = uid[order], t.column("leaf").to_numpy()[order]
    priority = t.column("distance").to_numpy()[order] if mode == "closest" else uid_uniform(uid, seed, _PRIORITY_STREAM)
    chosen = uid >= chosen_from if chosen_from is not None else np.zeros(uid.size, bool)
    values = _value_ranks(t.column("balance"))[order] if balance else None
    mask = chosen.copy()
    mask[~chosen] = select_in_leaves(
        leaf[~chosen], priority[~chosen], budget, None if values is None else values[~chosen], seed
    )
    present = np.unique(leaf[~chosen])
    if not np.array_equal(np.bincount(leaf[mask & ~chosen], minlength=budget.size)[present], budget[present]):
        raise AssertionError(f"bucket {bucket}: the selection differs from the leaf budgets")
    owner = route_index[np.searchsorted(route_min, uid, side="right") - 1]
    routed.write_routed(
        fs, path, pa.table({"uid": uid, "leaf": leaf, "selected": mask}, schema=_SELECTED_SCHEMA), owner, n_files
    )
    return False


@ray.remote(num_cpus=1)
def _assemble_task(
    out_uri: str, index: int, survivor_file: str, buckets: int, cluster_ids: np.ndarray
) -> tuple[int, int, bool]:
    """Writes the file's decisions; returns (rows, selected, done before)."""
    fs, root = resolve(out_uri)
    path = join(root, LAYOUT.sample_decision(index))
    if exists(fs, path):
        selected = pq.read_table(path, columns=["selected"], filesystem=fs).column("selected")
        return len(selected), int(pc.sum(selected).as_py() or 0), True
    mine = routed.read_routed(fs, [join(root, _selected_path(b)) for b in range(buckets)], index, _SELECTED_SCHEMA)
    order = np.argsort(mine.column("uid").to_numpy(), kind="stable")
    uid, leaf = mine.column("uid").to_numpy()[order], mine.column("leaf").to_numpy()[order]
    survivors = pq.read_table(join(root, survivor_file), columns=["uid", "source", "shard_id", "key"], filesystem=fs)
    s_uid = survivors.column("uid").to_numpy()
    s_order = np.argsort(s_uid, kind="stable")
    rows = s_order[np.searchsorted(s_uid, uid, sorter=s_order)]
    levels = cluster_ids.shape[1]
    ids = pa.ListArray.from_arrays(
        pa.array(np.arange(0, (uid.size + 1) * levels, levels, dtype=np.int32)), pa.array(cluster_ids[leaf].ravel())
    )
    meta = survivors.take(pa.array(rows, pa.int64()))
    table = pa.table(
        {
            "uid": uid,
            "source": meta.column("source"),
            "shard_id": meta.column("shard_id"),
            "key": meta.column("key"),
            "cluster_ids": ids,
            "selected": mine.column("selected").to_numpy(zero_copy_only=False)[order],
        },
        schema=DECISIONS_SCHEMA,
    )
    _write(fs, root, LAYOUT.sample_decision(index), table, row_group_size=10_000)
    return uid.size, int(table.column("selected").to_numpy().sum()), False


class _Laps:
    """Seconds since the previous lap, for the step log lines."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> str:
        now = time.monotonic()
        seconds, self.last = now - self.last, now
        return f"{seconds:.1f} s"


def _in_order(submit: Callable[[int], ray.ObjectRef], count: int, window: int) -> Iterator:
    """Results of ``submit(0..count-1)`` in order, with at most ``window`` tasks in flight."""
    return run_tasks((functools.partial(submit, i) for i in range(count)), window, ordered=True)


# --- the driver -------------------------------------------------------------------------------------------------


def _fingerprint(
    settings: SampleSettings, buckets: int, sample_size: int, facts: list[_FileFacts | None], paths: list[str]
) -> str:
    inputs = [[p, f.size, f.mtime_ns] if f else [p, None, None] for p, f in zip(paths, facts)]
    text = json.dumps(
        {
            "settings": settings.model_dump(mode="json"),
            "buckets": buckets,
            "sample_size": sample_size,
            "inputs": inputs,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _reset_if_changed(fs: pafs.FileSystem, root: str, fingerprint: str) -> None:
    run_file = join(root, RUN_FILE)
    advice = step_advice(fs, root, "sample")
    previous = read_json(fs, run_file, fields={"fingerprint": str}, advice=advice) if exists(fs, run_file) else None
    if previous is not None and previous["fingerprint"] == fingerprint:
        return
    if previous is not None:
        log.info("[sample] settings or inputs changed since the last run: its outputs are cleared")
    for rel in (DECISIONS_DIR, WORK_DIR, HIERARCHY_FILE):
        delete_quietly(fs, join(root, rel))
    write_json_atomic(fs, run_file, {"fingerprint": fingerprint})


@ray.remote(num_cpus=1)
def _train(
    out_uri: str,
    survivor_files: list[str],
    decision_files: list[str],
    alive: int,
    clusters: list[int],
    sample_size: int,
    dim: int,
    seed: int,
    window: int,
) -> list[str]:
    """Trains the hierarchy on the ``sample_size`` alive survivors of lowest hash (all when fewer) and writes it;
    returns its log lines. A Ray task, so that the driver never holds the training sample.

    Tasks return the items below a hash threshold set a little above ``sample_size`` (4 sigma); this task keeps the
    lowest ``sample_size`` of them in place (a second copy of the sample would double its memory).
    """
    laps, lines = _Laps(), []
    fraction = min(1.0, (sample_size + 4 * math.sqrt(sample_size) + 16) / alive)
    expected = fraction * alive
    capacity = int(expected + 8 * math.sqrt(expected) + 64)
    x, keys, at = np.empty((capacity, dim), np.float32), np.empty(capacity), 0
    for key, piece in _in_order(
        lambda i: _training_sample_task.remote(out_uri, survivor_files[i], decision_files[i], fraction, seed),
        len(survivor_files),
        window,
    ):
        if not len(piece):  # a file none of whose alive items fell below the threshold (or with none alive)
            continue
        if at + len(piece) > x.shape[0]:  # beyond 8 sigma: grow rather than fail
            x = np.concatenate([x[:at], np.empty((max(x.shape[0], len(piece)), dim), np.float32)])
            keys = np.concatenate([keys[:at], np.empty(max(keys.size, key.size))])
        x[at : at + len(piece)], keys[at : at + len(piece)] = piece, key
        at += len(piece)
    if at > sample_size:
        keep = np.sort(np.argpartition(keys[:at], sample_size - 1)[:sample_size])
        for start in range(0, sample_size, 4096):  # keep[j] >= j: each chunk reads only rows no chunk wrote yet
            chunk = keep[start : start + 4096]
            x[start : start + chunk.size] = x[chunk]
        at = sample_size
    if at == 0:
        raise ValueError(f"the training sample of {alive} survivors came out empty; raise sample_size")
    lines.append(f"[sample] training set: {at} of {alive} survivors, read in {laps()}")
    h = sampling.hierarchical_kmeans(x[:at], clusters, seed=seed)
    del x
    fs, root = resolve(out_uri)
    _write(fs, root, HIERARCHY_FILE, _hierarchy_table(h), row_group_size=10_000)
    lines.append(f"[sample] trained {clusters} clusters in {laps()}")
    return lines


def run_sample(
    out_uri: str,
    survivor_files: list[str],
    decision_files: list[str],
    settings: SampleSettings,
    buckets: int | None = None,
    sample_size: int | None = None,
    chosen_from: int | None = None,
) -> dict:
    """Balanced sampling of the alive survivors; writes ``sample/decisions/part-<i>.parquet`` per survivors file
    (``DECISIONS_SCHEMA``) and returns {inputs, selected, unsampled, levels, clusters_per_level}.

    ``chosen_from``: survivors of uids from it on are a release's images, selected already: the clusters are made of
    all survivors, each leaf's share of (chosen + the target) is filled with new images where the chosen ones leave
    room (as evenly as the leaves allow), and the target counts the new images only.

    ``buckets``: select tasks (default: one per ``BUCKET_ROWS`` alive survivors). ``sample_size``: the training
    sample of the leaf k-means (default: ``settings.training_points_per_cluster`` per leaf, at most ``MAX_TRAINING_POINTS``;
    at least ``MIN_TRAINING_POINTS_PER_LEAF`` per leaf).
    """
    if len(survivor_files) != len(decision_files):
        raise ValueError("one decisions file per survivors file is needed")
    laps = _Laps()
    fs, root = resolve(out_uri)
    n_files = len(survivor_files)
    facts = map_footers(lambda p: _file_facts(fs, join(root, p), "uid"), survivor_files)
    dropped_facts = map_footers(lambda p: _file_facts(fs, join(root, p), None), decision_files)
    if any(f is None for f in facts):
        raise FileNotFoundError(f"missing survivors files: {[p for p, f in zip(survivor_files, facts) if f is None]}")
    survivors = [f for f in facts if f is not None]  # every file's, as just checked
    nonempty = [i for i, f in enumerate(survivors) if f.rows]
    route_min = np.asarray([survivors[i].uid_min for i in nonempty], np.int64)  # selected uids go back by these ranges
    if np.any(route_min[1:] <= np.asarray([survivors[i].uid_max for i in nonempty[:-1]], np.int64)):
        raise ValueError("survivors files must hold disjoint, increasing uid ranges")
    alive = sum(f.rows for f in survivors) - sum(f.rows for f in dropped_facts if f)
    clusters = cluster_counts(alive, settings.clusters) if alive else []
    k1 = clusters[0] if clusters else 1
    if sample_size is None:
        sample_size = min(settings.training_points_per_cluster * k1, MAX_TRAINING_POINTS)
    sample_size = max(sample_size, MIN_TRAINING_POINTS_PER_LEAF * k1)
    buckets = buckets or max(1, math.ceil(alive / BUCKET_ROWS))
    inputs = [*survivor_files, *decision_files]
    _reset_if_changed(fs, root, _fingerprint(settings, buckets, sample_size, [*facts, *dropped_facts], inputs))
    window = task_window()
    balance = settings.balance_key is not None

    if alive == 0:
        for i in range(n_files):
            if not exists(fs, join(root, LAYOUT.sample_decision(i))):
                _write(fs, root, LAYOUT.sample_decision(i), DECISIONS_SCHEMA.empty_table(), row_group_size=10_000)
        log.info("[sample] 0 after dedup, 0 selected")
        return {"inputs": 0, "selected": 0, "unsampled": 0, "levels": 0, "clusters_per_level": []}

    # 1. train
    if not exists(fs, join(root, HIERARCHY_FILE)):
        dim = pq.read_schema(join(root, survivor_files[0]), filesystem=fs).field("embedding").type.list_size
        for line in ray.get(
            _train.remote(
                out_uri, survivor_files, decision_files, alive, clusters, sample_size, dim, settings.seed, window
            )
        ):
            log.info(line)
        laps()
    centroids, parents = _hierarchy_from_table(pq.read_table(join(root, HIERARCHY_FILE), filesystem=fs))
    n_leaves = centroids[0].shape[0]
    cluster_ids = leaf_cluster_ids(parents, n_leaves)
    per_level = [int(c.shape[0]) for c in centroids]
    cluster_ids_ref = ray.put(cluster_ids)

    if not all(exists(fs, join(root, LAYOUT.sample_decision(i))) for i in range(n_files)):
        # 2. assign
        centroids_ref = ray.put(centroids[0])
        counts, chosen, reused = np.zeros(n_leaves, np.int64), np.zeros(n_leaves, np.int64), 0
        for leaves, n, done in progress(
            _in_order(
                lambda i: _assign_task.remote(
                    out_uri, i, survivor_files[i], decision_files[i], centroids_ref, buckets, balance, chosen_from
                ),
                n_files,
                window,
            ),
            "[sample] assign",
            n_files,
            log.info,
            unit="files",
        ):
            counts[leaves[leaves >= 0]] += n[leaves >= 0]
            chosen[-1 - leaves[leaves < 0]] += n[leaves < 0]
            reused += done
        if counts.sum() != alive:
            raise ValueError(
                f"{counts.sum()} alive survivors, but the files' row counts say {alive}: "
                "a decisions file lists a uid more than once"
            )
        log.info(
            f"[sample] assigned {alive} survivors to {n_leaves} leaves "
            f"({reused} of {n_files} files done before) in {laps()}"
        )

        # 3. budget
        hierarchy = LeafCountHierarchy(
            assignments=cluster_ids,
            centroids=tuple(centroids),
            parents=tuple(parents),
            leaf_distance=np.zeros(0, np.float32),
            leaf_counts=counts,
        )
        rng = np.random.default_rng(settings.seed)
        new = target_count(alive - int(chosen.sum()), settings)
        budget = sampling.leaf_budgets(hierarchy, int(chosen.sum()) + new, rng)
        if chosen.any():  # the chosen fill their leaves' shares first; the new images fill what is left, evenly
            budget = sampling.water_fill(np.maximum(budget - chosen, 0), new, rng)

        # 4. select
        args = ray.put(budget), ray.put(route_min), ray.put(np.asarray(nonempty, np.int64))  # a tuple: arity checked
        reused = sum(
            progress(
                _in_order(
                    lambda b: _select_task.remote(
                        out_uri, b, n_files, *args, settings.mode, balance, settings.seed, chosen_from
                    ),
                    buckets,
                    window,
                ),
                "[sample] select",
                buckets,
                log.info,
                unit="buckets",
            )
        )
        log.info(f"[sample] selected {int(budget.sum())} in {buckets} buckets ({reused} done before) in {laps()}")

    # 5. assemble
    rows = selected = reused = 0
    for r, s, done in progress(
        _in_order(
            lambda i: _assemble_task.remote(out_uri, i, survivor_files[i], buckets, cluster_ids_ref), n_files, window
        ),
        "[sample] assemble",
        n_files,
        log.info,
        unit="files",
    ):
        rows, selected, reused = rows + r, selected + s, reused + done
    log.info(
        f"[sample] {rows} after dedup, {selected} selected, {rows - selected} unsampled "
        f"({len(per_level)} cluster levels {per_level}; {reused} of {n_files} decision files done before) in {laps()}"
    )
    return {
        "inputs": rows,
        "selected": selected,
        "unsampled": rows - selected,
        "levels": len(per_level),
        "clusters_per_level": per_level,
    }
