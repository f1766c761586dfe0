"""curation.score.read_parquet: Parquet rows as inputs, named by index or source column; unfit columns say what to
set, in words ``layout_problem`` reads back."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from curation.score.inputs import InputShard
from curation.score.read_parquet import ParquetReading, image_column, layout_problem
from curation.score.sources import parse_source
from curation.settings import InputSettings


def _rows(root, settings: InputSettings) -> list[dict]:
    shard = InputShard("parquet-x", "parquet", (str(root / "x.parquet"),))
    return list(ParquetReading(str(root), settings, 1 << 20)._parquet(shard))


def test_rows_by_index_or_source_column(tmp_path):
    table = pa.table({"jpg": pa.array([b"a", b"b"], pa.binary()), "name": ["p", "p"], "caption": ["c0", "c1"]})
    pq.write_table(table, tmp_path / "x.parquet")
    rows = _rows(tmp_path, InputSettings())  # no column "image": the one binary column is read
    assert [parse_source(r["source"]).row for r in rows] == [0, 1]
    assert [r["image"]["bytes"] for r in rows] == [b"a", b"b"] and "c1" in rows[1]["metadata_json"]
    named = _rows(tmp_path, InputSettings(source_column="name"))
    assert [parse_source(r["source"]).part for r in named] == ["p", "p"]  # the shard's reader makes them unique


def test_unfit_columns_are_one_row_whose_reason_names_the_setting(tmp_path):
    pq.write_table(
        pa.table({"a": pa.array([b"1"], pa.binary()), "b": pa.array([b"2"], pa.binary())}), tmp_path / "x.parquet"
    )
    (row,) = _rows(tmp_path, InputSettings())
    assert row["image"] is None
    problem = layout_problem(row["reason"])
    assert problem is not None and "set input.image_column" in problem and "a, b" in problem
    assert layout_problem("unreadable: something else") is None
    assert image_column(pa.schema([("image", pa.binary())]), InputSettings()) == ("image", None)
