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

import functools
import hashlib
import json
import logging
import math
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import NotRequired, TypedDict, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import ray
from ray.data import ActorPoolStrategy

from common import schema, watchdog
from common.layout import LAYOUT
from common.storage import (
    delete_quietly,
    exists,
    io_counts,
    join,
    redact,
    remove_temporaries,
    resolve,
    retry_io,
    retry_io_stream,
    write_json_atomic,
    write_parquet_atomic,
)
from curation.config import CurateConfig, config_from_json
from curation.records import read_commits, read_run_record, run_record
from curation.score.inputs import InputShard
from curation.score.metadata import merge_all, metadata_types
from curation.score.reader import ShardReader
from curation.score.stage import StageRunner
from curation.stages import stage_classes

log = logging.getLogger(__name__)


def stage_runner(stage_name: str, cfg: CurateConfig) -> StageRunner:
    """The runner of the stage a config names, its models set up."""
    return StageRunner(stage_classes()[stage_name], cfg)


@functools.cache
def _task_runner(stage_name: str, cfg_json: str) -> StageRunner:
    """Task stages are set up once per worker process, like an actor's setup()."""
    return stage_runner(stage_name, config_from_json(cfg_json))


# A column the score chain hands on with the rows: the highest peak RSS (KiB) of the processes that handled the row so
# far. The writer drops it (it selects the schemas' columns).
PEAK_RSS = "_peak_rss_kib"


def _reset_peak_rss() -> None:
    """Start this process's peak RSS afresh, so that a task's peak is its own and not an earlier task's in the same
    (reused) Ray worker. Linux only (/proc/self/clear_refs); elsewhere the peak stays the process's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_kib() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


def _raise_peak(table: pa.Table) -> pa.Table:
    """``table`` with its rows' peak RSS raised to this process's."""
    peak = _peak_rss_kib()
    if PEAK_RSS not in table.schema.names:
        return table.append_column(PEAK_RSS, pa.array(np.full(table.num_rows, peak, np.int64)))
    i = table.schema.get_field_index(PEAK_RSS)
    return table.set_column(i, PEAK_RSS, pc.max_element_wise(table.column(i), pa.scalar(peak, pa.int64())))


def _mib(kib: int) -> int:
    return math.ceil(kib / 1024)


def _named_task(stage_name: str) -> Callable[..., pa.Table]:
    """A task function named after its stage, so Ray Data's progress shows stage names."""

    def run(table: pa.Table, cfg_json: str) -> pa.Table:
        _reset_peak_rss()
        return _raise_peak(_task_runner(stage_name, cfg_json)(table))

    run.__name__ = run.__qualname__ = stage_name
    return run


class _MeasuredRunner(StageRunner):
    """An actor stage's runner that raises its rows' peak RSS to the actor's over the call (its models included)."""

    def __call__(self, table: pa.Table) -> pa.Table:
        _reset_peak_rss()
        return _raise_peak(super().__call__(table))


def _named_actor(stage_name: str) -> type[StageRunner]:
    return type(stage_name, (_MeasuredRunner,), {"__module__": __name__})


class _FusedRunner:
    """A fused run's actor (``fused`` in the config): the stages' runners, called in turn on each batch."""

    def __init__(self, stage_classes: list[type], cfg: CurateConfig):
        self.runners = [StageRunner(stage_class, cfg) for stage_class in stage_classes]

    def __call__(self, table: pa.Table) -> pa.Table:
        _reset_peak_rss()
        for runner in self.runners:
            table = runner(table)
        return _raise_peak(table)


def _named_fused_actor(step: tuple[str, ...]) -> type[_FusedRunner]:
    return type("+".join(step), (_FusedRunner,), {"__module__": __name__})


def _shard_reader(cfg: CurateConfig, input_uri: str) -> ShardReader:
    return ShardReader(input_uri, cfg.input, cfg.embedding_dim, cfg.filters.max_file_bytes)


# Columns the score chain hands on with the rows, like PEAK_RSS: the retried I/O calls and throttling answers of reading
# them, each counted on one row (the chunk's first), so that a shard's rows add up to its read's counts.
IO_COLUMNS = {"_io_retries": "io_retries", "_io_throttles": "io_throttles"}


def _counted_chunks(chunks: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """``chunks`` with the I/O counts of making each (this process's, while the reader ran: stages fused into the
    same task count their own) on its first row; a chunk without rows hands them on to the next."""
    pending = dict.fromkeys(IO_COLUMNS.values(), 0)
    while True:
        before = io_counts()
        chunk = next(chunks, None)
        after = io_counts()
        if chunk is None:
            return
        for key in pending:
            pending[key] += after[key] - before[key]
        for column, key in IO_COLUMNS.items():
            values = np.zeros(chunk.num_rows, np.int64)
            if chunk.num_rows:
                values[0], pending[key] = pending[key], 0
            chunk = chunk.append_column(column, pa.array(values))
        yield chunk


def io_note(counts: dict) -> str:
    """The console's words for a phase's I/O retries and throttling answers; empty when there were none."""
    retries, throttles = counts.get("io_retries", 0), counts.get("io_throttles", 0)
    return f"; {retries} I/O retries ({throttles} throttled by the store)" if retries or throttles else ""


def _read_shards(batch: pa.Table, cfg_json: str, input_uri: str) -> Iterator[pa.Table]:
    """Stream each input shard in chunks (a generator: Ray Data never holds a whole shard in one block)."""
    cfg = config_from_json(cfg_json)
    reader = _shard_reader(cfg, input_uri)
    policy = cfg.ray.io_retry_policy()
    for row in batch.to_pylist():
        shard = InputShard.from_row(row)
        _reset_peak_rss()
        first = reader.name(shard.paths[0]) if shard.paths else "no files"
        what = f"reading input shard {shard.shard_id} ({first}{' and more' if len(shard.paths) > 1 else ''})"
        for chunk in _counted_chunks(retry_io_stream(functools.partial(reader.read, shard), policy, what)):
            yield _raise_peak(chunk)


def _finalise(table: pa.Table) -> pa.Table:
    """Rows still pending after the last stage are kept."""
    status = pc.if_else(pc.equal(table.column("status"), schema.PENDING), schema.KEPT, table.column("status"))
    return table.set_column(table.schema.get_field_index("status"), "status", status)


def _write_parts(batch: pa.Table, out_uri: str, cfg_json: str, results_hash: str) -> pa.Table:
    """Write the batch's rows as one ledger part (and one scored part) per input shard; return receipts. Each write
    is atomic and named by its content, so one retried after an I/O error leaves what one try would."""
    _reset_peak_rss()
    cfg = config_from_json(cfg_json)
    seen = io_counts()
    shards = sorted(set(batch.column("shard_id").to_pylist()))
    what = f"writing the results of input shard(s) {', '.join(shards[:3])}{' ...' if len(shards) > 3 else ''}"
    receipts = retry_io(
        lambda: _write_parts_once(batch, out_uri, cfg, results_hash),
        cfg.ray.io_retry_policy(),
        f"{what} to {redact(out_uri)}",
    )
    now = io_counts()
    for key in IO_COLUMNS.values():  # the writes' own counts go on the batch's first receipt
        extra = np.zeros(receipts.num_rows, np.int64)
        extra[:1] = now[key] - seen[key]
        receipts = receipts.set_column(receipts.schema.get_field_index(key), key, pc.add(receipts.column(key), extra))
    return receipts


def _write_parts_once(batch: pa.Table, out_uri: str, cfg: CurateConfig, results_hash: str) -> pa.Table:
    fs, root = resolve(out_uri)
    batch = _finalise(batch)
    scored_schema = schema.with_metadata(
        schema.scored_schema(cfg.embedding_dim),
        table="scored",
        config_hash=results_hash,
        extra={"embedding_model": cfg.models.embedding.name, "embedding_dim": cfg.embedding_dim},
    )
    ledger_schema = schema.with_metadata(schema.ledger_schema(), table="ledger", config_hash=results_hash)
    receipts = []
    peaks = []  # per receipt: the highest peak of the tasks before this one that handled the shard's rows here
    for shard_id in sorted(set(batch.column("shard_id").to_pylist())):
        rows = batch.filter(pc.equal(batch.column("shard_id"), shard_id))
        sources = sorted(rows.column("source").to_pylist())
        part = "part-" + hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16] + ".parquet"
        ledger_file = f"{LAYOUT.ledger}/{shard_id}/{part}"
        write_parquet_atomic(
            fs,
            join(root, ledger_file),
            rows.select(ledger_schema.names).cast(ledger_schema),
            row_group_size=cfg.output.ledger_row_group_size,
            compression=cfg.output.compression,
        )
        kept = rows.filter(pc.equal(rows.column("status"), schema.KEPT))
        scored_file = None
        if kept.num_rows:
            scored_file = f"{LAYOUT.scored}/{shard_id}/{part}"
            write_parquet_atomic(
                fs,
                join(root, scored_file),
                kept.select(scored_schema.names).cast(scored_schema),
                row_group_size=cfg.output.row_group_size,
                compression=cfg.output.compression,
            )
        receipts.append(
            {
                "shard_id": shard_id,
                "shard_size": pc.max(rows.column("shard_size")).as_py(),  # null unless the shard's last chunk is here
                "rows": rows.num_rows,
                "kept": kept.num_rows,
                "ledger_file": ledger_file,  # relative to the output root
                "scored_file": scored_file,
                **{key: _column_sum(rows, column) for column, key in IO_COLUMNS.items()},
                # which JSON types each metadata field of the kept rows took: the write phase types the columns
                # (JSON text: a dict column of changing keys would not stay one Arrow type across receipts)
                "metadata_types": json.dumps(metadata_types(kept.column("metadata_json").to_pylist())),
            }
        )
        before = pc.max(rows.column(PEAK_RSS)).as_py() if PEAK_RSS in rows.schema.names else None
        peaks.append(before or 0)
    mine = _peak_rss_kib()  # after every write of the batch
    for receipt, peak in zip(receipts, peaks):
        receipt["peak_rss_mb"] = _mib(max(peak, mine))
    return pa.Table.from_pylist(receipts)


def _column_sum(table: pa.Table, column: str) -> int:
    return int(pc.sum(table.column(column)).as_py() or 0) if column in table.schema.names else 0


def score_in_process(cfg: CurateConfig, shards: list[InputShard], input_uri: str) -> pa.Table:
    """The same stages in this process, batch by batch, without Ray: the baseline benchmarks compare against."""
    runners = [(stage_runner(name, cfg), cfg.stages[name].batch_size) for name in cfg.enabled_stages]
    reader = _shard_reader(cfg, input_uri)
    tables = []
    for shard in shards:
        table = reader.read_table(shard)
        for runner, size in runners:
            table = pa.concat_tables([runner(table.slice(i, size)) for i in range(0, table.num_rows, size)])
        tables.append(_finalise(table))
    return pa.concat_tables(tables)


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
            _read_shards,  # type: ignore[arg-type]  # Ray types fn as taking the batch alone; fn_kwargs gives the rest
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
                ds = ds.map_batches(_named_task(step[0]), fn_kwargs={"cfg_json": cfg_json}, **common)
                continue
            runner, kwargs = (
                (_named_actor(step[0]), {"stage_class": stage_classes()[step[0]], "cfg": self.cfg})
                if len(step) == 1
                else (_named_fused_actor(step), {"stage_classes": [stage_classes()[n] for n in step], "cfg": self.cfg})
            )
            ds = ds.map_batches(
                runner,
                fn_constructor_kwargs=kwargs,
                compute=ActorPoolStrategy(min_size=actors[0], max_size=actors[1]),
                **common,
            )
        return ds.map_batches(
            _write_parts,  # type: ignore[arg-type]  # Ray types fn as taking the batch alone; fn_kwargs gives the rest
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
        return {"the reader (_read_shards)": ask(_IO_CPUS), **steps, "the writer (_write_parts)": ask(_IO_CPUS)}

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
