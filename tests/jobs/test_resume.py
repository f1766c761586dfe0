"""Curation that survives kills and hostile inputs: the driver killed at several points and resubmitted gives the
uninterrupted run's result; a hostile corpus mixed into the pool never crashes the job or escapes <out>."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import schema
from common.layout import LAYOUT
from curation.score.ledger import read_ledger, reason_code
from generators.hostile_inputs import write_bad_inputs
from generators.sample_pool import ultralytics_assets
from jobs import curate

LITE = "configs/curate/lite.yaml"
pytestmark = pytest.mark.slow


def _command(repo: Path, pool: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.curate",
        "--config",
        str(repo / LITE),
        "--input",
        str(pool),
        "--output",
        str(out),
    ]


def _run_job(repo: Path, pool: Path, out: Path, kill_on: str | None = None) -> tuple[int, str]:
    """Run the curate job as its own process; SIGKILL it when a line starting with ``kill_on`` appears."""
    proc = subprocess.Popen(
        _command(repo, pool, out), cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_on and line.startswith(kill_on):
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
            break
    proc.wait(timeout=600)
    return proc.returncode, "".join(lines)


def _fates(out: Path) -> dict[str, tuple]:
    rows = read_ledger(str(out), ["source", "status", "stage", "key"]).to_pylist()
    assert len(rows) == len({r["source"] for r in rows}), "a source appears twice in the ledger"
    return {
        Path(r["source"]).name + "|" + Path(r["source"]).parent.name: (r["status"], r["stage"], r["key"]) for r in rows
    }


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").iterdir())}


@pytest.fixture(scope="module")
def reference(sample_pool, repo_root, tmp_path_factory, ray_local):
    """An uninterrupted run on its own copy of the pool, run the same way as the killed ones."""
    out = tmp_path_factory.mktemp("reference") / "out"
    code, log = _run_job(repo_root, sample_pool, out)
    assert code == 0, log
    return out


@pytest.mark.parametrize(
    "kill_on",
    ["[score] committed 1/", "[dedup]", "[sample]"],
    ids=["during-scoring", "between-phases", "during-writing"],
)
def test_killed_driver_resumes_to_the_uninterrupted_result(kill_on, reference, sample_pool, repo_root, tmp_path):
    out = tmp_path / "out"
    code, log = _run_job(repo_root, sample_pool, out, kill_on=kill_on)
    assert code == -signal.SIGKILL, log
    # a kill can land inside a commit write: its _tmp- file is not a commit
    committed_before = len([p for p in (out / LAYOUT.score_commits).glob("*.json") if not p.name.startswith("_")])
    code, log = _run_job(repo_root, sample_pool, out)
    assert code == 0, log
    total, skipped, scored = map(
        int, re.search(r"\[score\] (\d+) input shards, (\d+) already committed, (\d+) to score", log).groups()
    )
    assert skipped == committed_before and scored == total - committed_before  # committed shards are not rescored
    if kill_on != "[score] committed 1/":
        assert scored == 0
    assert _fates(out) == _fates(reference)
    assert _shards(out) == _shards(reference)  # byte-identical final shards and manifest
    assert not list(out.rglob("_tmp-*"))  # no partial files left behind


def _commits(out: Path) -> list[Path]:
    """The score phase's commit records (a kill can leave a ``_tmp-`` file, which is none)."""
    return [p for p in (out / LAYOUT.score_commits).glob("*.json") if not p.name.startswith("_")]


def test_ctrl_c_says_what_is_committed_in_one_line_and_the_same_command_resumes(
    reference, sample_pool, repo_root, tmp_path
):
    out, log_path = tmp_path / "out", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _command(repo_root, sample_pool, out), cwd=repo_root, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not _commits(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the driver and the local Ray it started
        proc.wait(timeout=300)
    text = log_path.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    [line] = [line for line in text.splitlines() if "interrupted" in line]
    committed = len(_commits(out))
    assert committed >= 1
    shards = f"{committed} input shard{'' if committed == 1 else 's'}"
    assert line.startswith(f"[curate] interrupted: {shards} scored and committed in {out}; ")
    assert line.endswith("; rerun the same command to resume")
    code, log_text = _run_job(repo_root, sample_pool, out)
    assert code == 0, log_text
    assert f"{committed} already committed" in log_text
    assert _fates(out) == _fates(reference)
    assert _shards(out) == _shards(reference)


def test_hostile_inputs_never_crash_and_never_escape_the_output(sample_pool, repo_root, tmp_path, ray_local):
    pool = tmp_path / "pool"
    shutil.copytree(sample_pool, pool, symlinks=True)
    expected = write_bad_inputs(pool / "hostile", (ultralytics_assets() / "zidane.jpg").read_bytes())
    assert len(expected) + 13 >= 20  # with the sample pool's bad/ and odd/ kinds
    before = {p for p in tmp_path.rglob("*")}
    out = tmp_path / "out"
    assert curate.main(["--config", str(repo_root / LITE), "--input", str(pool), "--output", str(out)]) == 0
    written_outside = {p for p in tmp_path.rglob("*") if out not in p.parents and p != out} - before
    assert not written_outside
    ledger = {Path(r["source"]).name: r for r in read_ledger(str(out)).to_pylist() if "/hostile/" in r["source"]}
    assert set(ledger) == set(expected)
    for name, code in expected.items():
        row = ledger[name]
        if code is None:
            assert row["stage"] != "decode", (name, row["reason"])
        else:
            assert (row["status"], row["stage"], reason_code(row["reason"])) == (schema.REJECTED, "decode", code), name


def test_parquet_rows_with_hostile_names_and_null_bytes(repo_root, tmp_path, ray_local):
    pool = tmp_path / "pool"
    pool.mkdir()
    good = (ultralytics_assets() / "bus.jpg").read_bytes()
    table = pa.table(
        {
            "image": pa.array([good, None, b"", good[:500]], pa.binary()),
            "source": ["../../escape.jpg", "/etc/passwd", "a/../../b", "..\\..\\c"],
        }
    )
    pq.write_table(table, pool / "part.parquet")
    out = tmp_path / "out"
    before = {p for p in tmp_path.rglob("*")}
    args = [
        "--config",
        str(repo_root / LITE),
        "--input",
        str(pool),
        "--output",
        str(out),
        "input.source_column=source",
        "--phases",
        "score",
    ]
    assert curate.main(args) == 0
    assert not ({p for p in tmp_path.rglob("*") if out not in p.parents and p != out} - before)
    rows = {r["source"].split("#", 1)[1]: r for r in read_ledger(str(out)).to_pylist()}
    assert set(rows) == set(table.column("source").to_pylist())
    assert reason_code(rows["/etc/passwd"]["reason"]) == "unreadable"
    assert reason_code(rows["a/../../b"]["reason"]) == "empty_file"
    assert reason_code(rows["..\\..\\c"]["reason"]) in ("corrupt", "not_an_image")
    json.dumps(rows, default=str)  # the ledger holds plain values only
