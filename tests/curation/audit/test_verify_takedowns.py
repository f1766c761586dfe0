"""The audit's takedown checks on an output laid out by hand: an unfinished takedown, a replaced file kept past its
grace, one still in its grace, and a listed image left in a listed shard are each reported once."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from common.layout import LAYOUT
from common.storage import DamagedRecordError, resolve
from curation.audit.verify_takedowns import TakedownCheck


def _record(out, list_id: str, status: str, superseded: list[str], delete_after: dt.datetime, entries: list[str]):
    (out / LAYOUT.takedowns).mkdir(parents=True, exist_ok=True)
    record = {
        "id": list_id,
        "list": f"{list_id}.txt",
        "at": "2026-12-01T00:00:00+00:00",
        "status": status,
        "superseded": superseded,
        "delete_after": delete_after.isoformat(),
    }
    (out / LAYOUT.takedown_record(list_id)).write_text(json.dumps(record))
    pq.write_table(pa.table({"entry": pa.array(entries, pa.string())}), out / LAYOUT.takedown_entries(list_id))


def test_takedown_findings_name_the_file_the_row_and_what_to_do(tmp_path):
    out = tmp_path / "out"
    (out / LAYOUT.shards).mkdir(parents=True)
    now = dt.datetime.now(dt.UTC)
    old = f"{LAYOUT.shards}/part-00000-old.parquet"
    (out / old).write_bytes(b"replaced")
    _record(out, "t1", "running", [old], now - dt.timedelta(days=1), ["s3://pool/b.jpg"])
    _record(out, "t2", "done", [f"{LAYOUT.final_ledger}/x.parquet"], now + dt.timedelta(days=7), ["deadbeef"])
    shard = pa.table(
        {"key": ["k0", "deadbeef", "k2"], "source": ["s3://pool/a.jpg", "s3://pool/c.jpg", "s3://pool/b.jpg"]}
    )
    pq.write_table(shard, out / LAYOUT.shards / "part-00000-new.parquet")

    found: list[tuple] = []
    counts: Counter = Counter()
    fs, root = resolve(str(out))
    check = TakedownCheck(fs, root, lambda *p: found.append(p), lambda *d: found.append(d), counts)
    check.load()
    check.check({"shards": [{"file": "part-00000-new.parquet"}, {"file": "missing.parquet"}]})
    assert check.replaced == {old, f"{LAYOUT.final_ledger}/x.parquet"}
    assert counts["replaced_in_grace"] == 1
    assert found == [
        (LAYOUT.takedown_record("t1"), None, "a takedown that did not finish: run the same jobs.takedown command again"),
        (old, None, f"replaced by takedown t1 and kept past its grace ({(now - dt.timedelta(days=1)).isoformat()}): "
         "it may hold a taken-down image; run jobs.takedown again to delete it"),
        (f"{LAYOUT.shards}/part-00000-new.parquet", 2, "holds s3://pool/b.jpg, which takedown t1 removed"),
        (f"{LAYOUT.shards}/part-00000-new.parquet", 1, "holds s3://pool/c.jpg, which takedown t2 removed"),
    ]  # fmt: skip


def test_a_damaged_takedown_record_is_one_finding_and_nothing_else_is_checked(tmp_path):
    out = tmp_path / "out"
    (out / LAYOUT.takedowns).mkdir(parents=True)
    (out / LAYOUT.takedown_record("t1")).write_text("{")
    found: list[tuple] = []
    fs, root = resolve(str(out))
    check = TakedownCheck(fs, root, lambda *p: found.append(p), lambda *d: found.append(d), Counter())
    check.load()
    check.check({"shards": []})
    [(rel, exc)] = found
    assert rel == LAYOUT.takedowns and isinstance(exc, DamagedRecordError) and "not valid JSON" in exc.problem
    assert check.records == [] and check.replaced == set()
