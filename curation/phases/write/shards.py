"""Phase 4, "write", as Ray tasks: the final curated shards and the final ledger from partitioned decisions.

Inputs, all on the output store: the committed phase-1 files (scored and ledger parts per input shard), the dedup
decisions (``dedup/decisions/part-<i>.parquet``: the dropped survivors of survivor partition ``i``) and the sample
decisions (``sample/decisions/part-<i>.parquet``: every dedup survivor of partition ``i`` with its cluster ids and
whether it was selected). Partition ``i`` covers a contiguous run of input shards (``curation.phases.survivors``).

- Final shards: the selected images in global (shard_id, source) order, ``write.rows_per_shard`` per shard. The
  driver reads one count per partition, cuts the global order into output shards and gives each output shard's
  task the slices of the partitions it spans; the task reads those slices and its input shards' scored files.
- Final ledger: one task per run of input shards (about ``write.ledger_rows_per_task`` inputs) applies the
  decisions of its shards to their phase-1 ledger rows, by position within each shard (rows sorted by source), and
  writes one file per input shard; it returns its part of the funnel.
- Each image's bytes once: phase 1 keeps a scored part's image bytes in a file of their own
  (``scored_images/``, ``LAYOUT.images_of``), and after the manifest's switch ``drop_bytes`` deletes those files
  (one task per run of input shards); the scored parts, without bytes from the start, stay as they are. An output
  scored before the image files keeps its bytes in the scored parts: those are rewritten without them (a file's
  Parquet statistics say whether it still holds any). The shard tasks of a later write (``--phases write`` with
  other settings) read the bytes the output no longer holds from the pool, by ``source``, a container at a time,
  and check each against its key (``with_originals``): a changed or missing pool stops the phase naming the image,
  before anything is switched. Why keep the bytes until the switch: the first write would otherwise stream every
  input shard of the pool again (a tar is read whole to pick out its survivors) and could not run without the
  pool; a rerun that must re-read them is the rare case. Why files of their own: a rewrite of the scored parts
  reads and writes every other column (~5 KB a survivor, ~7.5 TB at 1.5e9 survivors); a delete moves nothing.
- Four steps of the phase's ``StepRunner`` (``curation.steps.runner``): ``selected`` (the counts), ``shards``,
  ``ledger`` and ``drop_bytes``; each unit's receipt is recorded, so a killed write phase redoes only the units it
  had not finished. Files are named by their content (``<stem>-<sha256 prefix>``), so a rerun writes the same names
  and bytes, and the manifest, written before ``drop_bytes``, is the one switch.

Sizes at 1B survivors: the driver holds one count per partition (10^4 at 10^5 rows per partition) and one entry
per output shard (10^6 at 1000 rows per shard: the manifest lists them anyway); a shard task holds 1000 images; a
ledger task ``write.ledger_rows_per_task`` ledger rows.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Sequence
from hashlib import sha256
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common import schema
from common.config import hash_json_each
from common.console import plural
from common.layout import LAYOUT
from common.storage import (
    delete_quietly,
    encode_parquet,
    exists,
    join,
    open_parquet,
    redact,
    resolve,
    write_bytes_atomic,
)
from curation.config import CurateConfig, config_from_json
from curation.phases.write.takedown import Takedowns, applied_takedowns
from curation.records import read_done
from curation.score.ledger import funnel_of, read_part
from curation.score.metadata import merge_all, split_metadata
from curation.score.originals import OriginalsMissing, SourceReader
from curation.steps.runner import StepRunner, TaskStep

log = logging.getLogger(__name__)


def write_named_by_content(fs, root: str, folder: str, stem: str, table: pa.Table, **encoding: Any) -> dict:
    """Write ``table`` as ``<folder>/<stem>-<sha256 prefix>.parquet`` (``encoding``: ``encode_parquet``'s options);
    returns its manifest entry."""
    data = encode_parquet(table, **encoding)
    digest = sha256(data).hexdigest()
    name = f"{stem}-{digest[:16]}.parquet"
    write_bytes_atomic(fs, join(root, folder, name), data)
    return {"file": name, "rows": table.num_rows, "bytes": len(data), "sha256": digest}


def _read_if_exists(fs, root: str, path: str, columns: list[str] | None = None) -> pa.Table | None:
    full = join(root, path)
    return pq.read_table(full, columns=columns, filesystem=fs) if exists(fs, full) else None


# --- final shards -------------------------------------------------------------------------------------------------------

SHARD_ORDER = ["shard_id", "source"]  # the final shards' row order


def shard_encoding(cfg: CurateConfig) -> dict[str, Any]:
    """How the final shards are encoded. Their row groups are small (``output.shard_row_group_size``, for training
    reads), and per row group and column, zstd's set-up, a dictionary and statistics cost more than the data they
    encode: ``output.shard_compression`` (snappy), no dictionaries, and statistics only on the row order, the one
    thing a reader can skip row groups by (``benchmarks/RESULTS.md``, "Bytes once, and the write phase's encoding")."""
    return {
        "row_group_size": cfg.output.shard_row_group_size,
        "compression": cfg.output.shard_compression,
        "use_dictionary": False,
        "write_statistics": SHARD_ORDER,
    }


def plan_output_shards(selected: list[int], rows_per_shard: int) -> list[list[tuple[int, int, int]]]:
    """Cut the global order of selected rows into output shards: per shard, (partition, start, stop) slices of the
    partitions' selected rows."""
    offsets = np.concatenate([[0], np.cumsum(selected)]).astype(np.int64)
    total = int(offsets[-1])
    plan = []
    for lo in range(0, total, rows_per_shard):
        hi = min(lo + rows_per_shard, total)
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        pieces = []
        for p in range(first, len(selected)):
            if offsets[p] >= hi:
                break
            start, stop = max(lo, offsets[p]) - offsets[p], min(hi, offsets[p + 1]) - offsets[p]
            if stop > start:
                pieces.append((p, int(start), int(stop)))
        plan.append(pieces)
    return plan


@ray.remote(num_cpus=0.25)
def _count_selected(out_uri: str, path: str) -> dict:
    fs, root = resolve(out_uri)
    table = _read_if_exists(fs, root, path, ["selected"])
    return {"selected": 0 if table is None else int(pc.sum(table.column("selected")).as_py() or 0)}


def final_shard_schema(cfg: CurateConfig, metadata_fields: dict[str, str] | None = None) -> pa.Schema:
    """The final shards' schema with their file metadata: ours, and the features ``datasets`` reads (the image
    column an ``Image``), so ``load_dataset("parquet", ...)`` decodes images with no cast. ``metadata_fields``: the
    pool's metadata fields typed in this run (the manifest's ``metadata_fields``)."""
    dim = cfg.embedding_dim if cfg.write.include_embedding else None
    target = schema.with_metadata(
        schema.curated_schema(dim, metadata_fields),
        table="curated",
        config_hash=cfg.results_hash(),
        extra={"embedding_model": cfg.models.embedding.name, "embedding_dim": cfg.embedding_dim},
    )
    return target.with_metadata({**target.metadata, **schema.hf_metadata(target)})


@ray.remote(num_cpus=0.5)
def _write_output_shards(
    out_uri: str,
    first: int,
    plan: list[list[tuple[int, int, int]]],
    scored_files: dict[str, list[str]],
    cfg_json: str,
    target: pa.Schema,
    takedowns: Takedowns,
    originals: SourceReader,
) -> dict:
    """Output shards ``first, first + 1, ...`` (``plan`` gives each one's slices of the partitions' selected rows):
    the selected rows in uid (= shard_id, source) order, with their cluster ids, written with ``target``; images a
    recorded takedown lists are left out. Bytes the scored files no longer hold are read from the pool."""
    cfg = config_from_json(cfg_json)
    fs, root = resolve(out_uri)

    def selected_of(partition: int) -> pa.Table:
        t = pq.read_table(
            join(root, LAYOUT.sample_decision(partition)),
            columns=["uid", "source", "shard_id", "cluster_ids", "selected"],
            filesystem=fs,
        )
        return t.filter(t.column("selected"))

    # the scored files have all but the cluster ids and the typed metadata (made here from their metadata_json)
    columns = [n for n in target.names if n not in ("cluster_ids", "metadata")]
    typed = (
        {f.name: _METADATA_KIND[f.type] for f in target.field("metadata").type} if "metadata" in target.names else {}
    )

    def scored_of(shard_id: str) -> pa.Table:
        return pa.concat_tables([read_part(fs, join(root, f), columns, target) for f in scored_files[shard_id]])

    # the output shards walk the partitions and input shards in increasing order: each file is read once, one held
    selected, scored = functools.lru_cache(maxsize=1)(selected_of), functools.lru_cache(maxsize=1)(scored_of)
    shards = []
    for k, pieces in enumerate(plan, start=first):
        wanted = pa.concat_tables([selected(p).slice(start, stop - start) for p, start, stop in pieces])
        rows = []
        for shard_id in sorted(set(wanted.column("shard_id").to_pylist())):
            table = scored(shard_id)
            mine = wanted.filter(pc.equal(wanted.column("shard_id"), shard_id))
            at = pc.index_in(mine.column("source"), value_set=table.column("source"))  # mine is in source order
            if at.null_count:
                raise RuntimeError(
                    f"input shard {shard_id}: {at.null_count} selected images are not in its scored "
                    "files (the output was changed by hand?); rerun with --phases score,dedup,sample,write"
                )
            picked = takedowns.without(table.take(at).append_column("cluster_ids", mine.column("cluster_ids")))
            rows.append(with_originals(picked, originals, shard_id))  # a taken-down image is never read again
        table = with_typed_metadata(pa.concat_tables(rows), typed).select(target.names).cast(target)
        shards.append(write_named_by_content(fs, root, LAYOUT.shards, f"part-{k:05d}", table, **shard_encoding(cfg)))
    return {"shards": shards}


def with_originals(table: pa.Table, originals: SourceReader, shard_id: str) -> pa.Table:
    """Scored rows with the image bytes an earlier write dropped (``drop_scored_bytes``) read again from the pool,
    each checked against its key; raises ``OriginalsMissing`` naming what cannot be."""
    image = table.column("image").combine_chunks()
    data = image.field("bytes")
    if not data.null_count:
        return table
    missing = pc.is_null(data)
    wanted = table.filter(missing).select(["source", "key"]).to_pylist()
    found, problems = originals.read_verified({r["source"]: r["key"] for r in wanted})
    if problems:
        source, why = next(iter(problems.items()))
        raise OriginalsMissing(
            f"input shard {shard_id}: {len(problems)} images to write are not in the output (the scored files keep no "
            f"image bytes once the final shards are written) and cannot be read again from the pool "
            f"{redact(originals.pool or '')}: {source}: {why}. Put the pool back as it was curated, or curate it "
            "again (--new-run)"
        )
    refilled = pa.array([found[s] for s in table.column("source").filter(missing).to_pylist()], pa.binary())
    filled = pc.replace_with_mask(data, missing, refilled)
    image = pa.StructArray.from_arrays([filled, image.field("path")], fields=list(schema.IMAGE_TYPE))
    return table.set_column(table.schema.get_field_index("image"), table.schema.field("image"), image)


_METADATA_KIND = {t: kind for kind, t in schema.METADATA_TYPES.items()}


def with_typed_metadata(table: pa.Table, typed: dict[str, str]) -> pa.Table:
    """Rows whose ``metadata_json`` holds all their metadata, with the ``typed`` fields moved into ``metadata``."""
    struct, rest = split_metadata(table.column("metadata_json").to_pylist(), typed)
    table = table.set_column(
        table.schema.get_field_index("metadata_json"), "metadata_json", pa.array(rest, pa.string())
    )
    return table if struct is None else table.append_column("metadata", struct)


# --- final ledger -------------------------------------------------------------------------------------------------------


def _reason_of_list(values: pa.ChunkedArray) -> pa.ChunkedArray:
    """A list<int32> column as Python prints lists ("[3, 1]")."""
    text = pc.binary_join(pc.cast(values, pa.list_(pa.string())), ", ")
    return pc.binary_join_element_wise("[", text, "]", "")


def apply_decisions(ledger: pa.Table, dups: pa.Table | None, sample: pa.Table | None) -> pa.Table:
    """One input shard's phase-1 ledger with the dedup and sample fates applied (rows sorted by source)."""
    ledger = ledger.take(pc.sort_indices(ledger, [("source", "ascending")]))
    kept = pc.equal(ledger.column("status"), schema.KEPT)
    status, stage, reason = ledger.column("status"), ledger.column("stage"), ledger.column("reason")
    dup_of, dup_signal, clusters = (
        ledger.column("duplicate_of"),
        ledger.column("duplicate_signal"),
        ledger.column("cluster_ids"),
    )
    if sample is not None and sample.num_rows:
        at = pc.index_in(ledger.column("source"), value_set=sample.column("source"))
        clusters = pc.if_else(pc.and_(kept, pc.is_valid(at)), sample.column("cluster_ids").take(at), clusters)
        unsampled = pc.and_(kept, pc.invert(pc.fill_null(sample.column("selected").take(at), True)))
        written = pc.and_(kept, pc.invert(unsampled))
        status = pc.if_else(unsampled, schema.UNSAMPLED, status)
        stage = pc.if_else(unsampled, "sample", pc.if_else(written, "write", stage))
        unsampled_reason = pc.binary_join_element_wise(
            "unsampled: cluster ", _reason_of_list(clusters), " was over its share of the target", ""
        )
        reason = pc.if_else(unsampled, unsampled_reason, reason)
    else:
        stage = pc.if_else(kept, "write", stage)
    if dups is not None and dups.num_rows:
        at = pc.index_in(ledger.column("source"), value_set=dups.column("source"))
        dropped = pc.and_(kept, pc.is_valid(at))
        of, signal = dups.column("duplicate_of").take(at), dups.column("duplicate_signal").take(at)
        status = pc.if_else(dropped, schema.DUPLICATE, status)
        stage = pc.if_else(dropped, "dedup", stage)
        dup_of = pc.if_else(dropped, of, dup_of)
        dup_signal = pc.if_else(dropped, signal, dup_signal)
        clusters = pc.if_else(dropped, pa.nulls(ledger.num_rows, clusters.type), clusters)
        dup_reason = pc.binary_join_element_wise("duplicate: near-duplicate of ", of, " by ", signal, "")
        reason = pc.if_else(dropped, dup_reason, reason)
    for name, values in (
        ("status", status),
        ("stage", stage),
        ("reason", reason),
        ("duplicate_of", dup_of),
        ("duplicate_signal", dup_signal),
        ("cluster_ids", clusters),
    ):
        ledger = ledger.set_column(ledger.schema.get_field_index(name), ledger.schema.field(name), values)
    return ledger


@ray.remote(num_cpus=0.5)
def _write_ledger_group(
    out_uri: str, shards: list[tuple[str, list[str], int | None]], cfg_json: str, takedowns: Takedowns
) -> dict:
    """Final-ledger files for a run of input shards: (shard_id, ledger files, survivor partition or None)."""
    cfg = config_from_json(cfg_json)
    fs, root = resolve(out_uri)
    target = schema.with_metadata(schema.ledger_schema(), table="final_ledger", config_hash=cfg.results_hash())
    decisions: dict[int, tuple[pa.Table | None, pa.Table | None]] = {}
    files: list[dict] = []
    funnel: Counter[str] = Counter()
    for shard_id, ledger_files, partition in shards:
        if partition is not None and partition not in decisions:
            decisions[partition] = (
                _read_if_exists(
                    fs,
                    root,
                    LAYOUT.dedup_decision(partition),
                    ["source", "shard_id", "duplicate_of", "duplicate_signal"],
                ),
                _read_if_exists(
                    fs, root, LAYOUT.sample_decision(partition), ["source", "shard_id", "cluster_ids", "selected"]
                ),
            )
        dups, sample = decisions[partition] if partition is not None else (None, None)

        def of_shard(t: pa.Table | None, shard_id: str = shard_id) -> pa.Table | None:
            return None if t is None else t.filter(pc.equal(t.column("shard_id"), shard_id))

        parts = schema.ledger_schema()
        ledger = pa.concat_tables([read_part(fs, join(root, f), parts.names, parts) for f in ledger_files])
        table = apply_decisions(ledger.cast(parts), of_shard(dups), of_shard(sample))
        table = takedowns.mark(table).cast(target)
        funnel.update(funnel_of(table))
        files.append(
            {
                **write_named_by_content(
                    fs,
                    root,
                    LAYOUT.final_ledger,
                    shard_id,
                    table,
                    row_group_size=cfg.output.ledger_row_group_size,
                    compression=cfg.output.compression,
                ),
                "shard_id": shard_id,
            }
        )
    return {"files": files, "funnel": dict(funnel)}


# --- the phase ----------------------------------------------------------------------------------------------------------


class _Selected(TaskStep):
    """How many images each survivor partition's sample decisions select: what cuts the global order into shards."""

    name, unit_name, task = "selected", "partitions", _count_selected

    def __init__(self, out_uri: str, records: dict[str, dict], partitions: int):
        # own: the commit records decided on, so that scoring more shards, or again, redoes the phase
        super().__init__(
            {f"part-{i:06d}": (out_uri, LAYOUT.sample_decision(i)) for i in range(partitions)},
            hash_json_each(sorted(records.items())),
        )

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {"selected": [r["selected"] for r in receipts]}


class _Shards(TaskStep):
    """The final shards: one unit per survivor partition, the output shards that start in it (they read its
    decisions and a little of the next's)."""

    name, unit_name, task = "shards", "partitions", _write_output_shards

    def __init__(self, plan: list, scored: dict[int, dict[str, list[str]]], out_uri: str, *args: Any):
        starts: dict[int, list[int]] = {}
        for k, pieces in enumerate(plan):
            starts.setdefault(pieces[0][0], []).append(k)
        calls = {
            f"part-{partition:06d}": (
                out_uri,
                ks[0],
                plan[ks[0] : ks[-1] + 1],
                {s: files for k in ks for p, _, _ in plan[k] for s, files in scored[p].items()},
                *args,  # cfg_json, target, takedowns, originals: the same for every unit
            )
            for partition, ks in starts.items()
        }
        takedowns: Takedowns = args[2]
        super().__init__(calls, [reason for _, reason in takedowns.lists])  # a takedown since: its images left out

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {"shards": [shard for r in receipts for shard in r["shards"]]}


def shard_groups(records: dict[str, dict], rows_per_task: int) -> dict[str, list[str]]:
    """Runs of input shards in shard order, each of about ``rows_per_task`` inputs: the units of a task per run."""
    groups: dict[str, list[str]] = {}
    group, rows = [], 0
    for n, shard_id in enumerate(sorted(records), start=1):
        group.append(shard_id)
        rows += records[shard_id]["rows"]
        if rows >= rows_per_task or n == len(records):
            groups[f"group-{len(groups):07d}"] = group
            group, rows = [], 0
    return groups


class _Ledger(TaskStep):
    """The final ledger: one unit per run of input shards of about ``write.ledger_rows_per_task`` inputs."""

    name, unit_name, task = "ledger", "tasks", _write_ledger_group

    def __init__(self, records: dict[str, dict], partition_of: dict[str, int], rows_per_task: int, *args: Any):
        calls = {  # args: out_uri, cfg_json, takedowns
            unit: (args[0], [(s, records[s]["ledger_files"], partition_of.get(s)) for s in group], *args[1:])
            for unit, group in shard_groups(records, rows_per_task).items()
        }
        super().__init__(calls)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        funnel: Counter = Counter()
        for receipt in receipts:
            funnel.update(receipt["funnel"])
        return {"files": [f for r in receipts for f in r["files"]], "funnel": dict(sorted(funnel.items()))}


def _safety(cfg: CurateConfig) -> list[dict]:
    """What the dataset card says of each safety filter that ran: the stage, the reason code it rejects with, its
    model, licence, weights and threshold (the ``filters`` key and its value; None: scored without rejecting)."""

    def weights(ref: object) -> dict:  # a models.* reference: a ModelRef or a bare name
        return {"weights": getattr(ref, "ref", ref), "pinned": bool(getattr(ref, "sha256", None))}

    entries = []
    if "nsfw" in cfg.enabled_stages:
        m = cfg.models.nsfw
        entries.append(
            {
                "stage": "nsfw",
                "reason": "nsfw",
                "model": m.model,
                "licence": m.licence,
                **weights(m.caffemodel),
                "setting": "filters.nsfw_max_score",
                "max_score": cfg.filters.nsfw_max_score,
            }
        )
    c = cfg.models.clip
    if "clip" in cfg.enabled_stages and c.nsfw_head is not None:
        entries.append(
            {
                "stage": "clip",
                "reason": "nsfw",
                "model": c.nsfw_model,
                "licence": c.nsfw_licence,
                **weights(c.nsfw_head),
                "setting": "filters.clip_nsfw_max_score",
                "max_score": cfg.filters.clip_nsfw_max_score,
            }
        )
    return entries


def _dedup_summary(out) -> dict:
    """The link rule the dedup phase used, its chance estimate and what it dropped (its done record)."""
    if not out.exists(LAYOUT.done("dedup")):
        return {}
    dedup = read_done(out.fs, out.root, "dedup")
    return {"chance": dedup.get("chance"), "components": dedup.get("components")}


def write_phase(
    runner: StepRunner,
    cfg: CurateConfig,
    records: dict[str, dict],
    partition_of: dict[str, int],
    partitions: int,
    originals: SourceReader,
) -> dict:
    """Write the final shards and final ledger as ``runner``'s steps; returns the manifest (not yet switched to: the
    caller writes it). ``originals`` reads the bytes the scored files no longer hold from the pool."""
    out, cfg_json = runner.output, cfg.model_dump_json()
    metadata_fields = schema.typed_metadata_fields(merge_all(r.get("metadata_types") or {} for r in records.values()))
    target = final_shard_schema(cfg, metadata_fields)  # once per run: every shard task gets the same schema
    takedowns = applied_takedowns(out.fs, out.root)  # images taken down stay down when the shards are written again
    scored: dict[int, dict[str, list[str]]] = {}
    for shard_id, partition in partition_of.items():
        scored.setdefault(partition, {})[shard_id] = records[shard_id]["scored_files"]
    plan = plan_output_shards(runner.run(_Selected(out.uri, records, partitions))["selected"], cfg.write.rows_per_shard)
    shards = runner.run(_Shards(plan, scored, out.uri, cfg_json, target, takedowns, originals))["shards"]
    ledger = runner.run(_Ledger(records, partition_of, cfg.write.ledger_rows_per_task, out.uri, cfg_json, takedowns))
    log.info(f"[write] {plural(len(shards), 'final shard')}; the final ledger of {plural(len(records), 'input shard')}")
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "config_hash": cfg.results_hash(),
        "settings_hash": runner.phase_fingerprint,
        "embedding_model": cfg.models.embedding.name,
        "metadata_fields": metadata_fields,  # the pool's metadata fields typed in the shards' metadata struct
        # what the dataset card says of the curation, so that a takedown can rewrite the card from the manifest alone
        "curation": {
            "profile": cfg.profile,
            "min_short_side": cfg.filters.min_short_side,
            "stages": list(cfg.enabled_stages),
            "safety": _safety(cfg),
            "blocklists": [redact(uri) for uri in cfg.filters.blocklists],
        },
        "embedding_dim": cfg.embedding_dim if cfg.write.include_embedding else None,  # in the shards, when there
        "version": 1,  # a takedown publishes the next
        "shards": shards,
        "final_ledger": ledger["files"],
        "totals": {
            "shards": len(shards),
            "rows": sum(s["rows"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
        },
        "funnel": ledger["funnel"],
        "dedup": _dedup_summary(out),  # how dedup decided, for the card
    }


# --- after the switch: each image's bytes once -------------------------------------------------------------------------


@ray.remote(num_cpus=0.25)
def _drop_scored_bytes(out_uri: str, files: list[str], cfg_json: str) -> dict:
    """Each scored part's image file deleted; a scored part that holds its image bytes itself (scored before the
    image files) rewritten without them, their paths kept. Returns how many files and bytes fewer."""
    cfg = config_from_json(cfg_json)
    fs, root = resolve(out_uri)
    dropped = freed = 0
    for rel in files:
        images = fs.get_file_info(join(root, LAYOUT.images_of(rel)))
        if images.type == pafs.FileType.File:
            delete_quietly(fs, images.path)
            dropped, freed = dropped + 1, freed + images.size
            continue  # a part written beside an image file never holds bytes itself: no footer to read
        path = join(root, rel)
        with open_parquet(fs, path) as pf:
            if _without_bytes(pf.metadata):
                continue
            size, file_schema = fs.get_file_info(path).size, pf.schema_arrow
            table = pf.read(columns=[n if n != "image" else "image.path" for n in file_schema.names])
        at = file_schema.get_field_index("image")
        paths = table.column(at).combine_chunks().field("path")  # read as a struct of the path alone
        image = pa.StructArray.from_arrays([pa.nulls(len(paths), pa.binary()), paths], fields=list(schema.IMAGE_TYPE))
        table = table.set_column(at, file_schema.field("image"), image).cast(file_schema)
        # no image bytes left: the row groups of a file that carries none (as the ledger's), not of one with images
        data = encode_parquet(
            table, row_group_size=cfg.output.ledger_row_group_size, compression=cfg.output.compression
        )
        write_bytes_atomic(fs, path, data)
        dropped, freed = dropped + 1, freed + size - len(data)
    return {"files": dropped, "bytes": freed}


def _without_bytes(meta: pq.FileMetaData) -> bool:
    """Whether a scored file's statistics say every image's bytes are null."""
    column = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == "image.bytes")
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(column).statistics
        if stats is None or stats.null_count != meta.row_group(g).num_rows:
            return False
    return True


class _DropBytes(TaskStep):
    """The scored files without the image bytes: one unit per run of input shards of about
    ``write.ledger_rows_per_task`` inputs."""

    name, unit_name, task = "drop_bytes", "tasks", _drop_scored_bytes

    def __init__(self, records: dict[str, dict], rows_per_task: int, out_uri: str, cfg_json: str):
        calls = {
            unit: (out_uri, [f for s in group for f in records[s]["scored_files"]], cfg_json)
            for unit, group in shard_groups(records, rows_per_task).items()
        }
        super().__init__(calls)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {key: sum(r[key] for r in receipts) for key in ("files", "bytes")}


def drop_scored_bytes(runner: StepRunner, cfg: CurateConfig, records: dict[str, dict]) -> dict:
    """After the switch to the final shards: the scored files' image bytes dropped, so that the output holds each
    image's bytes once (the kept ones in the final shards). A later write reads them from the pool
    (``with_originals``). Returns how many files were deleted or rewritten and how many bytes that freed."""
    stats = runner.run(_DropBytes(records, cfg.write.ledger_rows_per_task, runner.output.uri, cfg.model_dump_json()))
    delete_quietly(runner.output.fs, runner.output.path(LAYOUT.scored_images))  # its folders, empty now
    return stats
