"""Dedup's last step as Ray tasks: connected components over the pair tables, one survivor kept per component.

Input: the pair files of every signal (columns ``a``, ``b``: survivor uids; other columns ignored), in signal
priority order, and the survivor files (``curation.phases.survivors``: uid-sorted, disjoint uid ranges). Output:
``dedup/decisions/part-<i>.parquet`` for survivor file ``i``: its dropped survivors, by uid, with the key of the
survivor kept instead and the signal that linked them. Decisions are exactly those of ``keep_rule.resolve_duplicates``
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
   ``keep_rule.resolve_duplicates`` on them (the kernel itself, on a monotone relabelling of the uids: same keep order,
   same breadth-first parents), and ``write`` gathers the dropped rows of each survivor file of a group.

Shuffles are ``curation.phases.routed`` files (one per task, row groups per destination). Each task skips itself when its
last output exists and returns the receipt stored in that file's footer, so a rerun redoes only missing work and
the driver takes the same path; every output is a deterministic function of its inputs, so reruns are
byte-identical. The driver holds per-task receipts and file names only: O(P * rounds + F).

Sizes at 10^9 survivors (F = 10^4 survivor files of 10^5 rows, 2% of survivors in near-duplicate groups; the link
rule's chance links bounded at 1e-4 of the survivors, 10^5, by ``curation.phases.dedup.chance``, so the pairs are the
real copies' and a few more: ~10^8 at most): P = 2 * pairs / ``edges_per_partition`` = 50 partitions; a graph task holds about
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from common.console import plural
from common.layout import LAYOUT
from common.storage import delete_quietly
from curation.phases.dedup.component_files import DECISIONS_DIR, WORK_DIR, ComponentsError, layout_of
from curation.phases.dedup.component_tasks import (
    attach_task,
    contract_task,
    edges_task,
    finish_task,
    hook_task,
    keep_task,
    label_task,
    members_task,
    pairs_task,
    write_task,
)
from curation.steps.runner import StepRunner, task_step
from curation.steps.window import parquet_rows

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def _work(*parts: str) -> str:
    return "/".join([WORK_DIR, *parts])


def _parts(stage: str, n: int) -> list[str]:
    return [_work(stage, f"part-{p:06d}.parquet") for p in range(n)]


def _run(
    runner: StepRunner,
    name: str,
    unit_name: str,
    task: Any,
    args: Sequence[tuple],
    *,
    own: Any = None,
    outputs: Sequence[str] = (),
    reduce: Callable[[Sequence[dict]], dict] | None = None,
) -> dict:
    """Run ``task`` once per ``args`` as the step ``components/<name>``; its stats."""
    step = task_step(f"components/{name}", unit_name, task, outputs=outputs, reduce=reduce)
    return runner.run(step({f"part-{k:06d}": a for k, a in enumerate(args)}, own))


def by_signal_words(counts: dict[str, int], none: str = "no signal") -> str:
    """Counts per signal in words, in the signals' order: "phash 11, embedding 10" (``none`` when there are none)."""
    return ", ".join(f"{signal} {n}" for signal, n in counts.items()) or none


def _total(field: str) -> Callable[[Sequence[dict]], dict]:
    return lambda receipts: {field: sum(r[field] for r in receipts)}


@dataclass(frozen=True)
class _Plan:
    """What every step of one components run shares."""

    runner: StepRunner
    layout: ray.ObjectRef  # the survivor files' layout, shared by every task through the object store
    n_parts: int

    @property
    def uri(self) -> str:
        return self.runner.output.uri


def _label_components(plan: _Plan, edges: list[str], remaining: int, local_edges: int, max_rounds: int):
    """Steps 3-5: the routed label files of every node in some pair, the rounds run, whether one task finished."""
    uri, layout, n = plan.uri, plan.layout, plan.n_parts
    adjacency, routed, rounds, labels = edges, False, 0, []
    while remaining > local_edges:
        if rounds == max_rounds:
            raise ComponentsError(
                f"connected components not converged after max_rounds={max_rounds} rounds: {remaining} directed "
                f"edges left, more than local_edges={local_edges}; raise max_rounds or local_edges"
            )
        rounds += 1
        step = f"round-{rounds:03d}"
        hooks, messages = _parts(f"{step}/hooks", n), _parts(f"{step}/messages", n)
        # round 1 reads its own edges file; later rounds their rows of every routed edges file
        mine = [adjacency if routed else [adjacency[p]] for p in range(n)]
        args: list[tuple] = [(uri, layout, rounds, mine[p], routed, p, hooks[p], messages[p]) for p in range(n)]
        _run(plan.runner, f"{step}/hook", "partitions", hook_task, args)
        adjacency, children = _parts(f"{step}/edges", n), _parts(f"{step}/children", n)
        args = [(uri, layout, hooks[p], messages, p, adjacency[p], children[p]) for p in range(n)]
        remaining = _run(plan.runner, f"{step}/contract", "partitions", contract_task, args, reduce=_total("edges"))[
            "edges"
        ]
        routed = True
        log.info(f"[components] round {rounds}: {plural(remaining, 'directed edge')} left")
    if remaining:  # what is left fits one task
        labels = [_work(f"round-{rounds + 1:03d}", "labels-local.parquet")]
        args = [(uri, layout, adjacency, labels[0])]
        done = _run(
            plan.runner, f"round-{rounds + 1:03d}/finish", "tasks", finish_task, args, reduce=_total("components")
        )
        log.info(
            f"[components] {plural(remaining, 'directed edge')} left: finished in one task "
            f"({plural(done['components'], 'component')})"
        )
    # 5: labels back through the rounds
    for r in range(rounds, 0, -1):
        step = f"round-{r:03d}"
        children, out = _parts(f"{step}/children", n), _parts(f"{step}/labels", n)
        args = [(uri, layout, children, labels, p, out[p]) for p in range(n)]
        _run(plan.runner, f"{step}/labels", "partitions", label_task, args)
        labels = out
    return labels, rounds, bool(remaining)


def _edges(plan: _Plan, pair_list: list[tuple[int, str]], own: dict) -> tuple[list[int], list[str], int]:
    """Steps 1-2: each pair file's rows, the edge partitions, and how many directed edges they hold."""
    uri, layout, n = plan.uri, plan.layout, plan.n_parts
    routes = [_work("pairs", f"{code:03d}-{k:06d}.parquet") for k, (code, _) in enumerate(pair_list)]
    args: list[tuple] = [(uri, layout, path, code, r) for (code, path), r in zip(pair_list, routes)]
    rows = _run(
        plan.runner,
        "pairs",
        "pair files",
        pairs_task,
        args,
        own=own,
        outputs=[WORK_DIR],
        reduce=lambda receipts: {"rows": [r["rows"] for r in receipts]},
    )["rows"]
    edges = _parts("edges", n)
    args = [(uri, layout, routes, p, edges[p]) for p in range(n)]
    remaining = _run(plan.runner, "edges", "partitions", edges_task, args, reduce=_total("edges"))["edges"]
    return rows, edges, remaining


def _keep(
    plan: _Plan,
    groups: list[np.ndarray],
    survivor_files: list[str],
    labels: list[str],
    edges: list[str],
    signals: tuple[str, ...],
    batch_rows: int,
) -> dict:
    """Step 6: the keep rule on each component, and the decisions files."""
    uri, layout, n, runner = plan.uri, plan.layout, plan.n_parts, plan.runner
    group_edges, file_labels = _parts("keep/edges", n), _parts("keep/labels", n)
    args: list[tuple] = [(uri, layout, labels, edges[p], p, group_edges[p], file_labels[p]) for p in range(n)]
    nodes = _run(runner, "attach", "partitions", attach_task, args, reduce=_total("nodes"))["nodes"]
    members = _parts("keep/members", len(groups))
    args = [
        (uri, layout, file_labels, g, [survivor_files[i] for i in files], batch_rows, members[g])
        for g, files in enumerate(groups)
    ]
    _run(runner, "members", "file groups", members_task, args)
    dropped = _parts("keep/dropped", n)
    args = [(uri, layout, signals, members, group_edges, p, dropped[p]) for p in range(n)]
    kept = _run(
        runner,
        "keep",
        "partitions",
        keep_task,
        args,
        reduce=lambda receipts: {
            "components": sum(r["components"] for r in receipts),
            "by_signal": {s: sum(r["dropped"][s] for r in receipts) for s in signals},
        },
    )
    outputs = [LAYOUT.dedup_decision(i) for i in range(len(survivor_files))]
    args = [(uri, layout, dropped, g, [outputs[i] for i in files]) for g, files in enumerate(groups)]
    _run(runner, "write", "file groups", write_task, args, outputs=[DECISIONS_DIR])
    return {"nodes": nodes, **kept}


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
    out = runner.output
    signals = tuple(pair_files)
    if len(signals) > 127:
        raise ValueError("at most 127 signals")
    pair_list = [(code, path) for code, s in enumerate(signals) for path in pair_files[s]]
    if partitions is None:
        pair_rows = sum(parquet_rows(out.fs, [out.path(path) for _, path in pair_list]))
        partitions = math.ceil(2 * pair_rows / edges_per_partition)
    n_parts = max(1, int(partitions))
    local_edges = edges_per_partition if local_edges is None else local_edges
    own = {
        "survivor_files": list(survivor_files),
        "pair_files": {s: list(pair_files[s]) for s in signals},
        "partitions": n_parts,
        "local_edges": int(local_edges),
        "files_per_task": int(files_per_task),
    }
    layout = layout_of(out.fs, out.root, survivor_files, n_parts, files_per_task)  # O(F) file boundaries
    plan = _Plan(runner, ray.put(layout), n_parts)

    rows, edges, remaining = _edges(plan, pair_list, own)
    pair_counts = {s: sum(n for (code, _), n in zip(pair_list, rows) if signals[code] == s) for s in signals}
    log.info(
        f"[components] {plural(sum(pair_counts.values()), 'pair')} ({by_signal_words(pair_counts)}): "
        f"{plural(remaining // 2, 'distinct edge')} in {plural(n_parts, 'partition')}"
    )
    labels, rounds, finished_locally = _label_components(plan, edges, remaining, local_edges, max_rounds)
    groups = [layout.files_of_group(g) for g in range(layout.n_groups)]
    kept = _keep(plan, groups, survivor_files, labels, edges, signals, survivor_batch_rows)
    if not keep_work:
        delete_quietly(out.fs, out.path(WORK_DIR))

    by_signal = kept["by_signal"]
    summary = {
        "pairs": pair_counts,
        "edges": remaining // 2,
        "nodes": kept["nodes"],
        "components": kept["components"],
        "dropped": sum(by_signal.values()),
        "by_signal": by_signal,
        "rounds": rounds,
        "finished_locally": finished_locally,
        "partitions": n_parts,
    }
    log.info(
        f"[components] {plural(kept['nodes'], 'linked survivor')} in {plural(summary['components'], 'group')}; "
        f"{summary['dropped']} dropped as copies ({by_signal_words(by_signal)}); "
        f"{plural(rounds, 'contraction round')}{', the rest finished in one task' if finished_locally else ''}"
    )
    return summary
