"""Embedding near-duplicate pairs over the partitioned survivors, cluster by cluster (as SemDeDup and Vo et al. 2024
do at scale): k-means cuts the embedding space into clusters of about ``cluster_size`` survivors, and each cluster is
searched exactly (faiss inner product) inside one Ray task.

Steps (``run_embedding_pairs``, each run by the phase's ``curation.steps.runner.StepRunner``, which clears a
step's outputs when its fingerprint changes and keeps them, with their receipts, on a resume):

1. ``embedding-plan`` (one Ray task). N from the survivor files' Parquet metadata; K = ceil(N / cluster_size)
   centroids trained by faiss k-means on a deterministic uniform sample (one Ray task per file draws its share with
   a seeded RNG; the plan task holds at most ``sample_size`` x D floats and K x D centroids). A centroid whose share
   of held-out sample rows predicts more than ``max_cluster`` members is replaced by a k-means of its own sample
   rows, so clusters are bounded before any data moves. Clusters are packed into buckets by their predicted rows
   (largest first into the lightest bucket). Written: ``dedup/embedding_plan/centroids.npy``,
   ``dedup/embedding_plan/buckets.json`` (the bucket of each cluster) and ``dedup/embedding_plan/chance.json`` (the
   sample's histograms the chance estimate reads: ``curation.phases.dedup.chance``).
2. ``embedding-assign`` (one task per survivor file). Each survivor's nearest centroid is its *home*; the clusters just
   across a nearby boundary are its *probes* (``ProbeRule``). It is written once per cluster (home and probes) to that
   cluster's bucket: ``dedup/embedding_buckets/b<bucket>/part-<file>.arrow`` (Arrow IPC, deleted once searched) with
   columns ``cluster``, ``uid``, ``home``, ``ranked`` (its home, then its probes) and ``embedding``.
3. ``embedding-search`` (one task per bucket). In each cluster every row, home or probe, takes its ``k`` nearest *home*
   rows; pairs at >= ``threshold`` are kept (``embedding_clusters.threshold_neighbours``), and of those, when the
   search is given the link rule's joint regions, only the pairs whose pHash distance confirms them (each row
   carries its pHash from the assign step; ``curation.phases.dedup.link_rule``). Two survivors are compared
   when they share a home or one probes the other's home. Written: ``dedup/pairs/embedding/part-<bucket>.parquet``
   (``a`` < ``b`` uids, int64; ``similarity`` float32, their inner product; ``distance`` uint8, their pHash
   distance, 65 where a pHash is missing; sorted by (a, b)).
   Cap: a cluster with more than ``max_cluster`` home rows (a prediction that was off, or a region denser than the
   sample showed) is split inside its task by a local k-means into sub-clusters of about ``cluster_size``, with the same
   home/probe rule, recursively; rows k-means cannot split (identical embeddings) are searched whole.

Each pair is listed once over all files, with no second shuffle: a pair (a, b) with different homes A and B sits
in cluster A only if b probes A, and in cluster B only if a probes B. When both hold, the cluster holding the
home of the smaller uid owns the pair; the other cluster's task sees this in the rows' ``ranked`` column and drops
it. Repeats within a cluster (found from both ends, or through two sub-clusters) are merged there.

Approximate like any inverted file: a pair is missed when neither survivor probes the other's home; and, as with
``reference.ivf_block_pairs``, each survivor's k nearest are taken per cluster, so a pair beyond a survivor's global k
nearest can be listed. Every listed pair is at >= ``threshold``. Against the exact search (``reference.flat_pairs``)
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
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import ray

from common.console import plural
from common.storage import delete_quietly
from curation.phases.dedup.chance import RANDOM_PAIRS
from curation.phases.dedup.embedding_clusters import Layout, ProbeRule, SearchSettings, default_cluster_size
from curation.phases.dedup.embedding_tasks import (
    BUCKETS_DIR,
    PAIRS_DIR,
    PLAN_DIR,
    assign_file,
    make_plan,
    read_plan,
    search_bucket,
    write_no_pairs,
)
from curation.phases.dedup.link_rule import Region
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner
from curation.steps.window import parquet_rows

log = logging.getLogger(__name__)


class EmbeddingPlan(Step):
    """The centroids and the bucket of each cluster, from a sample of the survivors (one unit; none for fewer than
    two survivors). Stats: clusters, buckets, sample, split_by_plan, rows_per_survivor, saturated."""

    name = "embedding-plan"
    unit_name = "plans"

    def __init__(
        self, output: Output, files: list[str], counts: np.ndarray, layout: Layout, probes: ProbeRule, chance_pairs: int
    ):
        self.output, self.files, self.counts, self.layout, self.probes = output, files, counts, layout, probes
        self.chance_pairs = chance_pairs

    def fingerprint(self) -> dict:
        files = {"files": list(self.files), "counts": self.counts.tolist()}
        return {**files, "layout": asdict(self.layout), "probes": asdict(self.probes), "chance": self.chance_pairs}

    def outputs(self) -> list[str]:
        return [PLAN_DIR]

    def units(self) -> list[str]:
        return ["plan"] if self.counts.sum() >= 2 else []

    def run_unit(self, unit: str) -> ray.ObjectRef:
        return make_plan.remote(self.output.uri, self.files, self.counts, self.layout, self.probes, self.chance_pairs)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        if not receipts:
            return {"clusters": 0, "buckets": 1}
        stats = dict(receipts[0])
        for level, line in stats.pop("log"):
            log.log(level, line)
        return stats


class EmbeddingAssign(Step):
    """Each survivor file's rows, written to the buckets of their home and probed clusters (one unit per file)."""

    name = "embedding-assign"
    unit_name = "survivor files"

    def __init__(self, output: Output, files: list[str], probes: ProbeRule, plan: dict):
        self.output, self.files, self.probes, self.plan = output, files, probes, plan

    def outputs(self) -> list[str]:
        return [BUCKETS_DIR]

    def units(self) -> list[str]:
        return [f"part-{i:06d}" for i in range(len(self.files))] if self.plan["clusters"] else []

    @functools.cached_property
    def shared(self) -> ray.ObjectRef:
        """The centroids with their spacing and the bucket of each cluster, put once for every task."""
        centroids, bucket_of = read_plan(self.output.fs, self.output.root)
        return ray.put((self.probes.centroids(centroids), bucket_of))

    def run_unit(self, unit: str) -> ray.ObjectRef:
        i = int(unit.removeprefix("part-"))
        return assign_file.remote(self.output.uri, self.files[i], i, self.shared, self.probes)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        rows = sum(r["rows"] for r in receipts)
        if receipts:
            log.info(
                f"[embedding pairs] {plural(rows, 'row')} (a survivor and a cluster it probes) written to "
                f"{plural(self.plan['buckets'], 'bucket')}"
            )
        return {"rows": rows, "cpu_s": round(sum(r["cpu_s"] for r in receipts), 1)}


class EmbeddingSearch(Step):
    """The pairs of each bucket (one unit per bucket; one empty pair file for fewer than two survivors)."""

    name = "embedding-search"
    unit_name = "buckets"

    def __init__(self, output: Output, n_files: int, plan: dict, settings: SearchSettings):
        self.output, self.n_files, self.plan, self.settings = output, n_files, plan, settings

    def fingerprint(self) -> dict:
        confirm = [asdict(r) for r in self.settings.confirm]
        return {"k": self.settings.k, "threshold": self.settings.threshold, "confirm": confirm}

    def outputs(self) -> list[str]:
        return [PAIRS_DIR]

    def units(self) -> list[str]:
        return [f"part-{b:05d}" for b in range(self.plan["buckets"])]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        if not self.plan["clusters"]:
            return write_no_pairs.remote(self.output.uri)
        return search_bucket.remote(self.output.uri, int(unit.removeprefix("part-")), self.n_files, self.settings)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        searched = [r for r in receipts if not r["skipped"]]
        pairs = sum(r["pairs"] for r in receipts)
        log.info(
            f"[embedding pairs] {plural(pairs, 'pair')} at cosine >= {self.settings.threshold} in "
            f"{plural(len(receipts), 'bucket')}"
        )
        return {
            "pairs": pairs,
            "buckets_searched": len(searched),
            "largest_cluster": max((r["largest_cluster"] for r in searched), default=None),
            "cpu_s": round(sum(r["cpu_s"] for r in searched), 1),
        }


@dataclass(frozen=True)
class SearchPlan:
    """The plan step's result, and what the assign and search steps share with it."""

    survivor_files: list[str]
    survivors: int
    layout: Layout
    probes: ProbeRule
    stats: dict  # the plan step's stats (clusters, buckets, ...)


def plan_embedding_search(
    runner: StepRunner,
    survivor_files: list[str],
    threshold: float,
    *,
    cluster_size: int | None = None,
    sample_size: int = 500_000,
    buckets: int | None = None,
    seed: int = 0,
    max_cluster: int | None = None,
    max_probes: int = 7,
    probe_z: float = 1.0,
    bucket_rows: int = 500_000,
    chance_pairs: int = RANDOM_PAIRS,
) -> SearchPlan:
    """The plan step: centroids, buckets and the chance histograms (``embedding_tasks.CHANCE_FILE``) of the survivors.

    ``survivor_files``: paths relative to the runner's output in the survivors schema (``uid``, ``phash`` and
    ``embedding`` are read). ``threshold``: the cosine the probe rule sizes its margin for. ``cluster_size``: mean
    survivors per cluster (None: ``default_cluster_size``); ``max_cluster``: home rows above which a cluster is split
    (None: 4 x cluster_size); ``sample_size``: most k-means sample rows held by the plan task; ``buckets``: search
    tasks (None: the predicted (survivor, cluster) rows / ``bucket_rows``, at least one per survivor file);
    ``max_probes``, ``probe_z``: see ``ProbeRule``; ``chance_pairs``: random pairs the chance estimate measures.
    """
    out = runner.output
    counts = np.asarray(parquet_rows(out.fs, [out.path(f) for f in survivor_files]), np.int64)
    n = int(counts.sum())
    cluster_size = cluster_size or default_cluster_size(n)
    layout = Layout(
        cluster_size, max(max_cluster or 4 * cluster_size, cluster_size), sample_size, buckets, bucket_rows, seed
    )
    probes = ProbeRule(max_probes, probe_z, threshold)
    stats = runner.run(EmbeddingPlan(out, survivor_files, counts, layout, probes, chance_pairs))
    return SearchPlan(list(survivor_files), n, layout, probes, stats)


def search_embedding_pairs(
    runner: StepRunner, plan: SearchPlan, threshold: float, k: int, confirm: tuple[Region, ...] = ()
) -> dict:
    """The assign and search steps: ``dedup/pairs/embedding/part-<bucket>.parquet``, the pairs among each survivor's
    ``k`` nearest at >= ``threshold`` that fall in a ``confirm`` region (every such pair where none is given).
    Returns a summary for the phase's record."""
    out = runner.output
    assigned = runner.run(EmbeddingAssign(out, plan.survivor_files, plan.probes, plan.stats))
    settings = SearchSettings(k, threshold, plan.probes, plan.layout, confirm)
    searched = runner.run(EmbeddingSearch(out, len(plan.survivor_files), plan.stats, settings))
    delete_quietly(out.fs, out.path(BUCKETS_DIR))  # each search removed its bucket; this, the empty folders
    if not plan.stats["clusters"]:
        return {"survivors": plan.survivors, "clusters": 0, "buckets": 1, "pairs": 0}
    return {
        "survivors": plan.survivors,
        **plan.stats,
        "threshold": threshold,
        "pairs": searched["pairs"],
        "buckets_searched": searched["buckets_searched"],
        "rows_assigned": assigned["rows"],
        "largest_cluster": searched["largest_cluster"],
        "cpu_s": {"assign": assigned["cpu_s"], "search": searched["cpu_s"]},
    }


def run_embedding_pairs(
    runner: StepRunner,
    survivor_files: list[str],
    threshold: float,
    k: int,
    confirm: tuple[Region, ...] = (),
    **plan_settings,
) -> dict:
    """``plan_embedding_search`` then ``search_embedding_pairs``, at one ``threshold``."""
    plan = plan_embedding_search(runner, survivor_files, threshold, **plan_settings)
    return search_embedding_pairs(runner, plan, threshold, k, confirm)
