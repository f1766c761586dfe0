"""Curating a new pool against a published release: copies of released images are duplicates of them, the new
images are sampled against the release's clusters, and the new output is the release's next version."""

import io
import json
import tarfile
from pathlib import Path

import imagehash
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from common.layout import LAYOUT
from curation.audit.verify import audit
from curation.phases.release import ReleaseError, open_release, survey_release_partition
from curation.phases.survivors import partition_path, survivors_schema
from curation.score.ledger import read_ledger
from jobs import curate, make_synthetic
from pretrain.data import DataIndex

REPO = Path(__file__).resolve().parents[3]
LITE = str(REPO / "configs/curate/lite.yaml")


def _shard_rows(out: Path, columns: list[str]) -> list[dict]:
    manifest = json.loads((out / LAYOUT.manifest).read_text())
    tables = [pq.read_table(out / LAYOUT.shards / s["file"], columns=columns) for s in manifest["shards"]]
    return pa.concat_tables(tables).to_pylist() if tables else []


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def increment(wds_curated_run, tmp_path_factory):
    """Pool B: new renders, and a tar holding 3 released images as they are, one recompressed and one enlarged to
    more pixels and saved lossless (a better copy by every other rule of the keep rule); curated --against the
    release A."""
    _, release = wds_curated_run
    base = tmp_path_factory.mktemp("increment")
    pool, out = base / "pool", base / "out"
    assert (
        make_synthetic.main(["--out", str(pool), "--n", "16", "--unlabelled", "--height", "512", "--width", "384"]) == 0
    )
    released = _shard_rows(release, ["key", "image", "format"])
    with tarfile.open(pool / "copies.tar", "w") as tar:
        for i, row in enumerate(released[:3]):
            _add(tar, f"copy{i}.jpg", row["image"]["bytes"])
        photo = next(r for r in released[3:] if r["format"] == "JPEG")
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(photo["image"]["bytes"])))
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=60)
        _add(tar, "recompressed3.jpg", buf.getvalue())
        buf = io.BytesIO()
        image.resize((image.width * 5 // 4, image.height * 5 // 4), Image.Resampling.LANCZOS).save(buf, "PNG")
        _add(tar, "enlarged4.png", buf.getvalue())
    argv = ["--config", LITE, "--input", str(pool), "--output", str(out), "--against", str(release)]
    assert curate.main([*argv, "sample.target_count=3"]) == 0
    return release, pool, out


@pytest.mark.slow
def test_copies_of_released_images_are_duplicates_of_them(increment):
    release, _, out = increment
    released = {r["key"]: r for r in _shard_rows(release, ["key", "phash", "width"])}
    ledger = read_ledger(str(out), ["source", "status", "duplicate_of", "width", "encoding_quality"]).to_pylist()
    copies = [r for r in ledger if "copies.tar#" in r["source"]]
    assert len(copies) == 5
    assert all(r["status"] == "duplicate" and r["duplicate_of"] in released for r in copies), copies
    enlarged = next(r for r in copies if r["source"].endswith("enlarged4.png"))
    assert enlarged["width"] > released[enlarged["duplicate_of"]]["width"] and enlarged["encoding_quality"] == 100
    # no image of the new version is a near-duplicate of a released one
    new = _shard_rows(out, ["key", "phash"])
    assert new, "the renders give new images"
    for row in new:
        assert row["key"] not in released
        for old in released.values():
            distance = imagehash.hex_to_hash(f"{row['phash']:016x}") - imagehash.hex_to_hash(f"{old['phash']:016x}")
            assert distance > 8


@pytest.mark.slow  # a second curation run, against the release
def test_new_images_are_sampled_to_the_target_and_the_output_is_the_next_version(increment):
    release, _, out = increment
    manifest = json.loads((out / LAYOUT.manifest).read_text())
    before = json.loads((release / LAYOUT.manifest).read_text())
    assert manifest["version"] == before["version"] + 1
    assert manifest["previous"]["release"] == str(release) and manifest["previous"]["version"] == before["version"]
    ledger = read_ledger(str(out), ["status"]).column("status").to_pylist()
    assert manifest["totals"]["rows"] == 3 == ledger.count("kept")  # sample.target_count counts the new images
    assert ledger.count("unsampled") > 0
    for version in (release, out):  # both versions verify
        result = audit(str(version))
        assert result.ok, result.summary()
    # training on the new version reads both
    index = DataIndex.scan(str(out / LAYOUT.shards))
    assert index.num_samples == before["totals"]["rows"] + manifest["totals"]["rows"]
    assert sum(1 for f in index.files if f.startswith("../")) == len(before["shards"])
    assert index.open(index.files[-1]).metadata.num_rows > 0


def test_a_release_needs_a_manifest_and_the_same_embedding_model(wds_curated_run, tmp_path):
    with pytest.raises(ReleaseError, match=r"no shards/manifest\.json"):
        open_release(str(tmp_path), "lite-colour-gradient-v1")
    with pytest.raises(ReleaseError, match="embedding model"):
        open_release(str(wds_curated_run[1]), "open_clip:ViT-B-32")


def test_a_release_written_before_a_survivor_column_is_read_with_it_null(wds_curated_run, tmp_path):
    """Survivor files of a release curated before ``encoding_quality`` and ``released`` existed."""
    _, release = wds_curated_run
    old = tmp_path / "release"
    survivors = pq.read_table(release / partition_path(0)).drop_columns(["encoding_quality", "released"])
    (old / partition_path(0)).parent.mkdir(parents=True)
    pq.write_table(survivors, old / partition_path(0))
    decisions = LAYOUT.part(LAYOUT.sample_decisions, 0)
    (old / decisions).parent.mkdir(parents=True)
    (old / decisions).write_bytes((release / decisions).read_bytes())
    dim = survivors.schema.field("embedding").type.list_size
    receipt = survey_release_partition._function(str(old), 0, str(tmp_path / "out"), "part.parquet", dim)
    table = pq.read_table(tmp_path / "out" / "part.parquet")
    assert table.schema.remove_metadata() == survivors_schema(dim) and receipt["rows"] == table.num_rows > 0
    assert table.column("released").to_pylist() == [True] * table.num_rows
    assert table.column("encoding_quality").null_count == table.num_rows
