"""The curated output in the tools users already have: Hugging Face ``datasets`` (the shards' own features, the
dataset card) and WebDataset tars (``jobs.export``), read back with those libraries."""

import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image, ImageOps

from common import schema
from common.config import load_config
from common.layout import LAYOUT
from curation.config import CurateConfig
from curation.phases.write.shards import final_shard_schema
from curation.score.ledger import read_ledger, reason_code
from jobs import curate, export
from tests.docs_text import section as docs_section

LITE = "configs/curate/lite.yaml"


def _manifest(out: Path) -> dict:
    return json.loads((out / LAYOUT.manifest).read_text())


def _shard_rows(out: Path) -> dict[str, dict]:
    """Every curated row by key, from the shards the manifest lists."""
    tables = [pq.read_table(out / LAYOUT.shards / s["file"]) for s in _manifest(out)["shards"]]
    return {r["key"]: r for r in pa.concat_tables(tables).to_pylist()}


def exported_json(row: dict) -> dict:
    """What a sample's .json holds: the shard row's columns but the image (bytes, such as the PDQ hash, as hex), the
    pool's metadata as one object."""
    meta = export.merged_metadata(row.get("metadata"), row.get("metadata_json"))
    columns = {k: v for k, v in row.items() if k not in ("image", "metadata", "metadata_json")}
    return {**{k: v.hex() if isinstance(v, bytes) else v for k, v in columns.items()}, "metadata": meta}


def _card(out: Path) -> tuple[dict, str]:
    text = (out / LAYOUT.card).read_text()
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


# --- Hugging Face datasets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [None, 384])
def test_features_are_written_as_datasets_writes_them(dim):
    import datasets

    table_schema = schema.curated_schema(dim)
    features = datasets.Features.from_arrow_schema(table_schema)
    features["image"] = datasets.Image()
    assert schema.hf_features(table_schema) == features.to_dict()
    assert schema.hf_card_features(table_schema) == features._to_yaml_list()
    written = datasets.arrow_writer.ArrowWriter._build_metadata(datasets.DatasetInfo(features=features))
    assert schema.hf_metadata(table_schema) == {k.encode(): v.encode() for k, v in written.items()}


def test_datasets_reads_the_shards_as_images_with_no_cast(curated_run, tmp_path):
    from datasets import Image as HFImage
    from datasets import load_dataset

    files = [str(curated_run / LAYOUT.shards / s["file"]) for s in _manifest(curated_run)["shards"]]
    hf = load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert hf.features["image"] == HFImage()
    truth = _shard_rows(curated_run)
    assert sorted(hf["key"]) == sorted(truth)
    for row in hf.select(range(min(4, len(hf)))):
        assert isinstance(row["image"], Image.Image)
        with Image.open(io.BytesIO(truth[row["key"]]["image"]["bytes"])) as original:
            assert row["image"].size == ImageOps.exif_transpose(original).size  # datasets applies the EXIF turn
        assert row["quality"] == pytest.approx(truth[row["key"]]["quality"])


def test_load_dataset_on_the_output_folder_reads_the_card_and_only_the_shards(curated_run, tmp_path):
    from datasets import Image as HFImage
    from datasets import load_dataset, load_dataset_builder

    builder = load_dataset_builder(str(curated_run), cache_dir=str(tmp_path / "cache"))
    read = sorted(Path(str(f)).name for f in builder.config.data_files["train"])
    assert read == sorted(s["file"] for s in _manifest(curated_run)["shards"])  # no ledger, no _state, no manifest
    warned: list[str] = []  # datasets logs to its own logger (not propagated): "splits without num_bytes" etc.
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("datasets").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = load_dataset(str(curated_run), split="train", cache_dir=str(tmp_path / "cache"))
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert warned == [] and [str(w.message) for w in caught] == []
    assert hf.features["image"] == HFImage() and isinstance(hf[0]["image"], Image.Image)
    assert sorted(hf["key"]) == sorted(_shard_rows(curated_run))


def test_card_header_and_funnel_match_the_run(curated_run, repo_root):
    header, body = _card(curated_run)
    manifest = _manifest(curated_run)
    cfg = load_config(CurateConfig, str(repo_root / LITE), ["write.rows_per_shard=4"])  # conftest's curated_run
    assert header["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "shards/part-*.parquet"}]}
    ]
    assert header["dataset_info"]["features"] == schema.hf_card_features(final_shard_schema(cfg))
    assert header["dataset_info"]["splits"] == [
        {"name": "train", "num_bytes": manifest["totals"]["bytes"], "num_examples": manifest["totals"]["rows"]}
    ]
    assert header["license"] == "other" and "placeholder" in body
    assert header["size_categories"] == ["n<1K"] and header["task_categories"]

    # the funnel table, read back row by row, against the final ledger
    ledger = read_ledger(str(curated_run), ["status", "stage", "reason"]).to_pylist()
    stopped, stage, reached, numbers = Counter(), None, {}, {}
    for line in body.split("## Funnel", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[3].isdigit():
            continue
        name, outcome, n = cells[1], cells[2], int(cells[3])
        if outcome == "reached":
            stage, reached[name] = name, n
        elif name in ("inputs", "final shards"):
            numbers[name] = n
        else:
            stopped[(stage, outcome)] += n
    expected = Counter(
        (
            r["stage"],
            r["status"]
            + (f": {reason_code(r['reason'])}" if reason_code(r["reason"]) not in ("", r["status"]) else ""),
        )
        for r in ledger
        if r["status"] != schema.KEPT
    )
    assert stopped == expected
    assert numbers == {"inputs": len(ledger), "final shards": sum(r["status"] == schema.KEPT for r in ledger)}
    assert reached["decode"] == len(ledger) and reached["write"] == numbers["final shards"]


def test_rewrite_writes_the_card_again(curated_run, sample_pool, repo_root, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    before = (out / LAYOUT.card).read_bytes()
    (out / LAYOUT.card).unlink()
    (out / LAYOUT.done("write")).unlink()
    args = ["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(out), "--phases", "write"]
    assert curate.main([*args, "write.rows_per_shard=4"]) == 0
    assert (out / LAYOUT.card).read_bytes() == before
    assert curate.main([*args, "write.rows_per_shard=3"]) == 0
    header, body = _card(out)
    assert header["dataset_info"]["splits"][0]["num_examples"] == _manifest(out)["totals"]["rows"]
    assert f"in {len(_manifest(out)['shards'])} Parquet shards" in body.replace("\n", " ")


# --- WebDataset -----------------------------------------------------------------------------------------------------


def _read_tars(folder: Path) -> list[dict]:
    import webdataset as wds

    urls = [str(p) for p in sorted(folder.glob("part-*.tar"))]
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


@pytest.mark.parametrize("per_tar", [None, 3])
def test_webdataset_export_round_trips(curated_run, tmp_path, per_tar, capsys):
    out = tmp_path / "wds"
    extra = [] if per_tar is None else ["--samples-per-tar", str(per_tar)]
    argv = ["--shards", str(curated_run / LAYOUT.shards), "--format", "webdataset", "--output", str(out), *extra]
    assert export.main(argv) == 0
    truth = _shard_rows(curated_run)
    tars = sorted(out.glob("part-*.tar"))
    manifest = _manifest(curated_run)
    assert len(tars) == (len(manifest["shards"]) if per_tar is None else math.ceil(len(truth) / per_tar))
    samples = _read_tars(out)
    assert len(samples) == len(truth) == len({s["__key__"] for s in samples})
    for sample in samples:
        row = truth[sample["__key__"]]
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "MPO": "jpg"}[row["format"]]
        assert set(sample) - {"__key__", "__url__", "__local_path__"} == {ext, "json"}
        assert sample[ext] == row["image"]["bytes"]  # the original bytes, not re-encoded
        meta = json.loads(sample["json"])
        assert "image" not in meta
        assert meta == exported_json(row)
    listing = json.loads((out / "manifest.json").read_text())
    assert [t["file"] for t in listing["tars"]] == [t.name for t in tars]
    for entry in listing["tars"]:
        assert hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest() == entry["sha256"]

    # a rerun skips finished tars: one removed (an interrupted export) is the only one written again, identically
    written = {t.name: t.stat().st_mtime_ns for t in tars}
    lost = tars[len(tars) // 2]
    lost.unlink()
    capsys.readouterr()
    assert export.main(argv) == 0
    assert f"{len(tars) - 1} of {len(tars)} tars done before" in capsys.readouterr().out
    assert {t.name: t.stat().st_mtime_ns for t in sorted(out.glob("part-*.tar")) if t != lost} == {
        n: m for n, m in written.items() if n != lost.name
    }
    assert json.loads((out / "manifest.json").read_text()) == listing


def test_export_names_a_missing_manifest(tmp_path, ray_local, capsys):
    argv = ["--shards", str(tmp_path / "nothing"), "--format", "webdataset", "--output", str(tmp_path / "wds")]
    assert export.main(argv) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_keys_from_data_are_safe_webdataset_keys():
    image = b"\xff\xd8 not really a jpeg"
    assert export.wds_key("ab" * 32, image) == "ab" * 32
    for text in ("../../etc/passwd", "a.b.c", "name with spaces.jpg", "x" * 300, ""):
        key = export.wds_key(text, image)
        assert "." not in key and "/" not in key and 0 < len(key) <= 100
    assert export.wds_key("a.b", image) != export.wds_key("a_b", image)
    assert export.wds_key(None, image) == hashlib.sha256(image).hexdigest()
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    assert export.image_extension(None, png.getvalue()) == "png"  # no format column: read from the header
    assert export.image_extension(None, image) == "bin"
    assert export.image_extension("MPO", image) == "jpg" and export.image_extension("TIFF", image) == "tiff"


def test_readme_examples_load_the_output_and_the_tars(curated_run, tmp_path, monkeypatch):
    """The documentation's "other tools" section, run as written on a copy of a curated output and its export."""
    (tmp_path / "out").mkdir()
    shutil.copytree(curated_run, tmp_path / "out" / "curated")
    section = docs_section("Using the curated data in other tools")
    command = re.search(r"```bash\n(python -m jobs.export [^\n\[]*)", section).group(1).split()
    monkeypatch.chdir(tmp_path)
    assert export.main(command[3:]) == 0
    check = """
print(json.dumps({"rows": len(ds), "image": type(ds[0]["image"]).__module__.split(".")[0], "key": first["__key__"],
                  "wds_image": type(next(v for k, v in first.items() if k not in ("__key__", "__url__", "json"))).__module__.split(".")[0],
                  "wds_json": first["json"]}))
"""
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S)) + check
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    truth = _shard_rows(curated_run)
    assert got["rows"] == len(truth) and got["image"] == got["wds_image"] == "PIL"
    assert got["wds_json"] == exported_json(truth[got["key"]])
