"""Takedown: listed images leave the published shards, the ledger says so, the audit proves it, and they stay out."""

import datetime as dt
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, CountedTask

from common import schema
from common.layout import LAYOUT, TAKEDOWN
from curation.audit.verify import audit
from curation.phases.write import takedown as td
from curation.score.ledger import read_ledger
from curation.steps.output import Output, claim_output
from jobs import curate
from jobs import takedown as job


@pytest.fixture()
def out(wds_curated_run, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(wds_curated_run[1], copy)
    return copy


def _manifest(out: Path) -> dict:
    return json.loads((out / LAYOUT.manifest).read_text())


def _rows(out: Path) -> list[dict]:
    files = [out / LAYOUT.shards / s["file"] for s in _manifest(out)["shards"]]
    return pa.concat_tables([pq.read_table(f, columns=["key", "source", "metadata"]) for f in files]).to_pylist()


def _list(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "takedown.txt"
    path.write_text("# requests of 2026-12-01\n\n" + "\n".join(entries) + "\n")
    return path


def _ledger(out: Path) -> dict[str, dict]:
    return {r["source"]: r for r in read_ledger(str(out), ["source", "status", "stage", "reason"]).to_pylist()}


def _three_entries(out: Path) -> tuple[list[str], set[str]]:
    """A key, a source and a URL naming three different kept images, and their sources."""
    a, b, c = _rows(out)[:3]
    return [a["key"], b["source"], c["metadata"]["url"]], {a["source"], b["source"], c["source"]}


def test_listed_images_by_key_source_and_url_are_taken_down(out, tmp_path, capsys):
    entries, sources = _three_entries(out)
    before = _manifest(out)
    listed = _list(tmp_path, *entries, "0" * 64)  # a key that is not in the output: nothing to remove for it
    argv = ["--output", str(out), "--list", str(listed), "--by", "legal@example.org", "--grace-minutes", "0"]
    assert job.main(argv) == 0
    assert "3 images of list" in capsys.readouterr().out
    manifest = _manifest(out)
    assert manifest["version"] == before["version"] + 1 == 2
    assert manifest["totals"]["rows"] == before["totals"]["rows"] - 3
    assert not sources & {r["source"] for r in _rows(out)}
    ledger = _ledger(out)
    for source in sources:
        assert ledger[source]["status"] == schema.TAKEN_DOWN and ledger[source]["stage"] == "takedown"
        assert ledger[source]["reason"].startswith(f"taken_down: listed in {listed}")
    assert sum(r["status"] == schema.TAKEN_DOWN for r in ledger.values()) == 3
    (record,) = td.takedown_records(*td.resolve(str(out)))
    assert record["by"] == "legal@example.org" and record["status"] == "done" and record["purged"]
    assert {r["source"] for r in record["removed"]} == sources
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


def test_replaced_files_stay_for_their_grace_then_go(out, tmp_path):
    entries, _ = _three_entries(out)
    previous = _manifest(out)
    assert job.main(["--output", str(out), "--list", str(_list(tmp_path, entries[0])), "--grace-minutes", "30"]) == 0
    # a trainer that indexed the previous manifest still finds every file it lists
    assert all((out / LAYOUT.shards / s["file"]).exists() for s in previous["shards"])
    assert audit(str(out)).ok
    # once the grace has passed, the audit says the old file may hold the image, and the next run deletes it
    path = out / td.record_path(td.read_list(str(_list(tmp_path, entries[0]))).id)
    record = json.loads(path.read_text())
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)).isoformat()
    path.write_text(json.dumps({**record, "delete_after": past}))
    problems = audit(str(out)).problems
    assert problems and all("kept past its grace" in p.what for p in problems)
    assert job.main(["--output", str(out), "--list", str(_list(tmp_path, entries[0]))]) == 0
    assert audit(str(out)).ok
    assert not any((out / rel).exists() for rel in record["superseded"])


@pytest.mark.parametrize("where", ["before the switch", "after the switch"])
def test_a_takedown_killed_midway_and_rerun_removes_exactly_the_listed(out, tmp_path, monkeypatch, where):
    entries, sources = _three_entries(out)
    lst = td.read_list(str(_list(tmp_path, *entries)))
    kept_before = {r["source"] for r in _rows(out)}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        if where == "before the switch":
            m.setattr(td, "write_json_atomic", _fail_on_manifest(td.write_json_atomic))
        else:
            m.setattr(td, "write_card", killed)
        with pytest.raises(KeyboardInterrupt):
            td.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert audit(str(out)).problems  # the record says the takedown did not finish
    if where == "before the switch":  # every step had finished: the rerun finishes from their records, no task runs
        for step, task in (
            (td._Scan, td._scan),
            (td._RewriteShards, td._rewrite_shard),
            (td._RewriteLedger, td._rewrite_ledger),
        ):
            monkeypatch.setattr(step, "task", CountedTask(task, kill_at=0))
    record = td.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert {r["source"] for r in record["removed"]} == sources
    assert {r["source"] for r in _rows(out)} == kept_before - sources
    assert _manifest(out)["version"] == 2
    result = audit(str(out))
    assert result.ok, result.summary()


def test_a_takedown_killed_between_units_reruns_only_the_rest(out, tmp_path, monkeypatch):
    shards = pa.concat_tables(pq.read_table(out / LAYOUT.shards / s["file"]) for s in _manifest(out)["shards"])
    firsts = {}  # an image of each input shard: one final-ledger file each to rewrite
    for row in shards.select(["key", "source", "shard_id"]).to_pylist():
        firsts.setdefault(row["shard_id"], row)
    picked = list(firsts.values())
    assert len(picked) >= 2
    lst = td.read_list(str(_list(tmp_path, *(r["key"] for r in picked))))
    monkeypatch.setattr(td, "task_window", lambda: 1)  # one task in flight: the first file is done when it is killed
    monkeypatch.setattr(td._RewriteLedger, "task", CountedTask(td._rewrite_ledger, kill_at=1))
    with pytest.raises(KeyboardInterrupt):
        td.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert len(list((out / LAYOUT.step_units(TAKEDOWN, "ledger")).glob("*.json"))) == 1

    resumed = CountedTask(td._rewrite_ledger)
    monkeypatch.setattr(td._RewriteLedger, "task", resumed)
    record = td.run_takedown(str(out), lst, by="t", grace_minutes=0)
    assert resumed.launched == len(picked) - 1
    assert {r["source"] for r in record["removed"]} == {r["source"] for r in picked}
    assert all(_ledger(out)[r["source"]]["status"] == schema.TAKEN_DOWN for r in picked)
    result = audit(str(out))
    assert result.ok, result.summary()


def _fail_on_manifest(write):
    def write_json(fs, path, obj):
        if path.endswith(LAYOUT.manifest):
            raise KeyboardInterrupt("killed before the switch")
        write(fs, path, obj)

    return write_json


def test_a_later_write_phase_keeps_taken_down_images_out(out, tmp_path):
    entries, sources = _three_entries(out)
    assert job.main(["--output", str(out), "--list", str(_list(tmp_path, *entries)), "--grace-minutes", "0"]) == 0
    pool = next(iter(_ledger(out))).split(".tar#")[0].rsplit("/", 1)[0]
    argv = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", pool, "--output", str(out)]
    assert curate.main([*argv, "--phases", "write", "write.rows_per_shard=2"]) == 0
    assert not sources & {r["source"] for r in _rows(out)}
    assert all(_ledger(out)[s]["status"] == schema.TAKEN_DOWN for s in sources)
    result = audit(str(out))
    assert result.ok, result.summary()
    # a new run on the output discards its results, never its takedowns
    records = sorted(p.name for p in (out / LAYOUT.takedowns).iterdir())
    claim_output(Output.at(str(out)), "another-config", pool, new_run=True)
    assert sorted(p.name for p in (out / LAYOUT.takedowns).iterdir()) == records and not (out / LAYOUT.scored).exists()


def test_a_bad_list_is_refused_before_anything_is_written(out, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    for listed, message in ((tmp_path / "missing.txt", "no such list"), (tmp_path / "empty.txt", "holds no entries")):
        assert job.main(["--output", str(out), "--list", str(listed)]) == 2
        assert message in capsys.readouterr().err
    assert not (out / LAYOUT.takedowns).exists() and not (out / LAYOUT.lease).exists()
