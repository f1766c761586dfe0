"""Pretraining on Ray Train with FSDP2 (2 CPU workers, gloo) on the curated sample shards, and its parts.

The reference run trains 12 steps (2 workers x 2 micro-batches of 1) with a checkpoint every 4 and records every
step's sample keys; the other runs
are checked against it: a run whose worker is killed mid-training must end with exactly the reference's samples
and losses per step, and a 2-worker checkpoint must continue on 1 worker with the next samples of the epoch.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import EVERY, FAST, STEPS, TINY, tensorboard_scalars
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from common import storage as fs_storage
from common.config import ConfigError, load_config
from jobs import pretrain as job
from pretrain import data
from pretrain.backbone import SIZES, build
from pretrain.config import PretrainConfig
from pretrain.export import BACKBONE_FILE, export_backbone, load_backbone
from pretrain.objective import TERMS, JointObjective, collapse_state
from pretrain.train import Trainer, build_model, build_optimizer, console_line, fingerprint
from training import checkpoint as ckpt
from training.config import OptimSettings
from training.metrics import latest_per_step, read_metrics
from training.schedules import lr_at, wd_at

REPO = Path(__file__).resolve().parents[2]


def run_job(shards: Path, storage: Path, name: str, *overrides: str) -> Path:
    args = ["--config", TINY, "--data", str(shards), "--storage", str(storage), "--name", name]
    assert job.main([*args, *FAST, *overrides]) == 0
    return storage / name


def keys_by_step(run: Path) -> dict[int, list[list[str]]]:
    return {s: r["keys"] for s, r in latest_per_step(read_metrics(str(run), "samples")).items()}


def shard_keys(index: data.DataIndex) -> dict[tuple[str, int], list[str]]:
    return {
        (f, g): index.open(f).read_row_group(g, columns=["key"]).column("key").to_pylist()
        for f, g in ((index.files[i], int(r)) for i, r in zip(index.file, index.row_group))
    }


def expected_keys(index: data.DataIndex, position: data.DataPosition, steps: int, per_worker: int, world: int):
    """Each step's keys per rank, straight from the epoch order (independent of the Ray Data path)."""
    lookup, out = shard_keys(index), []
    for _ in range(steps):
        nxt = data.advance(position, per_worker * world, index.num_samples)
        order = data.EpochOrder(index, 0, nxt.epoch)
        lo = nxt.consumed - per_worker * world
        ranks = []
        for r in range(world):
            segs = order.segments(lo + r * per_worker, lo + (r + 1) * per_worker)
            ranks.append([lookup[(s["file"], s["row_group"])][i] for s in segs for i in s["rows"]])
        out.append(ranks)
        position = nxt
    return out


@pytest.fixture(scope="module")
def shards(curated_run) -> Path:
    return curated_run / "shards"


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(shards, storage) -> Path:
    return run_job(shards, storage, "reference")


# --- the reference run ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_tiny_run_learns_without_a_collapse(shards, tmp_path):
    """The README's first command's pretraining, as shipped (60 steps, 2 workers, the sample pool's curated
    images): the MAE term falls, and so do the student's KL to its targets and the loss the console line leads
    with; the contrastive term ends clearly below ln K, and no collapse is named."""
    assert job.main(["--config", TINY, "--data", str(shards), "--storage", str(tmp_path), "--name", "readme"]) == 0
    cfg = load_config(PretrainConfig, TINY)
    train = latest_per_step(read_metrics(str(tmp_path / "readme")))
    steps = sorted(train)
    assert steps[-1] == cfg.steps, steps
    first, last = train[steps[0]], train[steps[-1]]
    assert last["mae"] < first["mae"] - 0.1, (first, last)
    kl = {s: r["cl"] - r["teacher_entropy"] for s, r in train.items()}
    student = {s: r["loss"] - cfg.objective.lambda_cl * r["teacher_entropy"] for s, r in train.items()}
    assert kl[steps[-1]] < 0.6 * kl[steps[0]] and student[steps[-1]] < 0.7 * student[steps[0]], (kl, student)
    assert last["cl"] < 0.85 * math.log(cfg.objective.cl.prototypes), last
    assert [r["collapse"] for r in train.values()] == [None] * len(train), train
    assert read_metrics(str(tmp_path / "readme"), "collapse") == []


# The README run's step-20 window as recorded (docs/pretraining.md, "Reading a pretraining run").
STEP_20 = {
    "epoch": 19, "loss": 2.7540982, "mae": 1.0312903, "cl": 1.6632828, "koleo": 0.5952510,
    "teacher_entropy": 0.6851320, "batch_entropy": 1.4555112, "student_entropy": 1.9, "proto_used": 3.3,
    "cls_std": 0.7477914, "cls_rms": 0.9998604, "collapse": None, "lr": 8.49984e-4, "grad_norm": 31.058359,
    "momentum": 0.9911384, "images_per_s": 27.52, "tokens_per_s": 1541.1, "step_s": 0.2907, "data_wait_s": 0.0050,
    "compute_s": 0.2857,
}  # fmt: skip


def test_the_console_line_leads_with_the_loss_the_student_can_lower():
    """The line opens with mae + lambda x kl + w x koleo, kl = cl - H (the teacher targets' entropy has no gradient
    and rises in the README run while the student's terms hold); cl and H follow, with the collapse named."""
    cfg = load_config(PretrainConfig, TINY)
    line = console_line(cfg, 20, STEP_20)
    assert line.startswith(
        "[pretrain] step 20/60 ep 19 student loss 2.0690 = mae 1.0313 + 1 x kl 0.9782 + 0.1 x koleo 0.595"
        " | cl 1.6633 = kl + targets H 0.69 of ln K 4.159, info 0.77 of ln B 1.39, 3.3 protos, cls std/rms 0.75"
        " | lr 8.50e-04 gnorm 31.058 m 0.9911 | 27.5 img/s 1541 tok/s, step 0.291s = data 0.005s + compute 0.286s"
    ), line
    assert line.endswith("compute 0.286s") and "[" not in line.split("|")[1]  # healthy: no collapse named
    # the student loss is the recorded loss less lambda x H, whatever lambda is: the terms add up on the line
    half = load_config(PretrainConfig, TINY, ["objective.lambda_cl=0.5"])
    r = {**STEP_20, "loss": STEP_20["mae"] + 0.5 * STEP_20["cl"] + 0.1 * STEP_20["koleo"]}
    assert "student loss 1.5799 = mae 1.0313 + 0.5 x kl 0.9782 + 0.1 x koleo 0.595" in console_line(half, 20, r)
    # both collapse modes (and a constant CLS) are named on the line, after the terms they are read from
    for state in ("one prototype", "uniform targets", "uniform targets + constant CLS"):
        terms = console_line(cfg, 20, {**STEP_20, "collapse": state}).split(" | ")[1]
        assert terms.endswith(f"cls std/rms 0.75 [{state}]"), terms


@pytest.mark.slow
def test_short_fsdp_run_finishes_and_its_loss_falls(reference):
    train = latest_per_step(read_metrics(str(reference)))
    assert sorted(train) == list(range(1, STEPS + 1))
    losses = [train[s]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses
    assert train[STEPS]["mae"] < train[1]["mae"]
    for s, r in train.items():  # schedules step per optimiser step; timings add up
        fast = load_config(PretrainConfig, TINY, FAST)
        assert r["lr"] == pytest.approx(lr_at(s - 1, fast.optim, STEPS, fast.samples_per_step()))
        assert r["step_s"] == pytest.approx(r["data_wait_s"] + r["compute_s"])
        assert r["images_per_s"] > 0 and r["tokens_per_s"] > r["images_per_s"] and "mfu" not in r
    # Row groups of 4 split over 2 workers' steps of 2: each read by both, a window's figure 0 where a read task
    # still held its row groups from the step before (the same ones, at an epoch's end and the next one's start).
    amplification = [r["read_amplification"] for r in train.values()]
    assert min(amplification) >= 0 and 1 < np.mean(amplification) < 3, amplification
    # The contrastive diagnostics ride along (means over micro-batches and workers), with each window's collapse
    # state; a state held for log.collapse_patience steps is recorded once, with the step it began after.
    cfg = load_config(PretrainConfig, TINY, FAST)
    prototypes, rows = cfg.objective.cl.prototypes, cfg.objective.views.n_global * cfg.data.batch_size
    for r in train.values():
        assert all(math.isfinite(r[k]) for k in TERMS), r
        assert 0 <= r["teacher_entropy"] <= math.log(prototypes) + 1e-4 and 1 <= r["proto_used"] <= rows
        assert r["cl"] - r["teacher_entropy"] >= -1e-5, r  # the console's kl: a mean KL divergence
        assert r["collapse"] == collapse_state(r, prototypes, cfg.data.batch_size)
    # TensorBoard shows the same numbers, grouped
    board = tensorboard_scalars(reference)
    for tag, key in [
        ("loss/loss", "loss"),
        ("loss/cl", "cl"),
        ("optim/lr", "lr"),
        ("optim/grad_norm", "grad_norm"),
        ("perf/images_per_s", "images_per_s"),
        ("perf/data_wait_frac", "data_wait_frac"),
        ("perf/read_amplification", "read_amplification"),
        ("contrastive/teacher_entropy", "teacher_entropy"),
        ("contrastive/proto_used", "proto_used"),
    ]:
        assert board[tag] == pytest.approx({s: r[key] for s, r in train.items()}, rel=1e-6), tag
    assert "perf/mfu" not in board  # CPU: no peak to divide by
    reported = None
    for event in read_metrics(str(reference), "collapse"):
        assert event["state"] != reported and event["ended"] == (event["state"] is None)
        assert event["step"] - event["since"] >= 3
        assert all(train[s]["collapse"] == event["state"] for s in range(event["since"] + 1, event["step"] + 1))
        reported = event["state"]


def test_the_first_metrics_record_carries_the_host_memory_peak(reference):
    first, *rest = read_metrics(str(reference))
    assert 2**27 < first["host_memory_peak_bytes"] < 2**36  # a worker holding torch and the tiny model: 128 MiB..64 GiB
    assert not any("host_memory_peak_bytes" in r for r in rest)  # up to the first step only
    board = tensorboard_scalars(reference)
    assert board["perf/host_memory_peak_bytes"] == {first["step"]: pytest.approx(first["host_memory_peak_bytes"])}


def test_checkpoints_are_committed_and_only_the_last_k_kept(reference):
    kept = ckpt.list_checkpoints(str(reference))
    assert [(step, committed) for step, _, committed in kept] == [(8, True), (12, True)]
    commit = ckpt.read_commit(kept[-1][1])
    assert commit["step"] == STEPS and commit["world_size"] == 2
    assert commit["samples_seen"] == STEPS * 4
    index = data.load_index(str(reference))
    position = data.DataPosition()
    for _ in range(STEPS):
        position = data.advance(position, 4, index.num_samples)
    assert commit["data_position"] == position.to_dict()


def test_workers_read_disjoint_slices_in_the_planned_order(reference):
    index = data.load_index(str(reference))
    # shards of 4 rows, one row group each: the sample pool curates to 8 images (2 units, one per worker per epoch)
    assert len(index.files) == index.num_units >= 2
    recorded = keys_by_step(reference)
    assert [recorded[s] for s in range(1, STEPS + 1)] == expected_keys(index, data.DataPosition(), STEPS, 2, 2)
    by_epoch: dict[int, list[str]] = {}
    for record in read_metrics(str(reference), "samples"):
        by_epoch.setdefault(record["epoch"], []).extend(k for rank in record["keys"] for k in rank)
    per_epoch = index.num_samples // 4 * 4  # whole global batches of 4
    for epoch, keys in by_epoch.items():
        assert len(keys) == len(set(keys)), f"a sample fed twice in epoch {epoch}"
        assert len(keys) == per_epoch or epoch == max(by_epoch)


def test_export_writes_a_backbone_that_loads(reference, tmp_path):
    latest = ckpt.latest_committed(str(reference))
    out = tmp_path / "backbone.safetensors"
    meta = export_backbone(latest, str(out))
    assert meta["size"] == "tiny" and meta["step"] == str(STEPS)
    backbone = load_backbone(str(out))  # strict: exactly the backbone's keys
    # The same tensors through a different path: the whole objective, unsharded, from the DCP checkpoint.
    cfg = load_config(PretrainConfig, TINY, FAST)
    assert backbone.cfg.patch_size == cfg.model.patch_size == 8  # the run's model settings, not the size's default
    full = JointObjective(build(cfg.model.backbone()), cfg.objective, STEPS)
    state = {"model": full.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(latest), planner=ckpt.SafeLoadPlanner(), no_dist=True)
    for name, tensor in backbone.state_dict().items():
        torch.testing.assert_close(tensor, state["model"][f"student.{name}"], rtol=0, atol=0)
    fresh = build(cfg.model.backbone()).state_dict()
    assert not torch.equal(fresh["blocks.0.attn.qkv.weight"], backbone.state_dict()["blocks.0.attn.qkv.weight"])
    out_tokens = backbone(torch.randn(1, 3, 64, 48)).patches
    assert out_tokens.shape == (1, 8 * 6, SIZES["tiny"].width) and torch.isfinite(out_tokens).all()
    job_export = ckpt.read_safetensors(str(reference / BACKBONE_FILE))[0]  # the job's own export
    assert all(torch.equal(job_export[k], v) for k, v in backbone.state_dict().items())


# --- failures and resumes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def killed(shards, storage, reference) -> Path:
    return run_job(shards, storage, "killed", "fault.kill_at_step=6", "fault.kill_rank=1")


@pytest.mark.slow
def test_killed_worker_resumes_from_last_checkpoint_with_the_same_samples_and_state(killed, reference):
    (resume,) = read_metrics(str(killed), "resume")
    assert resume["step"] == EVERY and resume["checkpoint"].endswith(f"step_{EVERY:09d}")
    saved, loaded = resume["saved_fingerprint"], resume["fingerprint"]
    assert loaded.keys() == saved.keys() and all(loaded[k] == pytest.approx(saved[k], rel=1e-9) for k in saved)
    assert saved["exp_avg_sq"] > 0  # the optimiser state is part of it
    # The finished run is step for step the uninterrupted one: same samples, same losses.
    assert keys_by_step(killed) == keys_by_step(reference)
    ref, got = latest_per_step(read_metrics(str(reference))), latest_per_step(read_metrics(str(killed)))
    for s in range(1, STEPS + 1):
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), s
    # TensorBoard holds each step once: the resumed attempt's values replace what the killed one wrote past the
    # checkpoint
    board = tensorboard_scalars(killed)["loss/loss"]
    assert board == pytest.approx({s: got[s]["loss"] for s in range(1, STEPS + 1)}, rel=1e-6)
    # The files hold each step once: the resume dropped what the killed attempt wrote past its checkpoint.
    samples = read_metrics(str(killed), "samples")
    attempts = sorted({r["attempt"] for r in samples})
    assert len(attempts) == 2 and resume["dropped_records"] > 0
    assert [r["step"] for r in samples] == list(range(1, STEPS + 1))
    assert [r["step"] for r in samples if r["attempt"] == attempts[0]] == list(range(1, EVERY + 1))
    assert sorted(r["step"] for r in read_metrics(str(killed))) == list(range(1, STEPS + 1))


def test_two_worker_checkpoint_loads_into_one_process(reference):
    uri = ckpt.latest_committed(str(reference))
    commit = ckpt.read_commit(uri)
    assert commit["world_size"] == 2
    cfg = PretrainConfig.model_validate(commit["config"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(cfg, torch.device("cpu"))
        optimizer = build_optimizer(model, cfg.optim)
        fresh = fingerprint(ckpt.checkpointed(model, optimizer))
        ckpt.load(uri, model, optimizer)
        loaded = fingerprint(ckpt.checkpointed(model, optimizer))
        for k, v in commit["fingerprint"].items():
            assert loaded[k] == pytest.approx(v, rel=1e-9) and fresh[k] != loaded[k], k
        steps = {float(optimizer.state[p]["step"]) for p in optimizer.state}
        assert steps == {float(STEPS)}
        # and it trains on from there
        images = torch.randint(0, 256, (2, 3, 64, 48), dtype=torch.uint8)
        model(images, STEPS, torch.Generator().manual_seed(0))["loss"].backward()
        optimizer.step()
        assert fingerprint(ckpt.checkpointed(model, optimizer))["params"] != pytest.approx(loaded["params"], rel=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_worker_run_continues_on_one_worker(shards, storage, reference):
    shutil.copytree(reference, storage / "resharded")
    # fewer workers (a smaller global batch) and more steps: deliberate changes, allowed by name
    run = run_job(
        shards, storage, "resharded", "ray.workers=1", f"steps={STEPS + 4}", "--allow-change", "ray.workers,steps"
    )
    (resume,) = read_metrics(str(run), "resume")
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (STEPS, 2, 1)
    for k, v in resume["saved_fingerprint"].items():
        assert resume["fingerprint"][k] == pytest.approx(v, rel=1e-9)
    # One worker continues the data order where two left it: the next 2 samples per step.
    index = data.load_index(str(run))
    position = data.DataPosition(**resume["data_position"])
    recorded = keys_by_step(run)
    assert [recorded[s] for s in range(STEPS + 1, STEPS + 5)] == expected_keys(index, position, 4, 2, 1)
    train = latest_per_step(read_metrics(str(run)))
    assert all(math.isfinite(train[s]["loss"]) for s in range(STEPS + 1, STEPS + 5))
    assert ckpt.read_commit(ckpt.latest_committed(str(run)))["world_size"] == 1


@pytest.mark.slow
def test_a_global_batch_run_resumes_on_fewer_workers_with_the_same_samples_and_schedule(
    shards, storage, reference, capfd
):
    """``data.global_batch`` is the recipe: 8 steps on 2 workers, then 4 more on 1 worker with no override of the
    worker count. Each step of the resume takes the 4 images the 2-worker reference took at that step, at its
    learning rate; the start line says how the batch was split."""
    gb = ["optim.grad_accum=1", "data.global_batch=4"]
    run = run_job(shards, storage, "global-batch", *gb, "steps=8")
    run_job(shards, storage, "global-batch", *gb, "ray.workers=1", f"steps={STEPS}", "--allow-change", "steps")
    out = capfd.readouterr().out
    assert "global batch=4 (= 2 workers x 2 micro-batches x 1 images)" in out
    assert "global batch=4 (= 1 workers x 4 micro-batches x 1 images)" in out
    (resume,) = read_metrics(str(run), "resume")
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (8, 2, 1)
    recorded, expected = keys_by_step(run), keys_by_step(reference)
    for s in range(1, STEPS + 1):
        assert list(itertools.chain(*recorded[s])) == list(itertools.chain(*expected[s])), s
    train, ref = latest_per_step(read_metrics(str(run))), latest_per_step(read_metrics(str(reference)))
    assert [train[s]["lr"] for s in range(9, STEPS + 1)] == pytest.approx([ref[s]["lr"] for s in range(9, STEPS + 1)])


@pytest.mark.slow
def test_killed_driver_rerun_resumes_with_the_same_samples(shards, storage, reference, ray_local):
    name = "driver-killed"
    address = ray_local.get_runtime_context().gcs_address
    args = ["--config", TINY, "--data", str(shards), "--storage", str(storage), "--name", name, *FAST]
    driver = subprocess.Popen(
        [sys.executable, "-m", "jobs.pretrain", *args, f"ray.address={address}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None:
            metrics = storage / name / "metrics"
            done = [r["step"] for r in read_metrics(str(storage / name), "train")] if metrics.exists() else []
            if done and max(done) > EVERY:
                break
            time.sleep(0.2)
        assert driver.poll() is None, "the driver finished before it could be killed"
    finally:
        driver.kill()
        driver.wait()
    run = run_job(shards, storage, name)
    (resume,) = read_metrics(str(run), "resume")
    assert resume["step"] >= EVERY
    assert keys_by_step(run) == keys_by_step(reference)


def test_rerun_of_a_run_with_other_data_or_model_is_refused(shards, storage, reference, capsys):
    args = ["--config", TINY, "--storage", str(storage), "--name", "reference"]
    assert job.main([*args, "--data", str(shards.parent), *FAST]) == 2
    assert job.main([*args, "--data", str(shards), *FAST, "objective.cl.prototypes=128"]) == 2
    assert "use a new --name" in capsys.readouterr().err


# --- parts, without Ray ---------------------------------------------------------------------------------------------


def _index(rows: list[list[int]]) -> data.DataIndex:
    units = [(f, g, n) for f, groups in enumerate(rows) for g, n in enumerate(groups)]
    return data.DataIndex(
        files=[f"f{i}" for i in range(len(rows))],
        file=np.array([u[0] for u in units], np.int32),
        row_group=np.array([u[1] for u in units], np.int32),
        rows=np.array([u[2] for u in units], np.int64),
    )


def _positions(segments: list[dict], index: data.DataIndex) -> list[tuple[str, int, int]]:
    return [(s["file"], s["row_group"], r) for s in segments for r in s["rows"]]


def test_the_data_position_is_a_prefix_whatever_the_worker_count():
    index = _index([[5, 5, 3], [7], [2, 6]])  # 28 samples in 6 row groups
    order = data.EpochOrder(index, seed=3, epoch=0)
    sequence = _positions(order.segments(0, index.num_samples), index)
    assert len(set(sequence)) == 28
    # 2 workers x 3 for 2 steps, then 1 worker x 4 for 2 steps: together the first 20 samples of the order.
    pos, taken = data.DataPosition(), []
    for world, per_worker in ((2, 3), (1, 4)):
        plans = [
            data.worker_plan(
                index, seed=3, shuffle=True, position=pos, steps=2, per_worker=per_worker, world=world, rank=r
            )
            for r in range(world)
        ]
        taken += [p for segs, _ in plans for p in _positions(segs, index)]
        pos = plans[0][1]
    assert pos == data.DataPosition(0, 20) and sorted(taken) == sorted(sequence[:20])
    # The next step does not fit (28 - 20 < 12): a new epoch in a new order.
    segs, pos = data.worker_plan(index, seed=3, shuffle=True, position=pos, steps=1, per_worker=12, world=1, rank=0)
    assert pos == data.DataPosition(1, 12)
    assert _positions(segs, index) == _positions(data.EpochOrder(index, 3, 1).segments(0, 12), index)
    assert _positions(segs, index) != sequence[:12]


def test_schedules_warm_up_then_decay_per_optimiser_step():
    o = OptimSettings(lr=1e-3, min_lr=1e-5, warmup_steps=10, weight_decay=0.04, weight_decay_end=0.4)
    lrs = [lr_at(s, o, 100, 256) for s in range(100)]  # at 256 images per step the peak is optim.lr itself
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and lr_at(100, o, 100, 256) == pytest.approx(1e-5)
    assert wd_at(0, o, 100) == pytest.approx(0.04) and wd_at(100, o, 100) == pytest.approx(0.4)


def test_crop_keeps_the_output_aspect_and_centres_on_the_prominent_person():
    persons = [
        {"x0": 900, "y0": 100, "x1": 1000, "y1": 700, "prominent": True},
        {"x0": 0, "y0": 0, "x1": 50, "y1": 50, "prominent": False},
    ]
    centre = data.person_centre(persons, 1200, 800)
    assert centre == (950, 400)
    x0, y0, x1, y1 = data.aspect_crop(1200, 800, (128, 96), centre)
    assert (y0, y1) == (0, 800) and (x1 - x0) / (y1 - y0) == pytest.approx(96 / 128)
    assert x1 == 1200 or x0 < 950 < x1  # shifted to keep the person, clamped inside the image
    assert data.person_centre([], 1200, 800) == (600, 400)


class _Payload:
    pass


def test_checkpoint_loading_refuses_pickled_objects(tmp_path):
    saved = {"w": torch.ones(3), "hyper": {"lr": 0.1, "betas": (0.9, 0.95)}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    state = {"w": torch.zeros(3), "hyper": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "ok"), planner=ckpt.SafeLoadPlanner(), no_dist=True)
    assert state["hyper"] == {"lr": 0.1, "betas": (0.9, 0.95)} and torch.equal(state["w"], torch.ones(3))
    dcp.save({"obj": _Payload()}, checkpoint_id=str(tmp_path / "evil"), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"obj": None}, checkpoint_id=str(tmp_path / "evil"), planner=ckpt.SafeLoadPlanner(), no_dist=True)
    assert isinstance(info.value.failures[0][0], pickle.UnpicklingError)  # (exception, traceback) per rank
    unsafe = {"obj": None}  # DCP's own planner would have run the pickle
    dcp.load(unsafe, checkpoint_id=str(tmp_path / "evil"), no_dist=True)
    assert isinstance(unsafe["obj"], _Payload)


def test_config_overrides_are_typed_and_checked():
    cfg = load_config(PretrainConfig, TINY, ["optim.lr=3e-4", "ray.workers=4"])
    assert cfg.optim.lr == 3e-4 and cfg.samples_per_step() == 4 * 4  # the tiny config: 4 images per worker
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(PretrainConfig, TINY, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match="unknown size"):
        load_config(PretrainConfig, TINY, ["model.size=2b"])
    with pytest.raises(ConfigError, match="multiple of 8"):  # the tiny config's 8-px patches
        load_config(PretrainConfig, TINY, ["objective.views.local_size=[44,44]"])
    with pytest.raises(ConfigError, match="multiple of 16"):
        load_config(PretrainConfig, TINY, ["objective.views.local_size=[40,40]", "model.patch_size=16"])
    assert load_config(PretrainConfig, REPO / "configs/pretrain/sapiens2_0.4b.yaml").model.backbone().width == 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checkpoint_and_export_on_an_object_store(monkeypatch):
    """Save, list, load and export through pyarrow's S3 filesystem (a local moto server), no fsspec backend."""
    moto_server = pytest.importorskip("moto.server")
    import pyarrow.fs as pafs

    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
            monkeypatch.setenv(k, v)
        s3 = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", allow_bucket_creation=True
        )
        s3.create_dir("runs")
        # s3:// URIs resolve to the moto endpoint (on AWS, pyarrow's from_uri finds the real one).
        resolve = fs_storage.resolve
        monkeypatch.setattr(
            fs_storage, "resolve", lambda uri: (s3, uri[5:]) if uri.startswith("s3://") else resolve(uri)
        )
        cfg = load_config(PretrainConfig, TINY, FAST)
        torch.manual_seed(0)
        model = JointObjective(build(cfg.model.backbone()), cfg.objective, STEPS)
        optimizer = build_optimizer(model, cfg.optim)
        model(torch.randint(0, 256, (2, 3, 64, 48), dtype=torch.uint8), 0, torch.Generator().manual_seed(0))[
            "loss"
        ].backward()
        optimizer.step()
        run = "s3://runs/tiny"
        uri = ckpt.step_uri(run, 1)
        ckpt.save(uri, model, optimizer, {"step": 1, "config": cfg.model_dump(mode="json")})
        assert ckpt.list_checkpoints(run) == [(1, uri, True)] and ckpt.read_commit(uri)["step"] == 1
        torch.manual_seed(1)
        other = JointObjective(build(cfg.model.backbone()), cfg.objective, STEPS)
        other_opt = build_optimizer(other, cfg.optim)
        ckpt.load(uri, other, other_opt)
        for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
            assert torch.equal(a, b), name
        p = next(iter(optimizer.state))
        q = dict(zip(model.parameters(), other.parameters()))[p]
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])
        export_backbone(uri, f"{run}/{BACKBONE_FILE}")
        backbone = load_backbone(f"{run}/{BACKBONE_FILE}")
        assert all(torch.equal(v, model.student.state_dict()[k]) for k, v in backbone.state_dict().items())
    finally:
        server.stop()


def test_the_teacher_update_on_sharded_parameters_equals_a_lerp_per_parameter():
    cfg = load_config(PretrainConfig, TINY, ["ray.workers=1"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(cfg, torch.device("cpu"))
        teacher = [*model.teacher["backbone"].parameters(), *model.teacher["head"].parameters()]
        student = [*model.student.parameters(), *model.head.parameters()]
        assert len(teacher) == len(student) > 10 and all(isinstance(t, DTensor) for t in teacher + student)
        with torch.no_grad():
            for s in student:
                s.to_local().add_(torch.randn(s.to_local().shape))  # the student has moved away from its copy
        before = [t.to_local().clone() for t in teacher]
        m = model.update_teacher(30)  # one _foreach_lerp_ over the shards
        assert cfg.objective.cl.momentum < m < cfg.objective.cl.momentum_end
        for t, t0, s in zip(teacher, before, student):
            torch.testing.assert_close(t.to_local(), t0.lerp(s.to_local(), 1 - m))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # inductor compiles the tiny blocks on the CPU: about a minute
def test_compiled_blocks_under_fsdp2_train_as_eager_with_every_checkpointing_mode_and_schedule():
    """Each block compiled with its checkpointing inside (the order of ``build_model``), then sharded: the steps'
    terms equal the eager model's for full and selective checkpointing, also with the gathered parameters kept to
    the backward and two blocks prefetched, the settings the GPU check sweeps on one compiled model."""
    base = ["ray.workers=1", "objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]"]
    images = [torch.randint(0, 256, (2, 3, 64, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        terms = {}
        for setting in (
            ("model.compile=false", "model.activation_checkpointing=full"),
            ("model.compile=true", "model.activation_checkpointing=full"),
            ("model.compile=true", "model.activation_checkpointing=selective"),
            ("model.compile=true", "model.activation_checkpointing=selective", "fsdp.reshard_after_forward=never",
             "fsdp.prefetch=2"),
        ):  # fmt: skip
            cfg = load_config(PretrainConfig, TINY, [*base, *setting])
            trainer = Trainer(build_model(cfg, torch.device("cpu")), cfg, torch.device("cpu"))
            terms[setting] = torch.stack([trainer.train_step(step, images)[0] for step in range(2)])
        eager = next(iter(terms.values()))
        assert torch.isfinite(eager).all()
        for setting, t in list(terms.items())[1:]:
            torch.testing.assert_close(t, eager, rtol=1e-4, atol=1e-5, msg=lambda m, s=setting: f"{s}: {m}")
    finally:
        dist.destroy_process_group()


# --- evaluations during the run -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_probe_during_the_run_scores_the_ema_teacher_as_jobs_probe_does(shards, storage, tmp_path):
    """``probe.every`` scores the sharded EMA teacher (2 workers) at steps 2 and 4; at the last step its figures equal
    ``jobs.probe``'s on the teacher exported from the same checkpoint, in one process; TensorBoard has them too."""
    from jobs import make_synthetic, probe

    labelled = tmp_path / "labelled"
    assert make_synthetic.main(["--out", str(labelled), "--n", "8", "--val", "4", "--seed", "3"]) == 0
    steps = ["steps=4", "checkpoint.every=4", "probe.every=2", f"probe.data={labelled}", "probe.eval_limit=4"]
    args = ["--config", TINY, "--data", str(shards), "--storage", str(storage), "--name", "probed"]
    assert job.main([*args, *FAST, *steps, "--export", "teacher"]) == 0
    evals = latest_per_step(read_metrics(str(storage / "probed"), "eval"))
    assert sorted(evals) == [2, 4]
    for r in evals.values():
        assert 0 <= r["probe_miou"] <= 1 and 0 <= r["knn_miou"] <= 1 and 0 <= r["left_right_acc"] <= 1, r
        assert r["labels"] == 8 and r["eval_images"] == 4
    out = tmp_path / "probe.json"
    teacher = storage / "probed" / "teacher_backbone.safetensors"
    assert probe.main(["--data", str(labelled), "--backbone", str(teacher), "--out", str(out), "--val-limit", "4"]) == 0
    best = json.loads(out.read_text())["results"]["8"]
    assert evals[4]["probe_miou"] == pytest.approx(best["probe_best"]["miou"], abs=0.02)
    assert evals[4]["knn_miou"] == pytest.approx(best["knn_best"]["miou"], abs=0.02)
    board = tensorboard_scalars(storage / "probed")
    assert board["eval/probe_miou"] == pytest.approx({s: r["probe_miou"] for s, r in evals.items()}, rel=1e-6)


@pytest.mark.slow
def test_a_probe_that_cannot_read_its_data_is_turned_off_and_training_goes_on(shards, storage, tmp_path, capfd):
    """The evaluator's data fail on every rank at the start (val/ images of another size than train/'s): the run
    says so and trains to its end with no evaluation."""
    from jobs import make_synthetic

    a, b, labelled = tmp_path / "a", tmp_path / "b", tmp_path / "labelled"
    assert make_synthetic.main(["--out", str(a), "--n", "4", "--val", "2"]) == 0
    assert make_synthetic.main(["--out", str(b), "--n", "4", "--val", "2", "--height", "64", "--width", "48"]) == 0
    labelled.mkdir()
    shutil.copytree(a / "train", labelled / "train")
    shutil.copytree(b / "val", labelled / "val")
    overrides = ["steps=2", "checkpoint.every=2", "probe.every=1", f"probe.data={labelled}"]
    run = run_job(shards, storage, "probe-off", *overrides)
    assert sorted(latest_per_step(read_metrics(str(run)))) == [1, 2] and not read_metrics(str(run), "eval")
    assert "probe off" in capfd.readouterr().out
