"""curation.score.read_tar: a tar's members as rows, read as a stream, its sidecars as their sample's metadata."""

from __future__ import annotations

import io
import tarfile

from curation.score.inputs import InputShard
from curation.score.read_tar import TarReading
from curation.score.sources import parse_source
from curation.settings import InputSettings


def _tar(path, members) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere.jpg"
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data or b""))


def test_members_sidecars_and_links(tmp_path):
    _tar(tmp_path / "s.tar", [("k/1.jpg", b"one"), ("k/1.json", b'{"caption": "c"}'), ("k/2.jpg", None)])
    reader = TarReading(str(tmp_path), InputSettings(), 1 << 20)
    rows = list(reader._tar(InputShard("webdataset-s", "webdataset", (str(tmp_path / "s.tar"),))))
    assert [parse_source(r["source"]).part for r in rows] == ["k/1.jpg", "k/2.jpg"]
    assert rows[0]["image"]["bytes"] == b"one" and '"c"' in rows[0]["metadata_json"]
    assert rows[1]["reason"].startswith("not_a_file: a symbolic link")


def test_a_cut_tar_keeps_what_was_read(tmp_path):
    _tar(tmp_path / "s.tar", [("a.jpg", b"a" * 600), ("b.jpg", b"b" * 5000)])
    data = (tmp_path / "s.tar").read_bytes()
    (tmp_path / "s.tar").write_bytes(data[:2000])  # inside b.jpg's data
    reader = TarReading(str(tmp_path), InputSettings(), 1 << 20)
    rows = list(reader._tar(InputShard("webdataset-s", "webdataset", (str(tmp_path / "s.tar"),))))
    assert rows[0]["image"]["bytes"] == b"a" * 600
    last = parse_source(rows[-1]["source"])
    assert last.unread and rows[-1]["reason"].startswith("unreadable:")
