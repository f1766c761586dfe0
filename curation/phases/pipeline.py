"""Phases 2-4, the global ones: dedup, sample, write, as Ray programs over partitions on the output store.

The driver never gathers survivors: it holds the committed input shards' records, the list of survivor partitions
and per-partition or per-cluster summaries. Every step is a set of Ray tasks that read and write Parquet partitions
beside the output (``curation.phases.survivors`` describes the partitioning):

    dedup/survivors/part-<i>.parquet        survey: each survivor's uid, names, scores, pHash and embedding
    dedup/embedding_plan/                   the clusters and the sample's chance histograms (curation.phases.dedup.chance)
    dedup/pairs/phash/part-<p>.parquet      exact pHash pairs at the pHash-alone radius (curation.phases.dedup.phash_pairs)
    dedup/pairs/embedding/part-<b>.parquet  pairs within k-means clusters the pHash confirms (curation.phases.dedup.embedding_pairs)
    dedup/decisions/part-<i>.parquet        dropped survivors of partition i: kept key, signal (curation.phases.dedup.components)
    sample/decisions/part-<i>.parquet       every dedup survivor of partition i: cluster ids, selected
                                            (curation.phases.sample.cluster_sampling)
    shards/part-NNNNN-<digest>.parquet      final curated shards (curation.phases.write.shards)
    final_ledger/<shard_id>-<digest>.parquet   the ledger with every phase applied: one row per input
    shards/manifest.json                    the current shards and final-ledger files, totals, funnel
    README.md                               the dataset card for Hugging Face datasets and the Hub (curation.phases.write.card)

Each phase is a short list of steps on one ``StepRunner`` (``curation.steps.runner``), fingerprinted by the phase's
settings hash: dedup = survey, embedding plan (with the chance estimate that fits the link rule's radii), pHash
pairs (map, reduce), embedding pairs (assign, search), components
(pairs, edges, contraction rounds, labels, the keep rule); sample = train, assign, budget, select, assemble;
write = selected, shards, ledger, then (after the manifest's switch) drop_bytes. The runner keeps each step's
receipts and done record, so a rerun with the same settings redoes only the units not receipted, and other settings
clear a step's outputs before it runs again.
``_state/<phase>.done.json`` is written last, so a rerun skips a phase that is done with the same settings, and
re-running one phase clears the later ones' done records.

The manifest is the commit point of "write": the new files are written beside the old ones under names that end in
a prefix of their sha256, then the manifest is replaced in one atomic write, then the files it does not list are
deleted. A reader that goes through the manifest sees the complete old set or the complete new one. Then the scored
files are rewritten without their image bytes (``curation.phases.write.shards.drop_scored_bytes``): the output holds
each image's bytes once, and a later write reads them from the pool (``curation.score.originals``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow.fs as pafs
import ray

from common import watchdog
from common.config import hash_json, hash_json_each
from common.console import plural
from common.layout import GLOBAL_PHASES, LAYOUT
from common.storage import (
    delete_quietly,
    exists,
    join,
    remove_temporaries,
    write_json_atomic,
)
from curation.config import CurateConfig
from curation.phases import survivors
from curation.phases.dedup import chance
from curation.phases.dedup.components import by_signal_words, run_components
from curation.phases.dedup.embedding_pairs import plan_embedding_search, search_embedding_pairs
from curation.phases.dedup.embedding_tasks import read_chance
from curation.phases.dedup.phash_pairs import run_phash_pairs
from curation.phases.release import RELEASE_UID_MIN, Release, survey_release_partition
from curation.phases.sample.cluster_sampling import run_sample
from curation.phases.write.card import write_card
from curation.phases.write.shards import drop_scored_bytes, write_phase
from curation.records import read_commits, read_done, read_run_record
from curation.score.originals import SourceReader
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner
from curation.steps.window import task_window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """One global phase: its name (the ``--phases`` word), the phase that must be done first, the settings
    fingerprint its records are keyed by (other settings redo it), and what runs it (returns its done record)."""

    name: str
    needs: str
    fingerprint: Callable[[], str]
    run: Callable[[], dict]


class PhaseOrderError(RuntimeError):
    """A phase was asked for before the phase it needs has completed."""


def phase_done(out: Output, phase: str, settings_hash: str | None = None) -> bool:
    if not out.exists(LAYOUT.done(phase)):
        return False
    return settings_hash is None or read_done(out.fs, out.root, phase)["settings_hash"] == settings_hash


def phase_hash(cfg: CurateConfig, phase: str, against: Release | None = None) -> str:
    """The phase's settings hash; with a release to curate against, that release's manifest too (a takedown
    there, or another release, redoes the global phases)."""
    if against is None:
        return cfg.phase_hash(phase)
    return hash_json({"settings": cfg.phase_hash(phase), "against": against.previous()})


def require_phase(cfg: CurateConfig, out: Output, phase: str, against: Release | None = None) -> None:
    """Raise ``PhaseOrderError`` unless the phase ``phase`` needs is complete in ``out`` with these settings."""
    needed = LAYOUT.needs(phase)
    # score's settings are the run's, which claiming the output already checked
    fingerprint = phase_hash(cfg, needed, against) if needed in GLOBAL_PHASES else None
    if not phase_done(out, needed, fingerprint):
        raise PhaseOrderError(
            f"phase {phase} needs phase {needed} to be complete with these settings; run --phases {needed},{phase}"
        )


def check_order(cfg: CurateConfig, out: Output, phases: list[str], against: Release | None = None) -> None:
    """Raise ``PhaseOrderError`` for a global phase in ``phases`` whose needed phase is neither in ``phases`` nor
    complete: a job checks it before it writes anything (each phase checks again when its turn comes)."""
    for phase in GLOBAL_PHASES:
        if phase in phases and LAYOUT.needs(phase) not in phases:
            require_phase(cfg, out, phase, against)


class Survey(Step):
    """Dedup's first step: one survivor partition per unit, from the committed input shards (and the release's kept
    images, when curating against one)."""

    name = "survey"
    unit_name = "partitions"

    def __init__(self, phases: GlobalPhases):
        cfg = phases.cfg
        self.calls: dict[str, tuple] = {
            f"part-{i:06d}": (
                _survey_task,
                (phases.output.uri, shards, path, cfg.dedup.keep_score, cfg.sample.balance_key, cfg.embedding_dim),
            )
            for i, (shards, path) in enumerate(zip(phases.partitions, phases.survivor_files))
        }
        for j, path in enumerate(phases.release_files):
            assert phases.against is not None  # release files exist only with a release
            self.calls[f"release-{j:06d}"] = (
                survey_release_partition,
                (phases.against.uri, j, phases.output.uri, path, cfg.embedding_dim),
            )

        # the commit records each partition is made of: scoring more shards, or again, redoes the survey and the rest
        self.plan = hash_json_each((i, r) for i, shards in enumerate(phases.partitions) for _, r in shards)

    def fingerprint(self) -> str:
        return self.plan

    def outputs(self) -> list[str]:
        return [LAYOUT.survivors]

    def units(self) -> list[str]:
        return list(self.calls)

    def run_unit(self, unit: str) -> ray.ObjectRef:
        task, args = self.calls[unit]
        return task.remote(*args)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        for unit, receipt in zip(self.calls, receipts):
            if receipt["missing_embedding"]:
                raise PhaseOrderError(
                    f"{unit}: {receipt['missing_embedding']} images without an embedding: the global phases need the "
                    "embedding stage (enable stages.embedding and rescore, or run --phases score only)"
                )
        return {"rows": sum(r["rows"] for r in receipts)}


@ray.remote(num_cpus=0.5)
def _survey_task(
    out_uri: str, shards: list, path: str, keep_score: list[str], balance_key: str | None, dim: int
) -> dict:
    return survivors.survey_partition(out_uri, shards, path, keep_score, balance_key, dim)


class GlobalPhases:
    """``guard`` runs before each commit-point write and raises when this run may no longer write the output
    (``common.lease.Lease.check``); ``pool``: the pool's URI as the job was given it (default: the store the run
    record keeps), where the write phase reads the bytes the scored files no longer hold."""

    def __init__(
        self,
        cfg: CurateConfig,
        output: Output,
        guard: Callable[[], None] = lambda: None,
        against: Release | None = None,
        pool: str | None = None,
    ):
        self.cfg, self.output, self.guard, self.against, self.pool = cfg, output, guard, against, pool
        self.fs, self.root = output.fs, output.root
        self.records = read_commits(self.fs, self.root)
        self.partitions = survivors.plan_partitions(list(self.records.values()), cfg.dedup.rows_per_partition)
        self.survivor_files = [survivors.partition_path(i) for i in range(len(self.partitions))]
        # the release's kept images, as survivor partitions after the run's own (curation.phases.release)
        n = len(self.partitions)
        self.release_files = [survivors.partition_path(n + j) for j in range(against.partitions if against else 0)]
        steps = {"dedup": self._dedup, "sample": self._sample, "write": self._write}
        self.phases = {
            name: Phase(name, LAYOUT.needs(name), functools.partial(self.phase_hash, name), steps[name])
            for name in GLOBAL_PHASES
        }

    def phase_hash(self, phase: str) -> str:
        return phase_hash(self.cfg, phase, self.against)

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    def _require(self, phase: str) -> None:
        require_phase(self.cfg, self.output, phase, self.against)

    def _start(self, phase: str) -> None:
        # writes a kill cut short leave _tmp- files; this run holds the lease, so none of them is live
        remove_temporaries(self.fs, join(self.root, LAYOUT.state))
        for folder in (*LAYOUT.phase_folders(phase), LAYOUT.phase_steps(phase)):
            remove_temporaries(self.fs, join(self.root, folder), recursive=True)
        for later in LAYOUT.from_phase_on(phase):
            delete_quietly(self.fs, self.output.path(LAYOUT.done(later)))

    def runner(self, phase: str) -> StepRunner:
        """The runner of ``phase``'s steps: each step's records, resume and clearing (``curation.steps.runner``)."""
        return StepRunner(self.output, phase, self.phase_hash(phase), task_window(per_cpu=4), self.guard)

    def _finish(self, phase: str, record: dict, start: float) -> None:
        record = {**record, "settings_hash": self.phase_hash(phase), "seconds": round(time.monotonic() - start, 2)}
        self.guard()
        write_json_atomic(self.fs, self.output.path(LAYOUT.done(phase)), record)

    def run(self, name: str) -> dict:
        phase = self.phases[name]
        if phase_done(self.output, name, phase.fingerprint()):
            record = read_done(self.fs, self.root, name)
            log.info(f"[{name}] already done with these settings, skipped")
            return record
        self._require(name)
        self.guard()
        watchdog.stage(f"the {name} phase")
        self._start(name)
        start = time.monotonic()
        record = phase.run()
        self._finish(name, record, start)
        return record

    # --- phase 2: dedup ------------------------------------------------------------------------------------------

    def _dedup(self) -> dict:
        cfg, runner = self.cfg.dedup, self.runner("dedup")
        n = runner.run(Survey(self))["rows"]
        files = self.survivor_files + self.release_files  # the release's images are linked like any survivor
        configured = cfg.rule()
        if not n or not configured.regions:
            return {"inputs": n, "partitions": len(files), "pairs": {}, "components": {}}
        # the plan's sample gives the clusters and the chance histograms; the rule's radii follow from them
        probe_at = max((r.min_cosine for r in configured.joint if r.min_cosine is not None), default=1.0)
        plan = plan_embedding_search(
            runner,
            files,
            probe_at,
            cluster_size=cfg.cluster_size,
            seed=self.cfg.sample.seed,
            max_probes=cfg.max_probes,
            probe_z=cfg.probe_z,
            chance_pairs=cfg.chance_pairs,
        )
        estimate = chance.decide(
            read_chance(self.fs, self.root),
            configured,
            cfg.max_chance_fraction,
            fit_radii=cfg.fit_radii,
            allow=cfg.allow_chance,
        )
        log.info(estimate.line())
        rule = estimate.rule
        pair_files: dict[str, list[str]] = {}
        summaries = {}
        if rule.hash_radius >= 0:
            summaries["phash"] = run_phash_pairs(runner, files, rule.hash_radius)
            pair_files["phash"] = self.output.listed(LAYOUT.phash_pairs)
        threshold = rule.search_threshold
        if threshold is not None:
            summaries["embedding"] = search_embedding_pairs(runner, plan, threshold, cfg.embedding_k, rule.joint)
            pair_files["embedding"] = self.output.listed(LAYOUT.embedding_pairs)
        result = run_components(runner, pair_files, files)
        released = f" (the release's kept images in {len(self.release_files)} of them)" if self.release_files else ""
        log.info(
            f"[dedup] {plural(n, 'survivor')} in {plural(len(files), 'partition')}{released}: {result['dropped']} "
            f"dropped as copies ({by_signal_words(result['by_signal'], 'no links')}) in "
            f"{plural(result['components'], 'group')}"
        )
        return {
            "inputs": n,
            "partitions": len(files),
            "chance": estimate.summary(),
            "pairs": summaries,
            "components": result,
        }

    # --- phase 3: sample -----------------------------------------------------------------------------------------

    def _sample(self) -> dict:
        files = self.survivor_files + self.release_files  # the release's images: clustered with, and chosen before
        decisions = [LAYOUT.dedup_decision(i) for i in range(len(files))]
        chosen_from = RELEASE_UID_MIN if self.release_files else None
        # run_sample says in words what it selected; its summary is the phase's done record
        return run_sample(self.runner("sample"), files, decisions, self.cfg.sample, chosen_from=chosen_from)

    # --- phase 4: write ------------------------------------------------------------------------------------------

    def _write(self) -> dict:
        partition_of = {record["shard_id"]: i for i, shards in enumerate(self.partitions) for _, record in shards}
        runner = self.runner("write")
        if self.pool is None:
            run = read_run_record(self.fs, self.root)
            self.pool = run.get("input_store") or run["input"]
        originals = SourceReader(self.cfg.input, self.cfg.filters.max_file_bytes, self.pool)
        manifest = write_phase(runner, self.cfg, self.records, partition_of, len(self.partitions), originals)
        if self.against is not None:  # this output is the release's next version
            manifest = {**manifest, "version": self.against.version + 1, "previous": self.against.previous()}
        self.guard()
        write_json_atomic(self.fs, join(self.root, LAYOUT.manifest), manifest)  # the switch to the new files
        removed = self._remove_unlisted(manifest)
        # after the switch: the kept images' bytes are in the final shards, and a kill before here still has them
        dropped = drop_scored_bytes(runner, self.cfg, self.records)
        write_card(self.output.uri, manifest)  # after the switch: the card describes the current shards
        log.info(
            f"[write] {plural(manifest['totals']['rows'], 'image')} in {plural(len(manifest['shards']), 'shard')} "
            f"({plural(manifest['totals']['bytes'], 'byte')}); {plural(removed, 'file')} the manifest no longer lists "
            f"removed; image bytes dropped from {plural(dropped['files'], 'scored file')} "
            f"({plural(dropped['bytes'], 'byte')})"
        )
        return manifest["totals"]

    def _remove_unlisted(self, manifest: dict) -> int:
        """Delete every file under shards/ and final_ledger/ the manifest does not list (an earlier write's, the
        leftovers of an interrupted one); returns how many."""
        listed = {join(self.root, LAYOUT.manifest)}
        listed |= {join(self.root, LAYOUT.shards, s["file"]) for s in manifest["shards"]}
        listed |= {join(self.root, LAYOUT.final_ledger, f["file"]) for f in manifest["final_ledger"]}
        removed = 0
        for folder in (LAYOUT.shards, LAYOUT.final_ledger):
            if not exists(self.fs, join(self.root, folder)):
                continue
            for info in self.fs.get_file_info(pafs.FileSelector(join(self.root, folder), recursive=True)):
                if info.type == pafs.FileType.File and info.path not in listed:
                    delete_quietly(self.fs, info.path)
                    removed += 1
        return removed
