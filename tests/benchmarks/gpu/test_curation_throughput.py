"""Part curation of the GPU check: its pool of package photos at web sizes, and the rate it reports per point."""

import io

import pyarrow.parquet as pq
from PIL import Image

from benchmarks.gpu.curation_throughput import rate, web_sized_photos, write_parquet_pool
from generators.sample_pool import load_photos


def test_photos_come_at_each_long_side_or_as_shipped():
    shipped, small = web_sized_photos(("bus",), (0, 320))
    assert shipped == load_photos()["bus"].data
    with Image.open(io.BytesIO(small)) as im:
        assert max(im.size) == 320 and im.format == "JPEG"
    assert len(web_sized_photos(None, (0,))) == len(load_photos())


def test_the_pool_cycles_the_images_into_parquet_files_of_a_set_size(tmp_path):
    write_parquet_pool(tmp_path / "pool", [b"a", b"b"], 5, rows_per_file=2)
    files = sorted((tmp_path / "pool").iterdir())
    assert [f.name for f in files] == ["pool-00000.parquet", "pool-00001.parquet", "pool-00002.parquet"]
    assert [v for f in files for v in pq.read_table(f).column("image").to_pylist()] == [b"a", b"b", b"a", b"b", b"a"]


def test_the_running_rate_is_preferred_to_the_rate_from_the_start():
    assert rate({"images_per_s_running": 150.0, "images_per_s_from_start": 90.0}) == 150.0
    assert rate({"images_per_s_running": None, "images_per_s_from_start": 90.0}) == 90.0  # a pool too small to stream
