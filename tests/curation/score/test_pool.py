import io
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common import schema
from curation.score.pool import Pool, PoolError, list_shards
from curation.score.reader import ShardReader
from curation.score.sources import parse_source
from curation.settings import InputSettings


def read_shard(root, shard, settings: InputSettings | None = None):
    return ShardReader(str(root), settings or InputSettings(), 8, max_file_bytes=64 * 2**20).read_table(shard)


def _jpeg(color=(200, 10, 10), size=(400, 500)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture()
def folder_pool(tmp_path):
    root = tmp_path / "pool"
    (root / "a" / "b").mkdir(parents=True)
    for i in range(5):
        (root / "a" / f"img{i}.jpg").write_bytes(_jpeg((i * 40, 0, 0)))
    (root / "a" / "b" / "deep.png").write_bytes(_jpeg())
    (root / "_manifest.jsonl").write_text("{}\n")
    (root / ".hidden.jpg").write_bytes(_jpeg())
    (root / "_skipped_dir").mkdir()
    (root / "_skipped_dir" / "x.jpg").write_bytes(_jpeg())
    os.symlink(root / "does-not-exist.jpg", root / "a" / "broken.jpg")
    return root


def test_folder_pool_is_sharded_stably_and_skips_underscore_and_dot_names(folder_pool):
    shards = list_shards(Pool.at(str(folder_pool)), InputSettings(files_per_shard=3))
    uris = [u for s in shards for u in s.paths]
    assert len(uris) == 7  # 5 + deep.png + the broken symlink; _manifest, .hidden and _skipped_dir are not inputs
    assert not any("/_" in u or "/." in u for u in uris)
    assert [s.shard_id for s in shards] == ["files-000000", "files-000001", "files-000002"]
    assert shards == list_shards(Pool.at(str(folder_pool)), InputSettings(files_per_shard=3))


def test_broken_symlink_reaches_the_ledger_with_a_reason(folder_pool):
    (shard,) = list_shards(Pool.at(str(folder_pool)), InputSettings(files_per_shard=100))
    table = read_shard(folder_pool, shard)
    assert table.schema.equals(schema.working_schema(8))
    rows = {r["source"]: r for r in table.select(["source", "image", "reason", "shard_size"]).to_pylist()}
    broken = rows[str(folder_pool / "a" / "broken.jpg")]
    assert broken["image"] is None and broken["reason"] == "unreadable: broken or looping symbolic link"
    assert all(r["shard_size"] == 7 for r in rows.values())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: str(p / "missing"), "no such file or folder"),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no files"),
        (lambda p: "ftp://example.invalid/pool", "cannot open"),
    ],
)
def test_wrong_input_fails_fast_with_a_clear_message(tmp_path, make, message):
    with pytest.raises(PoolError, match=message):
        list_shards(Pool.at(make(tmp_path)), InputSettings())


def test_parquet_pool_with_struct_and_binary_columns(tmp_path):
    root = tmp_path / "pq"
    root.mkdir()
    images = [_jpeg((i, 0, 0)) for i in range(4)]
    struct = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)], schema.IMAGE_TYPE)
    pq.write_table(pa.table({"image": struct}), root / "a.parquet")
    pq.write_table(pa.table({"jpg": pa.array([*images, None], pa.binary())}), root / "b.parquet")
    shards = list_shards(Pool.at(str(root)), InputSettings())
    assert [s.kind for s in shards] == ["parquet", "parquet"]
    a = read_shard(root, shards[0])
    assert a.column("source").to_pylist()[1].endswith("a.parquet#row=1")
    assert a.column("image").to_pylist()[2]["bytes"] == images[2]
    b = read_shard(root, shards[1], InputSettings(image_column="jpg"))
    assert b.num_rows == 5 and "null" in b.column("reason").to_pylist()[4]
    missing_column = read_shard(root, shards[0], InputSettings(image_column="nope"))
    (reason,) = missing_column.column("reason").to_pylist()  # one row for the file, saying what to do
    assert "no column 'nope'" in reason and "input.image_column" in reason and "4 rows per the footer" in reason


def test_webdataset_tars_and_a_truncated_tar(tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    with tarfile.open(root / "shard-0.tar", "w") as tar:
        for i in range(3):
            for name, data in ((f"s{i}.jpg", _jpeg((0, i, 0))), (f"s{i}.json", b"{}")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    whole = (root / "shard-0.tar").read_bytes()
    (root / "shard-1.tar").write_bytes(whole[: len(whole) // 2])
    shards = list_shards(Pool.at(str(root)), InputSettings())
    assert [s.kind for s in shards] == ["webdataset", "webdataset"]
    good = read_shard(root, shards[0])
    assert [parse_source(s).part for s in good.column("source").to_pylist()] == ["s0.jpg", "s1.jpg", "s2.jpg"]
    bad = read_shard(root, shards[1]).to_pylist()
    assert bad[-1]["image"] is None and "tar shard unreadable" in bad[-1]["reason"]


def test_shard_ids_from_data_names_are_path_safe(tmp_path):
    root = tmp_path / "weird"
    (root / "..").mkdir(parents=True, exist_ok=True)
    (root).mkdir(exist_ok=True)
    pq.write_table(pa.table({"image": pa.array([_jpeg()], pa.binary())}), root / "a b;rm -rf $x.parquet")
    (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    assert "/" not in shard.shard_id and " " not in shard.shard_id and ";" not in shard.shard_id
