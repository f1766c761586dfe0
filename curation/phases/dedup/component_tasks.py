"""The Ray tasks of dedup's components step (``curation.phases.dedup.components`` describes the algorithm): the file
layout they share, each task's reads and writes, and the keep rule's attributes.

Each task receives the output URI, small parameters and relative paths; its last output is its commit record (a
routed or plain file with the task's receipt in its footer), so a task run again after its output exists returns
the same receipt without redoing its work.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from common.storage import exists, join, resolve, write_parquet_atomic
from curation.phases.dedup import keep_rule
from curation.phases.dedup.component_files import (
    ADJACENCY,
    DECISIONS,
    EDGES,
    GROUP_EDGES,
    HOOKS,
    LABELS,
    MEMBERS,
    MESSAGES,
    SURVIVOR_COLUMNS,
    ComponentsError,
    Layout,
    priority,
)
from curation.phases.routed import read_plain, read_receipt, read_routed, write_plain, write_routed
from curation.steps.window import parquet_rows

# ---------------------------------------------------------------------------------------------------------------
# Tasks. Each receives the output URI, small parameters and relative paths; its last output is its commit record.
# ---------------------------------------------------------------------------------------------------------------


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def _numbers(table: pa.Table, name: str, fill, dtype) -> np.ndarray:
    column = pc.cast(table.column(name), pa.from_numpy_dtype(dtype))  # first: an int8 column's nulls may be NaN
    return pc.fill_null(column, fill).to_numpy(zero_copy_only=False)


def keep_attributes(survivors: pa.Table) -> keep_rule.KeepAttributes:
    """What the keep rule ranks, from survivor rows (``curation.phases.survivors``; a missing value ranks lowest)."""
    return keep_rule.KeepAttributes(
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
def pairs_task(out_uri: str, layout: Layout, pair_file: str, code: int, out: str) -> dict:
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
def edges_task(out_uri: str, layout: Layout, pair_routes: list[str], part: int, out: str) -> dict:
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
def hook_task(
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
def contract_task(
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
def finish_task(out_uri: str, layout: Layout, adjacency: list[str], out: str) -> dict:
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
def label_task(out_uri: str, layout: Layout, children: list[str], next_labels: list[str], part: int, out: str) -> dict:
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
def attach_task(
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
def members_task(
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
def keep_task(
    out_uri: str,
    layout: Layout,
    signals: tuple[str, ...],
    members: list[str],
    group_edges: list[str],
    part: int,
    out: str,
) -> dict:
    """``keep_rule.resolve_duplicates`` on whole components. Members are indexed in uid order (the global order),
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
    result = keep_rule.resolve_duplicates(
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
def write_task(out_uri: str, layout: Layout, dropped: list[str], group: int, outputs: list[str]) -> dict:
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
