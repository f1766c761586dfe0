"""Running a takedown: remove a list's images from a published output, prove they are gone, and keep them gone.

``run_takedown`` finds the final shards that hold a listed image (Ray tasks reading the key, source and metadata
columns only), rewrites only those shards and the final-ledger files of their input shards (the images taken down,
``curation.phases.write.takedown``), and switches the manifest to the next version in one atomic write. Its record
says who asked, when, which list and what it removed.

Order of writes, so that a kill anywhere leaves the old version or the new one and the same command finishes it:
entries, new files (named by their content: a rerun writes the same names), the record as ``pending`` (with the
manifest it will publish), the manifest switch, the card, the record ``done``. The files the new version no longer
lists stay for ``grace_minutes`` (a trainer that indexed the previous manifest keeps reading them), then a takedown
run deletes them and marks the record ``purged``; with ``grace_minutes=0`` they go at once.

Sizes at 1B images: the driver holds the manifest (one entry per shard), the list, and one entry per removed image;
a scan task reads the small columns of ``_SHARDS_PER_SCAN`` shards, a rewrite task one shard.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections import Counter
from collections.abc import Callable
from hashlib import sha256

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from common.config import hash_json
from common.layout import LAYOUT, TAKEDOWN
from common.storage import (
    delete_quietly,
    encode_parquet,
    exists,
    join,
    parquet_options_like,
    read_json,
    redact,
    resolve,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)
from common.takedown_lists import (
    Listing,
    TakedownError,
    TakedownList,
    entries_path,
    record_path,
    takedown_records,
)
from curation.phases.write.card import write_card
from curation.phases.write.takedown import mark_taken_down, taken_down_reason
from curation.records import read_manifest
from curation.score.ledger import funnel_of
from curation.steps.output import Output
from curation.steps.runner import StepRunner, task_step
from curation.steps.window import task_window

log = logging.getLogger(__name__)

_SHARDS_PER_SCAN = 64


# --- Ray tasks ------------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0.25)
def _scan(out_uri: str, files: list[str], listing: Listing) -> dict:
    """Rows the list names in each of ``files`` (final shards): file -> [row index, entry that names it], for files
    with any. A shard written before the ``pdq`` column is hashed from its images where the list holds hashes."""
    fs, root = resolve(out_uri)
    found = {}
    for name in files:
        path = join(root, LAYOUT.shards, name)
        names = pq.read_schema(path, filesystem=fs).names
        wanted = ["key", "source", "metadata", "metadata_json"]
        if listing.hashed:
            wanted.append("pdq" if "pdq" in names else "image")
        table = pq.read_table(path, columns=[c for c in wanted if c in names], filesystem=fs)
        rows = [[row, entry] for row, entry in enumerate(listing.named_by(table)) if entry is not None]
        if rows:
            found[name] = rows
    return {"hits": found}


def _rewrite(fs, root: str, folder: str, name: str, table: pa.Table, like: pq.ParquetFile) -> dict:
    """``table`` written as the file ``name`` was (row groups, codecs, dictionaries, statistics, metadata), named by
    its content."""
    data = encode_parquet(table, **parquet_options_like(like.metadata))
    digest = sha256(data).hexdigest()
    new = f"{name.rsplit('-', 1)[0]}-{digest[:16]}.parquet"
    write_bytes_atomic(fs, join(root, folder, new), data)
    return {"file": new, "rows": table.num_rows, "bytes": len(data), "sha256": digest}


@ray.remote(num_cpus=0.5)
def _rewrite_shard(out_uri: str, name: str, drop: list[list]) -> dict:
    """A final shard without the rows ``drop`` ([row, entry] pairs): its new entry (None when nothing is left) and
    what it removed, each with the entry that named it."""
    fs, root = resolve(out_uri)
    pf = pq.ParquetFile(fs.open_input_file(join(root, LAYOUT.shards, name)))
    table = pf.read()
    rows = pa.array([row for row, _ in drop], pa.int64())
    keep = pc.invert(pc.is_in(pa.array(range(table.num_rows), pa.int64()), value_set=rows))
    removed = table.take(rows).select(["key", "source", "shard_id"]).to_pylist()
    for row, (_, entry) in zip(removed, drop, strict=True):
        row["entry"] = entry
    left = table.filter(keep)
    entry = _rewrite(fs, root, LAYOUT.shards, name, left, pf) if left.num_rows else None
    return {"entry": entry, "removed": removed}


@ray.remote(num_cpus=0.25)
def _rewrite_ledger(out_uri: str, entry: dict, reasons: dict[str, str]) -> dict:
    """An input shard's final-ledger file with the sources ``reasons`` names taken down: its new entry and the
    funnel's change."""
    fs, root = resolve(out_uri)
    pf = pq.ParquetFile(fs.open_input_file(join(root, LAYOUT.final_ledger, entry["file"])))
    before = pf.read()
    after = mark_taken_down(before, reasons)
    delta = funnel_of(after)
    delta.subtract(funnel_of(before))
    new = _rewrite(fs, root, LAYOUT.final_ledger, entry["file"], after, pf)
    return {"entry": {**new, "shard_id": entry["shard_id"]}, "funnel": {k: v for k, v in delta.items() if v}}


# the takedown's steps: the shards holding listed images, ``_SHARDS_PER_SCAN`` a unit; each of them without those
# images; the final-ledger file of each input shard they came from, with them taken down (the step adds the reason,
# which dates the list: a rerun on another day writes those files again)
_Scan = task_step("scan", "scans", _scan)
_RewriteShards = task_step("shards", "shards", _rewrite_shard)
_RewriteLedger = task_step("ledger", "files", _rewrite_ledger)


# --- the step ---------------------------------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


def run_takedown(
    out_uri: str,
    lst: TakedownList,
    *,
    by: str,
    grace_minutes: float,
    guard: Callable[[], None] = lambda: None,
) -> dict:
    """Take the listed images down from ``out_uri``'s published shards; returns the record. ``guard`` raises when
    the output's lease was lost (checked before the switch)."""
    fs, root = resolve(out_uri)
    if not exists(fs, join(root, LAYOUT.manifest)):
        raise TakedownError(f"{redact(out_uri)}: no {LAYOUT.manifest}; take images down from a published output")
    manifest = read_manifest(fs, root)
    path = join(root, record_path(lst.id))
    previous = read_json(fs, path) if exists(fs, path) else None
    pending = previous if previous is not None and previous["status"] == "pending" else None
    if pending is not None and pending.get("manifest_sha256") == _digest(manifest):
        log.info(f"[takedown] list {lst.id}: manifest version {pending['version']} is published; finishing")
        return _finish(fs, root, out_uri, pending, manifest, grace_minutes)
    at = pending["at"] if pending is not None else _now()  # a rerun after a kill writes the same files
    entries = pa.table({"entry": pa.array(lst.entries, pa.string())})
    write_parquet_atomic(fs, join(root, entries_path(lst.id)), entries, row_group_size=100_000)
    # the steps' receipts hold for this list against this manifest: a rerun after a kill keeps them
    runner = StepRunner(Output.at(out_uri), TAKEDOWN, hash_json([lst.id, _digest(manifest)]), task_window())
    files, listing = [s["file"] for s in manifest["shards"]], ray.put(lst.listing)
    scans = {
        f"scan-{i:07d}": (out_uri, files[i : i + _SHARDS_PER_SCAN], listing)
        for i in range(0, len(files), _SHARDS_PER_SCAN)
    }
    hits = {name: rows for r in runner.run(_Scan(scans))["receipts"] for name, rows in r["hits"].items()}
    log.info(
        f"[takedown] list {lst.id} ({len(lst.entries)} entries): {sum(map(len, hits.values()))} images listed in "
        f"{len(hits)} of {len(files)} shards"
    )
    if not hits and previous is not None and previous["status"] == "done":
        log.info(f"[takedown] list {lst.id}: taken down on {previous['at']}, nothing listed is left")
        return _finish(fs, root, out_uri, previous, manifest, grace_minutes)
    earlier = previous if previous is not None and previous["status"] == "done" else {}
    record = {
        "id": lst.id,
        "list": lst.name,
        "list_sha256": lst.sha256,
        "entries": len(lst.entries),
        "distance": lst.distance,
        "by": by,
        "at": at,
        "status": "pending",
        "from_version": manifest.get("version", 1),
        "version": manifest.get("version", 1) + (1 if hits else 0),
        "removed": earlier.get("removed", []),
        # per shard file replaced, the rows taken out of it: a reader that indexed it finds its other rows in the
        # replacement without reading it (gone after the grace)
        "removed_rows": earlier.get("removed_rows", {}),
        "superseded": earlier.get("superseded", []),
        "delete_after": (dt.datetime.fromisoformat(at) + dt.timedelta(minutes=grace_minutes)).isoformat(),
        "purged": False,
    }
    if hits:
        manifest, removed, superseded = _rewrite_listed(runner, manifest, hits, lst, at)
        record["removed"] = [*record["removed"], *removed]
        record["removed_rows"] = {**record["removed_rows"], **{n: sorted(r for r, _ in hits[n]) for n in hits}}
        record["superseded"] = [*record["superseded"], *superseded]
    write_json_atomic(fs, path, {**record, "manifest_sha256": _digest(manifest)})
    guard()
    if hits:
        write_json_atomic(fs, join(root, LAYOUT.manifest), manifest)  # the switch to the new version
    return _finish(fs, root, out_uri, record, manifest, grace_minutes)


def _digest(manifest: dict) -> str:
    return sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _rewrite_listed(
    runner: StepRunner, manifest: dict, hits: dict[str, list[int]], lst: TakedownList, at: str
) -> tuple[dict, list[dict], list[str]]:
    """Rewrite the shards with listed rows and their input shards' ledger files: (the next manifest, the removed
    images, the files it no longer lists)."""
    names = sorted(hits)
    shard_calls = {f"shard-{k:06d}": (runner.output.uri, n, hits[n]) for k, n in enumerate(names)}
    rewritten = runner.run(_RewriteShards(shard_calls))["receipts"]
    new_entry = dict(zip(names, (r["entry"] for r in rewritten)))
    removed = [row for r in rewritten for row in r["removed"]]
    reason = taken_down_reason(lst.name, lst.id, at)
    by_shard: dict[str, dict[str, str]] = {}
    for row in removed:
        by_shard.setdefault(row["shard_id"], {})[row["source"]] = f"{reason}: {row['entry']}"
    ledger_entries = [e for e in manifest["final_ledger"] if e["shard_id"] in by_shard]
    calls = {f"file-{k:06d}": (runner.output.uri, e, by_shard[e["shard_id"]]) for k, e in enumerate(ledger_entries)}
    new_ledger = {e["file"]: r for e, r in zip(ledger_entries, runner.run(_RewriteLedger(calls, reason))["receipts"])}
    funnel = Counter(manifest["funnel"])
    for r in new_ledger.values():
        funnel.update(r["funnel"])
    shards = [s for s in (new_entry[s["file"]] if s["file"] in hits else s for s in manifest["shards"]) if s]
    totals = {"shards": len(shards), "rows": sum(s["rows"] for s in shards), "bytes": sum(s["bytes"] for s in shards)}
    version = manifest.get("version", 1) + 1
    takedown = {"id": lst.id, "list": lst.name, "at": at, "removed": len(removed), "version": version}
    manifest = {
        **manifest,
        "shards": shards,
        "final_ledger": [
            new_ledger[e["file"]]["entry"] if e["file"] in new_ledger else e for e in manifest["final_ledger"]
        ],
        "totals": totals,
        "funnel": dict(sorted((k, v) for k, v in funnel.items() if v)),
        "version": version,
        "takedowns": [*manifest.get("takedowns", []), takedown],
    }
    superseded = [f"{LAYOUT.shards}/{n}" for n in names] + [
        f"{LAYOUT.final_ledger}/{e['file']}" for e in ledger_entries
    ]
    return manifest, [{"key": r["key"], "source": r["source"]} for r in removed], superseded


def _finish(fs, root: str, out_uri: str, record: dict, manifest: dict, grace_minutes: float) -> dict:
    if record["removed"]:
        write_card(out_uri, manifest)
    record = {**record, "status": "done"}
    record.pop("manifest_sha256", None)
    write_json_atomic(fs, join(root, record_path(record["id"])), record)
    log.info(
        f"[takedown] list {record['id']}: {len(record['removed'])} images removed, manifest version "
        f"{manifest.get('version', 1)}; {len(record['superseded'])} replaced files kept until {record['delete_after']}"
    )
    purge_due(fs, root, manifest, now=None if grace_minutes > 0 else record["delete_after"])
    return record


def purge_due(fs, root: str, manifest: dict, now: str | None = None) -> int:
    """Delete the replaced files of takedowns whose grace has passed (never a file the manifest lists)."""
    listed = {f"{LAYOUT.shards}/{s['file']}" for s in manifest["shards"]}
    listed |= {f"{LAYOUT.final_ledger}/{e['file']}" for e in manifest["final_ledger"]}
    now = now or _now()
    deleted = 0
    for record in takedown_records(fs, root):
        due = dt.datetime.fromisoformat(record["delete_after"]) <= dt.datetime.fromisoformat(now)
        if record.get("purged") or record["status"] != "done" or not due:
            continue
        for rel in record["superseded"]:
            if rel not in listed:
                delete_quietly(fs, join(root, rel))
                deleted += 1
        write_json_atomic(fs, join(root, record_path(record["id"])), {**record, "purged": True})
    if deleted:
        log.info(f"[takedown] {deleted} replaced files past their grace deleted")
    return deleted
