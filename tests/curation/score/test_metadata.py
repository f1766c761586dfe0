"""The pool's own metadata (WebDataset sidecars, a Parquet pool's other columns) travels with each image into the
ledger and the final shards, typed where the run agrees on a type, and back out as sidecars on export."""

import io
import json
import os
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import schema
from common.layout import LAYOUT
from curation.phases.write.shards import with_typed_metadata
from curation.score.ledger import read_ledger
from curation.score.metadata import merge_all, metadata_types, sample_key, split_metadata
from curation.score.pool import Pool, list_shards
from curation.score.sources import parse_source
from curation.settings import InputSettings
from generators.sample_pool import read_manifest
from jobs import export
from tests.curation.score.test_pool import _jpeg, read_shard

REPO = Path(__file__).resolve().parents[3]


def _add(tar: tarfile.TarFile, name: str, data: bytes, size: int | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    tar.addfile(info, io.BytesIO(data))


# A folder pool reads the sidecars beside a picture as a tar reads its members: the same tests hold for both.
LAYOUTS = ("tar", "folder")


def _tar_pool(tmp_path: Path, members: list[tuple[str, bytes]], layout: str = "tar") -> Path:
    """The members as one tar, or as the files of a folder pool."""
    root = tmp_path / "pool"
    root.mkdir()
    if layout == "folder":
        for name, data in members:
            (root / name).write_bytes(data)
        return root
    with tarfile.open(root / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    return root


def _metadata_rows(root: Path, settings: InputSettings | None = None) -> dict[str, tuple]:
    (shard,) = list_shards(Pool.at(str(root)), settings or InputSettings())
    rows = read_shard(root, shard, settings).select(["source", "metadata_json", "metadata_note"]).to_pylist()
    return {
        parse_source(r["source"]).leaf: (
            None if r["metadata_json"] is None else json.loads(r["metadata_json"]),
            r["metadata_note"],
        )
        for r in rows
    }


# --- readers ------------------------------------------------------------------------------------------------------


def test_sample_key_is_webdatasets():
    assert sample_key("a/b/000.jpg") == ("a/b/000", "jpg")
    assert sample_key("000.seg.png") == ("000", "seg.png")
    assert sample_key("dir.v2/000.JSON") == ("dir.v2/000", "json")
    assert sample_key("README") == ("README", "")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sidecars_before_or_after_the_image_join_it(tmp_path, layout):
    root = _tar_pool(
        tmp_path,
        [
            ("000.jpg", _jpeg()),
            ("000.json", json.dumps({"url": "http://x/0", "width": 400, "__key__": "000"}).encode()),
            ("000.txt", b"a man walking"),
            ("001.txt", "caption first, \u00e9".encode()),
            ("001.cls", b"7\n"),
            ("001.png", _jpeg()),
            ("002.jpg", _jpeg()),  # no sidecar
            ("003.json", b"{}"),  # a sidecar without an image: no row in a tar, a stray input in a folder
        ],
        layout,
    )
    rows = _metadata_rows(root)
    assert rows == {
        "000.jpg": ({"url": "http://x/0", "width": 400, "txt": "a man walking"}, None),
        "001.png": ({"txt": "caption first, \u00e9", "cls": 7}, None),
        "002.jpg": (None, None),
        **({"003.json": (None, None)} if layout == "folder" else {}),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_sidecars_are_notes_and_the_image_stays(tmp_path, layout):
    root = _tar_pool(
        tmp_path,
        [
            ("000.jpg", _jpeg()),
            ("000.json", b"{not json"),
            ("000.txt", b"caption \xff\xfe"),
            ("001.jpg", _jpeg()),
            ("001.json", json.dumps({"blob": "x" * 5000}).encode()),
            ("002.jpg", _jpeg()),
            ("002.json", json.dumps({"url": "u", "blob": "y" * 3000}).encode()),
            ("003.jpg", _jpeg()),
            ("003.json", b"[1, 2]"),  # JSON, not an object
        ],
        layout,
    )
    rows = _metadata_rows(root, InputSettings(max_metadata_kb=4))
    meta, note = rows["000.jpg"]
    assert meta == {"txt": "caption \\xff\\xfe"}
    assert "000.json is not valid JSON" in note and "000.txt is not UTF-8" in note
    assert rows["001.jpg"] == (None, "sidecar 001.json is 5012 bytes, over input.max_metadata_kb (4); dropped")
    assert rows["002.jpg"] == ({"url": "u", "blob": "y" * 3000}, None)
    assert rows["003.jpg"] == ({"json": [1, 2]}, None)
    # every image is still an input with its bytes
    (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    table = read_shard(root, shard, InputSettings(max_metadata_kb=4))
    assert table.num_rows == 4 and all(r["image"] for r in table.select(["image"]).to_pylist())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_metadata_over_the_limit_drops_the_largest_fields(tmp_path, layout):
    fields = {"url": "u", "bigger": "c" * 2500}  # each sidecar fits, the two together do not
    members = [("000.jpg", _jpeg()), ("000.json", json.dumps(fields).encode()), ("000.txt", b"b" * 1500)]
    root = _tar_pool(tmp_path, members, layout)
    (meta, note), *_ = _metadata_rows(root, InputSettings(max_metadata_kb=3)).values()
    assert meta == {"url": "u", "txt": "b" * 1500}
    assert note == "field(s) bigger dropped: the metadata is over input.max_metadata_kb (3)"


def test_a_sidecar_that_lies_about_its_size_ends_the_tar_with_a_row(tmp_path):
    root = tmp_path / "pool"
    root.mkdir()
    with tarfile.open(root / "a.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "000.jpg", _jpeg())
        info = tarfile.TarInfo("000.json")
        info.size = 10**15
        tar.addfile(info)  # header only: the "data" is whatever follows
    rows = read_shard(root, list_shards(Pool.at(str(root)), InputSettings())[0]).to_pylist()
    by_name = {parse_source(r["source"]).part: r for r in rows}
    assert by_name["000.jpg"]["image"] is not None
    assert "declares more bytes than the tar holds" in by_name["000.jpg"]["metadata_note"]
    assert by_name["<after 1 members>"]["reason"].startswith("unreadable: the member's header declares")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_fields_asked_for_are_kept(tmp_path, layout):
    members = [("000.jpg", _jpeg()), ("000.json", b'{"url": "u", "exif": "{}"}'), ("000.txt", b"c")]
    root = _tar_pool(tmp_path, members, layout)
    assert _metadata_rows(root, InputSettings(metadata=["url", "txt"]))["000.jpg"] == ({"url": "u", "txt": "c"}, None)
    assert _metadata_rows(root, InputSettings(metadata=[]))["000.jpg"] == (None, None)


def test_a_folders_sidecars_are_regular_files_of_the_pool_and_stray_ones_are_inputs(tmp_path):
    """The listing's rule for any input holds for a sidecar: a link out of the pool is never followed (it is an input
    with its row); binary parts are never read; a sidecar with no picture of its key is an input like any file."""
    members = [("000.jpg", _jpeg()), ("000.npy", b"\x93NUMPY"), ("notes.txt", b"how we crawled")]
    root = _tar_pool(tmp_path, members, "folder")
    outside = tmp_path / "secret.json"
    outside.write_text('{"token": "x"}')
    os.symlink(outside, root / "000.json")
    (shard,) = list_shards(Pool.at(str(root)), InputSettings())
    rows = {r["source"].rsplit("/", 1)[-1]: r for r in read_shard(root, shard).to_pylist()}
    assert set(rows) == {"000.jpg", "000.json", "notes.txt"}
    assert rows["000.jpg"]["metadata_json"] is None and rows["000.jpg"]["metadata_note"] is None
    assert rows["000.json"]["reason"].startswith("link_outside_pool")
    assert rows["notes.txt"]["image"]["bytes"] == b"how we crawled"  # decode calls it not_an_image


def test_a_shard_of_loose_files_never_parts_a_sample(tmp_path):
    members = [(f"{k:03d}.{ext}", _jpeg() if ext == "jpg" else b"{}") for k in range(5) for ext in ("jpg", "json")]
    root = _tar_pool(tmp_path, members, "folder")
    shards = list_shards(Pool.at(str(root)), InputSettings(files_per_shard=3))
    assert [[p.rsplit("/", 1)[-1] for p in s.paths] for s in shards] == [
        ["000.jpg", "000.json", "001.jpg", "001.json"],
        ["002.jpg", "002.json", "003.jpg", "003.json"],
        ["004.jpg", "004.json"],
    ]
    assert sum(read_shard(root, s).num_rows for s in shards) == 5


def test_parquet_columns_are_metadata_but_bytes_are_not(tmp_path):
    root = tmp_path / "pool"
    root.mkdir()
    table = pa.table(
        {
            "image": [_jpeg(), _jpeg(), None],
            "url": ["u0", None, "u2"],
            "similarity": [0.31, float("nan"), 0.2],
            "tags": [["a", "b"], [], None],
            "thumbnail": [b"x", b"y", b"z"],  # a second image: not metadata
            "crawled": pa.array([1_700_000_000_000_000] * 3, pa.timestamp("us")),
        }
    )
    pq.write_table(table, root / "p.parquet")
    rows = _metadata_rows(root)
    assert rows["row=0"] == (
        {"url": "u0", "similarity": 0.31, "tags": ["a", "b"], "crawled": "2023-11-14 22:13:20"},
        None,
    )
    assert rows["row=1"][0]["similarity"] is None  # NaN is not JSON
    assert rows["row=2"][0]["url"] == "u2"  # an unreadable row keeps its metadata too
    assert _metadata_rows(root, InputSettings(metadata=["url"]))["row=0"] == ({"url": "u0"}, None)


# --- types across a run -------------------------------------------------------------------------------------------


def test_fields_of_one_type_are_typed_and_the_rest_stays_json():
    texts = [
        json.dumps({"url": "a", "w": 400, "score": 1, "rating": 5, "tags": ["x"], "ok": True}),
        json.dumps({"url": "b", "w": None, "score": 0.5, "rating": "unrated", "ok": False}),
        None,
    ]
    types = merge_all([metadata_types(texts[:1]), metadata_types(texts[1:])])
    assert types == {
        "ok": ["bool"],
        "rating": ["int", "string"],
        "score": ["float", "int"],
        "tags": ["nested"],
        "url": ["string"],
        "w": ["int", "null"],
    }
    typed = schema.typed_metadata_fields(types)
    assert typed == {"ok": "bool", "score": "float", "url": "string", "w": "int"}
    struct, rest = split_metadata(texts, typed)
    assert struct is not None and struct.type == schema.metadata_struct(typed)
    assert struct.to_pylist() == [
        {"ok": True, "score": 1.0, "url": "a", "w": 400},
        {"ok": False, "score": 0.5, "url": "b", "w": None},
        None,
    ]
    assert [json.loads(r) if r else None for r in rest] == [{"rating": 5, "tags": ["x"]}, {"rating": "unrated"}, None]
    table = with_typed_metadata(pa.table({"metadata_json": pa.array(texts, pa.string())}), typed)
    assert table.column_names == ["metadata_json", "metadata"]


def test_a_value_that_does_not_fit_its_typed_field_stays_in_the_json():
    struct, rest = split_metadata([json.dumps({"w": "wide"})], {"w": "int"})
    assert struct is not None and struct.to_pylist() == [None] and rest == ['{"w": "wide"}']


def test_at_most_a_bounded_number_of_fields_are_typed():
    types = {f"f{i:04d}": ["string"] for i in range(500)}
    assert len(schema.typed_metadata_fields(types)) == schema.MAX_TYPED_METADATA_FIELDS


# --- end to end: a WebDataset pool with img2dataset's sidecars ------------------------------------------------------


@pytest.fixture()
def wds_run(wds_curated_run):
    return wds_curated_run


def _truth(pool: Path) -> dict[str, dict]:
    """The metadata the sample pool's sidecars hold, by ledger source."""
    with_sidecars = {}
    for row in read_manifest(pool):
        name = parse_source(row["path"])
        tar_name, member = name.container, name.part
        assert member is not None
        with tarfile.open(pool / tar_name) as tar:
            stem = member.rsplit(".", 1)[0]
            meta = json.load(tar.extractfile(f"{stem}.json"))
            meta["txt"] = tar.extractfile(f"{stem}.txt").read().decode()
        with_sidecars[f"{pool}/{row['path']}"] = meta
    return with_sidecars


def test_the_ledger_and_shards_keep_the_pools_metadata(wds_run):
    pool, out = wds_run
    truth = _truth(pool)
    ledger = read_ledger(str(out), columns=["source", "metadata_json", "metadata_note"]).to_pylist()
    assert {r["source"] for r in ledger} == set(truth)
    assert all(json.loads(r["metadata_json"]) == truth[r["source"]] for r in ledger)
    assert all(r["metadata_note"] is None for r in ledger)
    manifest = json.loads((out / LAYOUT.manifest).read_text())
    assert manifest["metadata_fields"] == {
        "caption": "string",
        "key": "string",
        "license": "string",
        "original_height": "int",
        "original_width": "int",
        "txt": "string",
        "url": "string",
    }
    shards = [out / LAYOUT.shards / s["file"] for s in manifest["shards"]]

    import duckdb  # SQL over the struct's fields

    got = duckdb.sql(
        "select source, metadata.url, metadata.original_width, metadata.txt, metadata_json "
        f"from read_parquet({[str(p) for p in shards]})"
    ).fetchall()
    assert len(got) == manifest["totals"]["rows"] > 0
    for source, url, width, txt, rest in got:
        assert (url, width, txt, rest) == (
            truth[source]["url"],
            truth[source]["original_width"],
            truth[source]["txt"],
            None,
        )

    import datasets

    ds = datasets.load_dataset("parquet", data_files=[str(p) for p in shards], split="train")
    assert ds.features["metadata"]["original_height"] == datasets.Value("int64")
    assert ds[0]["metadata"]["url"] == truth[ds[0]["source"]]["url"]
    assert "`original_width` (int)" in (out / LAYOUT.card).read_text()


def test_the_webdataset_export_writes_the_sidecars_back(wds_run, tmp_path):
    import webdataset as wds

    pool, out = wds_run
    truth = _truth(pool)
    argv = ["--shards", str(out / LAYOUT.shards), "--format", "webdataset", "--output", str(tmp_path / "wds")]
    assert export.main(argv) == 0
    samples = list(wds.WebDataset(sorted(str(p) for p in (tmp_path / "wds").glob("part-*.tar")), shardshuffle=False))
    assert samples
    for sample in samples:
        meta = json.loads(sample["json"])
        assert meta["metadata"] == truth[meta["source"]]
        assert sample["txt"].decode() == truth[meta["source"]]["txt"]
