"""curation.score.originals: sources read back through the one parser of source names, as the readers wrote them,
and checked against their key."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import schema
from curation.score.originals import CHANGED, SourceReader, SourceUnreadable
from curation.score.sources import member_name, unread_name
from curation.settings import InputSettings


def _tar(path, members) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_source_reader_reads_files_parquet_rows_and_tar_members(tmp_path):
    a, b = b"\xff\xd8 photo a", b"\x89PNG photo b"
    (tmp_path / "a.jpg").write_bytes(a)
    pq.write_table(
        pa.table({"image": pa.array([{"bytes": b, "path": "b"}, {"bytes": a, "path": "a"}], schema.IMAGE_TYPE)}),
        tmp_path / "pool.parquet",
        row_group_size=1,
    )
    _tar(tmp_path / "pool.tar", [("x/b.jpg", b), ("x/a.jpg", a)])
    reader = SourceReader()
    assert reader.read(str(tmp_path / "a.jpg")) == a
    assert reader.read(f"{tmp_path}/pool.parquet#row=0") == b
    assert reader.read(f"{tmp_path}/pool.parquet#row=1") == a
    assert reader.read(f"{tmp_path}/pool.tar#x/b.jpg") == b
    for source, why in (
        (str(tmp_path / "gone.jpg"), "missing"),
        (f"{tmp_path}/pool.parquet#row=7", "no row 7"),
        (f"{tmp_path}/pool.parquet#photo-12", "source_column"),
        (f"{tmp_path}/pool.tar#nope.jpg", "no member"),
    ):
        with pytest.raises(SourceUnreadable, match=why):
            reader.read(source)
    with pytest.raises(SourceUnreadable, match="max_file_bytes"):
        SourceReader(max_bytes=len(a) - 1).read(str(tmp_path / "a.jpg"))


def test_a_repeated_member_is_read_as_the_one_its_name_counts(tmp_path):
    tar_uri = _tar(tmp_path / "s.tar", [("a#1.jpg", b"first"), ("b.jpg", b"other"), ("a#1.jpg", b"second")])
    reader = SourceReader()
    assert reader.read(member_name(tar_uri, "a#1.jpg")) == b"first"
    assert reader.read(member_name(tar_uri, "a#1.jpg") + "#dup=2") == b"second"
    with pytest.raises(SourceUnreadable, match="no member"):
        reader.read(member_name(tar_uri, "a#1.jpg") + "#dup=3")


def test_a_part_that_was_never_read_is_not_opened(tmp_path):
    with pytest.raises(SourceUnreadable, match="could not be read"):
        SourceReader().read(unread_name(str(tmp_path / "gone.tar"), "after 3 members"))


def test_rows_named_by_their_source_column_are_verified_against_their_key(tmp_path):
    """img2dataset's layout: the images in a ``jpg`` column, named by ``key``, one name repeated."""
    images = [b"one", b"two", b"three"]
    pq.write_table(pa.table({"key": ["p-1", "p-2", "p-1"], "jpg": images}), tmp_path / "pool.parquet")
    uri = str(tmp_path / "pool.parquet")
    reader = SourceReader(InputSettings(source_column="key"))
    sha = {data: hashlib.sha256(data).hexdigest() for data in images}
    found, problems = reader.read_verified(
        {
            member_name(uri, "p-1"): sha[b"one"],
            member_name(uri, "p-1") + "#dup=2": sha[b"three"],
            member_name(uri, "p-2"): sha[b"one"],  # the pool changed under this name
            member_name(uri, "p-9"): sha[b"two"],
        }
    )
    assert found == {member_name(uri, "p-1"): b"one", member_name(uri, "p-1") + "#dup=2": b"three"}
    assert problems == {
        member_name(uri, "p-2"): CHANGED,
        member_name(uri, "p-9"): f"source not readable: no row 'p-9' in {uri}",
    }
