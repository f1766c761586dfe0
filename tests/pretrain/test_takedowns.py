"""Takedowns reaching a running pretraining (pretrain/takedowns.py): the removed images leave the epoch order, the
others keep theirs and a batch is topped up from the next ones; a replaced shard's rows are found in its
replacement, by key while the old file is there, else by place; a tiny run with a takedown in its middle."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FAST, REPO, TINY

from common.layout import LAYOUT
from jobs import takedown
from pretrain import data, takedowns
from tests.pretrain.test_reads import write_shards
from tests.pretrain.test_train import keys_by_step
from training.metrics import latest_per_step, read_metrics


def curated_like(tmp_path: Path) -> data.DataIndex:
    """3 shards of 32 rows in row groups of 8 under <out>/shards, named as the write phase names them."""
    folder = tmp_path / "out" / "shards"
    write_shards(folder, 3, 32, 8)
    manifest = json.loads((folder / "manifest.json").read_text())
    for s in manifest["shards"]:
        new = s["file"].replace(".parquet", "-0000000000000000.parquet")
        (folder / s["file"]).rename(folder / new)
        s["file"] = new
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return data.DataIndex.scan(str(folder))


def take_down(
    index: data.DataIndex, name: str, rows: list[int], *, delete: bool, rows_recorded: bool = True
) -> list[str]:
    """What jobs.takedown does to the shard ``name``: ``rows`` out, the rest rewritten under a new name, the manifest
    switched, the record written (with the rows it took out, unless ``rows_recorded`` is false: a takedown run before
    it recorded them); the old file deleted when ``delete`` (--grace-minutes 0). Returns the keys."""
    folder = Path(index.root)
    table = pq.read_table(folder / name)
    keep = np.setdiff1d(np.arange(table.num_rows), rows)
    new = name.rsplit("-", 1)[0] + "-1111111111111111.parquet"
    pq.write_table(table.take(pa.array(keep)), folder / new, row_group_size=8)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"] = [{"file": new, "rows": len(keep)} if s["file"] == name else s for s in manifest["shards"]]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    keys = table.column("key").take(pa.array(rows)).to_pylist()
    record = {"id": "abc", "at": "2026-01-01T00:00:00+00:00", "status": "done", "version": 2, "list": "l"}
    record |= {"removed": [{"key": k, "source": k} for k in keys], "superseded": [f"shards/{name}"]}
    if rows_recorded:
        record["removed_rows"] = {name: sorted(rows)}
    (folder.parent / "_state" / "takedown").mkdir(parents=True)
    (folder.parent / "_state" / "takedown" / "abc.json").write_text(json.dumps(record))
    if delete:
        (folder / name).unlink()
    return keys


def sequence(order: data.EpochOrder, lo: int, hi: int) -> tuple[list[str], int]:
    """The keys at positions [lo, hi) of the order, read as a worker reads them, and the images skipped there."""
    segments = order.segments(lo, hi)
    out = data.read_segments(pa.Table.from_pylist(segments), order.index.root, (16, 16), person_crop=False)
    return list(out["key"]), int(out["skipped"].sum())


def test_removed_images_leave_the_order_and_the_rest_keep_theirs(tmp_path):
    index = curated_like(tmp_path)
    before, _ = sequence(data.EpochOrder(index, 0, 1), 0, index.num_samples)
    gone = take_down(index, index.files[1], [3, 9, 17, 30], delete=False, rows_recorded=False)
    state = takedowns.update(takedowns.Takedowns(), index)
    assert state.files[index.files[1]].removed == (3, 9, 17, 30)  # found by key: the old file is still there
    removals = takedowns.Removals(index, state)
    order = data.EpochOrder(index, 0, 1, removals=removals)
    after, skipped = sequence(order, 0, index.num_samples - 4)
    assert after == [k for k in before if k not in gone] and skipped == 4
    # a worker's batch is topped up from the next images of the order: 8 per worker and step, none removed
    segments, position = data.worker_plan(
        index, seed=0, shuffle=True, position=data.DataPosition(1, 0), steps=5, per_worker=8, world=2, rank=1,
        removals=removals,
    )  # fmt: skip
    assert sum(len(s["rows"]) for s in segments) == 40 and position == data.DataPosition(1, 80)
    # the state survives a checkpoint's record
    assert takedowns.Takedowns.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_a_deleted_shard_is_read_from_its_replacement_and_the_position_moves_past_no_kept_image(tmp_path):
    index = curated_like(tmp_path)
    order = data.EpochOrder(index, 0, 0)
    before, _ = sequence(order, 0, index.num_samples)
    gone = take_down(index, index.files[0], [0, 5, 31], delete=True, rows_recorded=False)  # --grace-minutes 0
    try:
        sequence(order, 0, index.num_samples)
        raise AssertionError("the deleted shard was read")
    except data.ShardGone as exc:
        assert data.shard_gone(RuntimeError("wrapped")) is False and data.shard_gone(exc)
    state = takedowns.update(takedowns.Takedowns(), index)
    removals = takedowns.Removals(index, state)
    after, skipped = sequence(data.EpochOrder(index, 0, 0, removals=removals), 0, index.num_samples - 3)
    # the old file's keys are unknown now: its last rows' places go, each remaining image keeps one place
    assert skipped == 3 and not set(gone) & set(after)
    assert sorted(after) == sorted(k for k in before if k not in gone)
    # a run 40 samples into the epoch goes on with the sample it would have read next
    position = data.DataPosition(0, 40)
    moved = data.rebase(position, index, 0, True, None, removals)
    next_one = before[40:]
    nxt = next(k for k in next_one if k in after)
    assert after[moved.consumed] == nxt and moved.consumed == 40 - sum(k not in after for k in before[:40])
    # the run's start does not refuse the deleted file a takedown replaced
    index.check_present(takedowns.replaced_files(index.root))


def test_a_deleted_shard_is_placed_exactly_by_the_rows_its_takedown_recorded(tmp_path):
    index = curated_like(tmp_path)
    before, _ = sequence(data.EpochOrder(index, 0, 0), 0, index.num_samples)
    gone = take_down(index, index.files[0], [0, 5, 31], delete=True)  # --grace-minutes 0: only the record says
    state = takedowns.update(takedowns.Takedowns(), index)
    assert state.files[index.files[0]].removed == (0, 5, 31)
    after, skipped = sequence(data.EpochOrder(index, 0, 0, removals=takedowns.Removals(index, state)), 0, 93)
    assert skipped == 3 and after == [k for k in before if k not in gone]  # every other image keeps its place


def test_a_deleted_shard_is_recognised_through_a_ray_data_read_task(tmp_path, ray_local):
    import ray.data

    index = curated_like(tmp_path)
    segments = data.EpochOrder(index, 0, 0).segments(0, 8)
    (Path(index.root) / segments[0]["file"]).unlink()
    kwargs = {"data_uri": index.root, "out_hw": (16, 16), "person_crop": False}
    ds = ray.data.from_items(segments).map_batches(data.read_segments, batch_format="pyarrow", fn_kwargs=kwargs)
    with pytest.raises(Exception) as caught:
        list(ds.iter_batches(batch_size=4))
    assert data.shard_gone(caught.value)


@pytest.fixture(scope="module")
def few_hundred_curated(ray_local, tmp_path_factory) -> Path:
    """A curated output of a few hundred images in shards of 32: 320 phase-1 survivors as ``benchmarks/bench_scale.py``
    synthesises them (small real JPEGs keyed by their sha256, planted copies among them) through the real dedup,
    sample and write phases."""
    from benchmarks.bench_scale import config, synthesise
    from curation.phases.pipeline import GlobalPhases
    from curation.steps.output import Output

    out = tmp_path_factory.mktemp("few_hundred") / "out"
    cfg = config(["write.rows_per_shard=32"])
    synthesise(out, 320, 160, cfg, processes=1)
    for phase in ("dedup", "sample", "write"):
        GlobalPhases(cfg, Output.at(str(out))).run(phase)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("check_minutes", [0, 60], ids=["checked-every-step", "met-as-deleted-shards"])
def test_a_run_with_a_takedown_in_its_middle_finishes_without_the_removed_images(
    few_hundred_curated, ray_local, tmp_path, check_minutes
):
    """The tests' tiny run (2 workers) on a copy of a curated output of a few hundred images; after its first step
    ``jobs.takedown --grace-minutes 0`` removes every fifth image (their shards rewritten, the old files deleted at
    once), and a worker is killed at step 14 (the run resumes from step 12's checkpoint). It finishes, and no step
    after the takedown and the next check reads a removed image; with checks an hour apart the workers meet the
    deleted shards first and take the records then."""
    out = tmp_path / "out"
    shutil.copytree(few_hundred_curated, out)
    manifest = json.loads((out / LAYOUT.manifest).read_text())
    assert manifest["totals"]["rows"] >= 200 and len(manifest["shards"]) >= 6
    keys_of = [
        pq.read_table(out / LAYOUT.shards / s["file"], columns=["key"]).column("key") for s in manifest["shards"]
    ]
    gone = {k for column in keys_of for k in column.to_pylist()[::5]}
    (tmp_path / "list.txt").write_text("\n".join(sorted(gone)) + "\n")
    storage, steps = tmp_path / "runs", 20
    args = ["--config", TINY, "--data", str(out / LAYOUT.shards), "--storage", str(storage), "--name", "live", *FAST]
    args += [
        f"steps={steps}",
        f"data.takedown_check_minutes={check_minutes}",
        "fault.kill_at_step=14",
        "fault.kill_rank=1",
    ]
    driver = subprocess.Popen([sys.executable, "-m", "jobs.pretrain", *args], cwd=REPO, stderr=subprocess.PIPE)
    run = storage / "live"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None and max(steps_done(run), default=0) < 1:
            time.sleep(0.2)
        assert takedown.main(["--output", str(out), "--list", str(tmp_path / "list.txt"), "--grace-minutes", "0"]) == 0
        landed = max(steps_done(run))
        assert landed < 12, "the takedown landed after the run's checkpoint before the kill"
        _, err = driver.communicate(timeout=600)
    finally:
        driver.kill()
    assert driver.returncode == 0, err.decode()[-3000:]
    assert not any((out / LAYOUT.shards / s["file"]).exists() for s in manifest["shards"][:1])  # deleted at once
    keys = {s: [k for rank in ks for k in rank] for s, ks in keys_by_step(run).items()}
    assert sorted(keys) == list(range(1, steps + 1))
    train = latest_per_step(read_metrics(str(run)))
    assert sum(r["taken_down_skipped"] for s, r in train.items() if s > landed) > 0  # the metrics show it
    # checked at every step: none from the step after the next check on; an hour apart: none once the workers met a
    # deleted shard (images read ahead of the steps before it are trained on), by the first step that skips one
    honoured = min(s for s, r in train.items() if r["taken_down_skipped"])
    assert all(not gone & set(keys[s]) for s in range(landed + 2 if check_minutes == 0 else honoured, steps + 1))
    (resume,) = read_metrics(str(run), "resume")
    assert resume["step"] == 12


def steps_done(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(str(run), "train")] if (run / "metrics").exists() else []
