"""curation.audit.verify_shards: one final shard checked on its own, each finding a located ``Problem``."""

from __future__ import annotations

import hashlib
import io

import pyarrow as pa
import pyarrow.fs as pafs
from PIL import Image

from common import schema
from common.layout import LAYOUT
from curation.audit.verify_shards import Problem, check_shard, decode_error, schema_difference, short


def test_a_missing_or_foreign_file_is_located(tmp_path):
    fs, root = pafs.LocalFileSystem(), str(tmp_path)
    entry = {"file": "part-0.parquet", "bytes": 4, "sha256": hashlib.sha256(b"PAR1").hexdigest(), "rows": 1}
    problems, rows = check_shard(fs, root, entry, {"schema_version": schema.SCHEMA_VERSION}, decode=True)
    assert problems == [Problem(f"{LAYOUT.shards}/part-0.parquet", None, "listed in the manifest but missing")]
    assert rows.keys == []
    (tmp_path / LAYOUT.shards).mkdir()
    (tmp_path / LAYOUT.shards / "part-0.parquet").write_bytes(b"not parquet")
    problems, _ = check_shard(fs, root, entry, {"schema_version": schema.SCHEMA_VERSION}, decode=True)
    whats = [p.what for p in problems]
    assert whats[0].startswith("11 bytes, the manifest says 4") and "contents changed" in whats[1]
    assert whats[2].startswith("not a readable Parquet file")
    assert str(problems[0]) == f"{LAYOUT.shards}/part-0.parquet: {whats[0]}"


def test_schema_and_image_findings():
    expected = pa.schema([("key", pa.string()), ("image", pa.binary())])
    assert schema_difference(expected, expected) is None
    found = schema_difference(pa.schema([("key", pa.int64()), ("extra", pa.string())]), expected)
    assert found is not None and "missing column image" in found and "unexpected column extra" in found
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    assert decode_error(buf.getvalue()) is None and decode_error(b"junk") is not None
    assert short(None) == "null" and short("a" * 64) == "a" * 16 + "…"
