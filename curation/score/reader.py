"""One input shard streamed as working-schema tables: the reader of its format, its names made unique, its rows cut
into chunks of about ``input.read_chunk_mb``. Runs inside the score phase's Ray tasks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from common import schema
from curation.score.inputs import InputShard, input_row
from curation.score.read_folder import FolderReading
from curation.score.read_parquet import ParquetReading
from curation.score.read_tar import TarReading
from curation.score.sources import UniqueNames

if TYPE_CHECKING:
    from curation.settings import InputSettings


class ShardReader(FolderReading, ParquetReading, TarReading):
    """Streams one input shard as working-schema tables of about ``input.read_chunk_mb`` each.

    Every row carries ``shard_size`` = null except the rows of the last chunk, which carry the number of rows the
    shard produced: the driver commits a shard when that many rows have been written. A shard that holds no input
    still yields one row (``empty_shard``), so it is committed too.
    """

    def __init__(self, input_uri: str, settings: InputSettings, embedding_dim: int, max_file_bytes: int):
        super().__init__(input_uri, settings, max_file_bytes)
        self.schema = schema.working_schema(embedding_dim)

    def read(self, shard: InputShard) -> Iterator[pa.Table]:
        rows = itertools.chain(
            {"files": self._files, "parquet": self._parquet, "webdataset": self._tar}[shard.kind](shard),
            *(self._download_record(record) for record in shard.records),
        )
        chunk: list[dict] = []
        chunk_bytes, total, names = 0, 0, UniqueNames()
        for row in rows:
            row["source"] = names(row["source"])
            if chunk and chunk_bytes + _nbytes(row) > self.chunk_bytes:
                yield self._table(chunk, shard.shard_id, None)
                chunk, chunk_bytes = [], 0
            chunk.append(row)
            chunk_bytes += _nbytes(row)
            total += 1
        if total == 0:
            what = {
                "parquet": "the Parquet file holds no rows",
                "webdataset": "the tar holds no image members",
                "files": "the shard lists no files",
            }[shard.kind]
            chunk = [
                input_row(self.name(shard.paths[0]) if shard.paths else shard.shard_id, None, f"empty_shard: {what}")
            ]
            total = 1
        yield self._table(chunk, shard.shard_id, total)

    def read_table(self, shard: InputShard) -> pa.Table:
        """The whole shard as one table (for small shards: tests, in-process baselines)."""
        return pa.concat_tables(self.read(shard))

    def _table(self, rows: list[dict], shard_id: str, total: int | None) -> pa.Table:
        for row in rows:
            row.update(shard_id=shard_id, shard_size=total)
            row.setdefault("status", schema.PENDING)  # a failed download is decided already
        return pa.Table.from_pylist(rows, schema=self.schema)


def _nbytes(row: dict) -> int:
    return 256 + (len(row["image"]["bytes"]) if row["image"] else 0) + len(row.get("metadata_json") or "")
