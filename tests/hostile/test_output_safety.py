"""Outputs that two runs, a rewrite or a tampered file cannot corrupt: one lease holder per output, the manifest as
the commit point of the final files, training that reads only what a manifest lists (sha256 checked on request),
and an object-store data root used as given, query included."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import load_config
from common.layout import LAYOUT
from common.lease import Lease, LeaseHeld, LeaseLost
from curation.config import CurateConfig
from curation.phases.pipeline import GlobalPhases
from curation.steps.output import Output
from jobs import curate
from jobs import pretrain as pretrain_job
from pretrain import data

REPO = Path(__file__).resolve().parents[2]
LITE = str(REPO / "configs/curate/lite.yaml")
CURATED_WITH = ["write.rows_per_shard=4"]  # the settings of conftest's curated_run


def _foreign_lease(root: Path, heartbeat_age: float) -> dict:
    """A lease record as another machine's run would have left it."""
    now = time.time()
    record = {
        "token": "0" * 32,
        "command": "jobs.curate",
        "host": "other-node",
        "pid": 4242,
        "process": "4242:1",
        "machine": "elsewhere",
        "ray_job": "raysubmit_other",
        "started": now - 3600,
        "heartbeat": now - heartbeat_age,
    }
    path = root / LAYOUT.lease
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


def _listed(out: Path) -> list[str]:
    return [s["file"] for s in json.loads((out / LAYOUT.manifest).read_text())["shards"]]


@pytest.fixture
def out(curated_run, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(curated_run, dst)
    return dst


# --- the lease ------------------------------------------------------------------------------------------------------


def test_of_racing_claimants_exactly_one_wins_and_the_others_are_told_who(tmp_path):
    start, outcomes = threading.Barrier(4), []

    def claim() -> None:
        lease = Lease(str(tmp_path / "out"), holder="jobs.curate", settle_s=0.3)
        start.wait()
        try:
            outcomes.append(lease.acquire())
        except LeaseHeld as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if isinstance(o, Lease)]
    assert len(winners) == 1 and len(outcomes) == 4
    for refusal in (str(o) for o in outcomes if isinstance(o, LeaseHeld)):
        assert f"jobs.curate (host {socket.gethostname()}, pid {os.getpid()})" in refusal
        assert "last heartbeat" in refusal and "--break-lease" in refusal
    winners[0].check()
    winners[0].release()
    assert not (tmp_path / "out" / LAYOUT.lease).exists()


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(tmp_path, caplog):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from common.lease import Lease; "
            f"Lease({str(out)!r}, holder='jobs.curate', settle_s=0).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
            Lease(str(out), settle_s=0).acquire()
    finally:
        holder.kill()
        holder.wait()
    caplog.set_level(logging.INFO, logger="common.lease")
    Lease(str(out), settle_s=0).acquire().release()
    assert "has ended" in caplog.messages[0]


def test_a_stale_lease_is_taken_over_and_a_live_one_is_not(tmp_path, caplog):
    root = tmp_path / "out"
    _foreign_lease(root, heartbeat_age=20)
    with pytest.raises(LeaseHeld) as refused:
        Lease(str(root), settle_s=0).acquire()
    assert "host other-node" in str(refused.value) and "Ray job raysubmit_other" in str(refused.value)
    assert "last heartbeat 20 s ago" in str(refused.value)
    _foreign_lease(root, heartbeat_age=600)
    caplog.set_level(logging.INFO, logger="common.lease")
    lease = Lease(str(root), settle_s=0).acquire()
    assert "heartbeat is 10 min old" in caplog.messages[0]
    lease.release()


def test_a_heartbeat_that_finds_the_lease_taken_reports_the_loss(tmp_path):
    lost = threading.Event()
    holder = Lease(str(tmp_path), heartbeat_s=0.05, stale_s=1, settle_s=0, on_lost=lambda _: lost.set()).acquire()
    for _ in range(5):  # a heartbeat landing inside the breaker's settle time wins that round: the breaker retries
        try:
            Lease(str(tmp_path), settle_s=0.1).acquire(force=True)
            break
        except LeaseHeld:
            continue
    assert lost.wait(5) and not holder.held
    with pytest.raises(LeaseLost, match="lost its lease"):
        holder.check()


def test_curate_refuses_a_held_output_and_break_lease_takes_it(out, sample_pool, ray_local, capsys):
    _foreign_lease(out, heartbeat_age=5)
    args = ["--config", LITE, "--input", str(sample_pool), "--output", str(out), "--phases", "write", *CURATED_WITH]
    assert curate.main(args) == 2
    err = capsys.readouterr().err
    assert "is leased by another run" in err and "host other-node" in err and "--break-lease" in err
    assert curate.main([*args, "--break-lease"]) == 0
    assert "taking over the lease" in capsys.readouterr().out
    assert not (out / LAYOUT.lease).exists()  # given back at the end


# --- the manifest is the commit point -------------------------------------------------------------------------------


def test_a_rewrite_switches_readers_from_the_whole_old_set_to_the_whole_new_one(out, ray_local):
    """The write phase is rewritten with other settings; its holder loses the lease after the new shards are
    written: the manifest is not switched and readers keep the old set. A rerun switches, then cleans."""
    old_manifest = (out / LAYOUT.manifest).read_bytes()
    old = data.DataIndex.scan(str(out / "shards"))
    cfg = load_config(CurateConfig, LITE, ["write.rows_per_shard=3"])
    holder = Lease(str(out), settle_s=0).acquire()
    rival = Lease(str(out), settle_s=0)
    seen_during = []

    def guard() -> None:  # before the phase's deletions, before the manifest switch, before the done record
        if not rival.held and len(list((out / "shards").glob("part-*-*.parquet"))) > len(old.files):
            rival.acquire(force=True)  # a second run takes the output while the new shards sit beside the old
            seen_during.append(data.DataIndex.scan(str(out / "shards")))
        holder.check()

    with pytest.raises(LeaseLost):
        GlobalPhases(cfg, Output.at(str(out)), guard=guard).run("write")
    assert (out / LAYOUT.manifest).read_bytes() == old_manifest
    during = seen_during[0]
    assert during.files == old.files and during.num_samples == old.num_samples
    assert set(old.files) < {p.name for p in (out / "shards").glob("*.parquet")}  # the new files lie beside
    for name in during.files:
        assert during.open(name).metadata.num_rows > 0  # every listed file is there, whole
    rival.release()
    holder.release()

    rerun = Lease(str(out), settle_s=0).acquire()
    GlobalPhases(cfg, Output.at(str(out)), guard=rerun.check).run("write")
    rerun.release()
    new = data.DataIndex.scan(str(out / "shards"), verify_sha256=True)
    assert new.num_samples == old.num_samples and set(new.files).isdisjoint(old.files)
    assert sorted(p.name for p in (out / "shards").iterdir()) == sorted([*new.files, "manifest.json"])
    listed_ledger = {e["file"] for e in json.loads((out / LAYOUT.manifest).read_text())["final_ledger"]}
    assert {p.name for p in (out / "final_ledger").iterdir()} == listed_ledger


def test_a_resumed_phase_removes_the_temporaries_of_writes_a_kill_cut_short(out, ray_local):
    """A kill inside an atomic write leaves its ``_tmp-`` file: in _state/ (a done record) and in a phase's partition
    folders. The rerun of that phase, holding the lease, removes them and ends with the same files."""
    cfg = load_config(CurateConfig, LITE, CURATED_WITH)
    (out / "_state" / "sample.done.json").unlink()  # killed while writing sample's done record
    (out / "_state" / "write.done.json").unlink()
    leftovers = [
        out / "_state" / "_tmp-0badc0de-sample.done.json",
        out / "sample" / "decisions" / "_tmp-0badc0de-part-0.parquet",
    ]
    for path in leftovers:
        path.write_bytes(b"cut short")
    decisions = {p.name: p.read_bytes() for p in (out / "sample" / "decisions").glob("part-*.parquet")}
    lease = Lease(str(out), settle_s=0).acquire()
    GlobalPhases(cfg, Output.at(str(out)), guard=lease.check).run("sample")
    lease.release()
    assert not [p for p in leftovers if p.exists()]
    assert not list(out.rglob("_tmp-*"))
    assert {p.name: p.read_bytes() for p in (out / "sample" / "decisions").glob("part-*.parquet")} == decisions


def test_training_reads_only_what_the_manifest_lists(out):
    shards = out / "shards"
    shutil.copy(shards / _listed(out)[0], shards / "part-99999-stray.parquet")
    index = data.DataIndex.scan(str(shards))
    assert index.files == _listed(out) and "part-99999-stray.parquet" not in index.files
    (shards / "manifest.json").unlink()
    with pytest.raises(data.DataError, match=r"no manifest.json: training reads only the files a manifest lists"):
        data.DataIndex.scan(str(shards))


def test_sha256_verification_catches_a_modified_shard(out, tmp_path, capsys):
    shards, run = out / "shards", tmp_path / "runs" / "verify"
    data.ensure_index(str(shards), str(run), verify_sha256=True)
    victim = shards / _listed(out)[1]
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 3] ^= 0xFF  # inside the data pages: the footer and row counts still read
    victim.write_bytes(bytes(damaged))
    assert data.DataIndex.scan(str(shards)).num_samples > 0  # not asked to verify: not read
    with pytest.raises(data.DataError, match=f"1 shard\\(s\\) .* not the bytes the manifest lists: {victim.name}"):
        data.DataIndex.scan(str(shards), verify_sha256=True)
    args = [
        "--config",
        str(REPO / "configs/pretrain/tiny.yaml"),
        "--data",
        str(shards),
        "--storage",
        str(run.parent),
        "--name",
        run.name,
        "data.verify_sha256=true",
    ]
    assert pretrain_job.main(args) == 2  # the resumed run checks the data of its saved index again
    assert victim.name in capsys.readouterr().err


# --- an object-store data root with a query -------------------------------------------------------------------------


def test_an_s3_data_root_with_endpoint_override_is_indexed_and_read(s3, curated_run, tmp_path):
    import pyarrow.fs as pafs

    fs, query = s3
    pafs.copy_files(
        str(curated_run / "shards"),
        "curated/shards",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
        use_threads=False,
    )
    uri = f"s3://curated/shards{query}"
    run = tmp_path / "run"
    index = data.ensure_index(uri, str(run), verify_sha256=True)
    assert index.files == _listed(curated_run)  # names relative to the root, the query kept in index.root only
    saved = pq.read_schema(run / data.INDEX_FILE).metadata
    assert saved[b"humans1b.data_root"] == b"s3://curated/shards"  # no query, no credentials in the run directory
    index = data.load_index(str(run), uri)
    order = data.EpochOrder(index, seed=0, epoch=0)
    segments = pa.Table.from_pylist(order.segments(0, index.num_samples))
    batch = data.read_segments(segments, index.root, (32, 24), person_crop=True)
    assert batch["image"].shape == (index.num_samples, 32, 24, 3) and len(set(batch["key"])) == index.num_samples

    lease = Lease(f"s3://curated/out{query}", settle_s=0.2).acquire()  # the lease works there too
    with pytest.raises(LeaseHeld):
        Lease(f"s3://curated/out{query}", settle_s=0.2).acquire()
    lease.release()
    assert fs.get_file_info(f"curated/out/{LAYOUT.lease}").type == pafs.FileType.NotFound


def test_an_index_saved_before_relative_names_still_loads(curated_run):
    """Version 1 of the run's index held absolute paths (or URIs) and no version; it reads as relative names."""
    shards = curated_run / "shards"
    index = data.DataIndex.scan(str(shards))
    v1 = index.to_table().drop_columns(["sha256"]).replace_schema_metadata(None)
    v1 = v1.set_column(0, "file", pa.array([str(shards / f) for f in v1.column("file").to_pylist()]))
    for data_uri in (str(shards), None):  # the data folder as given, or the folder the paths share
        loaded = data.DataIndex.from_table(v1, data_uri)
        assert loaded.files == sorted(index.files) and loaded.root == str(shards)
        assert loaded.open(loaded.files[0]).metadata.num_rows == int(loaded.rows[loaded.file == 0].sum())
