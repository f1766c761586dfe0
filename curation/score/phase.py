"""Phase 1, "score": stream the pool through the configured stages into scored shards and ledger rows.

The pipeline is a Ray Data chain: read input shards -> one ``map_batches`` per stage (actor pools for model
stages, tasks for cheap ones) -> a writer that writes one part file per input shard per batch. The driver only
sees the writer's small receipts; when an input shard's parts cover all its inputs, the driver writes the shard's
commit record. Only committed parts count: a rerun skips committed shards and clears the rest, so results do not
depend on how Ray happened to split the data into blocks.

Memory: every step of the chain (the reader, each stage, the writer) asks Ray for ``input.task_memory_mb`` per
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
from collections.abc import Iterator
from typing import NotRequired, TypedDict, cast

import pyarrow as pa
import pyarrow.fs as pafs
import ray
from ray.data import ActorPoolStrategy

from common import watchdog
from common.layout import LAYOUT
from common.storage import (
    delete_quietly,
    exists,
    join,
    remove_temporaries,
    resolve,
    write_json_atomic,
)
from curation.config import CurateConfig
from curation.records import read_commits, read_run_record, run_record
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
from curation.stages import stage_classes

log = logging.getLogger(__name__)


def _as_they_come(ds: ray.data.Dataset) -> Iterator[dict]:
    """The writer's receipts as each block of them arrives, so that a shard is committed as soon as its parts are
    written: ``iter_rows`` prefetches, holding each block back until the next one is ready, which on a small pool
    delays every commit to the end of the phase."""
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
        yield from cast(pa.Table, batch).to_pylist()  # batch_format="pyarrow" gives tables


_MAX_MEMORY_WARNINGS = 10  # shards named over input.task_memory_mb; a pool of millions must not flood the console


class RunMismatch(RuntimeError):
    """The output folder holds a run made with different settings."""


def claim_output(out_uri: str, results_hash: str, input_uri: str, new_run: bool) -> None:
    """Record which run owns ``out_uri``; refuse to mix results of different settings in one output.

    Deletes the results of an earlier run: call it holding the output's lease (``common.lease``)."""
    fs, root = resolve(out_uri)
    path = join(root, LAYOUT.run_record)
    record = run_record(results_hash, input_uri)  # no credentials in _state
    input_uri = record["input"]
    if exists(fs, path) and not new_run:
        run = read_run_record(fs, root, expected=record)
        if run["results_hash"] != results_hash or run["input"] != input_uri:
            raise RunMismatch(
                f"{out_uri} holds a run of input {run['input']} with config hash {run['results_hash']}; this command has "
                f"input {input_uri} and config hash {results_hash}. Rerun with the same input and settings to resume, "
                "choose another --output, or pass --new-run to discard the old results."
            )
        if run.get("schema_version") != record["schema_version"]:
            # Its scored files lack columns the later phases read (encoding_quality since version 3).
            raise RunMismatch(
                f"{out_uri} was scored by an older version of the pipeline (tables of schema version "
                f"{run.get('schema_version', '2 or older')}; this one reads and writes version "
                f"{record['schema_version']}). Pass --new-run to score it again, or choose another --output."
            )
        if run.get("input_store") != record["input_store"]:  # the same pool reached anew (another endpoint)
            write_json_atomic(fs, path, {**run, "input_store": record["input_store"]})
        return
    for top in (LAYOUT.scored, LAYOUT.ledger):
        delete_quietly(fs, join(root, top))
    state = join(root, LAYOUT.state)
    if exists(fs, state):  # all of it but the lease this run holds and the takedowns, which bind every run
        keep = {join(root, LAYOUT.lease), join(root, LAYOUT.takedowns)}
        for info in fs.get_file_info(pafs.FileSelector(state)):
            if info.path not in keep:
                delete_quietly(fs, info.path)
    write_json_atomic(fs, path, record)


class _MapOptions(TypedDict):
    """The ``map_batches`` options every stage gets."""

    batch_size: int
    batch_format: str
    num_cpus: float
    memory: int
    num_gpus: NotRequired[float]


_IO_CPUS = 0.25  # the chain's reader and writer, mostly waiting on storage


class ScorePhase:
    """Runs phase 1 for one output folder; resumable per input shard."""

    def __init__(self, cfg: CurateConfig, out_uri: str, input_uri: str):
        self.cfg, self.out_uri, self.input_uri = cfg, out_uri, input_uri
        self.fs, self.root = resolve(out_uri)
        self.results_hash = cfg.results_hash()

    def commit_path(self, shard_id: str) -> str:
        return join(self.root, LAYOUT.score_commit(shard_id))

    def committed(self) -> dict[str, dict]:
        return read_commits(self.fs, self.root)

    def task_memory(self) -> int:
        """Bytes of memory each process of the chain requests of Ray: ``input.task_memory_mb``, lowered where the
        cluster could not hold at once the processes the chain needs to make progress (every actor stage's smallest
        pool and one task of each other step; no more than the largest node): Ray would leave some waiting for ever."""
        want = self.cfg.task_memory_mb * 2**20
        if not ray.is_initialized():
            return want
        nodes = [n["Resources"].get("memory", 0.0) for n in ray.nodes() if n.get("Alive")]
        at_once = 2 + sum((self._actors(step) or (1, 1))[0] for step in self.cfg.steps)
        fits = int(min(max(nodes, default=0.0), sum(nodes) / at_once))
        if 0 < fits < want:
            log.info(
                f"[score] input.task_memory_mb={self.cfg.task_memory_mb}: the {at_once} processes the score chain "
                f"needs at once would not fit in the cluster's memory ({sum(nodes) / 2**20:.0f} MiB); each requests "
                f"{fits / 2**20:.0f} MiB instead"
            )
            return fits
        return want

    def _actors(self, step: tuple[str, ...]) -> tuple[int, int] | None:
        """(min, max) actors of a step run by an actor pool (a model stage or a fused run); None for a task."""
        if len(step) == 1 and not stage_classes()[step[0]].uses_actors:
            return None
        return self.cfg.stages[step[0]].actors

    def _clear_uncommitted(self, shards: list[InputShard], committed: dict[str, dict]) -> None:
        # a commit record cut short by a kill leaves its temporary file; this run holds the lease, so none is live
        remove_temporaries(self.fs, join(self.root, LAYOUT.score_commits))
        for shard in shards:
            if shard.shard_id not in committed:
                for top in (LAYOUT.ledger, LAYOUT.scored):
                    delete_quietly(self.fs, join(self.root, top, shard.shard_id))

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
            fn_kwargs={"cfg_json": cfg_json, "input_uri": self.input_uri},
        )
        for step in self.cfg.steps:
            settings = self.cfg.stages[step[0]]  # a fused run's pool has its first stage's settings
            common = _MapOptions(
                batch_size=settings.batch_size, batch_format="pyarrow", num_cpus=settings.num_cpus, memory=memory
            )
            if settings.num_gpus:
                common["num_gpus"] = settings.num_gpus
            actors = self._actors(step)
            if actors is None:
                ds = ds.map_batches(named_task(step[0]), fn_kwargs={"cfg_json": cfg_json}, **common)
                continue
            runner, kwargs = (
                (named_actor(step[0]), {"stage_class": stage_classes()[step[0]], "cfg": self.cfg})
                if len(step) == 1
                else (named_fused_actor(step), {"stage_classes": [stage_classes()[n] for n in step], "cfg": self.cfg})
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
            fn_kwargs={"out_uri": self.out_uri, "cfg_json": cfg_json, "results_hash": self.results_hash},
        )

    def requests(self, memory: int) -> dict[str, dict[str, float]]:
        """What each step of ``build``'s chain asks Ray for per task or actor: the watchdog names a stuck one."""

        def ask(cpus: float, gpus: float = 0.0) -> dict[str, float]:
            return {"CPU": cpus, "memory": memory} | ({"GPU": gpus} if gpus else {})

        steps = {
            f"stage {step[0]}" + (f" (fused with {', '.join(step[1:])})" if len(step) > 1 else ""): ask(
                self.cfg.stages[step[0]].num_cpus, self.cfg.stages[step[0]].num_gpus
            )
            for step in self.cfg.steps
        }
        return {"the reader (read_shards)": ask(_IO_CPUS), **steps, "the writer (write_parts)": ask(_IO_CPUS)}

    def run(self, shards: list[InputShard]) -> dict:
        committed = self.committed()
        todo = [s for s in shards if s.shard_id not in committed]
        self._clear_uncommitted(shards, committed)
        log.info(f"[score] {len(shards)} input shards, {len(committed)} already committed, {len(todo)} to score")
        start = time.monotonic()
        done_rows = 0
        peaks: dict[str, int] = {}  # MiB, per shard committed this run
        io = dict.fromkeys(IO_COLUMNS.values(), 0)  # over the shards committed this run
        memory = self.task_memory() if todo else self.cfg.task_memory_mb * 2**20
        limit_mb, over = math.ceil(memory / 2**20), 0
        watchdog.stage("the score phase", self.requests(memory))
        if todo:
            parts: dict[str, list[dict]] = defaultdict(list)
            sizes: dict[str, int] = {}  # known once the receipt of a shard's last chunk arrives
            next_report = 0.0
            for receipt in _as_they_come(self.build(todo, memory)):
                shard_id = receipt["shard_id"]
                watchdog.beat(f"results of input shard {shard_id} written ({len(committed)}/{len(shards)} committed)")
                parts[shard_id].append(receipt)
                if receipt["shard_size"] is not None:
                    sizes[shard_id] = receipt["shard_size"]
                got = parts[shard_id]
                if shard_id in sizes and sum(r["rows"] for r in got) == sizes[shard_id]:
                    for key in io:
                        io[key] += sum(r[key] for r in got)
                    peak = peaks[shard_id] = self._commit(shard_id, parts.pop(shard_id))
                    over += peak > limit_mb
                    if peak > limit_mb and over <= _MAX_MEMORY_WARNINGS:
                        log.warning(
                            f"[score] warning: a process scoring input shard {shard_id} peaked at {peak} MiB, over "
                            f"the {limit_mb} MiB each requests of Ray (input.task_memory_mb): raise it, or lower "
                            "input.read_chunk_mb or filters.max_pixels"
                            + ("; further shards over it are only counted" if over == _MAX_MEMORY_WARNINGS else "")
                        )
                    committed[shard_id] = {"rows": sizes[shard_id]}
                    done_rows += sizes.pop(shard_id)
                    elapsed = time.monotonic() - start
                    if elapsed >= next_report or len(committed) == len(shards):
                        next_report = elapsed + 10.0
                        log.info(
                            f"[score] committed {len(committed)}/{len(shards)} shards, {done_rows} inputs this run,"
                            f" {done_rows / max(elapsed, 1e-9):.1f} img/s{io_note(io)}"
                        )
            missing = [s.shard_id for s in todo if s.shard_id not in committed]
            if missing:
                raise RuntimeError(f"[score] shards not complete after the pipeline finished: {missing[:5]}")
        elapsed = time.monotonic() - start
        top = max(peaks, key=peaks.__getitem__, default=None)
        summary = {
            "shards": len(shards),
            "inputs_this_run": done_rows,
            "seconds": round(elapsed, 2),
            # over the shards committed this run; None when there were none
            "peak_task_memory_mb": None if top is None else peaks[top],
            "peak_task_memory_shard": top,
            "task_memory_mb": limit_mb,
            "shards_over_task_memory": over,
            **io,  # retried object-store / disk calls and throttling answers of the shards committed this run
        }
        write_json_atomic(
            self.fs, join(self.root, LAYOUT.done("score")), {**summary, "settings_hash": self.results_hash}
        )
        return summary

    def _commit(self, shard_id: str, receipts: list[dict]) -> int:
        """Write the shard's commit record; returns the peak RSS (MiB) of the tasks that handled it."""
        record = {
            "shard_id": shard_id,
            "rows": sum(r["rows"] for r in receipts),
            "kept": sum(r["kept"] for r in receipts),
            "ledger_files": sorted(r["ledger_file"] for r in receipts),
            "scored_files": sorted(r["scored_file"] for r in receipts if r["scored_file"]),
            "results_hash": self.results_hash,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in receipts),
            **{key: sum(r[key] for r in receipts) for key in IO_COLUMNS.values()},
            "metadata_types": merge_all(json.loads(r["metadata_types"]) for r in receipts),
        }
        write_json_atomic(self.fs, self.commit_path(shard_id), record)
        return record["peak_rss_mb"]
