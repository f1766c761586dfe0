"""Phase 3 "sample" as steps of Ray tasks over the survivors' partitions: the hierarchical balanced sampling of
``curation.phases.sample.kmeans`` (Vo et al. 2024) with a driver that never holds per-item data and no task whose
work grows with the pool.

Inputs: the survivors files (``curation.phases.survivors``) and, per survivors file, the dedup decisions file listing the
uids it dropped (absent: none dropped). The survivors that are not dropped are the "alive" ones. Steps
(``curation.steps.runner``; their tasks in ``tasks``, their arithmetic in ``selection`` and ``kmeans``):

1. train, top-down (``kmeans.hierarchical_kmeans`` is the same arithmetic in one process). The levels are
   ``sample.clusters`` (fine to coarse) with levels added by ``kmeans.routing_levels`` so that no parent needs more
   than ``sample.max_fanout`` children and the top has at most that many clusters. Each item has a training key, a
   hash of (uid, seed); a level of k clusters trains on the items of key below ``kmeans.training_fraction`` (about
   ``sample.training_points_per_cluster`` per cluster): uniform, and independent of how items are partitioned.
   - gather: a task per survivors file writes its items of key below the largest fraction (the finest level's) to
     ``sample/work/training/part-<i>.parquet`` (uid, key, embedding): the only full read of the embeddings here;
   - per level, from the top: the driver splits the level's clusters over the parents in proportion to their
     items (``kmeans.allocate_children``; the top level has one parent) and groups consecutive parents into fits
     of at most ``max_fanout`` children; route-<l>: a task per training file sends its items of the level to
     their parent (down the levels above, ``kmeans.descend``) and on to the parent's group, routed
     (``curation.phases.routed``) into ``sample/work/route-<l>/``; fit-<l>: a task per group fits each parent's
     children on that parent's items (``kmeans.fit_children``: at most ``max_fanout`` centroids on at most 256
     points each) into ``sample/work/level-<l>/group-<g>.parquet``;
   - hierarchy: one task writes the levels to ``sample/hierarchy.parquet`` (level, cluster, parent, centroid).
2. assign: a task per survivors file gives each alive item its leaf by descending the hierarchy (nearest top
   centroid, then the nearest of its children, ...) and its squared distance to the leaf centroid, and writes the
   rows (uid, leaf, distance, balance) routed to buckets by leaf (``leaf % buckets``) into
   ``sample/work/buckets/part-<i>.parquet`` (one file per task), and its per-leaf counts into
   ``sample/work/counts/part-<i>.parquet``.
3. budget: one task sums the counts and splits the target over the leaves top-down (``kmeans.leaf_budgets``: a
   cluster smaller than its share is taken whole, the rest goes to its siblings) into ``sample/work/budget/``.
4. select: a task per bucket picks exactly each of its leaves' budget, closest to the centroid or at random (a
   fixed per-uid hash), spread over the balance key's values as ``kmeans.balanced_select`` does, and writes
   (uid, leaf, selected) routed back to the survivors files (they hold disjoint, increasing uid ranges, read from
   Parquet statistics by the driver) into ``sample/work/selected/bucket-<b>.parquet``.
5. assemble: a task per survivors file writes ``sample/decisions/part-<i>.parquet``: every alive survivor of file
   ``i`` in uid order with uid, source, shard_id, key, cluster_ids (leaf first, then each upper level), selected.
   With no survivor alive, this is the only step and writes empty decisions files.

Guarantees: exactly ``min(target, alive)`` items selected; the selection depends on the alive items and the settings
only, not on the number of files or buckets; same inputs give the same bytes. The first step's fingerprint holds the
settings, the plan and the inputs' paths, sizes and modification times: a rerun that finds another one clears every
step's outputs as it comes to it, so a resumed run never mixes two configurations.

Tasks, work and memory at 1B survivors on a cluster (M = 1000 survivors files of 1M rows, D = 384, F =
``max_fanout`` = 256, 64 training points per cluster; default levels 31.6k leaves under 3.2k under 25, the last
added by ``routing_levels``). Projected from the arithmetic, not measured:
- gather: M tasks, each one survivors file read row group by row group (its embeddings, ~4x in decoding buffers),
  writing ~2k training rows (1/500 of its items: 64 x 31.6k = 2M training rows in all, 3 GB);
- route-<l>: M tasks per level, each one training file (~2k rows, 3 MB), its rows compared with at most F centroids
  per level above;
- fit-<l>: at most F centroids on at most 256 x F = 65k points per task (typically 64 per centroid), reading its
  group's rows from the M route files (M footers). Top: 1 task, 25 clusters of the centroids of a 400-means of
  1.6k points. Middle: ~13-25 tasks of ~2 parents, each parent's ~126 clusters from the centroids of a 1.3k-means
  of its ~8k points, 10 resampling refits (~1.5e11 flops a parent: the largest tasks). Leaves: ~130 tasks of ~25
  parents x ~10 leaves on ~640 points each (~2.5e9 flops a task). Measured as kernels on random 384-d data, one
  core: a middle task 1.7 s, a leaf task 0.1 s (``benchmarks/RESULTS.md``). None of these grows with N: more
  items add tasks, or a level, never work to a task;
- hierarchy: one task, the centroids of every level (34.8k x D: 54 MB);
- assign: M tasks, each one survivors file's row groups plus ~28 bytes per row (uid, leaf, distance, balance:
  28 MB); work per row: 25 + ~126 + ~10 centroid distances (the fan-outs on its path), not all 31.6k leaves;
- budget task: per-leaf counts and budgets (31.6k int64) and the centroids, 64 files' counts at a time;
- select: 250 tasks of ~30 bytes per row of their bucket (``BUCKET_ROWS`` = 4M: ~120 MB, plus sorting);
- assemble: M tasks, the uid, source, shard_id and key columns of one survivors file (~100 MB at 1M rows);
- driver: per-file row counts and uid ranges, the fitted levels' centroids (54 MB, put once for the assign
  tasks), per-parent child counts, the leaves' cluster ids (31.6k x levels int32), one small receipt per task.
Every training and assign task's work is bounded by the settings and the survivors files' size, not by N; what
grows is the number of tasks, the footers a reader of routed files fetches (M), and the one budget task, which sums
every file's per-leaf counts (up to M x K1 rows: ~30M at 1B, seconds) and splits the target over the K1 leaves. A
parent far denser than its share of children (capped at F) routes more rows to its fit task than the fit uses.
Files under work/: M training, M routed per level, ~160 fitted groups, 2M from assign (buckets, counts); one per
bucket under selected/, M decisions. ``sample/work/`` can be deleted once every decisions file is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import ray

from common.console import plural
from curation.phases.sample import kmeans
from curation.phases.sample.selection import cluster_counts, leaf_cluster_ids
from curation.phases.sample.tasks import (
    BUCKETS_DIR,
    BUDGET_DIR,
    COUNTS_DIR,
    DECISIONS_DIR,
    SELECTED_DIR,
    TRAINING_DIR,
    assemble_task,
    assign_task,
    budget_task,
    empty_decisions_task,
    file_facts,
    fit_task,
    gather_task,
    hierarchy_task,
    level_dir,
    read_hierarchy,
    read_level,
    route_dir,
    route_task,
    select_task,
)
from curation.settings import SampleSettings
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner
from curation.steps.window import map_footers

log = logging.getLogger(__name__)

BUCKET_ROWS = 4_000_000  # default rows per select task


@dataclass(frozen=True)
class SamplePlan:
    """What the steps do, from the settings and the inputs' footers: the alive count, clusters per level (with the
    routing levels), buckets, and the survivors files' uid ranges that selected uids are routed back by."""

    output: Output
    survivor_files: list[str]
    decision_files: list[str]
    settings: SampleSettings
    chosen_from: int | None
    alive: int
    clusters: list[int]
    buckets: int
    route_min: np.ndarray  # first uid of each non-empty survivors file ...
    route_index: np.ndarray  # ... and its index
    inputs: list[list]  # [path, size, modification time] of every input file

    @classmethod
    def read(
        cls,
        output: Output,
        survivor_files: list[str],
        decision_files: list[str],
        settings: SampleSettings,
        buckets: int | None,
        chosen_from: int | None,
    ) -> SamplePlan:
        if len(survivor_files) != len(decision_files):
            raise ValueError("one decisions file per survivors file is needed")
        facts = map_footers(lambda p: file_facts(output.fs, output.path(p), "uid"), survivor_files)
        dropped = map_footers(lambda p: file_facts(output.fs, output.path(p), None), decision_files)
        if any(f is None for f in facts):
            missing = [p for p, f in zip(survivor_files, facts) if f is None]
            raise FileNotFoundError(f"missing survivors files: {missing}")
        survivors = [f for f in facts if f is not None]  # every file's, as just checked
        nonempty = [i for i, f in enumerate(survivors) if f.rows]
        route_min = np.asarray([survivors[i].uid_min for i in nonempty], np.int64)
        if np.any(route_min[1:] <= np.asarray([survivors[i].uid_max for i in nonempty[:-1]], np.int64)):
            raise ValueError("survivors files must hold disjoint, increasing uid ranges")
        alive = sum(f.rows for f in survivors) - sum(f.rows for f in dropped if f)
        clusters = kmeans.routing_levels(cluster_counts(alive, settings.clusters), settings.max_fanout) if alive else []
        inputs = [
            [p, f.size, f.mtime_ns] if f else [p, None, None]
            for p, f in zip([*survivor_files, *decision_files], [*facts, *dropped])
        ]
        return cls(
            output, survivor_files, decision_files, settings, chosen_from, alive=alive, clusters=clusters,
            buckets=buckets or max(1, math.ceil(alive / BUCKET_ROWS)),
            route_min=route_min, route_index=np.asarray(nonempty, np.int64), inputs=inputs,
        )  # fmt: skip

    def fingerprint(self) -> dict:
        return {
            "settings": self.settings.model_dump(mode="json"),
            "buckets": self.buckets,
            "chosen_from": self.chosen_from,
            "inputs": self.inputs,
        }

    def fraction(self, level: int) -> float:
        """The share of the alive items (by training key) that ``level`` is trained on."""
        return kmeans.training_fraction(self.clusters[level], self.settings.training_points_per_cluster, self.alive)

    @cached_property
    def files(self) -> dict[str, int]:
        """The per-file steps' units: survivors file index by unit name."""
        return {f"part-{i:06d}": i for i in range(len(self.survivor_files))}


class PlanStep(Step):
    """A step of a ``SamplePlan``."""

    def __init__(self, plan: SamplePlan):
        self.plan = plan


class Gather(PlanStep):
    """Every level's training items, a file per survivors file (``tasks.gather_task``)."""

    name = "gather"
    unit_name = "files"

    def fingerprint(self) -> dict:
        return self.plan.fingerprint()

    def outputs(self) -> list[str]:
        return [TRAINING_DIR]

    def units(self) -> list[str]:
        return list(self.plan.files)

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, i = self.plan, self.plan.files[unit]
        fraction = max(p.fraction(level) for level in range(len(p.clusters)))
        return gather_task.remote(p.output.uri, i, p.survivor_files[i], p.decision_files[i], fraction, p.settings.seed)


@dataclass
class Tree:
    """The levels fitted so far, fine to coarse (the driver's per-cluster state while training top-down)."""

    centroids: list[np.ndarray]
    parents: list[np.ndarray]  # parents[l][c]: the parent of cluster c of the l-th level held
    weight: np.ndarray  # the finest held level's items per cluster (estimated from its training items)
    groups: list[int]  # fit groups per held level


def fit_groups(children: np.ndarray, max_fanout: int) -> np.ndarray:
    """Each parent's fit group: consecutive parents, at most ``max_fanout`` children per group (a parent never has
    more)."""
    group, used, out = 0, 0, np.empty(children.size, np.int64)
    for p, k in enumerate(children):
        if used and used + k > max_fanout:
            group, used = group + 1, 0
        out[p], used = group, used + int(k)
    return out


class Route(PlanStep):
    """A level's training items routed to the fit task of their parent's group (``tasks.route_task``)."""

    unit_name = "files"

    def __init__(self, plan: SamplePlan, level: int, tree: Tree, group_of: np.ndarray):
        super().__init__(plan)
        self.level, self.tree, self.group_of = level, tree, group_of
        self.name = f"route-{level}"  # type: ignore[misc]

    def outputs(self) -> list[str]:
        return [route_dir(self.level)]

    def units(self) -> list[str]:
        return list(self.plan.files)

    @cached_property
    def refs(self) -> tuple[ray.ObjectRef | None, ray.ObjectRef]:
        above = ray.put((self.tree.centroids, self.tree.parents)) if self.tree.centroids else None
        return above, ray.put(self.group_of)

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, i = self.plan, self.plan.files[unit]
        return route_task.remote(p.output.uri, i, self.level, p.fraction(self.level), *self.refs)


class Fit(PlanStep):
    """A level's clusters, a group of parents per task (``tasks.fit_task``)."""

    unit_name = "groups"

    def __init__(
        self, plan: SamplePlan, level: int, parent_centroids: np.ndarray | None, children: np.ndarray, group_of
    ):
        super().__init__(plan)
        self.level, self.parent_centroids, self.children, self.group_of = level, parent_centroids, children, group_of
        self.name = f"fit-{level}"  # type: ignore[misc]
        self.bounds = np.searchsorted(group_of, np.arange(int(group_of.max()) + 2))

    def outputs(self) -> list[str]:
        return [level_dir(self.level)]

    def units(self) -> list[str]:
        return [f"group-{g:05d}" for g in range(self.bounds.size - 1)]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, g = self.plan, int(unit.removeprefix("group-"))
        lo, hi = int(self.bounds[g]), int(self.bounds[g + 1])
        steps = kmeans.default_resample_steps(len(p.clusters))[self.level]
        return fit_task.remote(
            p.output.uri, self.level, g, len(p.survivor_files), lo, self.children[lo:hi],
            None if self.parent_centroids is None else self.parent_centroids[lo:hi], p.settings.seed, steps,
            kmeans.grandchildren(p.clusters, self.level),
        )  # fmt: skip

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {
            "centroids": sum(r["centroids"] for r in receipts),
            "points": sum(r["points"] for r in receipts),
            "largest": {k: max(r[k] for r in receipts) for k in ("centroids", "points")},
        }


class Hierarchy(PlanStep):
    """``sample/hierarchy.parquet`` from the fitted levels. Its one file is rewritten whole, so it declares no
    folder to clear."""

    name = "hierarchy"
    unit_name = "hierarchies"

    def __init__(self, plan: SamplePlan, groups: list[int]):
        super().__init__(plan)
        self.groups = groups

    def units(self) -> list[str]:
        return ["hierarchy"]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        return hierarchy_task.remote(self.plan.output.uri, self.groups)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return receipts[0]


def train(runner: StepRunner, plan: SamplePlan) -> tuple[dict, dict]:
    """The hierarchy, top-down: gather, then route and fit per level, then the hierarchy file; returns the
    hierarchy step's stats and the largest fit task's centroids and points."""
    runner.run(Gather(plan))
    fs, root, fanout = plan.output.fs, plan.output.root, plan.settings.max_fanout
    tree = Tree([], [], np.array([float(plan.alive)]), [])
    largest = {"centroids": 0, "points": 0}
    for level in range(len(plan.clusters) - 1, -1, -1):
        children = kmeans.allocate_children(tree.weight, plan.clusters[level], fanout)
        group_of = fit_groups(children, fanout)
        runner.run(Route(plan, level, tree, group_of))
        above = tree.centroids[0] if tree.centroids else None
        fitted = runner.run(Fit(plan, level, above, children, group_of))
        largest = {k: max(largest[k], fitted["largest"][k]) for k in largest}
        groups = int(group_of.max()) + 1
        centroids, parent, weight = read_level(fs, root, level, groups)
        tree = Tree(
            [centroids, *tree.centroids],
            [parent, *tree.parents] if tree.centroids else [],
            weight,
            [groups, *tree.groups],
        )
    return runner.run(Hierarchy(plan, tree.groups)), largest


class Assign(PlanStep):
    name = "assign"
    unit_name = "files"

    def outputs(self) -> list[str]:
        return [BUCKETS_DIR, COUNTS_DIR]

    def units(self) -> list[str]:
        return list(self.plan.files)

    @cached_property
    def hierarchy(self) -> ray.ObjectRef:
        return ray.put(read_hierarchy(self.plan.output.fs, self.plan.output.root))

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, i = self.plan, self.plan.files[unit]
        balance = p.settings.balance_key is not None
        return assign_task.remote(
            p.output.uri, i, p.survivor_files[i], p.decision_files[i], self.hierarchy, p.buckets, balance, p.chosen_from
        )

    def reduce(self, receipts: Sequence[dict]) -> dict:
        rows = sum(r["rows"] for r in receipts)
        if rows != self.plan.alive:
            raise ValueError(
                f"{rows} alive survivors, but the files' row counts say {self.plan.alive}: "
                "a decisions file lists a uid more than once"
            )
        return {"rows": rows}


class Budget(PlanStep):
    name = "budget"
    unit_name = "budgets"

    def outputs(self) -> list[str]:
        return [BUDGET_DIR]

    def units(self) -> list[str]:
        return ["budget"]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        return budget_task.remote(self.plan.output.uri, len(self.plan.survivor_files), self.plan.settings)


class Select(PlanStep):
    name = "select"
    unit_name = "buckets"

    def outputs(self) -> list[str]:
        return [SELECTED_DIR]

    def units(self) -> list[str]:
        return [f"bucket-{b:05d}" for b in range(self.plan.buckets)]

    @cached_property
    def routes(self) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        return ray.put(self.plan.route_min), ray.put(self.plan.route_index)

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, s = self.plan, self.plan.settings
        bucket = int(unit.removeprefix("bucket-"))
        balance = s.balance_key is not None
        n_files = len(p.survivor_files)
        return select_task.remote(p.output.uri, bucket, n_files, *self.routes, s.mode, balance, s.seed, p.chosen_from)


class Assemble(PlanStep):
    name = "assemble"
    unit_name = "files"

    def outputs(self) -> list[str]:
        return [DECISIONS_DIR]

    def units(self) -> list[str]:
        return list(self.plan.files)

    @cached_property
    def cluster_ids(self) -> ray.ObjectRef:
        centroids, parents = read_hierarchy(self.plan.output.fs, self.plan.output.root)
        return ray.put(leaf_cluster_ids(parents, centroids[0].shape[0]))

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, i = self.plan, self.plan.files[unit]
        return assemble_task.remote(p.output.uri, i, p.survivor_files[i], p.buckets, self.cluster_ids)


class AssembleNoneAlive(Assemble):
    """Assemble when no survivor is alive: the only step, writing empty decisions files. It has assemble's name, so
    that each of the two leaves the other's records behind as stale."""

    def fingerprint(self) -> dict:
        return self.plan.fingerprint()

    def run_unit(self, unit: str) -> ray.ObjectRef:
        return empty_decisions_task.remote(self.plan.output.uri, self.plan.files[unit])


def summary_line(rows: int, selected: int, per_level: list[int], largest: dict, buckets: int) -> str:
    """The console's line of a sample run, in words: what was selected, the clusters (finest level first), the
    largest fit and the select tasks."""
    counts = [str(c) for c in per_level]
    clusters = " and ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 1 else counts)
    noun = "cluster" if per_level == [1] else "clusters (finest first)" if len(per_level) > 1 else "clusters"
    return (
        f"[sample] {selected} of the {plural(rows, 'image')} left after dedup selected, {rows - selected} unsampled; "
        f"{plural(len(per_level), 'cluster level')} of {clusters} {noun}; the largest fit: "
        f"{plural(largest['centroids'], 'centroid')} on {plural(largest['points'], 'point')}; "
        f"{plural(buckets, 'select bucket')}"
    )


def run_sample(
    runner: StepRunner,
    survivor_files: list[str],
    decision_files: list[str],
    settings: SampleSettings,
    buckets: int | None = None,
    chosen_from: int | None = None,
) -> dict:
    """Balanced sampling of the alive survivors, as ``runner``'s steps; writes ``sample/decisions/part-<i>.parquet``
    per survivors file (``tasks.DECISIONS_SCHEMA``) and returns {inputs, selected, unsampled, levels,
    clusters_per_level, largest_fit} (largest_fit: the most centroids and training points one fit task had).

    ``chosen_from``: survivors of uids from it on are a release's images, selected already: the clusters are made of
    all survivors, each leaf's share of (chosen + the target) is filled with new images where the chosen ones leave
    room (as evenly as the leaves allow), and the target counts the new images only.

    ``buckets``: select tasks (default: one per ``BUCKET_ROWS`` alive survivors).
    """
    plan = SamplePlan.read(runner.output, survivor_files, decision_files, settings, buckets, chosen_from)
    if plan.alive == 0:
        runner.run(AssembleNoneAlive(plan))
        log.info("[sample] no image left after dedup: none selected")
        return {"inputs": 0, "selected": 0, "unsampled": 0, "levels": 0, "clusters_per_level": [], "largest_fit": {}}
    trained, largest = train(runner, plan)
    runner.run(Assign(plan))
    runner.run(Budget(plan))
    runner.run(Select(plan))
    done = runner.run(Assemble(plan))
    per_level = trained["clusters_per_level"]
    rows, selected = done["rows"], done["selected"]
    log.info(summary_line(rows, selected, per_level, largest, plan.buckets))
    return {
        "inputs": rows,
        "selected": selected,
        "unsampled": rows - selected,
        "levels": len(per_level),
        "clusters_per_level": per_level,
        "largest_fit": largest,
    }
