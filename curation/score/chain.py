"""The processes of the score chain (``curation.score.phase`` builds and runs it): the stage runners Ray Data
calls, the reader of input shards, the writer of each shard's parts, their telemetry, and the same chain run in
one process (``score_in_process``) for tests and benchmarks.

Telemetry rides in the batches as columns whose names start with ``_`` (``PEAK_RSS``, ``IO_COLUMNS``): a Ray Data
process has no other channel to the driver than the rows it returns. The writer turns them into each part's receipt
and drops them, so no scored or ledger file ever holds one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import resource
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common import schema
from common.layout import LAYOUT
from common.storage import (
    io_counts,
    join,
    redact,
    resolve,
    retry_io,
    retry_io_stream,
    write_parquet_atomic,
)
from curation.config import CurateConfig, config_from_json
from curation.score.inputs import InputShard
from curation.score.metadata import metadata_types
from curation.score.reader import ShardReader
from curation.score.stage_runner import StageRunner
from curation.stages import stage_classes

log = logging.getLogger(__name__)


def stage_runner(stage_name: str, cfg: CurateConfig) -> StageRunner:
    """The runner of the stage a config names, its models set up."""
    return StageRunner(stage_classes()[stage_name], cfg)


@functools.cache
def task_runner(stage_name: str, cfg_json: str) -> StageRunner:
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


def named_task(stage_name: str) -> Callable[..., pa.Table]:
    """A task function named after its stage, so Ray Data's progress shows stage names."""

    def run(table: pa.Table, cfg_json: str) -> pa.Table:
        _reset_peak_rss()
        return _raise_peak(task_runner(stage_name, cfg_json)(table))

    run.__name__ = run.__qualname__ = stage_name
    return run


class _MeasuredRunner(StageRunner):
    """An actor stage's runner that raises its rows' peak RSS to the actor's over the call (its models included)."""

    def __call__(self, table: pa.Table) -> pa.Table:
        _reset_peak_rss()
        return _raise_peak(super().__call__(table))


def named_actor(stage_name: str) -> type[StageRunner]:
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


def named_fused_actor(group: tuple[str, ...]) -> type[_FusedRunner]:
    return type("+".join(group), (_FusedRunner,), {"__module__": __name__})


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


def read_shards(batch: pa.Table, cfg_json: str, input_uri: str) -> Iterator[pa.Table]:
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


def finalise(table: pa.Table) -> pa.Table:
    """Rows still pending after the last stage are kept."""
    status = pc.if_else(pc.equal(table.column("status"), schema.PENDING), schema.KEPT, table.column("status"))
    return table.set_column(table.schema.get_field_index("status"), "status", status)


def write_parts(batch: pa.Table, out_uri: str, cfg_json: str, results_hash: str) -> pa.Table:
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


def split_images(scored: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Scored rows as a scored part (its image bytes null, their paths kept) and the part's image file (``source``
    and ``image``, row for row): the write phase deletes the image files once the final shards hold the kept images,
    and the scored parts stay as they are (``curation.phases.write.shards.drop_scored_bytes``)."""
    at = scored.schema.get_field_index("image")
    image = scored.column(at).combine_chunks()
    paths = image.field("path")
    bare = pa.StructArray.from_arrays([pa.nulls(len(paths), pa.binary()), paths], fields=list(schema.IMAGE_TYPE))
    images = scored.select(["source", "image"]).replace_schema_metadata(None)
    return scored.set_column(at, scored.schema.field(at), bare), images


def scored_target(cfg: CurateConfig, results_hash: str) -> pa.Schema:
    """The schema scored parts are written with."""
    return schema.with_metadata(
        schema.scored_schema(cfg.embedding_dim),
        table="scored",
        config_hash=results_hash,
        extra={"embedding_model": cfg.models.embedding.name, "embedding_dim": cfg.embedding_dim},
    )


def write_scored(fs, root: str, scored_file: str, rows: pa.Table, cfg: CurateConfig, results_hash: str) -> None:
    """Kept rows (any superset of the scored columns) as the scored part ``scored_file`` and its image file."""
    target = scored_target(cfg, results_hash)
    scored, images = split_images(rows.select(target.names).cast(target))
    for path, table in ((LAYOUT.images_of(scored_file), images), (scored_file, scored)):
        write_parquet_atomic(
            fs, join(root, path), table, row_group_size=cfg.output.row_group_size, compression=cfg.output.compression
        )


def _write_parts_once(batch: pa.Table, out_uri: str, cfg: CurateConfig, results_hash: str) -> pa.Table:
    fs, root = resolve(out_uri)
    batch = finalise(batch)
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
            write_scored(fs, root, scored_file, kept, cfg, results_hash)
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
        tables.append(finalise(table))
    return pa.concat_tables(tables)
