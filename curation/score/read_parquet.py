"""Parquet pool files read as ledger rows: one per row the file holds, never what its footer promises.

A file's images are in ``input.image_column`` (or, in a file without it, its one binary column); rows are named by
their index or by ``input.source_column``. What a file says about itself is checked against what it holds: a
footer that promises rows that are not there, a row group too large to hold. Each lie is one row; what was read
before it stands. A file whose columns do not fit the ``input.*`` settings is one row saying what to set.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.imageio import safe_error
from curation.score.inputs import PARQUET_BUFFER, InputShard, input_row
from curation.score.read_downloads import DOWNLOAD_COLUMNS, DOWNLOAD_STATUS, DownloadRecords, Downloads, is_binary
from curation.score.sources import member_name, row_name, unread_name

if TYPE_CHECKING:
    from curation.settings import InputSettings


class ParquetReading(DownloadRecords):
    """The reader of Parquet pool files (and, through ``DownloadRecords``, of a downloader's records)."""

    def _parquet(self, shard: InputShard) -> Iterator[dict]:
        """Rows are what the file holds, never what its footer promises: a footer can claim any number of rows, and
        cells can be far larger than their compressed pages suggest."""
        (path,) = shard.paths
        uri = self.name(path)
        try:
            size = self._size(path)
            pf = pq.ParquetFile(self._open(path), buffer_size=PARQUET_BUFFER)  # column chunks streamed
            meta = pf.metadata
        except Exception as exc:  # noqa: BLE001 - no footer: the whole file becomes one ledger row with the reason
            self._store_failed(exc, uri)
            yield input_row(uri, None, f"unreadable: cannot read the Parquet file's footer: {safe_error(exc)}")
            return
        promised = meta.num_rows
        claims = [promised, *(meta.row_group(i).num_rows for i in range(meta.num_row_groups))]
        if min(claims) < 0 or (size is not None and max(claims) > max(size, 1)):
            # every row carries at least a byte of its image; a footer that claims more rows than the file has bytes
            # lies, and reading it could allocate for rows that are not there
            yield input_row(
                uri, None, f"unreadable: the footer claims {promised} rows in a file of {size} bytes; not read"
            )
            return
        column, problem = image_column(pf.schema_arrow, self.settings)
        if column not in pf.schema_arrow.names and DOWNLOAD_STATUS in pf.schema_arrow.names:
            # no bytes, a downloader's status: the record of a shard none of whose URLs brought a picture
            yield from self._download_record(path, beside_pictures=False)
            return
        if problem:  # one row for the file, with what to do: its rows cannot be told apart without its columns
            yield input_row(uri, None, f"unreadable: {problem} ({promised} rows per the footer, none read)")
            return
        source_column = self.settings.source_column
        columns = [column] + ([source_column] if source_column else [])
        metadata_columns = self._metadata_columns(pf.schema_arrow, columns)
        # a downloader's status of each row (img2dataset's Parquet output): a null image is a failed download
        download_columns = [c for c in DOWNLOAD_COLUMNS if c in pf.schema_arrow.names]
        columns = list(dict.fromkeys([*columns, *metadata_columns, *download_columns]))
        index = 0
        try:
            for group in range(meta.num_row_groups):
                rows, image_bytes = self._row_group_size(meta, group, column)
                if image_bytes > self.settings.max_row_group_mb * 2**20:
                    yield input_row(
                        unread_name(uri, f"rows {index}-{index + rows - 1}"), None,
                        f"unreadable: row group {group} holds {image_bytes // 2**20} MiB of images uncompressed, more "
                        f"than input.max_row_group_mb ({self.settings.max_row_group_mb}); rewrite the file with "
                        "smaller row groups or raise the setting",
                    )  # fmt: skip
                    index += rows
                    continue
                batch_size = max(1, min(64, self.chunk_bytes * max(rows, 1) // max(image_bytes, 1)))
                for batch in pf.iter_batches(batch_size=batch_size, row_groups=[group], columns=columns):
                    yield from self._parquet_rows(batch, uri, index, column, metadata_columns)
                    index += batch.num_rows
        except Exception as exc:  # noqa: BLE001 - what was read stands; one row for the rest of the file
            self._store_failed(exc, uri)
            yield input_row(
                unread_name(uri, f"from row {index}"), None,
                f"unreadable: unreadable from row {index} of the {promised} its footer promises: {safe_error(exc)}",
            )  # fmt: skip
            return
        if index != promised:
            yield input_row(
                unread_name(uri, f"rows {index}-{promised}"), None,
                f"unreadable: the footer promises {promised} rows; {index} are in the file",
            )  # fmt: skip

    @staticmethod
    def _row_group_size(meta: pq.FileMetaData, group: int, column: str) -> tuple[int, int]:
        """(rows, uncompressed bytes of the image column) of a row group, as its footer says."""
        rg = meta.row_group(group)
        image_bytes = sum(
            rg.column(i).total_uncompressed_size
            for i in range(rg.num_columns)
            if rg.column(i).path_in_schema.split(".")[0] == column
        )
        return rg.num_rows, image_bytes

    def _parquet_rows(
        self, batch: pa.RecordBatch, uri: str, first: int, column: str, metadata_columns: list[str]
    ) -> Iterator[dict]:
        images = batch.column(column)
        if pa.types.is_struct(images.type):
            images = images.field("bytes")
        if not (pa.types.is_binary(images.type) or pa.types.is_large_binary(images.type)):
            images = images.cast(pa.large_binary())  # binary_view, fixed_size_binary: lengths need an offset type
        lengths = pc.binary_length(images).to_pylist()  # sizes checked before any cell becomes a Python object
        source_column = self.settings.source_column
        names = batch.column(source_column).to_pylist() if source_column else [None] * batch.num_rows
        extra = batch.select(metadata_columns).to_pylist() if metadata_columns else None
        downloads = Downloads(batch)
        for i, (length, name) in enumerate(zip(lengths, names)):
            source = member_name(uri, _as_name(name)) if name is not None else row_name(uri, first + i)
            if length is None:
                failed = downloads.failed_row(source, i)
                row = failed or input_row(source, None, "unreadable: image bytes are null in the Parquet row")
            elif length > self.max_file_bytes:
                row = input_row(source, None, f"file_too_large: {length} bytes > {self.max_file_bytes}")
            else:
                row = input_row(source, images[i].as_py())
            yield from self._with_fields(row, extra[i] if extra is not None else None)


def image_column(file_schema: pa.Schema, settings: InputSettings) -> tuple[str, str | None]:
    """The column a Parquet pool file's images are read from: ``input.image_column``, or, in a file without it, the
    file's one binary column (img2dataset names it after its encode format: jpg, png, webp); and why the file's
    columns do not fit ``input.*`` (None when they do)."""
    names, column, source_column = file_schema.names, settings.image_column, settings.source_column
    if column not in names:
        binary = [f.name for f in file_schema if is_binary(f.type)]
        if len(binary) != 1:
            choices = f" (one of its binary columns: {', '.join(binary)})" if binary else ""
            return column, f"no column {column!r} (columns: {names}); set input.image_column{choices}"
        column = binary[0]
    image_type = file_schema.field(column).type
    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        image_type = image_type.field("bytes").type
    if not is_binary(image_type):
        return column, (
            f"column {column!r} holds {image_type}, not image bytes (binary, or a struct with a binary 'bytes' "
            "field); set input.image_column"
        )
    if source_column and source_column not in names:
        return column, f"no column {source_column!r} (columns: {names}); set input.source_column"
    return column, None


# The ledger reason of a Parquet file left unread for its columns, as the reader words it above.
_UNREAD_LAYOUT = re.compile(
    r"unreadable: (?P<problem>.*; set input\.\w+(?: \(one of its binary columns: [^)]*\))?) "
    r"\(-?\d+ rows per the footer, none read\)",
    re.S,
)


def layout_problem(reason: str | None) -> str | None:
    """What a ledger reason says is wrong with an unread Parquet file's columns (``no column 'image' (columns:
    [...]); set input.image_column``); None for any other reason."""
    found = _UNREAD_LAYOUT.fullmatch(reason or "")
    return found["problem"] if found else None


def _as_name(value) -> str:
    """A name from a Parquet source column of any type (bytes that are not UTF-8 are escaped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)
