"""What a spot cluster does to a training run, and how the run ends: a clean resume from the newest checkpoint that
reads back, or one line (exit 2) naming the file or setting, within one attempt, every earlier checkpoint intact.

The parts without Ray first (checkpoint verification, the failure classification, the metrics' compaction, the
resume identity); then pretraining runs on Ray Train, each a copy of one reference run with one fault. Fine-tuning's
faults on an object store are in ``test_object_store_jobs.py``.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import FAST, TINY

from common.config import ConfigError, load_config
from common.storage import StorageError
from finetune.config import FinetuneConfig
from jobs import finetune as finetune_job
from jobs import pretrain as job
from pretrain import data
from pretrain.backbone import build
from pretrain.config import PretrainConfig
from training import checkpoint as ckpt
from training import failures
from training.metrics import MetricsLog, drop_after, read_metrics
from training.runner import check_free_space, check_run, claim_run

REPO = Path(__file__).resolve().parents[2]
FINETUNE_TINY = str(REPO / "configs/finetune/tiny.yaml")


# --- checkpoints verified before they are trusted ------------------------------------------------------------------


@pytest.fixture
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(run: Path, step: int) -> str:
    uri = ckpt.step_uri(str(run), step)
    ckpt.save(uri, *_trained(step), {"step": step})
    return uri


def _overwrite_a_third(path: Path) -> None:
    data = bytearray(path.read_bytes())
    third = len(data) // 3
    data[third : 2 * third] = bytes(third)
    path.write_bytes(bytes(data))


def test_a_commit_record_lists_every_file_and_verify_finds_a_torn_overwritten_or_missing_one(tmp_path, one_process):
    uri = _save(tmp_path, 4)
    folder = Path(uri)
    commit = ckpt.read_commit(uri)
    on_disk = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    on_disk.pop(ckpt.COMMIT_FILE)
    assert {name: f["bytes"] for name, f in commit["files"].items()} == on_disk  # every file, its size as written
    assert {".metadata", "__0_0.distcp", "rng/rank-00000.pt"} <= set(on_disk)
    assert ckpt.verify(uri, commit) == []

    _overwrite_a_third(folder / "__0_0.distcp")  # the same size: only the checksum can tell
    assert ckpt.verify(uri, commit) == ["__0_0.distcp: its bytes differ from those written (CRC-32)"]
    # each rank reads back its share of the files: this file is rank 0's of 2, not rank 1's
    shares = [ckpt.verify(uri, commit, rank, 2) for rank in (0, 1)]
    assert sum(len(s) for s in shares) == 1
    (folder / "__0_0.distcp").write_bytes(b"torn")
    assert ckpt.verify(uri, commit) == [
        f"__0_0.distcp: 4 bytes, {commit['files']['__0_0.distcp']['bytes']} were written"
    ]
    (folder / ".metadata").unlink()
    assert ".metadata: missing" in ckpt.verify(uri, commit)

    # set aside: renamed, its files kept, no longer one of the run's checkpoints
    older = _save(tmp_path, 2)
    name = ckpt.set_aside(uri)
    assert name.startswith("damaged-step_000000004-") and (tmp_path / "checkpoints" / name / "commit.json").exists()
    assert [u for _, u, _ in ckpt.list_checkpoints(str(tmp_path))] == [older]
    assert ckpt.set_aside_names(str(tmp_path)) == [name]


def test_a_record_written_before_records_listed_files_still_needs_its_metadata(tmp_path, one_process):
    uri = _save(tmp_path, 2)
    commit = {k: v for k, v in ckpt.read_commit(uri).items() if k != "files"}
    assert ckpt.verify(uri, commit) == []
    (Path(uri) / ".metadata").unlink()
    assert ckpt.verify(uri, commit) == [".metadata: missing"]


def test_an_async_checkpoint_is_committed_only_once_written_and_holds_the_state_it_was_started_with(
    tmp_path, one_process
):
    blocking = ckpt.read_commit(_save(tmp_path / "blocking", 4))
    model, optimizer = _trained(4)
    started = {k: v.clone() for k, v in model.state_dict().items()}
    saver = ckpt.AsyncSaver(pinned=False)
    uri = ckpt.step_uri(str(tmp_path / "async"), 4)
    saver.start(uri, model, optimizer, {"step": 4}, None)
    with pytest.raises(RuntimeError, match="still in flight"):  # at most one in flight
        saver.start(ckpt.step_uri(str(tmp_path / "async"), 5), model, optimizer, {"step": 5}, None)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # training goes on while it is written
    assert saver.in_flight is not None
    saver.in_flight.done.result()  # every file written: still not a checkpoint of the run until committed
    assert ckpt.list_checkpoints(str(tmp_path / "async")) == [(4, uri, False)]
    assert ckpt.latest_committed(str(tmp_path / "async")) is None
    assert saver.ready(torch.device("cpu"))
    committed_uri, record, seconds = saver.commit()
    assert committed_uri == uri and record["step"] == 4 and set(seconds) == {"stage_s", "write_s", "summary_s"}
    commit = ckpt.read_commit(uri)
    assert ckpt.latest_committed(str(tmp_path / "async")) == uri and ckpt.verify(uri, commit) == []
    assert commit["files"].keys() == blocking["files"].keys()  # the same files, each with its size and CRC-32
    fresh, fresh_optimizer = _trained(0)
    ckpt.load(uri, fresh, fresh_optimizer)
    assert all(torch.equal(v, started[k]) for k, v in fresh.state_dict().items())  # the state at its start


def test_an_async_save_meeting_a_full_disk_fails_at_its_commit_naming_it(tmp_path, one_process):
    uri = ckpt.step_uri(str(tmp_path), 8)
    Path(uri).mkdir(parents=True)
    (Path(uri) / "__0_0.distcp").symlink_to("/dev/full")
    saver = ckpt.AsyncSaver(pinned=False)
    saver.start(uri, *_trained(8), {"step": 8}, None)
    with pytest.raises(Exception) as raised:
        saver.commit()
    assert failures.permanent(raised.value) == (
        f"no space left on the device writing {uri}: free space there (or lower checkpoint.keep), then run the same "
        "command again"
    )
    assert ckpt.list_checkpoints(str(tmp_path)) == [(8, uri, False)] and saver.in_flight is None


# --- one classification of failures ----------------------------------------------------------------------------------


def test_permanent_failures_get_one_line_and_transient_ones_none():
    assert failures.permanent(data.DataError("shard-1.parquet under /d is gone: restore it")) == (
        "shard-1.parquet under /d is gone: restore it"
    )
    assert failures.permanent(ConfigError("model.patch_size=16 does not fit")) == "model.patch_size=16 does not fit"
    try:  # a real full disk, as the kernel reports it
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 10)
            f.flush()
    except OSError as exc:
        full = exc
    assert full.errno == errno.ENOSPC and failures.permanent(full).startswith("no space left on the device")
    named = OSError(errno.ENOSPC, "No space left on device", "/runs/a/checkpoints/step_000000008")
    assert failures.permanent(named) == (
        "no space left on the device writing /runs/a/checkpoints/step_000000008: free space there (or lower "
        "checkpoint.keep), then run the same command again"
    )
    # a DCP save that failed on one rank raises on every rank, the rank's error inside
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise named
    except OSError as exc:
        wrapped = CheckpointException("save", {1: _wrap_exception(exc)})
    assert failures.permanent(wrapped) == failures.permanent(named)
    # a Ray task's error carries the task's exception as text only
    task = RuntimeError(
        "ray::MapBatches(read_segments)() (pid=1)\n  File 'pretrain/data.py', line 1\n"
        "pretrain.data.DataError: shard-1.parquet is gone: restore it\n\nray.exceptions.UserCodeException: UDF failed"
    )
    assert failures.permanent(task) == "shard-1.parquet is gone: restore it"
    assert failures.permanent(ckpt.CheckpointError("no readable checkpoint left")) == "no readable checkpoint left"
    # transient: a lost peer, a reset connection, a preempted node
    assert failures.permanent(RuntimeError("[gloo] Connection closed by peer")) is None
    assert failures.permanent(OSError(errno.ECONNRESET, "Connection reset by peer")) is None


def test_the_run_ends_with_the_permanent_line_or_says_the_restarts_ran_out():
    from ray.train.v2.api.exceptions import WorkerGroupError

    mixed = WorkerGroupError("x", {0: RuntimeError("[gloo] peer closed"), 1: failures.Permanent("disk full at X")})
    ended = failures.ended(mixed)
    assert isinstance(ended, failures.Permanent) and str(ended) == "disk full at X"
    transient = failures.ended(WorkerGroupError("x", {0: RuntimeError("[gloo] peer closed")}))
    assert isinstance(transient, failures.Exhausted)
    assert "RuntimeError: [gloo] peer closed; the same command resumes" in str(transient)

    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.api.config import FailureConfig

    policy = failures.stop_on_permanent(DefaultFailurePolicy(FailureConfig(max_failures=3)))
    assert policy.make_decision(mixed) == FailureDecision.RAISE  # no restart can fix it
    assert policy.make_decision(WorkerGroupError("x", {0: RuntimeError("reset")})) == FailureDecision.RETRY


# --- each step once in the metrics files -----------------------------------------------------------------------------


def test_a_resume_drops_what_earlier_attempts_wrote_past_its_checkpoint(tmp_path):
    cfg = load_config(PretrainConfig, TINY, ["log.backends=[]"])
    first = MetricsLog.for_run(str(tmp_path), 0, cfg)
    for step in range(1, 11):  # checkpoints at 4 and 8; killed after step 10
        first.write({"kind": "train", "step": step})
        if step % 4 == 0:
            first.write({"kind": "checkpoint", "step": step})
            first.roll(step + 1)
    first.out.close()
    assert drop_after(str(tmp_path), 8) == 2
    second = MetricsLog.for_run(str(tmp_path), 8, cfg)
    for step in range(9, 13):
        second.write({"kind": "train", "step": step})
    second.close()
    steps = [r["step"] for r in read_metrics(str(tmp_path))]
    assert steps == list(range(1, 13))  # each once, in the files themselves
    assert drop_after(str(tmp_path), 12) == 0


def test_two_commits_after_one_step_share_a_part_of_the_metrics(tmp_path):
    """An async save committed by the next save, then that save committed at the end: both records kept."""
    log = MetricsLog.for_run(str(tmp_path), 1, load_config(PretrainConfig, TINY, ["log.backends=[]"]))
    log.write({"kind": "train", "step": 8})
    for step in (4, 8):
        log.write({"kind": "checkpoint", "step": step})
        log.roll(9)
    log.close()
    assert [r["step"] for r in read_metrics(str(tmp_path), "checkpoint")] == [4, 8]


# --- a resume keeps the run's settings ------------------------------------------------------------------------------


def test_a_resume_refuses_a_changed_setting_unless_allowed_and_records_an_allowed_one(tmp_path):
    run = str(tmp_path / "run")
    before = load_config(PretrainConfig, TINY, [])
    identity = {"data": "/d", "model_hash": before.model_hash()}
    assert claim_run(run, identity, before.result_settings()) is None  # a new run
    # where it runs, how it logs or saves: not part of the run
    moved = load_config(PretrainConfig, TINY, ["log.every=1", "checkpoint.keep=9", "ray.max_failures=0"])
    assert check_run(run, identity, moved.result_settings()) == {}
    after = load_config(PretrainConfig, TINY, ["optim.lr=0.01", "steps=50"])
    with pytest.raises(ConfigError) as refused:
        check_run(run, identity, after.result_settings())
    assert f"this command changes optim.lr {before.optim.lr} -> 0.01, steps {before.steps} -> 50." in str(refused.value)
    assert "add --allow-change optim.lr,steps" in str(refused.value)
    with pytest.raises(ConfigError):  # every changed setting must be allowed
        check_run(run, identity, after.result_settings(), ["steps"])
    changes = claim_run(run, identity, after.result_settings(), ["optim", "steps"])
    assert changes == {"optim.lr": (before.optim.lr, 0.01), "steps": (before.steps, 50)}
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["settings"]["optim.lr"] == 0.01 and record["changes"][0]["settings"]["steps"] == [before.steps, 50]
    assert check_run(run, identity, after.result_settings()) == {}  # the recorded settings are now the new ones


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_ray_starts(tmp_path):
    check_free_space(str(tmp_path / "run"), 1 << 20, keep=3)
    with pytest.raises(StorageError, match=r"GiB free; one checkpoint of this run takes about .* checkpoint.keep=3"):
        check_free_space(str(tmp_path / "run"), 1 << 60, keep=3)


def test_a_backbone_of_another_patch_size_is_refused_before_ray_starts(tmp_path):
    import dataclasses

    from safetensors.torch import save_file

    backbone = build(load_config(FinetuneConfig, FINETUNE_TINY, ["model.patch_size=8"]).model.backbone())
    meta = {"format": "pt", "size": "tiny", "step": "1",
            "backbone_config": json.dumps(dataclasses.asdict(backbone.cfg))}  # fmt: skip
    path = tmp_path / "backbone.safetensors"
    save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(path), metadata=meta)
    finetune_job.check_backbone(str(path), load_config(FinetuneConfig, FINETUNE_TINY, ["model.patch_size=8"]))
    with pytest.raises(ConfigError, match=r"\(width .*patch 8\) .* set model.patch_size=8 as it was pretrained"):
        finetune_job.check_backbone(str(path), load_config(FinetuneConfig, FINETUNE_TINY, ["model.patch_size=16"]))
    path.write_bytes(b"\xff" * 64)  # read as a header length of 2^64 - 1 bytes
    with pytest.raises(StorageError, match=r"is not a safetensors file: a header of \d+ bytes in a file of 64"):
        finetune_job.check_backbone(str(path), load_config(FinetuneConfig, FINETUNE_TINY, ["model.patch_size=8"]))


# --- pretraining runs with one fault each -------------------------------------------------------------------------

KEEP3 = [*FAST, "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def finished(curated_run, tmp_path_factory) -> tuple[Path, Path]:
    """A finished 12-step run with checkpoints at 4, 8 and 12 (its shards, its storage)."""
    storage_dir = tmp_path_factory.mktemp("fault-runs")
    shards = curated_run / "shards"
    args = ["--config", TINY, "--data", str(shards), "--storage", str(storage_dir), "--name", "finished"]
    assert job.main([*args, *KEEP3]) == 0
    return shards, storage_dir


def _copy(finished: tuple[Path, Path], name: str) -> list[str]:
    shards, storage_dir = finished
    shutil.copytree(storage_dir / "finished", storage_dir / name)
    return ["--config", TINY, "--data", str(shards), "--storage", str(storage_dir), "--name", name, *KEEP3]


def _train_records(run: Path) -> list[dict]:
    return read_metrics(str(run), "train")


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(finished):
    args = _copy(finished, "damaged-distcp")
    run = finished[1] / "damaged-distcp"
    _overwrite_a_third(run / "checkpoints/step_000000012/__1_0.distcp")
    assert job.main(args) == 0
    (resume,) = read_metrics(str(run), "resume")
    assert resume["step"] == 8 and resume["dropped_records"] > 0
    (aside,) = ckpt.set_aside_names(str(run))
    assert aside.startswith("damaged-step_000000012-") and (run / "checkpoints" / aside / "__1_0.distcp").exists()
    # the resumed run retrains steps 9..12 exactly as the first time, and the files hold each step once
    reference = {r["step"]: r["loss"] for r in _train_records(finished[1] / "finished")}
    records = _train_records(run)
    assert sorted(r["step"] for r in records) == list(range(1, 13))
    assert all(r["loss"] == pytest.approx(reference[r["step"]], rel=1e-5) for r in records)
    for _, uri, committed in ckpt.list_checkpoints(str(run)):
        assert committed and ckpt.verify(uri, ckpt.read_commit(uri)) == []


@pytest.mark.slow
def test_with_no_readable_checkpoint_left_the_run_stops_in_one_line_keeping_them_all(finished, capsys):
    args = _copy(finished, "all-damaged")
    run = finished[1] / "all-damaged"
    (run / "checkpoints/step_000000012/.metadata").unlink()
    (run / "checkpoints/step_000000008/rng/rank-00001.pt").unlink()
    (run / "checkpoints/step_000000004/commit.json").write_text("{not json")
    capsys.readouterr()
    assert job.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: no readable checkpoint left in {run / 'checkpoints'}: damaged-step_000000004-")
    assert "Restore one from a backup under its step_* name, or start a new run (--name)" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert len(ckpt.set_aside_names(str(run))) == 3 and ckpt.list_checkpoints(str(run)) == []
    assert len(_train_records(run)) == 12  # nothing retrained: one attempt, stopped at once
    assert list((run / "errors").iterdir())  # the tracebacks are kept there


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_stops_the_run_at_once_naming_it(finished, capsys):
    args = _copy(finished, "disk-full")
    run = finished[1] / "disk-full"
    capsys.readouterr()
    assert job.main([*args, "steps=16", "--allow-change", "steps", "fault.disk_full_at_step=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: no space left on the device writing {run / 'checkpoints/step_000000016'}: free space there (or "
        "lower checkpoint.keep), then run the same command again"
    )
    # one attempt: steps 13..16 trained once, not once per restart of the worker group
    assert sorted(r["step"] for r in _train_records(run)) == list(range(1, 17))
    # every earlier checkpoint intact
    assert [s for s, _, committed in ckpt.list_checkpoints(str(run)) if committed] == [4, 8, 12]
    for _, uri, committed in ckpt.list_checkpoints(str(run)):
        assert not committed or ckpt.verify(uri, ckpt.read_commit(uri)) == []


@pytest.mark.slow
def test_a_changed_learning_rate_is_refused_and_taken_only_when_allowed(finished, capsys):
    args = _copy(finished, "changed-lr")
    run = finished[1] / "changed-lr"
    record = (run / "run.json").read_text()
    capsys.readouterr()
    assert job.main([*args, "optim.lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert "this command changes optim.lr 0.032 -> 0.01" in err and "--allow-change optim.lr" in err
    assert (run / "run.json").read_text() == record  # refused before anything was written
    assert job.main([*args, "optim.lr=0.01", "steps=14", "--allow-change", "optim.lr,steps"]) == 0
    assert "resuming" in capsys.readouterr().out
    (change,) = json.loads((run / "run.json").read_text())["changes"]
    assert change["settings"] == {"optim.lr": [0.032, 0.01], "steps": [12, 14]} and change["newest_checkpoint"] == 12


@pytest.mark.slow
def test_a_shard_gone_before_a_resume_is_named_before_ray_starts(curated_run, tmp_path, capsys):
    shards = tmp_path / "shards"
    shutil.copytree(curated_run / "shards", shards)
    args = ["--config", TINY, "--data", str(shards), "--storage", str(tmp_path / "runs"), "--name", "r", *FAST]
    assert job.main([*args, "steps=1", "checkpoint.every=1", "--allow-change", "steps"]) == 0
    gone = sorted(shards.glob("*.parquet"))[1]
    gone.unlink()
    capsys.readouterr()
    assert job.main([*args, "steps=2", "--allow-change", "steps"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"are gone ({gone.name}" in err and "Restore them, or start a new run (--name)" in err


@pytest.mark.slow
def test_a_shard_gone_under_a_running_stream_is_a_permanent_failure(curated_run, tmp_path, ray_local, monkeypatch):
    """Inside a worker the shard's loss reaches the loop through Ray Data's task error: still one permanent line."""
    # the read tasks open the shards, not the stream (which fetches the footers of a chunk over a few shards)
    monkeypatch.setattr(data, "FOOTERS_KEPT", 0)
    shards = tmp_path / "shards"
    shutil.copytree(curated_run / "shards", shards)
    index = data.DataIndex.scan(str(shards))
    cfg = load_config(PretrainConfig, TINY, [*FAST, "data.plan_steps=1"])
    for f in shards.glob("*.parquet"):
        f.unlink()
    batches = data.stream(index, cfg, position=data.DataPosition(), steps=2, world=1, rank=0)
    with pytest.raises(Exception) as raised:
        next(batches)
    line = failures.permanent(raised.value)
    assert line is not None and "is gone: the data was rewritten or removed" in line


@pytest.mark.slow
def test_with_async_saves_a_damaged_checkpoint_a_kill_mid_save_and_a_full_disk_end_as_with_blocking_ones(
    finished, capsys
):
    """One run meets the three: step 12's checkpoint damaged (resumes from 8), rank 1 killed at step 17 while step
    16's save is in flight (its folder has no commit record: resumes from the new 12), then a full disk at the last
    save (stops in one line). Every commit record written lists files that read back."""
    args = _copy(finished, "async")
    run = finished[1] / "async"
    _overwrite_a_third(run / "checkpoints/step_000000012/__1_0.distcp")
    capsys.readouterr()
    faults = ["fault.kill_at_step=17", "fault.kill_rank=1", "fault.disk_full_at_step=20"]
    assert job.main([*args, "checkpoint.async_save=true", "steps=20", "--allow-change", "steps", *faults]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: no space left on the device writing {run / 'checkpoints/step_000000020'}: free space there (or "
        "lower checkpoint.keep), then run the same command again"
    )
    resumes = read_metrics(str(run), "resume")
    assert [r["step"] for r in resumes] == [8, 12]
    # the async checkpoint of step 12 holds the state of step 12: its fingerprint, taken on the staged copy while
    # training went on, is the loaded state's
    saved, loaded = resumes[1]["saved_fingerprint"], resumes[1]["fingerprint"]
    assert saved["exp_avg_sq"] > 0 and all(loaded[k] == pytest.approx(v, rel=1e-9) for k, v in saved.items())
    (aside,) = ckpt.set_aside_names(str(run))
    assert aside.startswith("damaged-step_000000012-")
    assert sorted(r["step"] for r in _train_records(run)) == list(range(1, 21))
    assert [(s, committed) for s, _, committed in ckpt.list_checkpoints(str(run))] == [
        (8, True), (12, True), (16, True), (20, False)
    ]  # fmt: skip
    for _, uri, committed in ckpt.list_checkpoints(str(run)):
        assert not committed or ckpt.verify(uri, ckpt.read_commit(uri)) == []
    saves = read_metrics(str(run), "checkpoint")
    assert {r["step"] for r in saves if "stage_s" in r} == {12, 16}  # committed after training went on
