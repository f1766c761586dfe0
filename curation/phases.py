"""Phases 2-4, the global ones: dedup, sample, write.

They read the committed phase-1 results (never image bytes, except "write", which streams them shard by shard),
decide, and record their decisions beside the output:

    dedup/decisions.parquet    images dropped as near-duplicates: key kept instead, signal that linked them
    sample/decisions.parquet   every dedup survivor: cluster ids per level, selected or not
    shards/part-NNNNN-<digest>.parquet          final curated shards
    final_ledger/<shard_id>-<digest>.parquet    the ledger with every phase applied: one row per input
    shards/manifest.json       the current shards and final-ledger files (rows, bytes, sha256), totals, funnel

Each phase writes ``_state/<phase>.done.json`` with the hash of its settings (and of the phases before it) last,
so a rerun skips a phase that is done with the same settings, and re-running one phase clears the later ones.

The manifest is the commit point of "write": the new files are written beside the old ones under names that end
in a prefix of their sha256 (so a file a manifest lists is never overwritten with other bytes, and an identical
rerun gives the same names and bytes), then the manifest is replaced in one atomic write, then the files it does
not list are deleted. A reader that goes through the manifest sees the complete old set or the complete new one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common import schema
from common.storage import (
    delete_quietly,
    encode_parquet,
    exists,
    join,
    list_files,
    read_json,
    resolve,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)
from curation import dedup as dd
from curation import sampling
from curation.config import CurateConfig
from curation.score import LEDGER_DIR, STATE_DIR

GLOBAL_PHASES = ("dedup", "sample", "write")
DEDUP_FILE, SAMPLE_FILE = "dedup/decisions.parquet", "sample/decisions.parquet"
SHARDS_DIR, FINAL_LEDGER_DIR = "shards", "final_ledger"
MANIFEST = f"{SHARDS_DIR}/manifest.json"
_SURVIVOR_COLUMNS = ["key", "source", "shard_id", "phash", "width", "height", "quality", "aesthetic", "head_yaw_class"]


class PhaseOrderError(RuntimeError):
    """A phase was asked for before the phase it needs has completed."""


def _done_path(root: str, phase: str) -> str:
    return join(root, STATE_DIR, f"{phase}.done.json")


def phase_done(out_uri: str, phase: str, settings_hash: str | None = None) -> bool:
    fs, root = resolve(out_uri)
    path = _done_path(root, phase)
    if not exists(fs, path):
        return False
    return settings_hash is None or read_json(fs, path).get("settings_hash") == settings_hash


def committed_records(out_uri: str) -> list[dict]:
    fs, root = resolve(out_uri)
    return [read_json(fs, p) for p in list_files(fs, join(root, STATE_DIR, "score"), ".json")]


@dataclass
class Survivors:
    """Phase-1 survivors' metadata, in (shard_id, source) order; embeddings may be memory-mapped."""

    table: pa.Table  # _SURVIVOR_COLUMNS
    embedding: np.ndarray  # (N, D) float32, L2-normalised
    scratch: str | None = None

    def close(self) -> None:
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def load_survivors(out_uri: str, cfg: CurateConfig) -> Survivors:
    """Read the committed scored files' metadata columns and embeddings (no image bytes)."""
    fs, root = resolve(out_uri)
    files = sorted(f for r in committed_records(out_uri) for f in r["scored_files"])
    total = sum(pq.ParquetFile(fs.open_input_file(join(root, f))).metadata.num_rows for f in files)
    dim = cfg.embedding_dim
    scratch = None
    if total * dim * 4 > cfg.dedup.memory_budget_mb * 2**20:
        scratch = tempfile.mkdtemp(prefix="humans1b-embeddings-")
        embedding = np.lib.format.open_memmap(os.path.join(scratch, "e.npy"), "w+", np.float32, (total, dim))
    else:
        embedding = np.empty((total, dim), np.float32)
    tables, at = [], 0
    for f in files:
        t = pq.read_table(join(root, f), columns=[*_SURVIVOR_COLUMNS, "embedding"], filesystem=fs)
        if t.column("embedding").null_count:
            raise PhaseOrderError(
                f"{f} has images without an embedding: the global phases need the embedding stage "
                "(enable stages.embedding and rescore, or run --phases score only)"
            )
        flat = t.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        embedding[at : at + t.num_rows] = flat.reshape(t.num_rows, dim)
        at += t.num_rows
        tables.append(t.drop_columns(["embedding"]))
    table = pa.concat_tables(tables) if tables else pa.table({c: [] for c in _SURVIVOR_COLUMNS})
    # a stable order that does not depend on how parts were split
    order = np.lexsort((np.asarray(table.column("source").to_pylist(), object), np.asarray(table.column("shard_id").to_pylist(), object)))
    return Survivors(table.take(pa.array(order)), embedding[:at][order], scratch)


@ray.remote(num_cpus=1)
def _band_task(unique: np.ndarray, plan: dd.BandPlan, task: dd.HashTask) -> tuple[np.ndarray, ...]:
    return dd.band_pairs(unique, plan, task.band_index, (task.mask_start, task.mask_stop))


@ray.remote(num_cpus=1)
def _ivf_task(x: np.ndarray, part: dd.IvfPartition, lists: range, k: int, threshold: float) -> tuple[np.ndarray, ...]:
    return dd.ivf_block_pairs(x, part, lists, k, threshold)


def phash_pairs_on_ray(hashes: np.ndarray, radius: int, splits_per_band: int = 8) -> dd.HashPairs:
    """``dd.phash_pairs`` with each band's masks spread over Ray tasks (the distinct hashes shipped once)."""
    groups = dd.collapse_exact(hashes)
    if radius == 0 or groups.unique.size < 2:
        empty = np.empty(0, np.int64)
        return dd.pairs_from_unique(groups, empty, empty, np.empty(0, np.uint8))
    plan = dd.plan_bands(groups.unique.size, radius)
    unique = ray.put(groups.unique)
    results = ray.get([_band_task.remote(unique, plan, t) for t in plan.tasks(splits_per_band)])
    u, v, d = (np.concatenate(parts) for parts in zip(*results))
    return dd.pairs_from_unique(groups, u, v, d)


def embedding_pairs_on_ray(x: np.ndarray, threshold: float, k: int, lists_per_task: int = 64, seed: int = 0) -> dd.EmbeddingPairs:
    """The inverted-file path of ``dd.embedding_pairs`` with ranges of lists spread over Ray tasks."""
    part = dd.build_ivf_partition(x, None, 2, seed=seed)
    x_ref = ray.put(np.ascontiguousarray(x, dtype=np.float32))
    ranges = [range(a, min(a + lists_per_task, part.nlist)) for a in range(0, part.nlist, lists_per_task)]
    results = ray.get([_ivf_task.remote(x_ref, part, r, k, threshold) for r in ranges])
    i, j, sim = (np.concatenate(parts) for parts in zip(*results))
    return dd.unique_embedding_pairs(i, j, sim, x.shape[0], "ivf-ray")


def _first_score(table: pa.Table, columns: list[str]) -> np.ndarray:
    score = np.full(table.num_rows, np.nan)
    for name in reversed(columns):  # earlier columns win where set
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        score = np.where(np.isnan(values), score, values)
    return score


class GlobalPhases:
    """``guard`` runs before each commit-point write and raises when this run may no longer write the output
    (``common.lease.Lease.check``)."""

    def __init__(
        self, cfg: CurateConfig, out_uri: str, log: Callable[[str], None] = print, guard: Callable[[], None] = lambda: None
    ):
        self.cfg, self.out_uri, self.log, self.guard = cfg, out_uri, log, guard
        self.fs, self.root = resolve(out_uri)

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    def _require(self, phase: str) -> None:
        needed = {"dedup": "score", "sample": "dedup", "write": "sample"}[phase]
        ok = exists(self.fs, _done_path(self.root, needed)) if needed == "score" else phase_done(
            self.out_uri, needed, self.cfg.phase_hash(needed)
        )
        if not ok:
            raise PhaseOrderError(f"phase {phase} needs phase {needed} to be complete with these settings; run --phases {needed},{phase}")

    def _start(self, phase: str) -> None:
        for later in GLOBAL_PHASES[GLOBAL_PHASES.index(phase) :]:
            delete_quietly(self.fs, _done_path(self.root, later))

    def _finish(self, phase: str, record: dict, start: float) -> None:
        record = {**record, "settings_hash": self.cfg.phase_hash(phase), "seconds": round(time.monotonic() - start, 2)}
        self.guard()
        write_json_atomic(self.fs, _done_path(self.root, phase), record)

    def run(self, phase: str) -> dict:
        if phase_done(self.out_uri, phase, self.cfg.phase_hash(phase)):
            record = read_json(self.fs, _done_path(self.root, phase))
            self.log(f"[{phase}] already done with these settings, skipped")
            return record
        self._require(phase)
        self.guard()
        self._start(phase)
        start = time.monotonic()
        record = getattr(self, f"_{phase}")()
        self._finish(phase, record, start)
        return record

    # --- phase 2: dedup ------------------------------------------------------------------------------------------

    def _dedup(self) -> dict:
        cfg = self.cfg.dedup
        survivors = load_survivors(self.out_uri, self.cfg)
        try:
            t, n = survivors.table, survivors.table.num_rows
            pairs: dict[str, object] = {}
            distribute = n > cfg.distribute_above
            if "phash" in cfg.signals and n:
                hashes = t.column("phash").to_numpy(zero_copy_only=False).astype(np.uint64)
                pairs["phash"] = (
                    phash_pairs_on_ray(hashes, cfg.phash_radius)
                    if distribute
                    else dd.phash_pairs(hashes, cfg.phash_radius, threads=os.cpu_count() or 1)
                )
            if "embedding" in cfg.signals and n:
                pairs["embedding"] = (
                    embedding_pairs_on_ray(survivors.embedding, cfg.embedding_threshold, cfg.embedding_k)
                    if distribute and n > cfg.flat_max
                    else dd.embedding_pairs(survivors.embedding, cfg.embedding_threshold, cfg.embedding_k, flat_max=cfg.flat_max)
                )
            result = dd.resolve_duplicates(
                n,
                pairs,
                score=_first_score(t, cfg.keep_score) if n else None,
                width=t.column("width").to_numpy(zero_copy_only=False),
                height=t.column("height").to_numpy(zero_copy_only=False),
                keys=np.asarray([f"{k}\x00{s}" for k, s in zip(t.column("key").to_pylist(), t.column("source").to_pylist())], object),
            )
            dropped = np.flatnonzero(~result.keep)
            keys = np.asarray(t.column("key").to_pylist(), object)
            signal = result.linked_by_name()
            decisions = pa.table(
                {
                    "source": t.column("source").take(pa.array(dropped, pa.int64())),
                    "key": pa.array(keys[dropped].tolist(), pa.string()),
                    "duplicate_of": pa.array(keys[result.duplicate_of[dropped]].tolist(), pa.string()),
                    "duplicate_signal": pa.array([signal[i] for i in dropped], pa.string()),
                }
            )
            write_parquet_atomic(self.fs, join(self.root, DEDUP_FILE), decisions, row_group_size=10_000)
            by_signal = Counter(decisions.column("duplicate_signal").to_pylist())
            pair_counts = {name: int(np.asarray(p.i).size) for name, p in pairs.items()}
            self.log(f"[dedup] {n} survivors, {len(dropped)} near-duplicates dropped {dict(by_signal)}; pairs {pair_counts}")
            return {"inputs": n, "dropped": len(dropped), "by_signal": dict(by_signal), "pairs": pair_counts}
        finally:
            survivors.close()

    def dropped_sources(self) -> set[str]:
        return set(pq.read_table(join(self.root, DEDUP_FILE), columns=["source"], filesystem=self.fs).column("source").to_pylist())

    # --- phase 3: sample -----------------------------------------------------------------------------------------

    def _sample(self) -> dict:
        cfg = self.cfg.sample
        survivors = load_survivors(self.out_uri, self.cfg)
        try:
            dropped = self.dropped_sources()
            t = survivors.table
            alive = np.asarray([s not in dropped for s in t.column("source").to_pylist()], bool)
            t, x = t.filter(pa.array(alive)), np.ascontiguousarray(survivors.embedding[alive])
            n = t.num_rows
            size = cfg.target_count if cfg.target_count is not None else None
            fraction = None if size is not None else (cfg.target_fraction or 1.0)
            if n == 0:
                selected, ids, levels = np.zeros(0, bool), [], 0
            else:
                balance = None
                if cfg.balance_key:
                    values = t.column(cfg.balance_key).to_pylist()
                    codes = {v: i for i, v in enumerate(sorted({str(v) for v in values}))}
                    balance = np.asarray([codes[str(v)] for v in values], np.int64)
                clusters = cfg.clusters
                if clusters is not None:
                    clusters = [max(1, min(k, n)) for k in clusters]
                elif n < 8:
                    clusters = [1]
                selection = sampling.balanced_sample(
                    x, size=size, fraction=fraction, n_clusters=clusters, mode=cfg.mode, balance_key=balance, seed=cfg.seed
                )
                selected = np.zeros(n, bool)
                selected[selection.indices] = True
                ids = selection.cluster_ids.tolist()
                levels = selection.hierarchy.n_levels
            decisions = pa.table(
                {
                    "source": t.column("source"),
                    "key": t.column("key"),
                    "shard_id": t.column("shard_id"),
                    "cluster_ids": pa.array(ids, pa.list_(pa.int32())),
                    "selected": pa.array(selected, pa.bool_()),
                }
            )
            write_parquet_atomic(self.fs, join(self.root, SAMPLE_FILE), decisions, row_group_size=10_000)
            kept = int(selected.sum())
            self.log(f"[sample] {n} after dedup, {kept} selected, {n - kept} unsampled ({levels} cluster levels)")
            return {"inputs": n, "selected": kept, "unsampled": n - kept, "levels": levels}
        finally:
            survivors.close()

    # --- phase 4: write ------------------------------------------------------------------------------------------

    def _write(self) -> dict:
        decisions = pq.read_table(join(self.root, SAMPLE_FILE), filesystem=self.fs)
        chosen = decisions.filter(decisions.column("selected"))
        # global order: input shard, then source; output shard k takes rows [k * R, (k + 1) * R)
        order = np.lexsort((np.asarray(chosen.column("source").to_pylist(), object), np.asarray(chosen.column("shard_id").to_pylist(), object)))
        chosen = chosen.take(pa.array(order, pa.int64()))
        rows = self.cfg.write.rows_per_shard
        n_out = (chosen.num_rows + rows - 1) // rows
        records = {r["shard_id"]: r for r in committed_records(self.out_uri)}
        cfg_json = self.cfg.model_dump_json()
        futures = []
        for k in range(n_out):
            part = chosen.slice(k * rows, rows)
            shard_ids = sorted(set(part.column("shard_id").to_pylist()))
            files = [f for s in shard_ids for f in records[s]["scored_files"]]
            wanted = {s: c for s, c in zip(part.column("source").to_pylist(), part.column("cluster_ids").to_pylist())}
            futures.append(_write_final_shard.remote(self.out_uri, f"part-{k:05d}", files, wanted, cfg_json))
        shards = ray.get(futures)
        final_ledger, funnel = self._write_final_ledger(records)
        manifest = {
            "schema_version": schema.SCHEMA_VERSION,
            "config_hash": self.cfg.results_hash(),
            "settings_hash": self.cfg.phase_hash("write"),
            "embedding_model": self.cfg.models.embedding.name,
            "shards": shards,
            "final_ledger": final_ledger,
            "totals": {"shards": len(shards), "rows": sum(s["rows"] for s in shards), "bytes": sum(s["bytes"] for s in shards)},
            "funnel": funnel,
        }
        self.guard()
        write_json_atomic(self.fs, join(self.root, MANIFEST), manifest)  # the switch to the new files
        removed = self._remove_unlisted(manifest)
        self.log(
            f"[write] {manifest['totals']['rows']} images in {len(shards)} shards ({manifest['totals']['bytes']} bytes); "
            f"{removed} files the manifest no longer lists removed"
        )
        return manifest["totals"]

    def _remove_unlisted(self, manifest: dict) -> int:
        """Delete every file under shards/ and final_ledger/ the manifest does not list (an earlier write's, the
        leftovers of an interrupted one); returns how many."""
        listed = {join(self.root, MANIFEST)}
        listed |= {join(self.root, SHARDS_DIR, s["file"]) for s in manifest["shards"]}
        listed |= {join(self.root, FINAL_LEDGER_DIR, f["file"]) for f in manifest["final_ledger"]}
        removed = 0
        for folder in (SHARDS_DIR, FINAL_LEDGER_DIR):
            if not exists(self.fs, join(self.root, folder)):
                continue
            for info in self.fs.get_file_info(pafs.FileSelector(join(self.root, folder), recursive=True)):
                if info.type == pafs.FileType.File and info.path not in listed:
                    delete_quietly(self.fs, info.path)
                    removed += 1
        return removed

    def _write_final_ledger(self, records: dict[str, dict]) -> tuple[list[dict], dict]:
        """The phase-1 ledger with dedup and sample fates applied, one file per input shard; returns the files'
        manifest entries and the funnel."""
        dups = pq.read_table(join(self.root, DEDUP_FILE), filesystem=self.fs).to_pylist()
        dup_by_source = {d["source"]: d for d in dups}
        sample_rows = pq.read_table(join(self.root, SAMPLE_FILE), filesystem=self.fs).to_pylist()
        sample_by_source = {d["source"]: d for d in sample_rows}
        ledger_schema = schema.with_metadata(schema.ledger_schema(), table="final_ledger", config_hash=self.cfg.results_hash())
        funnel: Counter = Counter()
        files = []
        for shard_id in sorted(records):
            parts = [pq.read_table(join(self.root, f), filesystem=self.fs) for f in records[shard_id]["ledger_files"]]
            rows = sorted(pa.concat_tables(parts).to_pylist(), key=lambda r: r["source"])
            for row in rows:
                if row["status"] == schema.KEPT:
                    dup, sample = dup_by_source.get(row["source"]), sample_by_source.get(row["source"])
                    if dup:
                        row.update(status=schema.DUPLICATE, stage="dedup", duplicate_of=dup["duplicate_of"],
                                   duplicate_signal=dup["duplicate_signal"],
                                   reason=f"duplicate: near-duplicate of {dup['duplicate_of']} by {dup['duplicate_signal']}")
                    elif sample and not sample["selected"]:
                        row.update(status=schema.UNSAMPLED, stage="sample", cluster_ids=sample["cluster_ids"],
                                   reason=f"unsampled: cluster {sample['cluster_ids']} was over its share of the target")
                    else:
                        row.update(stage="write", cluster_ids=sample["cluster_ids"] if sample else None)
                phase = row["stage"] if row["stage"] in GLOBAL_PHASES else "score"
                funnel[f"{phase}/{row['stage']}/{row['status']}/{(row['reason'] or '').split(':', 1)[0]}"] += 1
            table = pa.Table.from_pylist(rows, schema=ledger_schema)
            files.append({**_write_named_by_content(self.fs, self.root, FINAL_LEDGER_DIR, shard_id, table, self.cfg),
                          "shard_id": shard_id})
        return files, dict(sorted(funnel.items()))


def _write_named_by_content(fs: pafs.FileSystem, root: str, folder: str, stem: str, table: pa.Table, cfg: CurateConfig) -> dict:
    """Write ``table`` as ``<folder>/<stem>-<sha256 prefix>.parquet``; returns its manifest entry."""
    data = encode_parquet(table, row_group_size=cfg.output.row_group_size, compression=cfg.output.compression)
    digest = sha256(data).hexdigest()
    name = f"{stem}-{digest[:16]}.parquet"
    write_bytes_atomic(fs, join(root, folder, name), data)
    return {"file": name, "rows": table.num_rows, "bytes": len(data), "sha256": digest}


@ray.remote(num_cpus=0.5)
def _write_final_shard(out_uri: str, stem: str, files: list[str], wanted: dict[str, list[int]], cfg_json: str) -> dict:
    """One final shard: the wanted rows of the given scored files, in (shard_id, source) order, with cluster ids."""
    cfg = CurateConfig.model_validate_json(cfg_json)
    fs, root = resolve(out_uri)
    dim = cfg.embedding_dim if cfg.write.include_embedding else None
    target = schema.with_metadata(
        schema.curated_schema(dim), table="curated", config_hash=cfg.results_hash(),
        extra={"embedding_model": cfg.models.embedding.name, "embedding_dim": cfg.embedding_dim},
    )
    pieces = []
    for f in files:
        t = pq.read_table(join(root, f), filesystem=fs)
        t = t.filter(pc.is_in(t.column("source"), pa.array(sorted(wanted), pa.string())))
        pieces.append(t)
    table = pa.concat_tables(pieces)
    order = np.lexsort((np.asarray(table.column("source").to_pylist(), object), np.asarray(table.column("shard_id").to_pylist(), object)))
    table = table.take(pa.array(order, pa.int64()))
    table = table.append_column("cluster_ids", pa.array([wanted[s] for s in table.column("source").to_pylist()], pa.list_(pa.int32())))
    table = table.select(target.names).cast(target)
    return _write_named_by_content(fs, root, SHARDS_DIR, stem, table, cfg)
