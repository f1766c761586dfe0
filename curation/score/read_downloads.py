"""A downloader's record of the URLs it tried, read as ledger rows: each URL that brought no image is one row.

img2dataset writes beside each shard (``<stem>.tar``, a folder ``<stem>/``, or ``<stem>.parquet``) ``<stem>.parquet``,
its record of every URL it tried (the URL list's columns, key, status, error_message, sizes). In its Parquet output
the record is the shard itself, bytes in a column named by the encode format (jpg, png, webp) and null where the
download failed. A failed URL's row has stage ``download`` and the downloader's status as its reason code, so the
ledger accounts for the whole URL list.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from common import schema
from common.imageio import safe_error, safe_message
from common.layout import DOWNLOAD
from curation.score.inputs import PARQUET_BUFFER, PoolAccess, input_row, with_metadata
from curation.score.sources import row_name, unread_name

DOWNLOAD_STATUS, DOWNLOAD_ERROR, DOWNLOAD_URL = "status", "error_message", "url"
DOWNLOADED = "success"
_RECORD_BATCH_ROWS = 256

_BINARY_TYPES = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view, pa.types.is_fixed_size_binary)


def is_binary(dtype: pa.DataType) -> bool:
    return any(test(dtype) for test in _BINARY_TYPES)


DOWNLOAD_COLUMNS = (DOWNLOAD_STATUS, DOWNLOAD_ERROR, DOWNLOAD_URL)
_MAX_DOWNLOAD_MESSAGE = 4096  # characters of a downloader's message looked at; the ledger keeps far fewer


class Downloads:
    """A batch's downloader columns (img2dataset's status, error_message and url), where it has them."""

    def __init__(self, batch: pa.RecordBatch):
        def texts(name: str) -> list[str | None]:
            if name not in batch.schema.names:
                return [None] * batch.num_rows
            return [None if v is None else str(v) for v in batch.column(name).to_pylist()]

        self.status, self.error, self.url = (texts(name) for name in DOWNLOAD_COLUMNS)

    def failed(self, i: int) -> bool:
        return self.status[i] not in (None, DOWNLOADED)

    def failed_row(self, source: str, i: int) -> dict | None:
        """Row ``i`` as a failed download (stage download, the status as its reason code, the downloader's message
        as its detail, sanitised as every reason is); None where the row is no failed download."""
        status = self.status[i]
        if status is None or not self.failed(i):
            return None
        code = re.sub(r"[^a-z0-9_]+", "_", status.lower()).strip("_")[:64] or "failed"
        message, url = (self.error[i] or "")[:_MAX_DOWNLOAD_MESSAGE], self.url[i]
        detail = safe_message(message.replace(url, "the URL") if url else message)
        row = input_row(source, None, f"{code}: {detail}" if detail else code)
        row.update(stage=DOWNLOAD, status=schema.REJECTED)
        return row


class DownloadRecords(PoolAccess):
    """Reads a downloader's records; the Parquet reader builds on it (a record is a Parquet file)."""

    def _metadata_columns(self, file_schema: pa.Schema, taken: list[str]) -> list[str]:
        """The file's columns that are its rows' metadata: those ``input.metadata`` names (all with "*"), but never
        the image or name columns, nor bytes (a second image is not metadata)."""
        wanted = self.settings.metadata
        return [
            f.name
            for f in file_schema
            if f.name not in taken and ("*" in wanted or f.name in wanted) and not is_binary(f.type)
        ]

    def _with_fields(self, row: dict, fields: dict | None) -> Iterator[dict]:
        """The row with the metadata of its Parquet columns (``fields``; None: the file gives none)."""
        if fields is None:
            yield row
            return
        meta = self._metadata()
        for field, value in fields.items():
            meta.add(field, value)
        yield from with_metadata([row], meta)

    def _download_record(self, path: str, beside_pictures: bool = True) -> Iterator[dict]:
        """A downloader's record of a shard (img2dataset's ``<shard>.parquet``): one row per URL whose status is not
        a success. Beside the shard, the URLs that succeeded are its pictures, read from the shard itself; a record
        read alone (no picture of its shard is in the pool) gives each of them a row saying so."""
        uri, index = self.name(path), 0
        try:
            pf = pq.ParquetFile(self._open(path), buffer_size=PARQUET_BUFFER)
            names = pf.schema_arrow.names
            if DOWNLOAD_STATUS not in names:
                yield input_row(uri, None, f"unreadable: no column {DOWNLOAD_STATUS!r} in a downloader's record of a "
                                      f"shard (columns: {names[:32]})")  # fmt: skip
                return
            metadata_columns = self._metadata_columns(pf.schema_arrow, [])
            columns = list(dict.fromkeys([*metadata_columns, *(c for c in DOWNLOAD_COLUMNS if c in names)]))
            for batch in pf.iter_batches(batch_size=_RECORD_BATCH_ROWS, columns=columns):
                downloads = Downloads(batch)
                listed = [i for i in range(batch.num_rows) if downloads.failed(i) or not beside_pictures]
                extra = batch.select(metadata_columns).take(listed).to_pylist() if metadata_columns and listed else None
                for k, i in enumerate(listed):
                    source = row_name(uri, index + i)
                    row = downloads.failed_row(source, i) or input_row(
                        source, None, "unreadable: the downloader's record has no failure for it, and no picture of "
                                      "its shard is in the pool"
                    )  # fmt: skip
                    yield from self._with_fields(row, extra[k] if extra is not None else None)
                index += batch.num_rows
        except Exception as exc:  # noqa: BLE001 - what was read stands; one row for the rest of the record
            self._store_failed(exc, uri)
            yield input_row(unread_name(uri, f"from row {index}"), None, f"unreadable: the downloader's record of the shard is "
                                                          f"unreadable from row {index}: {safe_error(exc)}")  # fmt: skip
