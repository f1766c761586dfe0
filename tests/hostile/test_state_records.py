"""Damaged state records: a rerun of jobs.curate on an output whose commit, run, done or manifest record is truncated,
garbage or of the wrong shape stops with one error line that names the file and says what to do, never a traceback,
and doing what it says finishes the run. Also: the peak memory of the processes that scored each input shard, in its
commit record and on the console."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from common.layout import LAYOUT
from common.lease import Lease, LeaseHeld, LeaseLost
from common.storage import DamagedRecordError, display_path, read_json
from curation.audit.verify import audit
from curation.config import CurateConfig
from curation.score.pool import Pool
from curation.steps.output import Output
from generators.sample_pool import ultralytics_assets
from jobs import audit as audit_job
from jobs import curate

REPO = Path(__file__).resolve().parents[2]
LITE = str(REPO / "configs/curate/lite.yaml")
# Two input shards; a request below any process's size so that every shard is warned about.
SETTINGS = ["input.files_per_shard=2", "input.task_memory_mb=64"]

DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "garbage": lambda data: b"\x89PNG\r\n\x1a\n\x00\xff\xfe" + data[:8],
    "wrong type": lambda data: b'["not", "a", "record"]',
}


def _args(pool: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", LITE, "--input", str(pool), "--output", str(out), *extra, *SETTINGS]


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    """Two people photos, a mirrored copy of one (a near-duplicate) and a file that is no image."""
    from PIL import Image, ImageOps

    root = tmp_path_factory.mktemp("records_pool")
    assets = ultralytics_assets()
    for name in ("bus.jpg", "zidane.jpg"):
        shutil.copy(assets / name, root / name)
    ImageOps.mirror(Image.open(assets / "bus.jpg")).save(root / "bus_flip.jpg", quality=90)
    (root / "notes.jpg").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def finished(pool, ray_local, tmp_path_factory) -> tuple[Path, str]:
    """One complete run (all four phases) and its console; copy the output before changing it."""
    out = tmp_path_factory.mktemp("records_run") / "out"
    console = io.StringIO()
    with redirect_stdout(console):
        assert curate.main(_args(pool, out)) == 0
    return out, console.getvalue()


@pytest.fixture
def out(finished, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(finished[0], dst)
    return dst


def _commit_file(out: Path) -> Path:
    return sorted((out / LAYOUT.score_commits).glob("*.json"))[0]


# record -> (its file in an output, what the advice must say)
RECORDS = {
    "commit": (
        _commit_file,
        ["commit record (phase score)", "To score that shard again, delete it and", "/_state/{dedup,sample,write}."],
    ),
    "run": (lambda out: out / LAYOUT.run_record, ["If this command made the output, write it back as", "--new-run"]),
    "dedup done": (lambda out: out / LAYOUT.done("dedup"), ["To redo phase dedup, delete it and rerun the same"]),
    "write done": (lambda out: out / LAYOUT.done("write"), ["To redo phase write, delete it and rerun the same"]),
    "manifest": (
        lambda out: out / LAYOUT.manifest,
        ["the commit point of the final shards", "/_state/write.done.json and rerun the same jobs.curate command"],
    ),
}


def _one_error(capsys) -> str:
    """The one error line a failed job printed; fails on a traceback or a second error line."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.err[-3000:]
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, captured.err[-3000:]
    return errors[0]


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("record", list(RECORDS))
def test_a_damaged_record_stops_the_rerun_naming_the_file_and_what_to_do(record, damage, pool, out, capsys):
    locate, advice = RECORDS[record]
    path = locate(out)
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    capsys.readouterr()
    assert curate.main(_args(pool, out)) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: damaged record {path}: "), line
    problem = {"truncated": "not valid JSON", "garbage": "not UTF-8 text", "wrong type": "holds an array"}[damage]
    assert problem in line, line
    for words in advice:
        assert words in line, line
    if record == "commit":  # the later phases' records it names are the ones this output holds
        assert f"{out}/_state/{{dedup,sample,write}}.done.json" in line


@pytest.mark.parametrize("record, field", [("commit", "ledger_files"), ("manifest", "final_ledger"), ("run", "input")])
def test_a_record_missing_a_field_it_needs_is_damaged(record, field, pool, out, capsys):
    path = RECORDS[record][0](out)
    data = json.loads(path.read_text())
    del (data["receipt"] if record == "commit" else data)[field]  # a commit record is its shard's unit receipt
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert curate.main(_args(pool, out)) == 2
    line = _one_error(capsys)
    shown = f"receipt.{field}" if record == "commit" else field
    assert line.startswith(f"error: damaged record {path}: has no {shown!r} field."), line


@pytest.mark.parametrize(
    "phase, damaged, advice",
    [
        (
            "dedup",
            lambda out: out / LAYOUT.step_started("dedup", "survey"),
            "It is a started record of a step of phase dedup. Delete it and rerun the same command: the step starts",
        ),
        (
            "dedup",
            lambda out: sorted((out / LAYOUT.step_units("dedup", "survey")).glob("*.json"))[0],
            "It is a unit record of a step of phase dedup. Delete it and rerun the same command: that unit is done",
        ),
    ],
    ids=["start record", "unit receipt"],
)
def test_records_read_while_a_phase_runs_are_named_too(phase, damaged, advice, pool, out, capsys):
    # so that the phase and its first step run again and read them
    (out / LAYOUT.done(phase)).unlink()
    (out / LAYOUT.step_done(phase, "survey")).unlink()
    path = damaged(out)
    path.write_text("{]")
    capsys.readouterr()
    assert curate.main(_args(pool, out)) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: damaged record {path}: not valid JSON") and advice in line, line


def test_following_the_advice_finishes_the_run(finished, pool, out, capsys):
    manifest = (finished[0] / LAYOUT.manifest).read_bytes()
    # the run record: written back as the message gives it, the run resumes with nothing to redo
    run = out / LAYOUT.run_record
    run.write_bytes(b"\x00" * 10)
    assert curate.main(_args(pool, out)) == 2
    given = re.search(r"write it back as (\{.*?\}) and rerun", _one_error(capsys)).group(1)
    run.write_text(given)
    assert curate.main(_args(pool, out)) == 0
    assert "[score] 2 input shards, 2 already committed, 0 to score" in capsys.readouterr().out
    # a done record: deleted, its phase and the later ones run again to the same manifest
    (out / LAYOUT.done("dedup")).write_text("{")
    assert curate.main(_args(pool, out)) == 2
    _one_error(capsys)
    (out / LAYOUT.done("dedup")).unlink()
    assert curate.main(_args(pool, out)) == 0
    assert (out / LAYOUT.manifest).read_bytes() == manifest
    # the manifest: deleted with the write phase's done record, the write phase writes the same one again
    (out / LAYOUT.manifest).write_text("[]")
    assert curate.main(_args(pool, out)) == 2
    _one_error(capsys)
    (out / LAYOUT.manifest).unlink()
    (out / LAYOUT.done("write")).unlink()
    assert curate.main(_args(pool, out)) == 0
    assert (out / LAYOUT.manifest).read_bytes() == manifest


@pytest.mark.slow  # scores a shard again and reruns the global phases
def test_a_damaged_commit_record_deleted_as_told_is_scored_again(finished, pool, out, capsys):
    commit = _commit_file(out)
    shard = commit.stem
    commit.write_text('{"shard_id": ')
    assert curate.main(_args(pool, out)) == 2
    _one_error(capsys)
    commit.unlink()
    for phase in ("dedup", "sample", "write"):
        (out / LAYOUT.done(phase)).unlink()
    assert curate.main(_args(pool, out)) == 0
    console = capsys.readouterr().out
    assert "[score] 2 input shards, 1 already committed, 1 to score" in console
    assert json.loads(commit.read_text())["receipt"]["shard_id"] == shard
    result = audit(str(out), decode=False)
    assert result.ok, result.summary()
    assert (out / LAYOUT.manifest).read_bytes() == (finished[0] / LAYOUT.manifest).read_bytes()


def test_a_damaged_lease_is_not_taken_without_break_lease(pool, out, capsys):
    lease = out / LAYOUT.lease
    lease.write_bytes(b"\xff" * 7)
    assert curate.main(_args(pool, out)) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: damaged record {lease}: not UTF-8 text"), line
    assert "rerun this command with --break-lease" in line
    assert curate.main(_args(pool, out, "--break-lease")) == 0
    assert not lease.exists()  # the run took it, wrote its own and gave it back


def test_the_audit_lists_damaged_records_as_problems(out, capsys):
    commit, done = _commit_file(out), out / LAYOUT.done("score")
    commit.write_text("[1, 2]")
    done.write_text("")
    capsys.readouterr()
    assert audit_job.main([str(out), "--no-decode"]) == 1
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    problems = [line.strip() for line in printed.out.splitlines() if line.startswith("  ")]
    rel = f"{LAYOUT.score_commits}/{commit.name}"
    assert problems == [
        f"{LAYOUT.done('score')}: damaged record: empty (0 bytes). It is phase score's done record. Delete it and "
        "rerun the same command: phase score writes it again (committed input shards are not scored again)",
        f"{rel}: damaged record: holds an array, not a JSON object. It is input shard {commit.stem}'s commit record "
        f"(phase score). To score that shard again, delete it and {out}/_state/{{dedup,sample,write}}.done"
        ".json (so the later phases redo their work on its new results), then rerun the same command",
    ], printed.out


# --- peak memory ----------------------------------------------------------------------------------------------------


def test_commit_records_carry_the_peak_memory_of_the_processes_that_scored_each_shard(finished):
    out, console = finished
    records = [json.loads(p.read_text())["receipt"] for p in sorted((out / LAYOUT.score_commits).glob("*.json"))]
    peaks = {r["shard_id"]: r["peak_rss_mb"] for r in records}
    assert len(peaks) == 2 and all(isinstance(p, int) and p > 0 for p in peaks.values()), peaks
    done = json.loads((out / LAYOUT.done("score")).read_text())
    assert done["peak_task_memory_mb"] == max(peaks.values())
    assert done["peak_task_memory_shard"] in peaks and done["task_memory_mb"] == 64
    line = next(line for line in console.splitlines() if line.startswith("[score] done:"))
    assert line.endswith(f"; peak task memory {max(peaks.values())} MiB of the 64 MiB each requests"), line
    # every Python process is over 64 MiB, so each shard is named once
    warned = re.findall(r"\[score\] warning: a process scoring input shard (\S+) peaked at (\d+) MiB", console)
    assert sorted(warned) == sorted((s, str(p)) for s, p in peaks.items())
    assert done["shards_over_task_memory"] == 2


def test_task_memory_defaults_to_what_bounds_a_process_and_can_be_set():
    cfg = CurateConfig()
    assert cfg.task_memory_mb == 256 + 3 * cfg.input.read_chunk_mb + -(-7 * cfg.filters.max_pixels // 2**20)
    bigger = CurateConfig.model_validate({"filters": {"max_pixels": 2 * cfg.filters.max_pixels}})
    assert bigger.task_memory_mb > cfg.task_memory_mb
    assert CurateConfig.model_validate({"input": {"task_memory_mb": 3000}}).task_memory_mb == 3000
    assert cfg.results_hash() == CurateConfig.model_validate({"input": {"task_memory_mb": 3000}}).results_hash()


def test_a_request_the_cluster_cannot_hold_for_every_process_at_once_is_lowered(
    repo_root, monkeypatch, tmp_path, caplog
):
    import ray

    from common.config import load_config
    from curation.score.phase import ScorePhase

    cfg = load_config(CurateConfig, repo_root / "configs/curate/lite.yaml")
    node = {"Alive": True, "Resources": {"memory": 4 * 2**30}}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    caplog.set_level(logging.INFO, logger="curation")
    # fused as lite ships it: reader + writer + decode + the fused pool's 2 actors
    phase = ScorePhase(cfg, Output.at(str(tmp_path / "out")), Pool.at(str(tmp_path)))
    assert phase.task_memory() == 4 * 2**30 // 5
    # unfused: reader + writer + decode, quality, phash, embedding + person's 2 actors, head_pose's, text_overlay's and
    # nsfw's 1
    unfused = ScorePhase(cfg.model_copy(update={"fused": []}), Output.at(str(tmp_path / "out")), Pool.at(str(tmp_path)))
    assert unfused.task_memory() == 4 * 2**30 // 11
    assert caplog.messages == [
        "[score] input.task_memory_mb=1250: the 5 processes the score chain needs at once would not fit in the "
        "cluster's memory (4096 MiB); each requests 819 MiB instead",
        "[score] input.task_memory_mb=1250: the 11 processes the score chain needs at once would not fit in the "
        "cluster's memory (4096 MiB); each requests 372 MiB instead",
    ]
    node["Resources"]["memory"] = 64 * 2**30
    assert phase.task_memory() == 1250 * 2**20 and len(caplog.messages) == 2


# --- the reader itself ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"", "empty (0 bytes)"),
        (b"  \n", "empty (3 bytes)"),
        (b'{"a": 1', "not valid JSON (Expecting ',' delimiter: line 1 column 8)"),
        (b'{"a": "\xe9"}', "not UTF-8 text (byte 0xe9 at offset 7)"),
        (b"null", "holds null, not a JSON object"),
        (b'"text"', "holds a string, not a JSON object"),
        (b'{"rows": 3}', "has no 'shard_id' field"),
        (b'{"shard_id": 7, "rows": 3}', "its 'shard_id' field is a number, not a string"),
        (b'{"shard_id": "s", "rows": true}', "its 'rows' field is a boolean, not an integer"),
        (b'{"shard_id": "s", "rows": 2.5}', "its 'rows' field is a number, not an integer"),
    ],
)
def test_read_json_names_what_is_wrong(tmp_path, data, problem):
    path = tmp_path / "record.json"
    path.write_bytes(data)
    with pytest.raises(DamagedRecordError) as caught:
        read_json(pafs.LocalFileSystem(), str(path), fields={"shard_id": str, "rows": int}, advice="Do this")
    assert str(caught.value) == f"damaged record {path}: {problem}. Do this."


def test_read_json_leaves_absent_files_to_the_caller_and_names_store_files_by_uri(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(pafs.LocalFileSystem(), str(tmp_path / "absent.json"))
    s3 = pafs.S3FileSystem(anonymous=True, region="us-east-1")
    assert display_path(s3, "bucket/out/_state/run.json") == "s3://bucket/out/_state/run.json"


def test_a_damaged_lease_is_held_until_broken(tmp_path, caplog):
    record = tmp_path / LAYOUT.lease
    record.parent.mkdir(parents=True)
    record.write_text('{"token": ')
    caplog.set_level(logging.INFO, logger="common.lease")
    with pytest.raises(LeaseHeld, match=r"damaged record .*lease\.json: not valid JSON .*--break-lease"):
        Lease(str(tmp_path), settle_s=0).acquire()
    lease = Lease(str(tmp_path), settle_s=0).acquire(force=True)
    assert "--break-lease was given" in caplog.messages[-1]
    record.write_text("[")  # another writer's bytes while this run holds it: the run stops, it does not crash
    with pytest.raises(LeaseLost, match="is damaged"):
        lease.check()
    lease.release()
    assert record.read_text() == "["  # not ours: left alone
