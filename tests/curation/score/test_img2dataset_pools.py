"""Pools as img2dataset writes them, in its three output formats, curated with no setting: sidecars are metadata,
its per-shard records and stats are not inputs, the Parquet image column is found, and every URL it could not fetch
is one ledger row (stage download), so the ledger accounts for the whole URL list.

The fast tests build img2dataset's layouts by hand; the slow ones run the real img2dataset 1.47.0 against a local
HTTP server. Its requirements (pandas<3, webdataset<0.3) conflict with the project's, so it lives in a virtualenv of
its own under ``~/.cache/humans1b/test-venvs`` (``HUMANS1B_TEST_VENVS``), made once and kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import html
import http.server
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common import schema
from common.layout import DOWNLOAD, LAYOUT
from curation.phases.write.card import funnel_markdown
from curation.score.ledger import read_ledger, reason_code
from curation.score.pool import Pool, list_shards, pin_listing, pinned_listing
from curation.settings import InputSettings
from curation.steps.output import Output
from tests.curation.score.test_pool import _jpeg, read_shard

REPO = Path(__file__).resolve().parents[3]
LITE = str(REPO / "configs" / "curate" / "lite.yaml")
IMG2DATASET = "img2dataset==1.47.0"


# --- img2dataset's layouts, by hand ----------------------------------------------------------------------------


def _record(rows: list[dict], binary: str | None = None) -> pa.Table:
    """img2dataset's per-shard record: the URL list's columns, then key, status and error_message (and, in its
    Parquet output, the bytes in a column named by the encode format)."""
    columns = {
        name: pa.array([r.get(name) for r in rows], pa.string())
        for name in ("url", "caption", "key", "status", "error_message")
    }
    if binary:
        columns[binary] = pa.array([r.get("bytes") for r in rows], pa.binary())
    return pa.table(columns)


def _sample(k: int, status: str = "success", error: str | None = None) -> dict:
    url = f"http://img.example/{k}.jpg"
    return {"url": url, "caption": f"caption {k}", "key": f"{k:09d}", "status": status, "error_message": error}


def _stats(path: Path) -> None:
    path.write_text(json.dumps({"count": 3, "successes": 2, "status_dict": {"success": 2}}))


def _sources(rows: list[dict]) -> dict[str, dict]:
    return {r["source"].rsplit("/", 1)[-1]: r for r in rows}


def test_a_webdataset_pools_records_and_stats_are_not_inputs_and_its_failed_urls_are_rows(tmp_path, caplog):
    root = tmp_path / "pool"
    root.mkdir()
    secret = "http://img.example/1.jpg?sig=s3cr3t"
    samples = [_sample(0), {**_sample(1), "url": secret}, _sample(2)]
    samples[1].update(
        status="failed_to_download",
        error_message=f"HTTP Error 403: Forbidden for {secret} 'quoted bytes' <object at 0x7f> \u00e9\x07",
    )
    with tarfile.open(root / "00000.tar", "w") as tar:
        for s in (samples[0], samples[2]):
            for ext, data in (("jpg", _jpeg()), ("json", json.dumps(s).encode()), ("txt", s["caption"].encode())):
                info = tarfile.TarInfo(f"{s['key']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    pq.write_table(_record(samples), root / "00000.parquet")
    _stats(root / "00000_stats.json")

    with caplog.at_level(logging.INFO, logger="curation"):
        (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    assert shard.kind == "webdataset" and shard.records == (str(root / "00000.parquet"),)
    assert "2 files beside the shards are the downloader's own" in caplog.text
    rows = _sources(read_shard(root, shard).to_pylist())
    assert set(rows) == {"00000.tar#000000000.jpg", "00000.tar#000000002.jpg", "00000.parquet#row=1"}
    assert json.loads(rows["00000.tar#000000002.jpg"]["metadata_json"])["caption"] == "caption 2"
    failed = rows["00000.parquet#row=1"]
    assert (failed["status"], failed["stage"], failed["image"]) == (schema.REJECTED, DOWNLOAD, None)
    # the downloader's message as every ledger reason is: no URL, quotes, object reprs or non-ASCII
    assert failed["reason"] == "failed_to_download: HTTP Error 403: Forbidden for the URL"
    assert json.loads(failed["metadata_json"])["url"] == secret  # the record's columns are the row's metadata
    assert all(r["shard_size"] == 3 for r in rows.values())


def test_a_files_pool_reads_its_records_once_even_for_a_shard_whose_every_url_failed(tmp_path):
    root, out = tmp_path / "pool", tmp_path / "out"
    (root / "00000").mkdir(parents=True)
    (root / "00001").mkdir()  # img2dataset leaves the folder of a shard with no picture empty
    ok = [_sample(k) for k in range(3)]
    for s in ok:
        (root / "00000" / f"{s['key']}.jpg").write_bytes(_jpeg())
        (root / "00000" / f"{s['key']}.json").write_text(json.dumps(s))
        (root / "00000" / f"{s['key']}.txt").write_text(s["caption"])
    pq.write_table(_record([*ok, _sample(3, "failed_to_download", "timed out")]), root / "00000.parquet")
    failed = [_sample(k, "failed_to_resize", "Image decoding error") for k in (10, 11)]
    pq.write_table(_record(failed), root / "00001.parquet")
    for stem in ("00000", "00001"):
        _stats(root / f"{stem}_stats.json")

    settings = InputSettings(files_per_shard=4)
    shards = list_shards(Pool.at(str(root)), settings)
    assert [len(s.paths) for s in shards] == [6, 3]  # a sample's three files stay together
    assert [len(s.records) for s in shards] == [1, 1]
    rows = [r for s in shards for r in read_shard(root, s, settings).to_pylist()]
    urls = Counter(json.loads(r["metadata_json"])["url"] for r in rows)
    assert urls == Counter(s["url"] for s in [*ok, _sample(3), *failed])  # every URL once
    assert Counter((r["stage"], reason_code(r["reason"])) for r in rows) == {
        (None, ""): 3,
        (DOWNLOAD, "failed_to_download"): 1,
        (DOWNLOAD, "failed_to_resize"): 2,
    }
    pictures = [r for r in rows if r["image"] is not None]
    assert all(json.loads(r["metadata_json"])["txt"].startswith("caption") for r in pictures)

    pin_listing(Output.at(str(out)), shards, settings)  # a resumed run reads the records from the pin
    assert pinned_listing(Output.at(str(out)), settings) == shards

    for path in (root / "00000").iterdir():  # every URL failed: the records alone are the pool, each read whole
        path.unlink()
    pq.write_table(_record([*failed, _sample(3, "failed_to_download", "timed out")]), root / "00000.parquet")
    shards = list_shards(Pool.at(str(root)), settings)
    assert [s.kind for s in shards] == ["parquet", "parquet"]  # told from img2dataset's Parquet output by content
    rows = [r for s in shards for r in read_shard(root, s, settings).to_pylist()]
    assert [(r["stage"], reason_code(r["reason"])) for r in rows] == [(DOWNLOAD, "failed_to_resize")] * 2 + [
        (DOWNLOAD, "failed_to_download"),
        (DOWNLOAD, "failed_to_resize"),
        (DOWNLOAD, "failed_to_resize"),
    ]


def test_img2dataset_parquet_output_is_read_with_no_setting(tmp_path, caplog):
    root = tmp_path / "pool"
    root.mkdir()
    rows = [
        {**_sample(0), "bytes": _jpeg()},
        _sample(1, "failed_to_download", "HTTP Error 404: Not Found"),
        _sample(2),  # null bytes, yet a success: not a failed download
    ]
    pq.write_table(_record(rows, binary="jpg"), root / "00000.parquet")
    _stats(root / "00000_stats.json")
    with caplog.at_level(logging.INFO, logger="curation"):
        (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    assert "one binary column is read as its images ('jpg' in 00000.parquet)" in caplog.text
    got = _sources(read_shard(root, shard).to_pylist())
    assert got["00000.parquet#row=0"]["image"]["bytes"] == rows[0]["bytes"]
    assert json.loads(got["00000.parquet#row=0"]["metadata_json"])["caption"] == "caption 0"
    assert (got["00000.parquet#row=1"]["stage"], got["00000.parquet#row=1"]["reason"]) == (
        DOWNLOAD,
        "failed_to_download: HTTP Error 404: Not Found",
    )
    assert got["00000.parquet#row=2"]["reason"] == "unreadable: image bytes are null in the Parquet row"


def test_a_parquet_file_with_several_binary_columns_names_them(tmp_path):
    root = tmp_path / "pool"
    root.mkdir()
    pq.write_table(pa.table({"jpg": [_jpeg()], "png": [b"x"], "url": ["u"]}), root / "a.parquet")
    (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    (row,) = read_shard(root, shard).to_pylist()
    assert row["reason"].startswith("unreadable: no column 'image'")
    assert "set input.image_column (one of its binary columns: jpg, png)" in row["reason"]
    (row,) = read_shard(root, shard, InputSettings(image_column="jpg")).to_pylist()
    assert row["image"] is not None


def test_the_funnel_starts_with_the_download():
    funnel = {
        "download/download/rejected/failed_to_download": 2,
        "score/decode/rejected/too_small": 1,
        "score/person/kept/": 3,
    }
    lines = funnel_markdown(["decode", "person"], funnel).splitlines()
    assert lines[3:5] == [
        "| download | download | reached | 6 | 100.0% |",
        "| | | rejected: failed_to_download | 2 | 33.3% |",
    ]
    assert lines[5] == "| score | decode | reached | 4 | 66.7% |"
    assert lines[-1].startswith("2 of the inputs are URLs the pool's downloader tried and got no image from")


# --- the real img2dataset ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def img2dataset_cli() -> Path:
    """img2dataset's command in a virtualenv of its own (its pins conflict with the project's), made once and kept;
    a session that finds another one making it waits for it."""
    root = Path(os.environ.get("HUMANS1B_TEST_VENVS", "~/.cache/humans1b/test-venvs")).expanduser()
    venv = root / f"{IMG2DATASET.replace('==', '-')}-py{sys.version_info.major}{sys.version_info.minor}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / _COMPLETE).is_file():  # a venv cut short is made again
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            pip = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 IMG2DATASET],
                capture_output=True, text=True, timeout=1800, env=_without_our_path(),
            )  # fmt: skip
            if pip.returncode != 0:
                pytest.fail(
                    f"pip could not install {IMG2DATASET} into {venv}:\n{pip.stdout[-2000:]}{pip.stderr[-2000:]}"
                )
            (venv / _COMPLETE).write_text(IMG2DATASET)
    return venv / "bin" / "img2dataset"


_COMPLETE = ".humans1b-complete"
_PEOPLE = ("zidane", "astronaut", "bus", "grace_hopper")
_NO_PERSON = ("china", "coffee")
FORMATS = ("files", "webdataset", "parquet")


def _without_our_path() -> dict[str, str]:
    """The environment for img2dataset's venv: none of this project on its path, and its libraries kept offline
    (albumentations asks the package index for a newer release when it is imported)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _serving(folder: Path) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 for the files of ``folder``; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _web(folder: Path) -> list[str]:
    """Pictures from the sample pool's photos (people, no people, one too small), a page and a document that are not
    pictures; returns the names, plus one the server does not have."""
    from generators.sample_pool import load_photos

    photos = load_photos()
    folder.mkdir()
    for name in (*_PEOPLE, *_NO_PERSON):
        (folder / f"{name}.jpg").write_bytes(photos[name].data)
    small = io.BytesIO()
    zidane = photos["zidane"].image
    zidane.resize((zidane.width * 300 // zidane.height, 300), Image.Resampling.LANCZOS).save(small, "JPEG")
    (folder / "small.jpg").write_bytes(small.getvalue())
    (folder / "page.jpg").write_bytes(b"<!doctype html><title>Moved</title><p>This photo has moved.")
    (folder / "doc.png").write_bytes(b"%PDF-1.4\n% a document, not a picture\n")
    return [*sorted(p.name for p in folder.iterdir()), "missing.jpg"]


@pytest.fixture(scope="module")
def img2dataset_pools(img2dataset_cli, tmp_path_factory) -> tuple[dict[str, Path], list[dict]]:
    """({output format: pool}, the URL list's rows): one URL list, with captions and extra columns, downloaded by
    img2dataset in each output format at full size (``--resize_mode no``)."""
    base = tmp_path_factory.mktemp("img2dataset")
    names = _web(base / "web")
    pools = {}
    with _serving(base / "web") as site:
        rows = [
            {"url": f"{site}/{name}", "caption": f"photo {k}: {name}", "license": "CC-BY-4.0", "page_id": 1000 + k}
            for k, name in enumerate(names)
        ]
        pq.write_table(pa.Table.from_pylist(rows), base / "urls.parquet")
        for fmt in FORMATS:
            pools[fmt] = base / fmt
            argv = [
                str(img2dataset_cli), "--url_list", str(base / "urls.parquet"), "--input_format", "parquet",
                "--url_col", "url", "--caption_col", "caption", "--save_additional_columns", '["license","page_id"]',
                "--output_format", fmt, "--output_folder", str(pools[fmt]), "--resize_mode", "no",
                "--number_sample_per_shard", "4", "--processes_count", "1", "--thread_count", "4",
                "--timeout", "10", "--retries", "0", "--enable_wandb", "False",
            ]  # fmt: skip
            run = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=_without_our_path())
            assert run.returncode == 0, run.stderr[-3000:]
    return pools, rows


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_img2dataset_pool_is_curated_with_no_setting(img2dataset_pools, ray_local, tmp_path, fmt, capsys):
    from jobs import audit as audit_job
    from jobs import curate

    pools, urls = img2dataset_pools
    out = tmp_path / "out"
    assert curate.main(["--config", LITE, "--input", str(pools[fmt]), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("'jpg'" in printed) == (fmt == "parquet")  # the column it found, said

    ledger = read_ledger(str(out), ["source", "status", "stage", "reason", "metadata_json"]).to_pylist()
    meta = [json.loads(r["metadata_json"]) for r in ledger]
    assert Counter(m["url"] for m in meta) == Counter(u["url"] for u in urls)  # the whole URL list, each URL once
    failed = {m["url"].rsplit("/", 1)[1]: r for m, r in zip(meta, ledger) if r["stage"] == DOWNLOAD}
    assert {name: reason_code(r["reason"]) for name, r in failed.items()} == {
        "missing.jpg": "failed_to_download",
        "page.jpg": "failed_to_resize",
        "doc.png": "failed_to_resize",
    }
    assert "404" in failed["missing.jpg"]["reason"]
    # img2dataset's own files are no inputs, and sidecars are metadata
    assert not [r for r in ledger if reason_code(r["reason"]) in ("not_an_image", "unreadable", "empty_shard")]
    assert not [r for r in ledger if r["source"].endswith((".json", ".txt"))]
    small = next(r for m, r in zip(meta, ledger) if m["url"].endswith("/small.jpg"))
    assert reason_code(small["reason"]) == "too_small"

    manifest = json.loads((out / LAYOUT.manifest).read_text())
    kept = pq.read_table([out / LAYOUT.shards / s["file"] for s in manifest["shards"]], columns=["metadata"])
    caption_of = {u["url"]: u["caption"] for u in urls}
    people = {u["url"] for u in urls if u["url"].rsplit("/", 1)[1].removesuffix(".jpg") in _PEOPLE}
    got = [m for m in kept.column("metadata").to_pylist()]
    assert got and all(m["url"] in people and m["caption"] == caption_of[m["url"]] for m in got)
    assert all(m["license"] == "CC-BY-4.0" and m["page_id"] >= 1000 for m in got)
    assert f"| download | download | reached | {len(urls)} | 100.0% |" in (out / LAYOUT.card).read_text()

    assert audit_job.main([str(out), "--report", "--config", LITE]) == 0
    report = html.unescape((out / LAYOUT.report / "index.html").read_text())
    assert "3 of the inputs are URLs the pool's downloader tried" in report
