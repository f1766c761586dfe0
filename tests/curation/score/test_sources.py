"""curation.score.sources: each name the readers write is taken apart by the one parser, whatever the names hold."""

from __future__ import annotations

import pytest

from curation.score.sources import (
    Source,
    UniqueNames,
    container_kind,
    member_name,
    parse_source,
    printable,
    row_name,
    unread_name,
)


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("/pool/a/img.jpg", Source("/pool/a/img.jpg", "files")),
        ("/pool/odd#name.jpg", Source("/pool/odd#name.jpg", "files")),  # a loose file may hold '#'
        ("/pool/x.parquet", Source("/pool/x.parquet", "parquet")),  # a stray Parquet file read as one input
        (row_name("s3://b/p/x.parquet", 12), Source("s3://b/p/x.parquet", "parquet", "row=12")),
        (member_name("/p/x.parquet", "photo-7"), Source("/p/x.parquet", "parquet", "photo-7")),
        (member_name("/p/s.TAR.GZ", "d/a#b.jpg"), Source("/p/s.TAR.GZ", "webdataset", "d/a#b.jpg")),
        (member_name("/p/s.tar", "x.tar#y.jpg"), Source("/p/s.tar", "webdataset", "x.tar#y.jpg")),
        ("/p/s.tar#a.jpg#dup=3", Source("/p/s.tar", "webdataset", "a.jpg", 3)),
        (unread_name("/p/s.tar", "after 4 members"), Source("/p/s.tar", "webdataset", "<after 4 members>")),
    ],
)
def test_names_parse_back(name, parsed):
    assert parse_source(name) == parsed


def test_parts_say_what_they_name():
    assert parse_source(row_name("/p/x.parquet", 3)).row == 3
    assert parse_source(member_name("/p/x.parquet", "photo")).row is None  # named by input.source_column
    assert parse_source(member_name("/p/s.tar", "row=3")).row is None  # a tar member of that name, not a row
    for what in ("from row 7", "rows 4-9", "after 2 members"):
        assert parse_source(unread_name("/p/x.parquet", what)).unread
    assert not parse_source(member_name("/p/s.tar", "<a>.jpg")).unread
    assert parse_source(member_name("/p/s.tar", "dir/a.JPG")).leaf == "a.JPG"
    assert parse_source("/pool/dir/b.png").leaf == "b.png"


def test_unique_names_count_repeats_and_parse_back():
    names = UniqueNames()
    written = [names(member_name("/p/s.tar", "a.jpg")) for _ in range(3)]
    assert written == ["/p/s.tar#a.jpg", "/p/s.tar#a.jpg#dup=2", "/p/s.tar#a.jpg#dup=3"]
    assert [parse_source(n).dup for n in written] == [1, 2, 3]
    assert {parse_source(n).part for n in written} == {"a.jpg"}


def test_kinds_and_printable_names():
    assert [container_kind(p) for p in ("a.parquet", "a.tgz", "a.tar.xz", "a.jpg")] == [
        "parquet",
        "webdataset",
        "webdataset",
        "files",
    ]
    assert printable(b"/p/caf\xe9.jpg".decode("utf-8", "surrogateescape")) == "/p/caf\\xe9.jpg"
