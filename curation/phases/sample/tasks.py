"""The Ray tasks of the partitioned sample phase (``curation.phases.sample.cluster_sampling``) and the files they
read and write. Each task writes its one output atomically and returns a small JSON receipt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.storage import exists, join, resolve, write_parquet_atomic
from curation.phases import routed
from curation.phases.sample import kmeans
from curation.phases.sample.selection import (
    PRIORITY_STREAM,
    TRAIN_STREAM,
    hierarchy_from_table,
    hierarchy_table,
    leaf_budgets,
    leaf_counts,
    member,
    select_in_leaves,
    uid_uniform,
    value_ranks,
)
from curation.settings import SampleSettings
from curation.steps.window import FOOTER_THREADS, map_footers

HIERARCHY_FILE, DECISIONS_DIR, WORK_DIR = LAYOUT.sample_hierarchy, LAYOUT.sample_decisions, LAYOUT.sample_work
BUCKETS_DIR, COUNTS_DIR, SELECTED_DIR = f"{WORK_DIR}/buckets", f"{WORK_DIR}/counts", f"{WORK_DIR}/selected"
BUDGET_DIR, TRAINING_DIR = f"{WORK_DIR}/budget", f"{WORK_DIR}/training"
BUDGET_FILE = f"{BUDGET_DIR}/budget.parquet"

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


def buckets_path(index: int) -> str:
    return f"{BUCKETS_DIR}/part-{index:06d}.parquet"


def counts_path(index: int) -> str:
    return f"{COUNTS_DIR}/part-{index:06d}.parquet"


def training_path(index: int) -> str:
    return f"{TRAINING_DIR}/part-{index:06d}.parquet"


def route_dir(level: int) -> str:
    return f"{WORK_DIR}/route-{level}"


def route_path(level: int, index: int) -> str:
    return f"{route_dir(level)}/part-{index:06d}.parquet"


def level_dir(level: int) -> str:
    return f"{WORK_DIR}/level-{level}"


def level_path(level: int, group: int) -> str:
    return f"{level_dir(level)}/group-{group:05d}.parquet"


def selected_path(bucket: int) -> str:
    return f"{SELECTED_DIR}/bucket-{bucket:05d}.parquet"


# --- files -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileFacts:
    rows: int
    uid_min: int
    uid_max: int
    size: int
    mtime_ns: int


def file_facts(fs: pafs.FileSystem, path: str, stats_column: str | None) -> FileFacts | None:
    """A Parquet file's rows, size, modification time and (with ``stats_column``) that column's range; None when
    the file is absent."""
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
    return FileFacts(meta.num_rows, int(lo), int(hi), int(info.size), int(info.mtime_ns or 0))


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
            gone = member(rows.column("uid").to_numpy(), dropped)
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


def read_hierarchy(fs: pafs.FileSystem, root: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return hierarchy_from_table(pq.read_table(join(root, HIERARCHY_FILE), filesystem=fs))


# --- train: the hierarchy, top-down, in fits of bounded size -----------------------------------------------------


@ray.remote(num_cpus=1)
def gather_task(out_uri: str, index: int, survivor_file: str, decision_file: str, fraction: float, seed: int) -> dict:
    """Writes the file's alive items whose training key (a hash of uid and seed) is below ``fraction``: the
    training items of every level, each level taking those below its own fraction; returns {rows}."""
    fs, root = resolve(out_uri)
    schema = _training_schema(pq.read_schema(join(root, survivor_file), filesystem=fs))
    pieces = [schema.empty_table()]
    for rows in _alive_row_groups(fs, root, survivor_file, decision_file, ["uid", "embedding"]):
        key = uid_uniform(rows.column("uid").to_numpy(), seed, TRAIN_STREAM)
        kept = rows.filter(pa.array(key < fraction))
        columns = {"uid": kept.column("uid"), "key": key[key < fraction], "embedding": kept.column("embedding")}
        pieces.append(pa.table(columns, schema=schema))
    table = pa.concat_tables(pieces)
    _write(fs, root, training_path(index), table)
    return {"rows": table.num_rows}


def _training_schema(survivors: pa.Schema) -> pa.Schema:
    return pa.schema([("uid", pa.int64()), ("key", pa.float64()), survivors.field("embedding")])


@ray.remote(num_cpus=1)
def route_task(
    out_uri: str, index: int, level: int, fraction: float, above: tuple | None, group_of: np.ndarray
) -> dict:
    """Routes the file's training items of ``level`` (key below ``fraction``) down the levels ``above`` it (centroids,
    parents; None at the top) to their parent, and on to the fit task of the parent's group; returns {rows}."""
    fs, root = resolve(out_uri)
    rows = pq.read_table(join(root, training_path(index)), filters=[("key", "<", fraction)], filesystem=fs)
    parent = np.zeros(rows.num_rows, np.int32)
    if above is not None and rows.num_rows:
        parent = kmeans.descend(_embeddings(rows), *above)[0][:, 0]
    rows = rows.append_column("parent", pa.array(parent, pa.int32()))
    routed.write_routed(fs, join(root, route_path(level, index)), rows, group_of[parent], int(group_of.max()) + 1)
    return {"rows": rows.num_rows}


@ray.remote(num_cpus=1)
def fit_task(
    out_uri: str,
    level: int,
    group: int,
    n_files: int,
    first_parent: int,
    children: np.ndarray,
    parent_centroids: np.ndarray | None,
    seed: int,
    resample_steps: int,
    grandchildren: int,
) -> dict:
    """Fits the children of the group's parents (``kmeans.fit_children``) on the items routed to them, in uid order,
    and writes them (parent, weight, centroid); returns {centroids, points}."""
    fs, root = resolve(out_uri)
    paths = [join(root, route_path(level, i)) for i in range(n_files)]
    schema = pq.read_schema(paths[0], filesystem=fs).remove_metadata()
    t = routed.read_routed(fs, paths, group, schema)
    t = t.take(pa.array(np.argsort(t.column("uid").to_numpy(), kind="stable")))
    dim = schema.field("embedding").type.list_size
    x = _embeddings(t) if t.num_rows else np.zeros((0, dim), np.float32)
    fitted = kmeans.fit_children(
        x, t.column("key").to_numpy(), t.column("parent").to_numpy(), first_parent, children, parent_centroids,
        level=level, seed=seed, resample_steps=resample_steps, grandchildren=grandchildren,
    )  # fmt: skip
    table = pa.table(
        {
            "parent": fitted.parent,
            "weight": fitted.weight,
            "centroid": pa.FixedSizeListArray.from_arrays(pa.array(fitted.centroids.ravel()), dim),
        }
    )
    _write(fs, root, level_path(level, group), table, row_group_size=10_000)
    return {"centroids": int(fitted.parent.size), "points": fitted.points}


def read_level(fs: pafs.FileSystem, root: str, level: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fitted level's (centroids, parents, weights), its groups' clusters in order."""
    t = pa.concat_tables(pq.read_table(join(root, level_path(level, g)), filesystem=fs) for g in range(groups))
    flat = t.column("centroid").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
    return np.ascontiguousarray(flat), t.column("parent").to_numpy(), t.column("weight").to_numpy()


@ray.remote(num_cpus=1)
def hierarchy_task(out_uri: str, groups: list[int]) -> dict:
    """Writes ``sample/hierarchy.parquet`` from the fitted levels (``groups[l]`` files of level l); returns
    {clusters_per_level}."""
    fs, root = resolve(out_uri)
    levels = [read_level(fs, root, level, g) for level, g in enumerate(groups)]
    h = kmeans.ClusterHierarchy(
        assignments=np.zeros((0, len(levels)), np.int32),
        centroids=tuple(c for c, _, _ in levels),
        parents=tuple(p for _, p, _ in levels[:-1]),
        leaf_distance=np.zeros(0, np.float32),
    )
    _write(fs, root, HIERARCHY_FILE, hierarchy_table(h), row_group_size=10_000)
    return {"clusters_per_level": [int(c.shape[0]) for c in h.centroids]}


# --- assign, budget, select, assemble -----------------------------------------------------------------------------


@ray.remote(num_cpus=1)
def assign_task(
    out_uri: str,
    index: int,
    survivor_file: str,
    decision_file: str,
    hierarchy: tuple[list[np.ndarray], list[np.ndarray]],
    buckets: int,
    balance: bool,
    chosen_from: int | None,
) -> dict:
    """Gives the file's alive survivors their leaf (down the ``hierarchy``: centroids, parents) and squared distance
    to it, routes (uid, leaf, distance,
    balance) to the buckets by leaf and writes the per-leaf counts (``selection.leaf_counts``); returns {rows}."""
    fs, root = resolve(out_uri)
    columns = ["uid", "embedding"] + (["balance"] if balance else [])
    uids, leaves, dists = [], [], []
    values: list[pa.Array] = []  # the balance key's chunks
    for rows in _alive_row_groups(fs, root, survivor_file, decision_file, columns):
        assignments, dist = kmeans.descend(_embeddings(rows), *hierarchy)
        leaf = assignments[:, 0]
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
    routed.write_routed(fs, join(root, buckets_path(index)), rows, leaf % buckets, buckets)
    _write(fs, root, counts_path(index), leaf_counts(uid, leaf, chosen_from))
    return {"rows": int(uid.size)}


@ray.remote(num_cpus=1)
def budget_task(out_uri: str, n_files: int, settings: SampleSettings) -> dict:
    """Sums the per-leaf counts of every file and writes each leaf's budget; returns {chosen, new}: the items chosen
    before and the new picks."""
    fs, root = resolve(out_uri)
    centroids, parents = read_hierarchy(fs, root)
    counts, chosen = np.zeros(centroids[0].shape[0], np.int64), np.zeros(centroids[0].shape[0], np.int64)
    paths = [join(root, counts_path(i)) for i in range(n_files)]
    for start in range(0, n_files, 4 * FOOTER_THREADS):  # a few files' counts held at a time
        for t in map_footers(lambda p: pq.read_table(p, filesystem=fs), paths[start : start + 4 * FOOTER_THREADS]):
            leaf = t.column("leaf").to_numpy()
            counts[leaf] += t.column("items").to_numpy()
            chosen[leaf] += t.column("chosen").to_numpy()
    budget = leaf_budgets(centroids, parents, counts, chosen, settings)
    _write(fs, root, BUDGET_FILE, pa.table({"budget": budget.astype(np.int64)}))
    return {"chosen": int(chosen.sum()), "new": int(budget.sum())}


@ray.remote(num_cpus=1)
def select_task(
    out_uri: str,
    bucket: int,
    n_files: int,
    route_min: np.ndarray,
    route_index: np.ndarray,
    mode: str,
    balance: bool,
    seed: int,
    chosen_from: int | None,
) -> dict:
    """Selects inside the bucket's leaves and routes (uid, leaf, selected) back to the survivors files; returns
    {rows, selected}. Items from ``chosen_from`` on are selected before (a release's), and the budget counts the
    others only."""
    fs, root = resolve(out_uri)
    budget = pq.read_table(join(root, BUDGET_FILE), filesystem=fs).column("budget").to_numpy()
    t = routed.read_routed(fs, [join(root, buckets_path(i)) for i in range(n_files)], bucket, _BUCKET_SCHEMA)
    uid = t.column("uid").to_numpy()
    order = np.argsort(uid, kind="stable")
    uid, leaf = uid[order], t.column("leaf").to_numpy()[order]
    priority = t.column("distance").to_numpy()[order] if mode == "closest" else uid_uniform(uid, seed, PRIORITY_STREAM)
    chosen = uid >= chosen_from if chosen_from is not None else np.zeros(uid.size, bool)
    values = value_ranks(t.column("balance"))[order] if balance else None
    mask = chosen.copy()
    mask[~chosen] = select_in_leaves(
        leaf[~chosen], priority[~chosen], budget, None if values is None else values[~chosen], seed
    )
    present = np.unique(leaf[~chosen])
    if not np.array_equal(np.bincount(leaf[mask & ~chosen], minlength=budget.size)[present], budget[present]):
        raise AssertionError(f"bucket {bucket}: the selection differs from the leaf budgets")
    owner = route_index[np.searchsorted(route_min, uid, side="right") - 1]
    routed.write_routed(
        fs,
        join(root, selected_path(bucket)),
        pa.table({"uid": uid, "leaf": leaf, "selected": mask}, schema=_SELECTED_SCHEMA),
        owner,
        n_files,
    )
    return {"rows": int(uid.size), "selected": int(mask.sum())}


@ray.remote(num_cpus=1)
def assemble_task(out_uri: str, index: int, survivor_file: str, buckets: int, cluster_ids: np.ndarray) -> dict:
    """Writes the file's decisions; returns {rows, selected}."""
    fs, root = resolve(out_uri)
    mine = routed.read_routed(fs, [join(root, selected_path(b)) for b in range(buckets)], index, _SELECTED_SCHEMA)
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
    return {"rows": int(uid.size), "selected": int(table.column("selected").to_numpy().sum())}


@ray.remote(num_cpus=0.25)
def empty_decisions_task(out_uri: str, index: int) -> dict:
    """The decisions file of survivors of which none is alive."""
    fs, root = resolve(out_uri)
    _write(fs, root, LAYOUT.sample_decision(index), DECISIONS_SCHEMA.empty_table(), row_group_size=10_000)
    return {"rows": 0, "selected": 0}
