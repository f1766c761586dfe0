"""Phase 1, "score": stream the pool through the configured stages into scored shards and ledger rows.

The pipeline is a Ray Data chain: read input shards -> one ``map_batches`` per stage (actor pools for model
stages, tasks for cheap ones) -> a writer that writes one part file per input shard per batch. The phase is one step
of the step runner (``curation.steps.runner``) whose units are the input shards: the driver only sees the writer's
small receipts, and when an input shard's parts cover all its inputs, its receipt (the shard's commit record: its
part files, rows, peak memory, retried I/O) is recorded as that unit's. Only committed parts count: a rerun skips
committed shards and clears the rest, so results do not depend on how Ray happened to split the data into blocks.

Memory: every process of the chain (the reader, each stage, the writer) asks Ray for ``input.task_memory_mb`` per
process, so a node runs no more of them at once than fit. The same request everywhere also keeps Ray Data fusing a
task stage into the actor stage after it where their CPU shares match (decode into the person actors in the lite
profile): a 2-CPU machine has no CPU left for a separate decode task once the actor pools are up. Each process
measures its peak RSS over its call, the rows carry the highest so far, and each shard's commit record holds the peak
of the processes that handled it (``peak_rss_mb``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import NotRequired, TypedDict, cast

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy

from common import watchdog
from common.layout import LAYOUT
from common.progress import Progress
from common.storage import delete_quietly, list_files, write_json_atomic
from curation.config import CurateConfig
from curation.records import read_commit
from curation.score.chain import (
    IO_COLUMNS,
    io_note,
    named_actor,
    named_fused_actor,
    named_task,
    read_shards,
    write_parts,
)
from curation.score.inputs import InputShard
from curation.score.metadata import merge_all
from curation.score.pool import Pool
from curation.stages import stage_classes
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner

log = logging.getLogger(__name__)


def _as_they_come(ds: ray.data.Dataset) -> Iterator[dict]:
    """The writer's receipts as each block of them arrives, so that a shard is committed as soon as its parts are
    written: ``iter_rows`` prefetches, holding each block back until the next one is ready, which on a small pool
    delays every commit to the end of the phase."""
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
        yield from cast(pa.Table, batch).to_pylist()  # batch_format="pyarrow" gives tables


_MAX_MEMORY_WARNINGS = 10  # shards named over input.task_memory_mb; a pool of millions must not flood the console


class _MapOptions(TypedDict):
    """The ``map_batches`` options every stage gets."""

    batch_size: int
    batch_format: str
    num_cpus: float
    memory: int
    num_gpus: NotRequired[float]


_IO_CPUS = 0.25  # the chain's reader and writer, mostly waiting on storage


class ScorePhase(Step):
    """Phase 1 for one output: the step whose units are the input shards (``run``), and the Ray Data chain that
    scores them (``build``)."""

    name = "shards"  # so the commit records are LAYOUT.score_commits
    unit_name = "input shards"

    def __init__(self, cfg: CurateConfig, out: Output, pool: Pool, scored_hash: str | None = None):
        self.cfg, self.out, self.pool = cfg, out, pool
        self.results_hash = cfg.results_hash()
        # the step's fingerprint: the settings phase 1 first scored the output with, which a change of thresholds
        # keeps (its committed shards are re-decided, not scored again: curation.score.redecide)
        self.scored_hash = scored_hash or self.results_hash
        self.shards: dict[str, InputShard] = {}
        self.this_run: dict[str, dict] = {}  # the commit records of the shards scored by this run
        self.memory = cfg.task_memory_mb * 2**20  # what each of the chain's processes requests (task_memory())
        self.started = False  # whether this run's units ran (the step was not done already)

    def outputs(self) -> list[str]:
        return [LAYOUT.scored, LAYOUT.scored_images, LAYOUT.ledger]

    def units(self) -> list[str]:
        return list(self.shards)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {
            "shards": len(receipts),
            "inputs": sum(r["rows"] for r in receipts),
            "kept": sum(r["kept"] for r in receipts),
        }

    def task_memory(self) -> int:
        """Bytes of memory each process of the chain requests of Ray: ``input.task_memory_mb``, lowered where the
        cluster could not hold at once the processes the chain needs to make progress (every actor stage's smallest
        pool and one task of each other process; no more than the largest node): Ray would leave some waiting for ever."""
        want = self.cfg.task_memory_mb * 2**20
        if not ray.is_initialized():
            return want
        nodes = [n["Resources"].get("memory", 0.0) for n in ray.nodes() if n.get("Alive")]
        at_once = 2 + sum((self._actors(group) or (1, 1))[0] for group in self.cfg.stage_groups)
        fits = int(min(max(nodes, default=0.0), sum(nodes) / at_once))
        if 0 < fits < want:
            log.info(
                f"[score] input.task_memory_mb={self.cfg.task_memory_mb}: the {at_once} processes the score chain "
                f"needs at once would not fit in the cluster's memory ({sum(nodes) / 2**20:.0f} MiB); each requests "
                f"{fits / 2**20:.0f} MiB instead"
            )
            return fits
        return want

    def _actors(self, group: tuple[str, ...]) -> tuple[int, int] | None:
        """(min, max) actors of a stage group run by an actor pool (a model stage or a fused run); None for a task."""
        if len(group) == 1 and not stage_classes()[group[0]].uses_actors:
            return None
        return self.cfg.stages[group[0]].actors

    def build(self, shards: list[InputShard], memory: int | None = None) -> ray.data.Dataset:
        """The chain over ``shards``; ``memory``: bytes each process requests (default ``task_memory()``)."""
        cfg_json = self.cfg.model_dump_json()
        memory = self.task_memory() if memory is None else memory
        ds: ray.data.Dataset = ray.data.from_items([s.to_row() for s in shards], override_num_blocks=len(shards))
        # I/O errors are retried inside the read and write functions (ray.io_retries); Ray Data retries the tasks
        # of lost workers and nodes itself
        ds = ds.map_batches(
            read_shards,  # type: ignore[arg-type]  # Ray types fn as taking the batch alone; fn_kwargs gives the rest
            batch_size=1,
            batch_format="pyarrow",
            num_cpus=_IO_CPUS,
            memory=memory,
            fn_kwargs={"cfg_json": cfg_json, "input_uri": self.pool.uri},
        )
        for group in self.cfg.stage_groups:
            settings = self.cfg.stages[group[0]]  # a fused run's pool has its first stage's settings
            common = _MapOptions(
                batch_size=settings.batch_size, batch_format="pyarrow", num_cpus=settings.num_cpus, memory=memory
            )
            if settings.num_gpus:
                common["num_gpus"] = settings.num_gpus
            actors = self._actors(group)
            if actors is None:
                ds = ds.map_batches(named_task(group[0]), fn_kwargs={"cfg_json": cfg_json}, **common)
                continue
            runner, kwargs = (
                (named_actor(group[0]), {"stage_class": stage_classes()[group[0]], "cfg": self.cfg})
                if len(group) == 1
                else (named_fused_actor(group), {"stage_classes": [stage_classes()[n] for n in group], "cfg": self.cfg})
            )
            ds = ds.map_batches(
                runner,
                fn_constructor_kwargs=kwargs,
                compute=ActorPoolStrategy(min_size=actors[0], max_size=actors[1]),
                **common,
            )
        return ds.map_batches(
            write_parts,  # type: ignore[arg-type]  # Ray types fn as taking the batch alone; fn_kwargs gives the rest
            batch_size=self.cfg.input.files_per_shard,
            batch_format="pyarrow",
            num_cpus=_IO_CPUS,
            memory=memory,
            fn_kwargs={"out_uri": self.out.uri, "cfg_json": cfg_json, "results_hash": self.results_hash},
        )

    def requests(self, memory: int) -> dict[str, dict[str, float]]:
        """What each process of ``build``'s chain asks Ray for per task or actor: the watchdog names a stuck one."""

        def ask(cpus: float, gpus: float = 0.0) -> dict[str, float]:
            return {"CPU": cpus, "memory": memory} | ({"GPU": gpus} if gpus else {})

        stages = {
            f"stage {group[0]}" + (f" (fused with {', '.join(group[1:])})" if len(group) > 1 else ""): ask(
                self.cfg.stages[group[0]].num_cpus, self.cfg.stages[group[0]].num_gpus
            )
            for group in self.cfg.stage_groups
        }
        return {"the reader (read_shards)": ask(_IO_CPUS), **stages, "the writer (write_parts)": ask(_IO_CPUS)}

    def run(self, shards: list[InputShard], guard: Callable[[], None] = lambda: None) -> dict:
        """Score every shard of ``shards`` not committed yet; the phase's summary, also its done record. ``guard``
        raises when this run may no longer write the output (``common.lease.Lease.check``)."""
        self.shards, self.this_run = {s.shard_id: s for s in shards}, {}
        runner = StepRunner(self.out, "score", self.scored_hash, window=1, guard=guard)
        adopt_previous_commits(self.out, runner.fingerprint(self))
        start, self.started = time.monotonic(), False
        totals = runner.run(self)
        if not self.started:  # the step was done: nothing of the pool ran
            log.info(f"[score] {len(shards)} input shards, {len(shards)} already committed, 0 to score")
        limit_mb = math.ceil(self.memory / 2**20)
        peaks = {shard_id: r["peak_rss_mb"] for shard_id, r in self.this_run.items()}
        top = max(peaks, key=peaks.__getitem__, default=None)
        summary = {
            "shards": totals["shards"],
            "inputs_this_run": sum(r["rows"] for r in self.this_run.values()),
            "seconds": round(time.monotonic() - start, 2),
            # over the shards committed this run; None when there were none
            "peak_task_memory_mb": None if top is None else peaks[top],
            "peak_task_memory_shard": top,
            "task_memory_mb": limit_mb,
            "shards_over_task_memory": sum(p > limit_mb for p in peaks.values()),
            # retried object-store / disk calls and throttling answers of the shards committed this run
            **{key: sum(r[key] for r in self.this_run.values()) for key in IO_COLUMNS.values()},
        }
        write_json_atomic(
            self.out.fs, self.out.path(LAYOUT.done("score")), {**summary, "settings_hash": self.results_hash}
        )
        return summary

    def run_units(self, todo: Sequence[str], window: int, progress: Progress) -> Iterator[tuple[str, dict]]:
        """Each input shard of ``todo`` with its commit record, as its last part is written. ``window`` and
        ``progress`` are the runner's for task steps: Ray Data bounds this chain, and its progress lines report img/s."""
        del window, progress
        self.started = True
        for shard_id in todo:  # what an uncommitted shard wrote before a kill: this run holds the lease
            for top in (LAYOUT.ledger, LAYOUT.scored, LAYOUT.scored_images):
                delete_quietly(self.out.fs, self.out.path(f"{top}/{shard_id}"))
        done, total = len(self.shards) - len(todo), len(self.shards)
        log.info(f"[score] {total} input shards, {done} already committed, {len(todo)} to score")
        if todo:
            self.memory = self.task_memory()
        watchdog.stage("the score phase", self.requests(self.memory))
        if not todo:
            return
        limit_mb, start, next_report, over = math.ceil(self.memory / 2**20), time.monotonic(), 0.0, 0
        running = dict.fromkeys(["rows", *IO_COLUMNS.values()], 0)  # over the shards committed this run
        parts: dict[str, list[dict]] = defaultdict(list)
        sizes: dict[str, int] = {}  # known once the receipt of a shard's last chunk arrives
        for receipt in _as_they_come(self.build([self.shards[u] for u in todo], self.memory)):
            shard_id = receipt["shard_id"]
            watchdog.beat(f"results of input shard {shard_id} written ({done}/{total} committed)")
            parts[shard_id].append(receipt)
            if receipt["shard_size"] is not None:
                sizes[shard_id] = receipt["shard_size"]
            if shard_id not in sizes or sum(r["rows"] for r in parts[shard_id]) != sizes[shard_id]:
                continue
            del sizes[shard_id]
            commit = self.this_run[shard_id] = self._commit(shard_id, parts.pop(shard_id))
            for key in running:  # running totals: a sum over this_run per shard would be quadratic in shards
                running[key] += commit[key]
            over += commit["peak_rss_mb"] > limit_mb
            self._warn_memory(shard_id, commit["peak_rss_mb"], limit_mb, over)
            done += 1
            elapsed = time.monotonic() - start
            if elapsed >= next_report or done == total:
                next_report = elapsed + 10.0
                log.info(
                    f"[score] committed {done}/{total} shards, {running['rows']} inputs this run,"
                    f" {running['rows'] / max(elapsed, 1e-9):.1f} img/s{io_note(running)}"
                )
            yield shard_id, commit
        missing = [u for u in todo if u not in self.this_run]
        if missing:
            raise RuntimeError(f"[score] shards not complete after the pipeline finished: {missing[:5]}")

    def _warn_memory(self, shard_id: str, peak: int, limit_mb: int, over: int) -> None:
        """Name the shard whose process peaked over ``limit_mb``; ``over``: shards over it so far this run."""
        if peak > limit_mb and over <= _MAX_MEMORY_WARNINGS:
            log.warning(
                f"[score] warning: a process scoring input shard {shard_id} peaked at {peak} MiB, over "
                f"the {limit_mb} MiB each requests of Ray (input.task_memory_mb): raise it, or lower "
                "input.read_chunk_mb or filters.max_pixels"
                + ("; further shards over it are only counted" if over == _MAX_MEMORY_WARNINGS else "")
            )

    def _commit(self, shard_id: str, receipts: list[dict]) -> dict:
        """The shard's commit record, from the writer's receipts of its parts."""
        return {
            "shard_id": shard_id,
            "rows": sum(r["rows"] for r in receipts),
            "kept": sum(r["kept"] for r in receipts),
            "ledger_files": sorted(r["ledger_file"] for r in receipts),
            "scored_files": sorted(r["scored_file"] for r in receipts if r["scored_file"]),
            "results_hash": self.results_hash,
            # the thresholds its scores were computed with (a re-decide reruns a stage whose computation they change)
            "scored_filters": self.cfg.filters.model_dump(mode="json"),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in receipts),
            **{key: sum(r[key] for r in receipts) for key in IO_COLUMNS.values()},
            "metadata_types": merge_all(json.loads(r["metadata_types"]) for r in receipts),
        }


def adopt_previous_commits(out: Output, fingerprint: str) -> None:
    """Move the commit records of an output scored before the score phase ran on the step runner
    (``LAYOUT.previous_score_commits``) into its step's records, so that resuming it rescores nothing: the run
    record, checked before, says the same settings made them."""
    old = list_files(out.fs, out.path(LAYOUT.previous_score_commits), ".json")
    if not old:
        return
    log.info(f"[score] {len(old)} commit records of an earlier version's layout moved to {LAYOUT.score_commits}/")
    write_json_atomic(out.fs, out.path(LAYOUT.step_started("score", ScorePhase.name)), {"fingerprint": fingerprint})
    for path in old:
        record = read_commit(out.fs, out.root, path)
        unit = {"fingerprint": fingerprint, "receipt": record}
        write_json_atomic(out.fs, out.path(LAYOUT.score_commit(record["shard_id"])), unit)
    delete_quietly(out.fs, out.path(LAYOUT.previous_score_commits))
