"""Every job on the object-store URIs curation takes: ``s3://bucket/prefix?endpoint_override=...&scheme=http&...``,
on a local S3 (moto). Pretraining and fine-tuning keep their runs there (Ray Train included, through the project's
pyarrow filesystem) and resume from their checkpoints; probing, exporting, auditing and the report read and write
there; no query or credentials end up in what the jobs write or print.

The URIs carry their credentials as user info (``s3://user:secret@bucket/...``): Ray's worker processes, started
before a test sets environment variables, reach the store with them.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import CountedTask, moto_s3, s3_query
from PIL import Image

from common import storage
from common.console import INTERRUPTED
from common.layout import LAYOUT
from common.storage import redact
from curation.phases.write import shards as ws
from curation.score.ledger import read_ledger
from finetune.train import load_finetuned
from jobs import audit as audit_job
from jobs import curate, make_synthetic, probe
from jobs import export as export_job
from jobs import finetune as finetune_job
from jobs import pretrain as pretrain_job
from jobs import takedown as takedown_job
from pretrain.export import BACKBONE_FILE, load_backbone
from training import checkpoint as ckpt
from training.metrics import latest_per_step, read_metrics
from training.runner import ray_storage, run_uri_for

REPO = Path(__file__).resolve().parents[2]
SECRET = "runsecret"
CREDS = f"runuser:{SECRET}"
PRETRAIN = [  # the tiny config, a few small steps
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "objective.views.global_size=[64,48]",
    "objective.views.local_size=[32,32]",
    "optim.warmup_steps=1",
    "data.batch_size=1",
    "log.every=1",
]
FINETUNE = ["checkpoint.every=2", "log.every=2", "eval.visualise=1", "eval.max_samples=4", "data.batch_size=2"]
CURATE = [  # only the stages the global phases need
    "stages.person.enabled=false",
    "stages.head_pose.enabled=false",
    "stages.quality.enabled=false",
    "stages.text_overlay.enabled=false",
    "stages.nsfw.enabled=false",
]


@pytest.fixture(scope="module")
def store():
    """A local S3 with buckets ``data`` and ``runs``: ``(filesystem, host:port)``."""
    with moto_s3("data", "runs") as (fs, endpoint):
        yield fs, endpoint


def s3(store, path: str) -> str:
    """The URI of ``bucket/key`` on the test store, as a user gives it: credentials and endpoint in it."""
    return f"s3://{CREDS}@{path}{s3_query(store[1])}"


def _objects(fs: pafs.FileSystem, prefix: str) -> dict[str, bytes]:
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
    return {i.path: fs.open_input_stream(i.path).read() for i in infos if i.type == pafs.FileType.File}


def _no_secrets(fs: pafs.FileSystem, prefix: str, store_records: tuple[str, ...] = ()) -> None:
    """No object under ``prefix`` holds the credentials, nor the endpoint's query but the ``store_records`` whose
    purpose is to reach the store again."""
    for path, data in _objects(fs, prefix).items():
        assert SECRET.encode() not in data, path
        assert b"endpoint_override" not in data or path in store_records, path


# --- URIs ---------------------------------------------------------------------------------------------------------


def test_a_uri_joins_its_path_before_its_query():
    base = "s3://u:p@bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"
    run = storage.join(base, "tiny", "checkpoints/")
    assert run == "s3://u:p@bucket/runs/tiny/checkpoints?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"
    assert run_uri_for(base, "tiny") == storage.join(base, "tiny")
    # parts are percent-encoded, as pyarrow decodes a URI's path; a filesystem path is joined as it is
    odd = storage.join("s3://bucket/runs?region=us-east-1", "a b#1?", "step_000000002")
    assert odd == "s3://bucket/runs/a%20b%231%3F/step_000000002?region=us-east-1"
    assert pafs.FileSystem.from_uri(odd)[1] == "bucket/runs/a b#1?/step_000000002"
    assert storage.join("bucket/pool/what?.jpg", "x") == "bucket/pool/what?.jpg/x"
    assert storage.basename(odd) == "step_000000002" and storage.basename("/runs/tiny/") == "tiny"
    assert ckpt.step_of(ckpt.step_uri(base, 12)) == 12
    assert storage.redact(run) == "s3://bucket/runs/tiny/checkpoints"
    assert (
        storage.without_credentials(base)
        == "s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http&region=us-east-1"
    )
    assert storage.without_credentials("gs://b/p?access_token=x&project=y") == "gs://b/p?project=y"


def test_ray_train_gets_the_projects_filesystem_and_a_plain_path(tmp_path):
    given = ray_storage("s3://bucket/runs?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1")
    assert given["storage_path"] == "bucket/runs"  # a path on the filesystem, no scheme, no query
    assert given["storage_filesystem"].__reduce__()[1][0]["endpoint_override"] == "127.0.0.1:9"  # what Ray pickles
    assert ray_storage(str(tmp_path / "runs")) == {"storage_path": str(tmp_path / "runs")}


# --- pretraining and fine-tuning ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(store, curated_run, ray_local):
    """A tiny pretraining run on the store: 4 steps, its newest checkpoint damaged, then the same command extended to
    steps=6 (a resume from the checkpoint before); returns the run's URI and the console of both commands."""
    fs, _ = store
    pafs.copy_files(
        str(curated_run / "shards"), "data/shards", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
    )
    args = ["--config", str(REPO / "configs/pretrain/tiny.yaml"), "--data", s3(store, "data/shards"),
            "--storage", s3(store, "runs/pretrain"), "--name", "tiny", *PRETRAIN]  # fmt: skip
    consoles = []
    for steps in (4, 6):
        extend = ["--allow-change", "steps"] if steps == 6 else []
        with contextlib.redirect_stdout(io.StringIO()) as console:
            assert pretrain_job.main([*args, f"steps={steps}", *extend]) == 0
        consoles.append(console.getvalue())
        if steps == 4:  # the newest checkpoint's shard overwritten in place on the store: same size, other bytes
            shard = "runs/pretrain/tiny/checkpoints/step_000000004/__0_0.distcp"
            data = bytearray(fs.open_input_stream(shard).read())
            data[len(data) // 3 : 2 * len(data) // 3] = bytes(2 * len(data) // 3 - len(data) // 3)
            with fs.open_output_stream(shard) as f:
                f.write(bytes(data))
    return storage.join(s3(store, "runs/pretrain"), "tiny"), consoles


@pytest.mark.slow  # two pretraining commands on Ray Train
def test_pretraining_on_an_object_store_trains_resumes_and_exports(store, pretrained):
    fs, _ = store
    run, consoles = pretrained
    assert [step for step, _, committed in ckpt.list_checkpoints(run) if committed] == [4, 6]  # keep=2
    train = latest_per_step(read_metrics(run))
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    (resume,) = read_metrics(run, "resume")
    # the damaged checkpoint was set aside on the store (its objects kept) and the run went on from step 2
    assert resume["step"] == 2 and resume["checkpoint"] == "s3://runs/pretrain/tiny/checkpoints/step_000000002"
    (damaged,) = ckpt.set_aside_names(run)
    assert fs.get_file_info(f"runs/pretrain/tiny/checkpoints/{damaged}/__0_0.distcp").type == pafs.FileType.File
    names = {info.base_name for info in fs.get_file_info(pafs.FileSelector("runs/pretrain/tiny"))}
    assert {"run.json", "checkpoints", "metrics", BACKBONE_FILE} <= names
    # the extension is recorded in the run's record
    (change,) = json.loads(fs.open_input_stream("runs/pretrain/tiny/run.json").read())["changes"]
    assert change["settings"] == {"steps": [4, 6]} and change["newest_checkpoint"] == 4  # the newest when it was taken
    assert "[pretrain] resuming s3://runs/pretrain/tiny with steps 4 -> 6:" in consoles[1]
    backbone = load_backbone(storage.join(run, BACKBONE_FILE))
    assert ckpt.read_safetensors(storage.join(run, BACKBONE_FILE))[1]["step"] == "6"
    assert torch.isfinite(backbone(torch.zeros(1, 3, 64, 48)).patches).all()
    assert json.loads(fs.open_input_stream("runs/pretrain/tiny/run.json").read())["data"] == "s3://data/shards"
    assert "[pretrain] backbone:    s3://runs/pretrain/tiny/backbone.safetensors (size tiny, step 6)" in consoles[1]
    for console in consoles:
        assert SECRET not in console and "endpoint_override" not in console
    _no_secrets(fs, "runs/pretrain")


@pytest.fixture(scope="module")
def labelled(store) -> str:
    args = ["--out", s3(store, "data/labelled"), "--n", "8", "--val", "4", "--height", "64", "--width", "48",
            "--rows-per-shard", "8", "--row-group-size", "4"]  # fmt: skip
    assert make_synthetic.main(args) == 0
    return s3(store, "data/labelled")


@pytest.mark.slow  # a pretraining run (two commands) and, here, what it feeds
def test_finetuning_on_an_object_store_from_a_pretrained_backbone_resumes(store, pretrained, labelled, capsys):
    fs, _ = store
    backbone = storage.join(pretrained[0], BACKBONE_FILE)
    args = ["--task", "seg", "--config", str(REPO / "configs/finetune/tiny.yaml"), "--data", labelled,
            "--storage", s3(store, "runs/finetune"), "--name", "seg", "--backbone", backbone, *FINETUNE]  # fmt: skip
    capsys.readouterr()
    assert finetune_job.main([*args, "steps=4"]) == 0
    # a changed setting is refused before anything starts, with what to add
    assert finetune_job.main([*args, "steps=6"]) == 2
    assert "changes steps 4 -> 6. To change it from the newest checkpoint on, add --allow-change steps" in (
        capsys.readouterr().err
    )
    # the newest checkpoint damaged on the store: set aside, and the run goes on from the one before
    fs.delete_file("runs/finetune/seg/checkpoints/step_000000004/.metadata")
    assert finetune_job.main([*args, "steps=6", "--allow-change", "steps"]) == 0
    console = capsys.readouterr().out
    run = storage.join(s3(store, "runs/finetune"), "seg")
    (resume,) = read_metrics(run, "resume")
    assert resume["step"] == 2 and resume["checkpoint"] == "s3://runs/finetune/seg/checkpoints/step_000000002"
    (damaged,) = ckpt.set_aside_names(run)
    assert damaged.startswith("damaged-step_000000004-")
    assert fs.get_file_info(f"runs/finetune/seg/checkpoints/{damaged}/commit.json").type == pafs.FileType.File
    assert [step for step, _, _ in ckpt.list_checkpoints(run)] == [4, 6]  # pruned by the worker (keep=2)
    report = json.loads(fs.open_input_stream("runs/finetune/seg/metrics.json").read())
    assert report["task"] == "seg" and report["step"] == 6 and 0 <= report["metrics"]["mIoU"] <= 1
    assert fs.get_file_info("runs/finetune/seg/pictures").type == pafs.FileType.Directory
    _, task = load_finetuned(storage.join(run, "finetuned.safetensors"))
    assert task.name == "seg"
    spec = json.loads(fs.open_input_stream("runs/finetune/seg/run.json").read())
    assert (
        spec["backbone"] == "s3://runs/pretrain/tiny/backbone.safetensors"
        and spec["train"] == "s3://data/labelled/train"
    )
    assert (
        "[finetune] resuming s3://runs/finetune/seg with steps 4 -> 6:" in console
        and "[finetune] model:    s3://runs/finetune/seg/" in console
    )
    assert SECRET not in console and "endpoint_override" not in console
    _no_secrets(fs, "runs/finetune")


@pytest.mark.slow  # a pretraining run (two commands) and, here, what it feeds
def test_probing_reads_and_writes_the_object_store(store, pretrained, labelled, capsys):
    fs, _ = store
    backbone = storage.join(pretrained[0], BACKBONE_FILE)
    out = s3(store, "runs/probe/result.json")
    args = ["--data", labelled, "--backbone", backbone, "--out", out, "--iters", "3", "--k", "2", "--threads", "1"]
    assert probe.main(args) == 0
    result = json.loads(fs.open_input_stream("runs/probe/result.json").read())
    assert result["config"]["backbone"] == "s3://runs/pretrain/tiny/backbone.safetensors"
    assert (
        result["config"]["train"] == "s3://data/labelled/train" and result["config"]["eval"] == "s3://data/labelled/val"
    )
    console = capsys.readouterr().out
    assert "[probe] result: s3://runs/probe/result.json" in console and SECRET not in console


# --- curation, its report and the export -------------------------------------------------------------------------


def _photo(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (size[1] // 20, size[0] // 20, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(blocks).resize(size, Image.NEAREST).save(buf, "JPEG", quality=90)
    return buf.getvalue()


_TILE = re.compile(
    r'<figure class="tile[^"]*" title="([^"]*)">(?:<span[^>]*>[^<]*</span>)?'
    r'(?:<img src="([^"]+)"|<div class="placeholder">([^<]*)</div>)'
)


def _tiles(page: str, section: str) -> dict[str, tuple[str | None, str | None]]:
    """source -> (thumbnail, placeholder) of the tiles in one section of the report."""
    body = page.split(f'<section id="{section}">', 1)[1].split("</section>", 1)[0]
    return {m[1]: (m[2] or None, m[3] or None) for m in _TILE.finditer(body)}


@pytest.fixture(scope="module")
def curated(store, ray_local) -> str:
    """A small pool on the store (3 photos to keep, 2 too small), curated into an output on the store."""
    fs, _ = store
    for i in range(5):
        size = (480, 400) if i < 3 else (200, 150)
        with fs.open_output_stream(f"data/pool/img-{i}.jpg") as f:
            f.write(_photo(i, size))
    out = s3(store, "runs/curated")
    args = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", s3(store, "data/pool"), "--output", out]
    assert curate.main([*args, *CURATE]) == 0
    return out


@pytest.mark.slow  # a curation run on the store
def test_the_report_shows_rejected_images_of_an_object_store_pool(store, curated, monkeypatch, capsys):
    fs, endpoint = store
    record = json.loads(fs.open_input_stream(f"runs/curated/{LAYOUT.run_record}").read())
    assert record["input"] == "s3://data/pool" and record["input_store"] == f"s3://data/pool{s3_query(endpoint)}"
    # the report reads the pool on the store the run recorded, with the environment's credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "runuser")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    lite = [*CURATE, "--config", str(REPO / "configs/curate/lite.yaml")]  # the overrides as jobs.curate had them
    assert audit_job.main([curated, *lite, "--report"]) == 0
    page = fs.open_input_stream("runs/curated/report/index.html").read().decode()
    rejected = _tiles(page, "rejected")
    assert sorted(rejected) == ["s3://data/pool/img-3.jpg", "s3://data/pool/img-4.jpg"]
    for source, (thumb, why) in rejected.items():
        assert thumb and why is None, (source, why)
        assert fs.get_file_info(f"runs/curated/report/{thumb}").size > 0
    kept = _tiles(page, "kept")
    assert kept and all(thumb for thumb, _ in kept.values())  # from the final shards on the store
    _no_secrets(fs, "runs/curated", store_records=(f"runs/curated/{LAYOUT.run_record}",))
    # the pool given again (credentials in its URI) is the one curated; another pool is refused, naming both
    assert audit_job.main([curated, *lite, "--report", "--input", s3(store, "data/pool")]) == 0
    capsys.readouterr()
    assert audit_job.main([curated, *lite, "--report", "--input", s3(store, "data/other")]) == 2
    err = capsys.readouterr().err
    assert "--input s3://data/other is not the pool s3://runs/curated was curated from (s3://data/pool)" in err
    assert SECRET not in err


@pytest.mark.slow  # two more curation runs on the store, a takedown and audits
def test_an_object_store_output_keeps_each_images_bytes_once_through_rewrites_takedowns_and_releases(
    store, curated, tmp_path, capsys, monkeypatch
):
    fs, _ = store
    scored = pq.read_table("runs/curated/scored", filesystem=fs, columns=["image"]).column("image")
    assert scored.combine_chunks().field("bytes").null_count == len(scored) > 0  # the shards hold the kept ones'
    assert fs.get_file_info(f"runs/curated/{LAYOUT.scored_images}").type == pafs.FileType.NotFound
    pool, lite = s3(store, "data/pool"), ["--config", str(REPO / "configs/curate/lite.yaml"), "--input"]

    def rewrite(rows_per_shard: int) -> int:  # the write phase again, other settings: the pool read again
        args = [*lite, pool, "--output", curated, "--phases", "write", *CURATE]
        return curate.main([*args, f"write.rows_per_shard={rows_per_shard}"])

    assert rewrite(1) == 0 and audit_job.main([curated]) == 0  # every image hashes to its key
    manifest = json.loads(fs.open_input_stream(f"runs/curated/{LAYOUT.manifest}").read())
    assert len(manifest["shards"]) == manifest["totals"]["rows"] >= 2
    first = pq.read_table(f"runs/curated/shards/{manifest['shards'][0]['file']}", filesystem=fs)
    # a report's picture on the store: its copies go, by their PDQ hashes; the list is saved on the store too
    reported = first.column("source")[0].as_py()
    with fs.open_output_stream("data/report/reported.jpg") as f:
        f.write(first.column("image")[0].as_py()["bytes"])
    report, saved = s3(store, "data/report"), s3(store, "data/lists/report.txt")
    argv = ["--output", curated, "--images", report, "--save-list", saved, "--grace-minutes", "0"]
    assert takedown_job.main(argv) == 0
    assert fs.open_input_stream("data/lists/report.txt").read().decode().count("pdq:") > 1
    assert audit_job.main([curated]) == 0

    # the same pool against the release (whose takedown made it version 2): its next version, the driver killed
    # after the switch to its shards, before the scored parts' image files are deleted; the same command finishes
    against = [*lite, pool, "--output", s3(store, "runs/next"), "--against", curated, *CURATE]
    monkeypatch.setattr(ws._DropBytes, "task", CountedTask(ws._drop_scored_bytes, kill_at=0))
    assert curate.main(against) == INTERRUPTED
    scored = pq.read_table("runs/next/scored", filesystem=fs, columns=["source"]).column("source")
    images = pq.read_table(f"runs/next/{LAYOUT.scored_images}", filesystem=fs, columns=["source", "image"])
    assert sorted(images["source"].to_pylist()) == sorted(scored.to_pylist())
    assert images["image"].combine_chunks().field("bytes").null_count == 0
    monkeypatch.undo()
    assert curate.main(against) == 0
    assert audit_job.main([s3(store, "runs/next")]) == 0
    assert json.loads(fs.open_input_stream(f"runs/next/{LAYOUT.manifest}").read())["version"] == 3
    # the release's takedown applied to the new crawl as a blocklist: the reported image never entered it
    fates = {r["source"]: r["reason"] for r in read_ledger(s3(store, "runs/next"), ["source", "reason"]).to_pylist()}
    assert fates[reported].startswith(f"blocklisted: {redact(curated)} takedown ")
    scored = pq.read_table("runs/next/scored", filesystem=fs, columns=["image"]).column("image")
    assert scored.combine_chunks().field("bytes").null_count == len(scored)
    assert fs.get_file_info(f"runs/next/{LAYOUT.scored_images}").type == pafs.FileType.NotFound

    # the taken-down image is not read again; another changed in the pool stops the rewrite, saying which
    source = manifest["shards"][1]
    changed = pq.read_table(f"runs/curated/shards/{source['file']}", filesystem=fs).column("source")[0].as_py()
    path = changed.removeprefix("s3://")
    original = fs.open_input_stream(path).read()
    with fs.open_output_stream(path) as f:
        f.write(_photo(99, (480, 400)))
    capsys.readouterr()
    try:
        assert rewrite(2) == 2
    finally:
        with fs.open_output_stream(path) as f:
            f.write(original)
    err = capsys.readouterr().err
    assert f"{changed}: source changed since curation" in err and SECRET not in err
    assert rewrite(2) == 0 and audit_job.main([curated]) == 0


@pytest.mark.slow  # three curation runs on the store
def test_thresholds_changed_on_an_object_store_output_are_re_decided_as_a_fresh_run_decides(store, ray_local, capsys):
    fs, _ = store
    for i, size in enumerate([(480, 400), (640, 520), (800, 600), (200, 150)]):
        with fs.open_output_stream(f"data/pool_rd/img-{i}.jpg") as f:
            f.write(_photo(20 + i, size))
    lite = ["--config", str(REPO / "configs/curate/lite.yaml")]
    run = [*lite, "--input", s3(store, "data/pool_rd"), "--output"]
    out, fresh, tight = s3(store, "runs/rd"), s3(store, "runs/rd_fresh"), "filters.min_short_side=450"
    assert curate.main([*run, out, *CURATE]) == 0
    capsys.readouterr()
    assert audit_job.main([out, *lite, *CURATE, "--what-if", tight]) == 0
    assert "[what-if] kept after scoring: 3 of 4 inputs -> 2" in capsys.readouterr().out
    assert curate.main([*run, out, *CURATE, tight]) == 0
    said = capsys.readouterr().out
    assert "[re-decide] need model work: none" in said and "0 inputs scored this run" in said
    assert curate.main([*run, fresh, *CURATE, tight]) == 0

    def published(root: str) -> tuple:
        manifest = json.loads(fs.open_input_stream(f"{root}/{LAYOUT.manifest}").read())
        return manifest["funnel"], manifest["config_hash"], sorted(s["sha256"] for s in manifest["shards"])

    assert published("runs/rd") == published("runs/rd_fresh")
    # relaxed past what was scored: the small image is read again from the store and run through the stages
    loose, fresh_loose = "filters.min_short_side=100", s3(store, "runs/rd_fresh_loose")
    assert curate.main([*run, out, *CURATE, loose]) == 0
    said = capsys.readouterr().out
    assert (
        "[re-decide] need model work: 1 input (1 from stage phash)" in said
        and "stages run again: phash on 1 input," in said
    )
    assert curate.main([*run, fresh_loose, *CURATE, loose]) == 0
    assert published("runs/rd") == published("runs/rd_fresh_loose") != published("runs/rd_fresh")
    assert audit_job.main([out]) == 0
    _no_secrets(fs, "runs/rd", store_records=(f"runs/rd/{LAYOUT.run_record}",))


@pytest.fixture(scope="module")
def shards_on_store(store, curated_run) -> str:
    """The session's curated shards (their manifest with them) copied into a folder on the store."""
    fs, _ = store
    pafs.copy_files(
        str(curated_run / LAYOUT.shards), "data/curated/shards",
        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
    )  # fmt: skip
    return s3(store, "data/curated/shards")


def test_exporting_curated_shards_between_object_store_folders(store, shards_on_store, ray_local):
    fs, _ = store
    out = s3(store, "runs/wds")
    assert export_job.main(["--shards", shards_on_store, "--format", "webdataset", "--output", out]) == 0
    manifest = json.loads(fs.open_input_stream("runs/wds/manifest.json").read())
    samples = sum(t["samples"] for t in manifest["tars"])
    curated_rows = json.loads(fs.open_input_stream(f"data/curated/{LAYOUT.manifest}").read())["totals"]["rows"]
    assert samples == curated_rows > 0
    members = []
    for t in manifest["tars"]:
        with tarfile.open(fileobj=io.BytesIO(fs.open_input_stream(f"runs/wds/{t['file']}").read())) as tar:
            members += tar.getnames()
    assert len([m for m in members if m.rsplit(".", 1)[1] in ("jpg", "png", "webp")]) == samples  # one image each
