"""Phase 3 "sample" as steps of Ray tasks over the survivors' partitions: the hierarchical balanced sampling of
``curation.phases.sample.kmeans`` (Vo et al. 2024) with a driver that never holds per-item data.

Inputs: the survivors files (``curation.phases.survivors``) and, per survivors file, the dedup decisions file listing the
uids it dropped (absent: none dropped). The survivors that are not dropped are the "alive" ones. Steps
(``curation.steps.runner``; their tasks in ``tasks``, their arithmetic in ``selection``):

1. train: the training set is the ``sample_size`` alive items of lowest hash of (uid, seed): uniform, and
   independent of how items are partitioned. Ray tasks return their files' items below a hash threshold; one
   training task keeps the lowest, trains the leaf centroids on them with faiss k-means and the upper levels on
   the leaf centroids (``kmeans.hierarchical_kmeans`` does both), ``sample.training_points_per_cluster`` points
   per leaf (faiss subsamples a larger set to at most 256 per centroid anyway). Written to
   ``sample/hierarchy.parquet`` (level, cluster, parent, centroid), which later steps read.
2. assign: a task per survivors file gives each alive item its leaf and squared distance to the leaf centroid and
   writes the rows (uid, leaf, distance, balance) routed to buckets by leaf (``leaf % buckets``) into
   ``sample/work/buckets/part-<i>.parquet`` (``curation.phases.routed``: one file per task), and its per-leaf
   counts into ``sample/work/counts/part-<i>.parquet``.
3. budget: one task sums the counts and splits the target over the leaves top-down (``kmeans.leaf_budgets``: a
   cluster smaller than its share is taken whole, the rest goes to its siblings) into ``sample/work/budget/``.
4. select: a task per bucket picks exactly each of its leaves' budget, closest to the centroid or at random (a
   fixed per-uid hash), spread over the balance key's values as ``kmeans.balanced_select`` does, and writes
   (uid, leaf, selected) routed back to the survivors files (they hold disjoint, increasing uid ranges, read from
   Parquet statistics by the driver) into ``sample/work/selected/bucket-<b>.parquet``.
5. assemble: a task per survivors file writes ``sample/decisions/part-<i>.parquet``: every alive survivor of file
   ``i`` in uid order with uid, source, shard_id, key, cluster_ids (leaf first, then each upper level), selected.
   With no survivor alive, this is the only step and writes empty decisions files.

Guarantees: exactly ``min(target, alive)`` items selected; the selection depends on the alive items, the settings
and ``sample_size`` only, not on the number of files or buckets; same inputs give the same bytes. The first step's
fingerprint holds the settings, the plan and the inputs' paths, sizes and modification times: a rerun that finds
another one clears every step's outputs as it comes to it, so a resumed run never mixes two configurations.

Memory, and what it becomes at 1B survivors on a cluster (1M-row survivors files, 384-d, sqrt(N) = 31.6k leaves):
- training task: the training sample (``sample_size`` x D float32; default 64 per leaf, at most
  ``MAX_TRAINING_POINTS`` = 1M points = 1.5 GB, i.e. 32 per leaf at 1B: set ``sample.clusters`` for such runs);
- driver: per-file row counts and uid ranges (M = 1000 files), the leaves' cluster ids (K1 x levels int32) for
  the assemble tasks, and one small receipt per task;
- train and assign tasks: one row group of a survivors file (its embeddings, ~4x in decoding buffers) plus, for
  assign, ~28 bytes per row of the file (uid, leaf, distance, balance: 28 MB); the survey should keep row groups
  at tens of thousands of rows;
- budget task: the leaf centroids (K1 x D: 49 MB), per-leaf counts and budgets (K1 int64) and 64 files' counts;
- select task: ~30 bytes per row of its bucket (``BUCKET_ROWS`` = 4M: ~120 MB, plus sorting; 250 buckets);
- assemble task: the uid, source, shard_id and key columns of one survivors file (~100 MB at 1M rows).
Files: 2M under work/, one per bucket under selected/, M decisions; every select task reads the M bucket-file
footers and every assemble task the bucket-count selected-file footers. ``sample/work/`` can be deleted once every
decisions file is written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import ray

from curation.phases.sample.selection import cluster_counts, leaf_cluster_ids
from curation.phases.sample.tasks import (
    BUCKETS_DIR,
    BUDGET_DIR,
    COUNTS_DIR,
    DECISIONS_DIR,
    SELECTED_DIR,
    assemble_task,
    assign_task,
    budget_task,
    empty_decisions_task,
    file_facts,
    read_hierarchy,
    select_task,
    train_task,
)
from curation.settings import SampleSettings
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner
from curation.steps.window import map_footers

log = logging.getLogger(__name__)

MIN_TRAINING_POINTS_PER_LEAF = 39  # below this faiss warns that k-means is poorly conditioned
MAX_TRAINING_POINTS = 1_000_000  # default cap of the training task's sample
BUCKET_ROWS = 4_000_000  # default rows per select task


@dataclass(frozen=True)
class SamplePlan:
    """What the steps do, from the settings and the inputs' footers: the alive count, clusters per level, training
    sample size, buckets, and the survivors files' uid ranges that selected uids are routed back by."""

    output: Output
    survivor_files: list[str]
    decision_files: list[str]
    settings: SampleSettings
    chosen_from: int | None
    alive: int
    clusters: list[int]
    sample_size: int
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
        sample_size: int | None,
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
        clusters = cluster_counts(alive, settings.clusters) if alive else []
        k1 = clusters[0] if clusters else 1
        if sample_size is None:
            sample_size = min(settings.training_points_per_cluster * k1, MAX_TRAINING_POINTS)
        inputs = [
            [p, f.size, f.mtime_ns] if f else [p, None, None]
            for p, f in zip([*survivor_files, *decision_files], [*facts, *dropped])
        ]
        return cls(
            output, survivor_files, decision_files, settings, chosen_from, alive=alive, clusters=clusters,
            sample_size=max(sample_size, MIN_TRAINING_POINTS_PER_LEAF * k1),
            buckets=buckets or max(1, math.ceil(alive / BUCKET_ROWS)),
            route_min=route_min, route_index=np.asarray(nonempty, np.int64), inputs=inputs,
        )  # fmt: skip

    def fingerprint(self) -> dict:
        return {
            "settings": self.settings.model_dump(mode="json"),
            "buckets": self.buckets,
            "sample_size": self.sample_size,
            "chosen_from": self.chosen_from,
            "inputs": self.inputs,
        }

    @cached_property
    def files(self) -> dict[str, int]:
        """The per-file steps' units: survivors file index by unit name."""
        return {f"part-{i:06d}": i for i in range(len(self.survivor_files))}


class PlanStep(Step):
    """A step of a ``SamplePlan``."""

    def __init__(self, plan: SamplePlan):
        self.plan = plan


class Train(PlanStep):
    """The hierarchy, by one task (``tasks.train_task``) that gathers the training sample with tasks of its own.
    Its one file is rewritten whole, so it declares no folder to clear."""

    name = "train"
    unit_name = "hierarchies"

    def __init__(self, plan: SamplePlan, window: int):
        super().__init__(plan)
        self.window = window

    def fingerprint(self) -> dict:
        return self.plan.fingerprint()

    def units(self) -> list[str]:
        return ["hierarchy"]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p = self.plan
        return train_task.remote(
            p.output.uri, p.survivor_files, p.decision_files, p.alive, p.clusters, p.sample_size, p.settings.seed,
            self.window,
        )  # fmt: skip

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return receipts[0]


class Assign(PlanStep):
    name = "assign"
    unit_name = "files"

    def outputs(self) -> list[str]:
        return [BUCKETS_DIR, COUNTS_DIR]

    def units(self) -> list[str]:
        return list(self.plan.files)

    @cached_property
    def centroids(self) -> ray.ObjectRef:
        return ray.put(read_hierarchy(self.plan.output.fs, self.plan.output.root)[0][0])

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p, i = self.plan, self.plan.files[unit]
        balance = p.settings.balance_key is not None
        return assign_task.remote(
            p.output.uri, i, p.survivor_files[i], p.decision_files[i], self.centroids, p.buckets, balance, p.chosen_from
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


def run_sample(
    runner: StepRunner,
    survivor_files: list[str],
    decision_files: list[str],
    settings: SampleSettings,
    buckets: int | None = None,
    sample_size: int | None = None,
    chosen_from: int | None = None,
) -> dict:
    """Balanced sampling of the alive survivors, as ``runner``'s steps; writes ``sample/decisions/part-<i>.parquet``
    per survivors file (``tasks.DECISIONS_SCHEMA``) and returns {inputs, selected, unsampled, levels,
    clusters_per_level}.

    ``chosen_from``: survivors of uids from it on are a release's images, selected already: the clusters are made of
    all survivors, each leaf's share of (chosen + the target) is filled with new images where the chosen ones leave
    room (as evenly as the leaves allow), and the target counts the new images only.

    ``buckets``: select tasks (default: one per ``BUCKET_ROWS`` alive survivors). ``sample_size``: the training
    sample of the leaf k-means (default: ``settings.training_points_per_cluster`` per leaf, at most
    ``MAX_TRAINING_POINTS``; at least ``MIN_TRAINING_POINTS_PER_LEAF`` per leaf).
    """
    plan = SamplePlan.read(runner.output, survivor_files, decision_files, settings, buckets, sample_size, chosen_from)
    if plan.alive == 0:
        runner.run(AssembleNoneAlive(plan))
        log.info("[sample] 0 after dedup, 0 selected")
        return {"inputs": 0, "selected": 0, "unsampled": 0, "levels": 0, "clusters_per_level": []}
    trained = runner.run(Train(plan, runner.window))
    runner.run(Assign(plan))
    runner.run(Budget(plan))
    runner.run(Select(plan))
    done = runner.run(Assemble(plan))
    per_level = trained["clusters_per_level"]
    rows, selected = done["rows"], done["selected"]
    log.info(
        f"[sample] {rows} after dedup, {selected} selected, {rows - selected} unsampled ({len(per_level)} cluster "
        f"levels {per_level}, trained on {trained['points']} points, {plan.buckets} buckets)"
    )
    return {
        "inputs": rows,
        "selected": selected,
        "unsampled": rows - selected,
        "levels": len(per_level),
        "clusters_per_level": per_level,
    }
