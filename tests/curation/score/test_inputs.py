"""curation.score.inputs: the input shard's pinned row, the rows every reader yields and the reason codes."""

from __future__ import annotations

from curation.score.inputs import (
    READ_CODES,
    InputShard,
    PoolAccess,
    input_row,
    inside,
    is_sidecar,
    split_read_reason,
    with_metadata,
)
from curation.score.metadata import InputMetadata
from curation.settings import InputSettings


def test_shard_row_round_trip_keeps_raw_names_and_records():
    odd = b"/pool/caf\xe9.jpg".decode("utf-8", "surrogateescape")
    shard = InputShard("files-000000", "files", ("/pool/a.jpg", odd), (10, -1), ("/pool/a.parquet",))
    row = shard.to_row()
    assert row["paths"][1] == b"/pool/caf\xe9.jpg" and row["records"] == 1
    assert InputShard.from_row(row) == shard


def test_rows_and_reasons():
    row = input_row("/pool/d/a.jpg", b"xy")
    assert row == {"source": "/pool/d/a.jpg", "image": {"bytes": b"xy", "path": "a.jpg"}, "reason": None}
    assert input_row("/pool/b.jpg", None, "unreadable: gone")["image"] is None
    assert split_read_reason("file_too_large: 9 bytes > 8") == ("file_too_large", "9 bytes > 8")
    assert split_read_reason("odd: text") == ("unreadable", "odd: text")
    assert split_read_reason(None) == ("unreadable", "no bytes could be read")
    assert "empty_shard" in READ_CODES


def test_sidecars_links_and_metadata():
    assert is_sidecar("k/001.JSON") and not is_sidecar("k/001.jpg")
    assert inside("/pool/a", "/pool") and inside("/pool", "/pool") and not inside("/pool2/a", "/pool")
    meta = InputMetadata(["*"], 64)
    meta.add("caption", "a dog")
    rows = list(with_metadata([input_row("a", b"1"), input_row("b", b"2")], meta))
    assert len(rows) == 2 and all("a dog" in r["metadata_json"] for r in rows)
    assert list(with_metadata([], meta)) == []


def test_pool_access_names_inputs_by_their_uri(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"abc")
    access = PoolAccess(str(tmp_path), InputSettings(), 1 << 20)
    assert access.name(str(tmp_path / "a.jpg")) == str(tmp_path / "a.jpg")
    assert access._size(str(tmp_path / "a.jpg")) == 3
    with access._open(str(tmp_path / "a.jpg")) as f:
        assert f.read() == b"abc"
