"""Dedup's last step as Ray tasks: connected components over the pair tables, one survivor kept per component.

Input: the pair files of every signal (columns ``a``, ``b``: survivor uids; other columns ignored), in signal
priority order, and the survivor files (``curation.phases.survivors``: uid-sorted, disjoint uid ranges). Output:
``dedup/decisions/part-<i>.parquet`` for survivor file ``i``: its dropped survivors, by uid, with the key of the
survivor kept instead and the signal that linked them. Decisions are exactly those of ``dedup.resolve_duplicates``
on the whole graph (same components, same kept item, same ``duplicate_of`` and ``linked_by``) with the survivors'
``keep_attributes`` and, for ties, ``key`` then ``source`` (the keys the single-driver phase passes).

Steps (each a set of Ray tasks over partition files under ``dedup/components/``; nodes are the uids that occur in
some pair, hash-partitioned into P partitions; a survivor without pairs is kept and never touched):

1. ``pairs``: each pair file's rows as directed edges both ways, routed by source node.
2. ``edges``: per partition, the distinct edges with the first signal that links them.
3. Contraction rounds (random-priority hooking): every node hooks to the node of lowest priority (a bijective hash
   of the uid, reseeded each round) in its closed neighbourhood, then every edge is replaced by the edge between
   its endpoints' hooks, self-loops dropped. The lowest-priority node of a component and its neighbours merge, so
   a component of k > 1 nodes loses at least one node per round, and a constant fraction in expectation: rounds
   grow with the logarithm of the largest component (3 for groups of 2-10, 6 for groups of up to ~100 nodes,
   8 for a star of 10^5 leaves, 17 for a chain of 10^5 nodes). A component shrunk to one node leaves the graph.
   Each round is two steps: ``hook`` (each node's hook; messages telling the neighbours) and ``contract`` (the
   next round's edges; each node's hook, routed to the hook's partition for step 5).
4. When the edges left fit one partition (``local_edges``) one task finishes with scipy on what is left (label =
   smallest uid of the component); with none left nothing is needed. ``max_rounds`` caps the rounds before that.
5. ``labels``, rounds backwards: a node's label is its hook's label, or the hook itself where the hook left the
   graph (it was its component's last node).
6. The keep rule: labels meet the edges (``attach``) and the survivor attributes (``members``, one task per
   ``files_per_task`` survivor files); each component's members and edges meet in one ``keep`` task, which runs
   ``dedup.resolve_duplicates`` on them (the kernel itself, on a monotone relabelling of the uids: same keep order,
   same breadth-first parents), and ``write`` gathers the dropped rows of each survivor file of a group.

Shuffles are ``curation.phases.routed`` files (one per task, row groups per destination). Each task skips itself when its
last output exists and returns the receipt stored in that file's footer, so a rerun redoes only missing work and
the driver takes the same path; every output is a deterministic function of its inputs, so reruns are
byte-identical. The driver holds per-task receipts and file names only: O(P * rounds + F).

Sizes at 10^9 survivors (F = 10^4 survivor files of 10^5 rows, 2% of survivors in near-duplicate groups,
~10^8 pairs): P = 2 * pairs / ``edges_per_partition`` = 50 partitions; a graph task holds about
``edges_per_partition`` = 4M directed edges (16 B each; a few hundred MB with its sorts), plus skew: contraction
gathers a component's edges on one node, which has at most one edge per member, so the largest group adds up to
its size to one task (a group of 10^5 copies of one image: 10^5 edges). ``members`` streams ``files_per_task`` = 4 survivor files
(``survivor_batch_rows`` at a time) against their ~8000 grouped uids; ``keep`` holds 1/P of the 2*10^7 grouped survivors (4*10^5 rows with
their keys and sources, ~100 MB) and their edges, each component whole; ``write`` 4 files' decisions. Routed
files to the 2500 file groups have 20 KB footers. The driver: O(P) receipts per step and the F file boundaries
(about 300 KB, shared with the tasks through one object).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.storage import delete_quietly, exists, join, resolve, write_parquet_atomic
from curation.phases.dedup import kernels
from curation.phases.routed import (
    read_plain,
    read_receipt,
    read_routed,
    write_plain,
    write_routed,
)
from curation.phases.runtime import map_footers, parquet_rows
from curation.phases.step import Calls, StepRunner

log = logging.getLogger(__name__)

WORK_DIR, DECISIONS_DIR = LAYOUT.components, LAYOUT.dedup_decisions
SURVIVOR_COLUMNS = ["uid", "shard_id", "source", "key", "score", "width", "height", "encoding_quality", "released"]

EDGES = pa.schema([("src", pa.int64()), ("dst", pa.int64()), ("code", pa.int8())])
ADJACENCY = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
HOOKS = pa.schema([("node", pa.int64()), ("hook", pa.int64())])  # a node and the node it hooked to
MESSAGES = pa.schema([("node", pa.int64()), ("neighbour_hook", pa.int64())])
LABELS = pa.schema([("node", pa.int64()), ("label", pa.int64())])
GROUP_EDGES = pa.schema([("lo", pa.int64()), ("hi", pa.int64()), ("code", pa.int8())])
MEMBERS = pa.schema(
    [
        ("uid", pa.int64()),
        ("shard_id", pa.string()),
        ("source", pa.string()),
        ("key", pa.string()),
        ("score", pa.float64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("encoding_quality", pa.int8()),
        ("released", pa.bool_()),
    ]
)
DECISIONS = pa.schema(
    [
        ("uid", pa.int64()),
        ("source", pa.string()),
        ("shard_id", pa.string()),
        ("key", pa.string()),
        ("duplicate_of", pa.string()),
        ("duplicate_signal", pa.string()),
    ]
)


class ComponentsError(RuntimeError):
    """The components cannot be computed as asked (rounds exhausted, uids that are no survivor's)."""


# ---------------------------------------------------------------------------------------------------------------
# Where things live
# ---------------------------------------------------------------------------------------------------------------


def mix64(x: np.ndarray | int) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit words that scatters neighbouring uids."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def priority(uid: np.ndarray, round_number: int) -> np.ndarray:
    """A node's priority in a round: distinct uids never tie, and the order is fresh every round."""
    return mix64(np.asarray(uid).astype(np.uint64) ^ mix64(round_number))


@dataclass(frozen=True)
class Layout:
    """Node partitions (hash of the uid), survivor files (uid ranges, from the files' statistics) and file groups
    (runs of ``files_per_task`` files: the unit of the ``members`` and ``write`` tasks)."""

    n_parts: int
    group_of_file: np.ndarray  # of every survivor file
    first_uid: np.ndarray  # of each non-empty survivor file, increasing
    last_uid: np.ndarray
    file_index: np.ndarray  # those files' positions in the survivor list

    @property
    def n_groups(self) -> int:
        return int(self.group_of_file.max()) + 1 if self.group_of_file.size else 0

    def files_of_group(self, group: int) -> np.ndarray:
        return np.flatnonzero(self.group_of_file == group)

    def part_of(self, uid: np.ndarray) -> np.ndarray:
        return (mix64(uid) % np.uint64(self.n_parts)).astype(np.int64)

    def group_of(self, uid: np.ndarray) -> np.ndarray:
        return self.group_of_file[self.file_of(uid)]

    def file_of(self, uid: np.ndarray) -> np.ndarray:
        uid = np.asarray(uid, np.int64)
        pos = np.searchsorted(self.first_uid, uid, side="right") - 1
        outside = (pos < 0) | (uid > self.last_uid[np.maximum(pos, 0)]) if self.first_uid.size else uid == uid
        if outside.any():
            raise ComponentsError(f"pair uid {int(uid[outside][0])} lies in no survivor file's uid range")
        return self.file_index[pos]


def _uid_range(fs, path: str) -> tuple[int, int] | None:
    """First and last uid of a survivor file from its row-group statistics (or its uid column without them)."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        if meta.num_rows == 0:
            return None
        leaf = [meta.schema.column(c).path for c in range(meta.num_columns)].index("uid")
        stats = [meta.row_group(g).column(leaf).statistics for g in range(meta.num_row_groups)]
        if all(s is not None and s.has_min_max for s in stats):
            return min(int(s.min) for s in stats), max(int(s.max) for s in stats)
        bounds = pc.min_max(pf.read(columns=["uid"]).column("uid"))
        return int(bounds["min"].as_py()), int(bounds["max"].as_py())


def _layout(fs, root: str, survivor_files: Sequence[str], n_parts: int, files_per_task: int) -> Layout:
    ranges = map_footers(lambda f: _uid_range(fs, join(root, f)), survivor_files)
    held = [(i, r) for i, r in enumerate(ranges) if r is not None]
    first = np.asarray([r[0] for _, r in held], np.int64)
    last = np.asarray([r[1] for _, r in held], np.int64)
    if np.any(first[1:] <= last[:-1]):
        bad = int(np.flatnonzero(first[1:] <= last[:-1])[0])
        raise ComponentsError(
            f"survivor files {survivor_files[held[bad][0]]} and {survivor_files[held[bad + 1][0]]} are not in uid order"
        )
    groups = np.arange(len(survivor_files)) // files_per_task
    return Layout(n_parts, groups, first, last, np.asarray([i for i, _ in held], np.int64))


# ---------------------------------------------------------------------------------------------------------------
# Tasks. Each receives the output URI, small parameters and relative paths; its last output is its commit record.
# ---------------------------------------------------------------------------------------------------------------


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def _numbers(table: pa.Table, name: str, fill, dtype) -> np.ndarray:
    column = pc.cast(table.column(name), pa.from_numpy_dtype(dtype))  # first: an int8 column's nulls may be NaN
    return pc.fill_null(column, fill).to_numpy(zero_copy_only=False)


def keep_attributes(survivors: pa.Table) -> kernels.KeepAttributes:
    """What the keep rule ranks, from survivor rows (``curation.phases.survivors``; a missing value ranks lowest)."""
    return kernels.KeepAttributes(
        released=_numbers(survivors, "released", False, bool),
        width=_numbers(survivors, "width", 0, np.int64),
        height=_numbers(survivors, "height", 0, np.int64),
        quality=_numbers(survivors, "encoding_quality", np.nan, np.float64),
        score=_numbers(survivors, "score", np.nan, np.float64),
    )


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` at ``query`` in the sorted ``keys``, and whether each query was found (value 0 where not)."""
    if keys.size == 0:
        return np.zeros(query.size, values.dtype), np.zeros(query.size, bool)
    at = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    found = keys[at] == query
    return np.where(found, values[at], 0), found


def _first_of_runs(*sorted_keys: np.ndarray) -> np.ndarray:
    """Mask of the first row of each run of equal keys (rows sorted by the keys)."""
    n = sorted_keys[0].size
    first = np.ones(n, bool)
    if n:
        first[1:] = np.logical_or.reduce([k[1:] != k[:-1] for k in sorted_keys])
    return first


def _distinct_pairs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((dst, src))
    src, dst = src[order], dst[order]
    first = _first_of_runs(src, dst)
    return src[first], dst[first]


@ray.remote(num_cpus=1)
def _pairs_task(out_uri: str, layout: Layout, pair_file: str, code: int, out: str) -> dict:
    """A pair file's links as directed edges both ways, routed by source node."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    t = read_plain(fs, join(root, pair_file), ["a", "b"])
    a, b = _column(t, "a").astype(np.int64), _column(t, "b").astype(np.int64)
    layout.file_of(np.concatenate([a, b]))  # every uid must be a survivor's
    link = a != b
    a, b = a[link], b[link]
    src, dst = np.concatenate([a, b]), np.concatenate([b, a])
    edges = pa.table([src, dst, np.full(src.size, code, np.int8)], schema=EDGES)
    write_routed(fs, join(root, out), edges, layout.part_of(src), layout.n_parts, {"rows": t.num_rows})
    return {"rows": t.num_rows}


@ray.remote(num_cpus=1)
def _edges_task(out_uri: str, layout: Layout, pair_routes: list[str], part: int, out: str) -> dict:
    """The distinct directed edges of a partition's nodes, each with the first signal (lowest code) linking it."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    t = read_routed(fs, [join(root, p) for p in pair_routes], part, EDGES)
    src, dst, code = _column(t, "src"), _column(t, "dst"), _column(t, "code")
    order = np.lexsort((code, dst, src))
    src, dst, code = src[order], dst[order], code[order]
    first = _first_of_runs(src, dst)
    edges = pa.table([src[first], dst[first], code[first]], schema=EDGES)
    receipt = {"edges": edges.num_rows}
    write_plain(fs, join(root, out), edges, receipt)
    return receipt


def _read_adjacency(fs, root: str, paths: list[str], part: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A round's edges: plain files read whole (``part`` None) or routed files' rows for ``part``."""
    full = [join(root, p) for p in paths]
    if part is None:
        tables = [read_plain(fs, p, ["src", "dst"]) for p in full]
        t = pa.concat_tables(tables) if tables else ADJACENCY.empty_table()
    else:
        t = read_routed(fs, full, part, ADJACENCY, columns=["src", "dst"])
    return _column(t, "src"), _column(t, "dst")


@ray.remote(num_cpus=1)
def _hook_task(
    out_uri: str,
    layout: Layout,
    round_number: int,
    adjacency: list[str],
    routed: bool,
    part: int,
    hooks_out: str,
    messages_out: str,
) -> dict:
    """Every node of the partition hooks to the lowest-priority node of its closed neighbourhood; each neighbour
    is told the hook (it needs it to rewrite the edge from its side)."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, messages_out))) is not None:
        return done
    src, dst = _read_adjacency(fs, root, adjacency, part if routed else None)
    # by node, its lowest-priority neighbour first; priorities are a bijection, so repeated edges sit together
    order = np.lexsort((priority(dst, round_number), src))
    distinct = _first_of_runs(src[order], dst[order])
    src, dst = src[order][distinct], dst[order][distinct]
    starts = np.flatnonzero(_first_of_runs(src))
    node, best = src[starts], dst[starts]
    hook = np.where(priority(node, round_number) < priority(best, round_number), node, best)
    write_plain(fs, join(root, hooks_out), pa.table([node, hook], schema=HOOKS))
    told, neighbour_hook = _distinct_pairs(dst, np.repeat(hook, np.diff(np.append(starts, src.size))))
    messages = pa.table([told, neighbour_hook], schema=MESSAGES)
    receipt = {"nodes": int(node.size), "edges": int(src.size)}
    write_routed(fs, join(root, messages_out), messages, layout.part_of(told), layout.n_parts, receipt)
    return receipt


@ray.remote(num_cpus=1)
def _contract_task(
    out_uri: str, layout: Layout, hooks: str, messages: list[str], part: int, adjacency_out: str, children_out: str
) -> dict:
    """Edge (x, y) becomes (hook(x), hook(y)): here x's side, from the message hook(y) sent to x. Also routes each
    node's hook to the hook's partition, where the labels come back through later."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, children_out))) is not None:
        return done
    h = read_plain(fs, join(root, hooks))
    node, hook = _column(h, "node"), _column(h, "hook")
    m = read_routed(fs, [join(root, p) for p in messages], part, MESSAGES)
    src = hook[np.searchsorted(node, _column(m, "node"))]  # every told node is one of this partition's
    dst = _column(m, "neighbour_hook")
    link = src != dst
    src, dst = _distinct_pairs(src[link], dst[link])
    write_routed(
        fs, join(root, adjacency_out), pa.table([src, dst], schema=ADJACENCY), layout.part_of(src), layout.n_parts
    )
    receipt = {"edges": int(src.size)}
    write_routed(fs, join(root, children_out), h, layout.part_of(hook), layout.n_parts, receipt)
    return receipt


@ray.remote(num_cpus=1)
def _finish_task(out_uri: str, layout: Layout, adjacency: list[str], out: str) -> dict:
    """The components of what is left, in one task (scipy): label = smallest uid of the component."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    src, dst = _read_adjacency(fs, root, adjacency, None)
    node = np.unique(src)  # edges go both ways: every node is some edge's source
    i, j = np.searchsorted(node, src), np.searchsorted(node, dst)
    graph = csr_matrix((np.ones(i.size, np.int8), (i, j)), shape=(node.size, node.size))
    n_components, component = connected_components(graph, directed=False)
    _, first = np.unique(component, return_index=True)  # nodes are sorted: the first member is the smallest
    label = node[first][component]
    receipt = {"nodes": int(node.size), "components": int(n_components)}
    write_routed(
        fs, join(root, out), pa.table([node, label], schema=LABELS), layout.part_of(node), layout.n_parts, receipt
    )
    return receipt


@ray.remote(num_cpus=1)
def _label_task(out_uri: str, layout: Layout, children: list[str], next_labels: list[str], part: int, out: str) -> dict:
    """Labels of one round's nodes from the next round's: a node takes its hook's label, or the hook itself when
    the hook left the graph (its component had shrunk to that one node)."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    c = read_routed(fs, [join(root, p) for p in children], part, HOOKS)
    node, hook = _column(c, "node"), _column(c, "hook")
    nxt = read_routed(fs, [join(root, p) for p in next_labels], part, LABELS).sort_by("node")
    next_label, found = _lookup(_column(nxt, "node"), _column(nxt, "label"), hook)
    label = np.where(found, next_label, hook)
    receipt = {"nodes": int(node.size)}
    write_routed(
        fs, join(root, out), pa.table([node, label], schema=LABELS), layout.part_of(node), layout.n_parts, receipt
    )
    return receipt


@ray.remote(num_cpus=1)
def _attach_task(
    out_uri: str, layout: Layout, labels: list[str], edges: str, part: int, group_edges_out: str, labels_out: str
) -> dict:
    """A partition's edges go to their component's keep task; its nodes' labels go to their survivor file's group."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, labels_out))) is not None:
        return done
    lab = read_routed(fs, [join(root, p) for p in labels], part, LABELS).sort_by("node")
    node, label = _column(lab, "node"), _column(lab, "label")
    e = read_plain(fs, join(root, edges)).filter(pc.less(pc.field("src"), pc.field("dst")))
    lo = _column(e, "src")
    group_edges = pa.table([lo, _column(e, "dst"), _column(e, "code")], schema=GROUP_EDGES)
    edge_label = label[np.searchsorted(node, lo)]
    write_routed(fs, join(root, group_edges_out), group_edges, layout.part_of(edge_label), layout.n_parts)
    receipt = {"nodes": int(node.size)}
    write_routed(fs, join(root, labels_out), lab, layout.group_of(node), layout.n_groups, receipt)
    return receipt


@ray.remote(num_cpus=1)
def _members_task(
    out_uri: str, layout: Layout, labels: list[str], group: int, survivor_files: list[str], batch_rows: int, out: str
) -> dict:
    """What the keep rule needs of the survivors in some pair, read from one group of survivor files (streamed)."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    lab = read_routed(fs, [join(root, p) for p in labels], group, LABELS).sort_by("node")
    node, label = _column(lab, "node"), _column(lab, "label")
    found = [MEMBERS.empty_table()]
    for survivor_file in survivor_files if node.size else []:
        with fs.open_input_file(join(root, survivor_file)) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=SURVIVOR_COLUMNS):
                _, in_pairs = _lookup(node, node, batch.column("uid").to_numpy())
                found.append(
                    pa.Table.from_batches([batch]).filter(pa.array(in_pairs)).select(MEMBERS.names).cast(MEMBERS)
                )
    members = pa.concat_tables(found).sort_by("uid")
    if not np.array_equal(_column(members, "uid"), node):
        missing = np.setdiff1d(node, _column(members, "uid"))
        raise ComponentsError(
            f"pair uid {int(missing[0]) if missing.size else '?'} is not exactly one survivor of {', '.join(survivor_files)}"
        )
    receipt = {"nodes": int(node.size)}
    write_routed(fs, join(root, out), members, layout.part_of(label), layout.n_parts, receipt)  # to its component
    return receipt


class _Links(NamedTuple):
    i: np.ndarray
    j: np.ndarray


@ray.remote(num_cpus=1)
def _keep_task(
    out_uri: str,
    layout: Layout,
    signals: tuple[str, ...],
    members: list[str],
    group_edges: list[str],
    part: int,
    out: str,
) -> dict:
    """``dedup.resolve_duplicates`` on whole components. Members are indexed in uid order (the global order),
    so keep order, key ranks and breadth-first parents are those of the single-process run."""
    fs, root = resolve(out_uri)
    if (done := read_receipt(fs, join(root, out))) is not None:
        return done
    m = read_routed(fs, [join(root, p) for p in members], part, MEMBERS).sort_by("uid")
    e = read_routed(fs, [join(root, p) for p in group_edges], part, GROUP_EDGES)
    uid = _column(m, "uid")
    i, j, code = np.searchsorted(uid, _column(e, "lo")), np.searchsorted(uid, _column(e, "hi")), _column(e, "code")
    links = {name: _Links(i[code == c], j[code == c]) for c, name in enumerate(signals)}
    keys = np.asarray(
        [f"{k}\x00{s}" for k, s in zip(m.column("key").to_pylist(), m.column("source").to_pylist())], object
    )
    result = kernels.resolve_duplicates(
        m.num_rows,
        links,
        keep_attributes(m),
        keys=keys,  # the tie-break of the single-driver phase: key, then source
    )
    dropped = np.flatnonzero(~result.keep)
    names = np.asarray(result.signals, object)
    decisions = pa.table(
        [
            pa.array(uid[dropped]),
            m.column("source").take(dropped),
            m.column("shard_id").take(dropped),
            m.column("key").take(dropped),
            m.column("key").take(result.duplicate_of[dropped]),
            pa.array(names[result.linked_by[dropped]].tolist(), pa.string()),
        ],
        schema=DECISIONS,
    )
    by_signal = Counter(names[result.linked_by[dropped]].tolist())
    receipt = {"components": int(result.keep.sum()), "dropped": {s: by_signal.get(s, 0) for s in signals}}
    write_routed(fs, join(root, out), decisions, layout.group_of(uid[dropped]), layout.n_groups, receipt)
    return receipt


@ray.remote(num_cpus=1)
def _write_task(out_uri: str, layout: Layout, dropped: list[str], group: int, outputs: list[str]) -> dict:
    """The decisions file of each survivor file of a group: its dropped survivors, by uid."""
    fs, root = resolve(out_uri)
    paths = [join(root, o) for o in outputs]
    if all(exists(fs, p) for p in paths):
        return {"rows": sum(parquet_rows(fs, paths))}
    t = read_routed(fs, [join(root, p) for p in dropped], group, DECISIONS).sort_by("uid")
    file = layout.file_of(_column(t, "uid"))
    for index, path in zip(layout.files_of_group(group), paths):
        if not exists(fs, path):
            write_parquet_atomic(fs, path, t.filter(pa.array(file == index)), row_group_size=100_000)
    return {"rows": t.num_rows}


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def _work(*parts: str) -> str:
    return "/".join([WORK_DIR, *parts])


def _parts(stage: str, n: int) -> list[str]:
    return [_work(stage, f"part-{p:06d}.parquet") for p in range(n)]


def _units(calls: Sequence[tuple[Any, tuple]]) -> dict[str, tuple[Any, tuple]]:
    return {f"part-{k:06d}": call for k, call in enumerate(calls)}


def _total(field: str) -> Callable[[Sequence[dict]], dict]:
    return lambda receipts: {field: sum(r[field] for r in receipts)}


def _label_components(
    runner: StepRunner,
    layout: ray.ObjectRef,
    edges: list[str],
    remaining: int,
    n_parts: int,
    local_edges: int,
    max_rounds: int,
) -> tuple[list[str], int, bool]:
    """Steps 3-5: the routed label files of every node in some pair, the rounds run, whether one task finished."""
    uri = runner.output.uri
    adjacency, routed, rounds, labels, finished_locally = edges, False, 0, [], False
    while remaining:
        if remaining <= local_edges:
            labels = [_work(f"round-{rounds + 1:03d}", "labels-local.parquet")]
            call = (_finish_task, (uri, layout, adjacency, labels[0]))
            done = runner.run(Calls(f"components/round-{rounds + 1:03d}/finish", {"all": call}))
            log.info(
                f"[components] {remaining} directed edges left: finished in one task ({done['components']} components)"
            )
            finished_locally = True
            break
        if rounds == max_rounds:
            raise ComponentsError(
                f"connected components not converged after max_rounds={max_rounds} rounds: {remaining} directed "
                f"edges left, more than local_edges={local_edges}; raise max_rounds or local_edges"
            )
        rounds += 1
        step = f"round-{rounds:03d}"
        hooks, messages = _parts(f"{step}/hooks", n_parts), _parts(f"{step}/messages", n_parts)
        # round 1 reads its own edges file; later rounds their rows of every routed edges file
        hook = [
            (
                _hook_task,
                (uri, layout, rounds, adjacency if routed else [adjacency[p]], routed, p, hooks[p], messages[p]),
            )
            for p in range(n_parts)
        ]
        runner.run(Calls(f"components/{step}/hook", _units(hook), unit_name="partitions"))
        adjacency, children = _parts(f"{step}/edges", n_parts), _parts(f"{step}/children", n_parts)
        contract = [
            (_contract_task, (uri, layout, hooks[p], messages, p, adjacency[p], children[p])) for p in range(n_parts)
        ]
        step_stats = Calls(
            f"components/{step}/contract", _units(contract), unit_name="partitions", summarise=_total("edges")
        )
        routed, remaining = True, runner.run(step_stats)["edges"]
        log.info(f"[components] round {rounds}: {remaining} directed edges left")

    # 5: labels back through the rounds
    for r in range(rounds, 0, -1):
        step = f"round-{r:03d}"
        children, out = _parts(f"{step}/children", n_parts), _parts(f"{step}/labels", n_parts)
        label = [(_label_task, (uri, layout, children, labels, p, out[p])) for p in range(n_parts)]
        runner.run(Calls(f"components/{step}/labels", _units(label), unit_name="partitions"))
        labels = out
    return labels, rounds, finished_locally


def run_components(
    runner: StepRunner,
    pair_files: dict[str, list[str]],
    survivor_files: list[str],
    partitions: int | None = None,
    max_rounds: int = 64,
    *,
    edges_per_partition: int = 4_000_000,
    local_edges: int | None = None,
    files_per_task: int = 4,
    survivor_batch_rows: int = 65_536,
    keep_work: bool = False,
) -> dict:
    """Components of the pairs of every signal and the keep rule; writes ``LAYOUT.dedup_decision(i)`` per survivor file.

    ``pair_files`` maps each signal to its pair files (relative to the output), in priority order: a pair that
    two signals link counts as the first's. ``partitions`` (P) defaults to twice the pair rows over
    ``edges_per_partition``; ``local_edges`` (default ``edges_per_partition``) is the most directed edges left that
    one task finishes alone. Raises ``ComponentsError`` when ``max_rounds`` rounds leave more than that.
    ``files_per_task`` survivor files make one ``members`` / ``write`` task.
    Intermediate files live under ``dedup/components/`` and are removed at the end unless ``keep_work``.
    """
    out, uri = runner.output, runner.output.uri
    signals = tuple(pair_files)
    if len(signals) > 127:
        raise ValueError("at most 127 signals")
    pair_list = [(code, path) for code, s in enumerate(signals) for path in pair_files[s]]
    if partitions is None:
        pair_rows = sum(parquet_rows(out.fs, [out.path(path) for _, path in pair_list]))
        partitions = math.ceil(2 * pair_rows / edges_per_partition)
    n_parts = max(1, int(partitions))
    local_edges = edges_per_partition if local_edges is None else local_edges
    plan = {
        "survivor_files": list(survivor_files),
        "pair_files": {s: list(pair_files[s]) for s in signals},
        "partitions": n_parts,
        "local_edges": int(local_edges),
        "files_per_task": int(files_per_task),
    }
    # O(F) file boundaries, shared by every task through the object store (not copied into each call)
    layout_here = _layout(out.fs, out.root, survivor_files, n_parts, files_per_task)
    layout = ray.put(layout_here)

    # 1-2: edges
    routes = [_work("pairs", f"{code:03d}-{k:06d}.parquet") for k, (code, _) in enumerate(pair_list)]
    calls: list[tuple[Any, tuple]] = [(_pairs_task, (uri, layout, path, code, r)) for (code, path), r in zip(pair_list, routes)]
    rows = runner.run(
        Calls(
            "components/pairs",
            _units(calls),
            unit_name="pair files",
            own=plan,
            outputs=[WORK_DIR],
            summarise=lambda receipts: {"rows": [r["rows"] for r in receipts]},
        )
    )["rows"]
    pair_counts = {s: sum(n for (code, _), n in zip(pair_list, rows) if signals[code] == s) for s in signals}
    edges = _parts("edges", n_parts)
    calls = [(_edges_task, (uri, layout, routes, p, edges[p])) for p in range(n_parts)]
    remaining = runner.run(Calls("components/edges", _units(calls), unit_name="partitions", summarise=_total("edges")))[
        "edges"
    ]
    log.info(f"[components] {pair_counts} pairs: {remaining // 2} distinct edges in {n_parts} partitions")
    labels, rounds, finished_locally = _label_components(
        runner, layout, edges, remaining, n_parts, local_edges, max_rounds
    )

    # 6: keep rule
    group_edges, file_labels = _parts("keep/edges", n_parts), _parts("keep/labels", n_parts)
    calls = [(_attach_task, (uri, layout, labels, edges[p], p, group_edges[p], file_labels[p])) for p in range(n_parts)]
    nodes = runner.run(Calls("components/attach", _units(calls), unit_name="partitions", summarise=_total("nodes")))[
        "nodes"
    ]
    groups = [layout_here.files_of_group(g) for g in range(layout_here.n_groups)]
    members = _parts("keep/members", len(groups))
    calls = [
        (
            _members_task,
            (uri, layout, file_labels, g, [survivor_files[i] for i in files], survivor_batch_rows, members[g]),
        )
        for g, files in enumerate(groups)
    ]
    runner.run(Calls("components/members", _units(calls), unit_name="file groups"))
    dropped = _parts("keep/dropped", n_parts)
    calls = [(_keep_task, (uri, layout, signals, members, group_edges, p, dropped[p])) for p in range(n_parts)]
    kept = runner.run(
        Calls(
            "components/keep",
            _units(calls),
            unit_name="partitions",
            summarise=lambda receipts: {
                "components": sum(r["components"] for r in receipts),
                "by_signal": {s: sum(r["dropped"][s] for r in receipts) for s in signals},
            },
        )
    )
    outputs = [LAYOUT.dedup_decision(i) for i in range(len(survivor_files))]
    calls = [(_write_task, (uri, layout, dropped, g, [outputs[i] for i in files])) for g, files in enumerate(groups)]
    runner.run(Calls("components/write", _units(calls), unit_name="file groups", outputs=[DECISIONS_DIR]))
    if not keep_work:
        delete_quietly(out.fs, out.path(WORK_DIR))

    by_signal = kept["by_signal"]
    summary = {
        "pairs": pair_counts,
        "edges": remaining // 2,
        "nodes": nodes,
        "components": kept["components"],
        "dropped": sum(by_signal.values()),
        "by_signal": by_signal,
        "rounds": rounds,
        "finished_locally": finished_locally,
        "partitions": n_parts,
    }
    log.info(
        f"[components] {nodes} survivors in {summary['components']} groups; {summary['dropped']} dropped {by_signal}; "
        f"{rounds} rounds"
    )
    return summary
