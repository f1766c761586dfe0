"""curation.score.reader: one shard streamed as working-schema tables, its names unique and parsed back by the
audit's one parser."""

from __future__ import annotations

import io
import tarfile

import pyarrow as pa

from common import schema
from curation.score.inputs import InputShard
from curation.score.reader import ShardReader
from curation.score.sources import parse_source
from curation.settings import InputSettings


def test_repeated_members_are_told_apart_and_parse_back(tmp_path):
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for data in (b"first", b"second"):
            info = tarfile.TarInfo("a#1.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reader = ShardReader(str(tmp_path), InputSettings(), 8, max_file_bytes=1 << 20)
    table = reader.read_table(InputShard("webdataset-s", "webdataset", (str(tmp_path / "s.tar"),)))
    assert table.schema.equals(schema.working_schema(8))
    names = [parse_source(s) for s in table.column("source").to_pylist()]
    assert [(n.container, n.part, n.dup) for n in names] == [(str(tmp_path / "s.tar"), "a#1.jpg", k) for k in (1, 2)]
    assert table.column("shard_size").to_pylist() == [2, 2]


def test_chunks_carry_the_shard_size_last_and_an_empty_shard_one_row(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(bytes(700_000))
    reader = ShardReader(str(tmp_path), InputSettings(read_chunk_mb=1), 8, max_file_bytes=1 << 22)
    paths = tuple(str(tmp_path / f"{i}.jpg") for i in range(3))
    chunks = list(reader.read(InputShard("files-000000", "files", paths)))
    assert len(chunks) == 3 and [c.column("shard_size").to_pylist() for c in chunks] == [[None], [None], [3]]
    (empty,) = reader.read(InputShard("files-000001", "files", ()))
    assert pa.Table.to_pylist(empty.select(["reason", "shard_size"])) == [
        {"reason": "empty_shard: the shard lists no files", "shard_size": 1}
    ]
