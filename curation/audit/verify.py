"""Verify a curated output before anyone trains on it.

Checks, each reported as a ``Problem`` that names the file (relative to the output root), the row where there is
one, and what is wrong:

- every shard the manifest lists exists, with the manifest's size, sha256, row count, schema and file metadata
  (``datasets``' features included);
- ``shards/`` holds nothing the manifest does not list (readers that glob ``*.parquet`` would pick it up);
- every image decodes and its bytes hash to its ``key``; keys (and sources) are unique across all shards;
- the manifest lists one final-ledger file per committed input shard, with its sha256, and ``final_ledger/``
  holds nothing else; each covers every input of its shard exactly once (the inputs are the phase-1 ledger's rows,
  counted in the shard's commit record); its funnel equals the manifest's; its kept rows are exactly the shards'
  rows;
- no image a recorded takedown lists (``_state/takedown/``) is in a listed shard, every takedown finished, and the
  files a takedown replaced are gone once its grace has passed.

Everything goes through ``common.storage``, so ``s3://bucket/prefix`` is audited like a local folder.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema, watchdog
from common.layout import GLOBAL_PHASES, LAYOUT, funnel_phase
from common.storage import DamagedRecordError, exists, file_sha256, join, path_on_store, resolve
from curation.audit.verify_shards import Problem, ShardRows, check_shard, short
from curation.audit.verify_takedowns import TakedownCheck
from curation.records import commit_files, read_commit, read_done, read_manifest
from curation.score.ledger import reason_code

STATUSES = (schema.KEPT, schema.REJECTED, schema.ERROR, schema.DUPLICATE, schema.UNSAMPLED, schema.TAKEN_DOWN)


@dataclass
class AuditResult:
    out_uri: str
    problems: list[Problem]
    counts: dict[str, int]  # what was checked: shards, shard_rows, images_decoded, inputs, ledger_rows
    seconds: float
    manifest: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self.counts.items())
        head = f"{self.out_uri}: " + ("sound" if self.ok else f"{len(self.problems)} problem(s)")
        return "\n".join([f"{head} (checked {checked}; {self.seconds:.1f} s)", *(f"  {p}" for p in self.problems)])


def funnel_key(stage: str | None, status: str, reason: str | None) -> str:
    """The manifest's funnel bucket of a final-ledger row: ``<phase>/<stage>/<status>/<reason code>``."""
    return f"{funnel_phase(stage)}/{stage}/{status}/{reason_code(reason)}"


class _Auditor:
    def __init__(self, out_uri: str, decode: bool, workers: int):
        self.out_uri, self.decode, self.workers = out_uri, decode, workers
        self.fs, self.root = resolve(out_uri)
        self.problems: list[Problem] = []
        self.counts: Counter = Counter()
        self.damaged_commits: set[str] = set()  # input shards whose commit record is damaged (reported once)
        self.takedowns = TakedownCheck(self.fs, self.root, self.problem, self.damaged, self.counts)

    def problem(self, file: str, row: int | None, what: str) -> None:
        self.problems.append(Problem(file, row, what))

    def damaged(self, rel: str, exc: DamagedRecordError) -> None:
        self.problem(rel, None, f"damaged record: {exc.problem}. {exc.what_to_do}")

    def path(self, rel: str) -> str:
        return join(self.root, rel)

    def _files_under(self, rel: str) -> list[str]:
        """Every file below ``rel`` (relative paths), hidden ones too: leftovers count as stray files."""
        base = self.path(rel)
        if not exists(self.fs, base):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True))
        return sorted(f"{rel}/{i.path[len(base) :].lstrip('/')}" for i in infos if i.type == pafs.FileType.File)

    # --- manifest and shards ---------------------------------------------------------------------------------

    def manifest(self) -> dict | None:
        if not exists(self.fs, self.path(LAYOUT.manifest)):
            self.problem(
                LAYOUT.manifest, None, "missing: the write phase has not completed (run jobs.curate to the end)"
            )
            return None
        try:
            manifest = read_manifest(self.fs, self.root)
        except DamagedRecordError as exc:
            self.damaged(LAYOUT.manifest, exc)
            return None
        missing = [k for k in ("shards", "totals", "funnel", "schema_version", "config_hash") if k not in manifest]
        if missing:
            self.problem(LAYOUT.manifest, None, f"not a manifest: no {', '.join(missing)}")
            return None
        if manifest["schema_version"] != schema.SCHEMA_VERSION:
            self.problem(
                LAYOUT.manifest,
                None,
                f"schema version {manifest['schema_version']}; this audit checks version {schema.SCHEMA_VERSION}",
            )
        shards = manifest["shards"]
        totals = {
            "shards": len(shards),
            "rows": sum(s["rows"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
        }
        for key, value in totals.items():
            if manifest["totals"].get(key) != value:
                self.problem(
                    LAYOUT.manifest,
                    None,
                    f"totals.{key} is {manifest['totals'].get(key)}, its shards add up to {value}",
                )
        previous = manifest.get("previous")
        if previous:  # the release this output is the next version of: read on this store, as training reads it
            release = previous["release"]
            path = join(path_on_store(release), LAYOUT.manifest)
            if not exists(self.fs, path):
                self.problem(
                    LAYOUT.manifest,
                    None,
                    f"the next version of {release}, whose {LAYOUT.manifest} is not on this store (training would stop)",
                )
        return manifest

    def shards(self, manifest: dict) -> list[ShardRows]:
        entries = manifest["shards"]
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            results = []
            for result in pool.map(lambda e: check_shard(self.fs, self.root, e, manifest, self.decode), entries):
                results.append(result)
                watchdog.beat(f"[audit] {len(results)}/{len(entries)} shards checked")
        listed = {f"{LAYOUT.shards}/{e['file']}" for e in entries}
        for rel in self._files_under(LAYOUT.shards):
            if rel not in listed and rel != LAYOUT.manifest and rel not in self.takedowns.replaced:
                self.problem(rel, None, "not in the manifest (a stray file: readers globbing *.parquet would read it)")
        counts = Counter(e["file"] for e in entries)
        for name, n in counts.items():
            if n > 1:
                self.problem(LAYOUT.manifest, None, f"lists {name} {n} times")
        shard_rows = []
        for problems, rows in results:
            self.problems.extend(problems)
            shard_rows.append(rows)
            self.counts["shard_rows"] += len(rows.keys)
            self.counts["images_decoded"] += rows.decoded
        self.counts["shards"] = len(entries)
        for what, attr in (("key", "keys"), ("source", "sources")):
            first: dict[str, tuple[str, int]] = {}
            for rows in shard_rows:
                for i, value in enumerate(getattr(rows, attr)):
                    if value is None:
                        continue
                    if value in first:
                        f, r = first[value]
                        self.problem(
                            rows.file,
                            i,
                            f"{what} {short(value) if what == 'key' else value} is not unique: also at {f} row {r}",
                        )
                    else:
                        first[value] = (rows.file, i)
        return shard_rows

    # --- ledger --------------------------------------------------------------------------------------------------

    def _read(self, rel: str, columns: list[str]) -> pa.Table | None:
        try:
            return pq.read_table(self.path(rel), columns=columns, filesystem=self.fs)
        except FileNotFoundError:
            self.problem(rel, None, "missing")
        except Exception as exc:  # noqa: BLE001 - damaged or foreign file
            self.problem(rel, None, f"not a readable ledger file: {type(exc).__name__}: {exc}")
        return None

    def _listed_ledger(self, manifest: dict, records: dict[str, dict]) -> dict[str, str]:
        """The final-ledger files the manifest lists, checked against the commit records: {path: shard_id}."""
        entries = manifest.get("final_ledger")
        if entries is None:
            self.problem(
                LAYOUT.manifest,
                None,
                "lists no final_ledger files (written by an older version): rerun jobs.curate with --phases write",
            )
            return {}
        listed = {}
        for entry in entries:
            rel = f"{LAYOUT.final_ledger}/{entry['file']}"
            if entry["shard_id"] not in records and entry["shard_id"] not in self.damaged_commits:
                self.problem(
                    rel, None, f"listed in the manifest for input shard {entry['shard_id']}, which has no commit record"
                )
                continue
            listed[rel] = entry["shard_id"]
            if exists(self.fs, self.path(rel)) and (digest := file_sha256(self.fs, self.path(rel))) != entry["sha256"]:
                self.problem(
                    rel,
                    None,
                    f"sha256 {short(digest)} differs from the manifest's {short(entry['sha256'])} (contents changed)",
                )
        for shard_id in sorted(set(records) - set(listed.values())):
            self.problem(LAYOUT.manifest, None, f"lists no final-ledger file for committed input shard {shard_id}")
        return listed

    def ledger(self, manifest: dict | None) -> list[dict]:
        """Check the final ledger against the commit records; return its rows with their file and row."""
        records = {}
        for path in commit_files(self.fs, self.root):
            try:
                record = read_commit(self.fs, self.root, path)
            except DamagedRecordError as exc:
                self.damaged(path[len(self.root) :].lstrip("/"), exc)
                self.damaged_commits.add(path.rsplit("/", 1)[-1].removesuffix(".json"))
                continue
            records[record["shard_id"]] = record
        for phase in ("score", *GLOBAL_PHASES):
            rel = LAYOUT.done(phase)
            if not exists(self.fs, self.path(rel)):
                self.problem(rel, None, f"missing: phase {phase} has not completed")
                continue
            try:
                done = read_done(self.fs, self.root, phase)
            except DamagedRecordError as exc:
                self.damaged(rel, exc)
                continue
            if phase == "score" and (want := done["shards"]) != len(records) + len(self.damaged_commits):
                self.problem(
                    LAYOUT.score_commits, None, f"{len(records)} input shards committed, the score phase had {want}"
                )
        self.counts["inputs"] = sum(r["rows"] for r in records.values())
        if manifest is None:  # the manifest names the final-ledger files; its absence is reported already
            return []
        expected = self._listed_ledger(manifest, records)
        for rel in self._files_under(LAYOUT.final_ledger):
            if rel not in expected and rel not in self.takedowns.replaced:
                self.problem(rel, None, "not a final-ledger file the manifest lists (a stray file)")
        columns = ["source", "shard_id", "key", "status", "stage", "reason"]
        rows: list[dict] = []
        for rel, shard_id in sorted(expected.items()):
            # a shard whose commit record is damaged (reported above): its rows still count, unchecked against inputs
            commit = records.get(shard_id)
            inputs: dict[str, tuple[str, int]] = {}
            for part in commit["ledger_files"] if commit else []:
                t = self._read(part, ["source"])
                for i, s in enumerate(t.column("source").to_pylist() if t is not None else []):
                    inputs.setdefault(s, (part, i))
            if commit and len(inputs) != commit["rows"]:
                self.problem(
                    LAYOUT.score_commit(shard_id),
                    None,
                    f"records {commit['rows']} inputs, its phase-1 ledger files hold {len(inputs)} distinct ones",
                )
            table = self._read(rel, columns)
            if table is None:
                continue
            if commit and table.num_rows != commit["rows"]:
                self.problem(rel, None, f"{table.num_rows} rows for {commit['rows']} inputs of shard {shard_id}")
            seen: dict[str, int] = {}
            for i, row in enumerate(table.to_pylist()):
                source = row["source"]
                if source in seen:
                    self.problem(rel, i, f"input {source} has a second row (first at row {seen[source]})")
                    continue
                seen[source] = i
                if commit and source not in inputs:
                    self.problem(rel, i, f"{source} is not an input of shard {shard_id}")
                if row["shard_id"] != shard_id:
                    self.problem(rel, i, f"shard_id {row['shard_id']!r}, expected {shard_id!r}")
                if row["status"] not in STATUSES:
                    self.problem(rel, i, f"unknown status {row['status']!r}")
                rows.append({**row, "file": rel, "row": i})
            for source, (part, i) in inputs.items():
                if source not in seen:
                    self.problem(rel, None, f"no row for input {source} ({part} row {i})")
        first: dict[str, dict] = {}
        for row in rows:  # an input in two shards' ledgers would be counted twice
            if row["source"] in first:
                other = first[row["source"]]
                if other["file"] != row["file"]:
                    self.problem(
                        row["file"],
                        row["row"],
                        f"input {row['source']} also has a row in {other['file']} row {other['row']}",
                    )
            else:
                first[row["source"]] = row
        self.counts["ledger_rows"] = len(rows)
        return rows

    def cross_check(self, manifest: dict, shard_rows: list[ShardRows], ledger: list[dict]) -> None:
        funnel = Counter(funnel_key(r["stage"], r["status"], r["reason"]) for r in ledger)
        for key in sorted(set(funnel) | set(manifest["funnel"])):
            if funnel.get(key, 0) != manifest["funnel"].get(key, 0):
                self.problem(
                    LAYOUT.manifest,
                    None,
                    f"funnel {key}: the manifest says {manifest['funnel'].get(key, 0)}, the "
                    f"final ledger has {funnel.get(key, 0)}",
                )
        by_source = {r["source"]: r for r in ledger}
        in_shards = set()
        for rows in shard_rows:
            for i, (key, source) in enumerate(zip(rows.keys, rows.sources)):
                if source is None:
                    continue
                in_shards.add(source)
                entry = by_source.get(source)
                if entry is None:
                    self.problem(rows.file, i, f"{source} has no final-ledger row")
                elif entry["status"] != schema.KEPT:
                    self.problem(
                        rows.file,
                        i,
                        f"{source} is in a shard but {entry['file']} row {entry['row']} says {entry['status']}",
                    )
                elif entry["key"] != key:
                    self.problem(
                        rows.file,
                        i,
                        f"key {short(key)} differs from {entry['file']} row {entry['row']}'s {short(entry['key'])}",
                    )
        for r in ledger:
            if r["status"] == schema.KEPT and r["source"] not in in_shards:
                self.problem(r["file"], r["row"], f"{r['source']} is kept but no readable shard row holds it")


def audit(out_uri: str, *, decode: bool = True, workers: int | None = None) -> AuditResult:
    """Verify the curated output at ``out_uri`` (local or ``s3://``); see the module docstring for the checks."""
    start = time.monotonic()
    auditor = _Auditor(out_uri, decode, workers or min(8, os.cpu_count() or 1))
    auditor.takedowns.load()
    manifest = auditor.manifest()
    shard_rows = auditor.shards(manifest) if manifest else []
    ledger = auditor.ledger(manifest)
    if manifest:
        auditor.cross_check(manifest, shard_rows, ledger)
        auditor.takedowns.check(manifest)
    order = {p: i for i, p in enumerate(auditor.problems)}  # stable: by file, then row, then finding order
    problems = sorted(dict.fromkeys(auditor.problems), key=lambda p: (p.file, -1 if p.row is None else p.row, order[p]))
    counts = {k: auditor.counts[k] for k in ("shards", "shard_rows", "images_decoded", "inputs", "ledger_rows")}
    return AuditResult(out_uri, problems, counts, time.monotonic() - start, manifest)
