"""A takedown run: listed images leave the published shards, the ledger says so, the audit proves it, a kill
anywhere is finished by the same command, and the replaced files go once their grace has passed."""

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CountedTask

from common import schema
from common import takedown_lists as td
from common.layout import LAYOUT, TAKEDOWN
from common.storage import resolve
from curation.audit.verify import audit
from curation.phases.write import takedown_run
from jobs import takedown as job


def test_listed_images_by_key_source_and_url_are_taken_down(
    out, capsys, three_entries, takedown_list, manifest_of, rows_of, ledger_of
):
    entries, sources = three_entries(out)
    before = manifest_of(out)
    listed = takedown_list(*entries, "0" * 64)  # a key that is not in the output: nothing to remove for it
    argv = ["--output", str(out), "--list", str(listed), "--by", "legal@example.org", "--grace-minutes", "0"]
    assert job.main(argv) == 0
    assert "3 images of list" in capsys.readouterr().out
    manifest = manifest_of(out)
    assert manifest["version"] == before["version"] + 1 == 2
    assert manifest["totals"]["rows"] == before["totals"]["rows"] - 3
    assert not sources & {r["source"] for r in rows_of(out)}
    ledger = ledger_of(out)
    for source in sources:
        assert ledger[source]["status"] == schema.TAKEN_DOWN and ledger[source]["stage"] == "takedown"
        assert ledger[source]["reason"].startswith(f"taken_down: listed in {listed}")
    assert sum(r["status"] == schema.TAKEN_DOWN for r in ledger.values()) == 3
    (record,) = td.takedown_records(*resolve(str(out)))
    assert record["by"] == "legal@example.org" and record["status"] == "done" and record["purged"]
    assert {r["source"] for r in record["removed"]} == sources
    # the rows taken out of each replaced shard, for a trainer that indexed it (gone at once with no grace)
    assert sum(map(len, record["removed_rows"].values())) == 3
    assert {f"shards/{name}" for name in record["removed_rows"]} <= set(record["superseded"])
    # only the shards that held them were rewritten; the replaced files are gone (no grace)
    unchanged = {s["file"] for s in before["shards"]} & {s["file"] for s in manifest["shards"]}
    assert len(unchanged) >= len(before["shards"]) - 3
    on_disk = {p.name for p in (out / LAYOUT.shards).glob("part-*.parquet")}
    assert on_disk == {s["file"] for s in manifest["shards"]}
    assert f"{manifest['totals']['rows']} human-centric images" in (out / LAYOUT.card).read_text()
    result = audit(str(out))
    assert result.ok, result.summary()

    # the same command again changes nothing
    snapshot = (out / LAYOUT.manifest).read_bytes()
    assert job.main(argv) == 0
    assert (out / LAYOUT.manifest).read_bytes() == snapshot


def test_replaced_files_stay_for_their_grace_then_go(out, three_entries, takedown_list, manifest_of):
    entries, _ = three_entries(out)
    previous = manifest_of(out)
    assert job.main(["--output", str(out), "--list", str(takedown_list(entries[0])), "--grace-minutes", "30"]) == 0
    # a trainer that indexed the previous manifest still finds every file it lists
    assert all((out / LAYOUT.shards / s["file"]).exists() for s in previous["shards"])
    assert audit(str(out)).ok
    # once the grace has passed, the audit says the old file may hold the image, and the next run deletes it
    path = out / td.record_path(td.read_list(str(takedown_list(entries[0]))).id)
    record = json.loads(path.read_text())
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    path.write_text(json.dumps({**record, "delete_after": past}))
    problems = audit(str(out)).problems
    assert problems and all("kept past its grace" in p.what for p in problems)
    assert job.main(["--output", str(out), "--list", str(takedown_list(entries[0]))]) == 0
    assert audit(str(out)).ok
    assert not any((out / rel).exists() for rel in record["superseded"])


@pytest.mark.parametrize("where", ["before the switch", "after the switch"])
def test_a_takedown_killed_midway_and_rerun_removes_exactly_the_listed(
    out, monkeypatch, where, three_entries, takedown_list, manifest_of, rows_of
):
    entries, sources = three_entries(out)
    lst = td.read_list(str(takedown_list(*entries)))
    kept_before = {r["source"] for r in rows_of(out)}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        if where == "before the switch":
            m.setattr(takedown_run, "write_json_atomic", _fail_on_manifest(takedown_run.write_json_atomic))
        else:
            m.setattr(takedown_run, "write_card", killed)
        with pytest.raises(KeyboardInterrupt):
            takedown_run.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert audit(str(out)).problems  # the record says the takedown did not finish
    if where == "before the switch":  # every step had finished: the rerun finishes from their records, no task runs
        for step, task in (
            (takedown_run._Scan, takedown_run._scan),
            (takedown_run._RewriteShards, takedown_run._rewrite_shard),
            (takedown_run._RewriteLedger, takedown_run._rewrite_ledger),
        ):
            monkeypatch.setattr(step, "task", CountedTask(task, kill_at=0))
    record = takedown_run.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert {r["source"] for r in record["removed"]} == sources
    # the rows taken out of each replaced shard, for a trainer that indexed it (gone at once with no grace)
    assert sum(map(len, record["removed_rows"].values())) == 3
    assert {f"shards/{name}" for name in record["removed_rows"]} <= set(record["superseded"])
    assert {r["source"] for r in rows_of(out)} == kept_before - sources
    assert manifest_of(out)["version"] == 2
    result = audit(str(out))
    assert result.ok, result.summary()


def test_a_takedown_killed_between_units_reruns_only_the_rest(out, monkeypatch, takedown_list, manifest_of, ledger_of):
    shards = pa.concat_tables(pq.read_table(out / LAYOUT.shards / s["file"]) for s in manifest_of(out)["shards"])
    firsts = {}  # an image of each input shard: one final-ledger file each to rewrite
    for row in shards.select(["key", "source", "shard_id"]).to_pylist():
        firsts.setdefault(row["shard_id"], row)
    picked = list(firsts.values())
    assert len(picked) >= 2
    lst = td.read_list(str(takedown_list(*(r["key"] for r in picked))))
    # one task in flight: the first file is done when it is killed
    monkeypatch.setattr(takedown_run, "task_window", lambda: 1)
    monkeypatch.setattr(takedown_run._RewriteLedger, "task", CountedTask(takedown_run._rewrite_ledger, kill_at=1))
    with pytest.raises(KeyboardInterrupt):
        takedown_run.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert len(list((out / LAYOUT.step_units(TAKEDOWN, "ledger")).glob("*.json"))) == 1

    resumed = CountedTask(takedown_run._rewrite_ledger)
    monkeypatch.setattr(takedown_run._RewriteLedger, "task", resumed)
    record = takedown_run.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert resumed.launched == len(picked) - 1
    assert {r["source"] for r in record["removed"]} == {r["source"] for r in picked}
    assert all(ledger_of(out)[r["source"]]["status"] == schema.TAKEN_DOWN for r in picked)
    result = audit(str(out))
    assert result.ok, result.summary()


def _fail_on_manifest(write):
    def write_json(fs, path, obj):
        if path.endswith(LAYOUT.manifest):
            raise KeyboardInterrupt("killed before the switch")
        write(fs, path, obj)

    return write_json
