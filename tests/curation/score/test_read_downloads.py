"""curation.score.read_downloads: a downloader's record gives each URL that brought no image one ledger row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from common import schema
from common.layout import DOWNLOAD
from curation.score.read_downloads import DownloadRecords, Downloads, is_binary
from curation.score.sources import parse_source
from curation.settings import InputSettings


def _record() -> pa.Table:
    return pa.table(
        {
            "url": ["http://x/0.jpg", "http://x/1.jpg", "http://x/2.jpg"],
            "status": ["success", "failed_to_download", None],
            "error_message": [None, "HTTP 404 at http://x/1.jpg", None],
            "caption": ["c0", "c1", "c2"],
        }
    )


def test_failed_urls_become_rows_with_the_status_as_reason(tmp_path):
    pq.write_table(_record(), tmp_path / "00000.parquet")
    rows = list(
        DownloadRecords(str(tmp_path), InputSettings(), 1 << 20)._download_record(str(tmp_path / "00000.parquet"))
    )
    (row,) = rows
    assert parse_source(row["source"]).row == 1
    assert (row["stage"], row["status"]) == (DOWNLOAD, schema.REJECTED)
    assert row["reason"] == "failed_to_download: HTTP 404 at the URL" and "c1" in row["metadata_json"]


def test_a_batch_tells_failures_and_binary_columns():
    downloads = Downloads(_record().to_batches()[0])
    assert [downloads.failed(i) for i in range(3)] == [False, True, False]
    assert downloads.failed_row("s", 0) is None
    assert is_binary(pa.large_binary()) and not is_binary(pa.string())
