"""Pools as the web leaves them: names that are not UTF-8, empty shards, object stores reached through an endpoint
override with awkward keys, pools that change under a run, symbolic links, oversized files and shards, stray files
beside tars, repeated and null names. Every input ends in the ledger exactly once, with a reason, and the job exits 0.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.layout import LAYOUT
from curation.score.ledger import read_ledger, reason_code
from curation.score.pool import Pool, list_shards
from curation.score.reader import ShardReader
from curation.settings import InputSettings
from jobs import curate

LITE = "configs/curate/lite.yaml"
# Only the stages the global phases need: these tests are about inputs, not about detectors.
FAST = [
    "stages.person.enabled=false",
    "stages.head_pose.enabled=false",
    "stages.quality.enabled=false",
    "stages.text_overlay.enabled=false",
    "stages.nsfw.enabled=false",
]
MB = 2**20


def photo(seed: int, size=(480, 400)) -> bytes:
    """A distinct decodable JPEG (random blocks, so no two are near-duplicates)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (size[1] // 40, size[0] // 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(blocks).resize(size, Image.NEAREST).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def run(repo_root: Path, pool: str, out: Path, *extra: str, phases: str = "score,dedup,sample,write") -> int:
    args = ["--config", str(repo_root / LITE), "--input", pool, "--output", str(out), "--phases", phases, *FAST, *extra]
    return curate.main(args)


def ledger_rows(out: Path) -> list[dict]:
    rows = read_ledger(str(out), ["source", "status", "stage", "reason"]).to_pylist()
    repeated = [s for s, n in Counter(r["source"] for r in rows).items() if n > 1]
    assert not repeated, f"sources in the ledger more than once: {repeated}"
    return rows


def read_all(root, shard, settings: InputSettings | None = None, max_file_bytes=64 * MB) -> pa.Table:
    return ShardReader(str(root), settings or InputSettings(), 8, max_file_bytes).read_table(shard)


# --- one hostile folder pool through the whole job ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_folder(tmp_path_factory) -> tuple[Path, dict[str, str | None]]:
    """A folder pool of odd names, links and sizes; returns it and input name -> expected reason code (None: kept)."""
    base = tmp_path_factory.mktemp("hostile_folder")
    root, outside = base / "pool", base / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    expected: dict[str, str | None] = {}
    raw = bytes(root)
    with open(os.path.join(raw, b"caf\xe9 latin-1.jpg"), "wb") as f:  # a Latin-1 byte: not valid UTF-8
        f.write(photo(1))
    expected["caf\\xe9 latin-1.jpg"] = None
    (root / "sub" / "ünïcödé 写真 #1 ?.jpg").write_bytes(photo(2))
    expected["ünïcödé 写真 #1 ?.jpg"] = None
    (root / "plain.jpg").write_bytes(photo(3))
    expected["plain.jpg"] = None
    os.symlink(root / "plain.jpg", root / "inside_link.jpg")  # a link inside the pool is an input
    expected["inside_link.jpg"] = None
    (outside / "secret.jpg").write_text("password=hunter2\n")
    os.symlink(outside / "secret.jpg", root / "escape.jpg")
    expected["escape.jpg"] = "link_outside_pool"
    (outside / "folder").mkdir()
    (outside / "folder" / "x.jpg").write_bytes(photo(4))
    os.symlink(outside / "folder", root / "linked_folder")
    expected["linked_folder"] = "linked_folder"
    os.symlink(root / "sub", root / "loop_to_sub")  # a folder link inside the pool is not followed either
    expected["loop_to_sub"] = "linked_folder"
    os.symlink(root / "gone.jpg", root / "dangling.jpg")
    expected["dangling.jpg"] = "unreadable"
    (root / "notes.txt").write_text("api_key=sk-live-abcdef\n")
    expected["notes.txt"] = "not_an_image"
    with open(root / "huge_sparse.jpg", "wb") as f:  # 8 GiB on paper, never read
        f.truncate(8 * 2**30)
    expected["huge_sparse.jpg"] = "file_too_large"
    return root, expected


def test_hostile_folder_pool_every_input_once_with_its_reason(hostile_folder, repo_root, tmp_path, ray_local):
    root, expected = hostile_folder
    out = tmp_path / "out"
    assert run(repo_root, str(root), out, "input.files_per_shard=4") == 0
    rows = ledger_rows(out)
    by_name = {r["source"].rsplit("/", 1)[-1]: r for r in rows}
    assert set(by_name) == set(expected)
    for name, code in expected.items():
        row = by_name[name]
        if code is None:
            assert row["status"] in ("kept", "duplicate", "unsampled"), (name, row)
        else:
            assert (row["status"], row["stage"], reason_code(row["reason"])) == ("rejected", "decode", code), (
                name,
                row,
            )
    # the content of a non-image, or of a link's target, never reaches the ledger
    text = repr(read_ledger(str(out)).to_pylist())
    assert "hunter2" not in text and "sk-live" not in text


def test_non_utf8_names_are_read_by_their_bytes(hostile_folder):
    root, _ = hostile_folder
    (shard,) = list_shards(Pool.at(str(root)), InputSettings(files_per_shard=100))
    table = read_all(root, shard)
    row = next(r for r in table.to_pylist() if "latin-1" in r["source"])
    assert row["source"].endswith("caf\\xe9 latin-1.jpg") and row["image"]["bytes"] == photo(1)


# --- shards that hold nothing, tars beside stray files, repeated and null names -------------------------------------


def test_empty_shards_are_committed_and_stray_files_beside_tars_do_not_change_the_format(
    repo_root, tmp_path, ray_local
):
    pool = tmp_path / "wds"
    pool.mkdir()
    with tarfile.open(
        pool / "a.tar", "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape"
    ) as tar:
        add_member(tar, "s0.jpg", photo(10))
        add_member(tar, "s0.json", b"{}")
        add_member(tar, "s1.jpg", photo(11))
        add_member(tar, "s1.jpg", photo(12))  # the same member name twice: both are inputs
        add_member(tar, "caf\udce9.jpg", photo(13))  # raw byte 0xE9 in the member name
    with tarfile.open(pool / "sidecars_only.tar", "w") as tar:
        add_member(tar, "s9.json", b"{}")
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), pool / "zero_rows.parquet")
    (pool / "README.txt").write_text("how this pool was made\n")
    (pool / "cover.jpg").write_bytes(photo(14))
    shards = list_shards(Pool.at(str(pool)), InputSettings())
    assert sorted(s.kind for s in shards) == ["files", "webdataset", "webdataset"]  # the majority decides

    out = tmp_path / "out"
    assert run(repo_root, str(pool), out) == 0
    rows = ledger_rows(out)
    codes = {r["source"][len(str(pool)) + 1 :]: reason_code(r["reason"]) for r in rows}
    assert codes["sidecars_only.tar"] == "empty_shard"
    assert codes["zero_rows.parquet"] == "not_an_image"  # in a tar pool, a lone Parquet file is a loose file
    assert codes["README.txt"] == "not_an_image"
    members = {k for k in codes if k.startswith("a.tar#")}
    assert members == {"a.tar#s0.jpg", "a.tar#s1.jpg", "a.tar#s1.jpg#dup=2", "a.tar#caf\\xe9.jpg"}
    assert {r["status"] for r in rows if r["source"].split("/")[-1].startswith(("a.tar#", "cover"))} <= {
        "kept",
        "duplicate",
        "unsampled",
    }
    # a rerun finds every shard committed, empty ones included
    assert run(repo_root, str(pool), out) == 0
    assert len(ledger_rows(out)) == len(rows)


def test_a_parquet_pool_of_empty_files_and_repeated_or_null_names(repo_root, tmp_path, ray_local):
    pool = tmp_path / "pq"
    pool.mkdir()
    images = [photo(20 + i) for i in range(4)]
    pq.write_table(
        pa.table({"image": pa.array(images, pa.binary()), "name": ["x", "x", None, "y"]}), pool / "a.parquet"
    )
    pq.write_table(
        pa.table({"image": pa.array([], pa.binary()), "name": pa.array([], pa.string())}), pool / "b.parquet"
    )
    out = tmp_path / "out"
    assert run(repo_root, str(pool), out, "input.source_column=name") == 0
    names = sorted(r["source"].rsplit("/", 1)[-1] for r in ledger_rows(out))
    assert names == ["a.parquet#row=2", "a.parquet#x", "a.parquet#x#dup=2", "a.parquet#y", "b.parquet"]


# --- sizes are checked before reading; big shards stream --------------------------------------------------------------


def test_oversized_tar_members_are_skipped_unread_and_big_shards_stream_in_chunks(tmp_path):
    pool = tmp_path / "big"
    pool.mkdir()
    with tarfile.open(pool / "big.tar", "w") as tar:
        for i in range(12):
            noise = np.random.default_rng(i).integers(0, 256, (400, 480, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(noise).save(buf, "JPEG", quality=95)  # ~0.3 MB each: the shard spans several chunks
            add_member(tar, f"{i:02d}.jpg", buf.getvalue())
        add_member(tar, "zz_huge.jpg", bytes(3 * MB))
    (shard,) = list_shards(Pool.at(str(pool)), InputSettings())
    reader = ShardReader(str(pool), InputSettings(read_chunk_mb=1), 8, max_file_bytes=2 * MB)
    chunks = list(reader.read(shard))
    assert len(chunks) >= 2 and all(c.nbytes < 2 * MB for c in chunks)
    sizes = [c.column("shard_size").to_pylist() for c in chunks]
    assert all(v is None for s in sizes[:-1] for v in s) and set(sizes[-1]) == {13}  # the total rides on the last
    huge = next(r for c in chunks for r in c.to_pylist() if r["source"].endswith("zz_huge.jpg"))
    assert huge["image"] is None and reason_code(huge["reason"]) == "file_too_large"


# --- a pool that changes under a run ---------------------------------------------------------------------------------


def test_resume_uses_the_pinned_listing_and_refuses_a_changed_layout(repo_root, tmp_path, ray_local, capsys):
    pool = tmp_path / "pool"
    pool.mkdir()
    for i in range(6):
        (pool / f"m{i}.jpg").write_bytes(photo(50 + i))
    out = tmp_path / "out"
    assert run(repo_root, str(pool), out, "input.files_per_shard=2", phases="score") == 0
    # a run killed before its second shard committed, then new files land, sorting before the old ones
    for record in (LAYOUT.score_commit("files-000001"), LAYOUT.step_done("score", "shards"), LAYOUT.done("score")):
        (out / record).unlink()
    for i in range(3):
        (pool / f"a{i}.jpg").write_bytes(photo(60 + i))
    assert run(repo_root, str(pool), out, "input.files_per_shard=2", phases="score") == 0
    assert "pinned" in capsys.readouterr().out
    sources = sorted(Path(r["source"]).name for r in ledger_rows(out))
    assert sources == [f"m{i}.jpg" for i in range(6)]
    # the same output with another shard layout is refused, naming the setting
    assert run(repo_root, str(pool), out, "input.files_per_shard=3", phases="score") == 2
    assert "input.files_per_shard=2 (this command: 3)" in capsys.readouterr().err
    # --new-run starts over on the pool as it is now
    assert run(repo_root, str(pool), out, "input.files_per_shard=3", "--new-run", phases="score") == 0
    assert len(ledger_rows(out)) == 9


# --- an object-store pool behind an endpoint override, with credentials in the URI and awkward keys -----------------


AWKWARD_KEYS = [
    "pool/with space.jpg",
    "pool/100%.jpg",
    "pool/a#b.jpg",
    "pool/what?.jpg",
    "pool/ünï 写真.jpg",
    "pool/%20literal.jpg",
]


@pytest.fixture()
def s3_pool():
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        client = boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            region_name="us-east-1",
            aws_access_key_id="pooluser",
            aws_secret_access_key="poolsecret",
        )
        client.create_bucket(Bucket="web")
        for i, key in enumerate(AWKWARD_KEYS):
            client.put_object(Bucket="web", Key=key, Body=photo(70 + i))
        yield f"s3://pooluser:poolsecret@web/pool?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()


def test_s3_pool_through_an_endpoint_override_with_awkward_keys(s3_pool, repo_root, tmp_path, ray_local):
    shards = list_shards(Pool.at(s3_pool), InputSettings())
    rows = read_all(s3_pool, shards[0]).to_pylist()
    assert sorted(r["source"] for r in rows) == sorted(f"s3://web/{k}" for k in AWKWARD_KEYS)
    assert all(r["image"] is not None for r in rows), [r["reason"] for r in rows]

    out = tmp_path / "out"
    assert run(repo_root, s3_pool, out, phases="score") == 0
    ledger = ledger_rows(out)
    assert sorted(r["source"] for r in ledger) == sorted(f"s3://web/{k}" for k in AWKWARD_KEYS)
    assert {r["status"] for r in ledger} == {"kept"}
    assert "poolsecret" not in repr(read_ledger(str(out)).to_pylist())


def test_parquet_file_whose_image_column_is_not_bytes_is_one_row_saying_what_to_do(tmp_path):
    pool = tmp_path / "wrong"
    pool.mkdir()
    pq.write_table(
        pa.table({"image": ["https://example.com/a.jpg", "https://example.com/b.jpg"]}), pool / "urls.parquet"
    )
    (shard,) = list_shards(Pool.at(str(pool)), InputSettings())
    (row,) = read_all(pool, shard).to_pylist()
    assert row["source"].endswith("/urls.parquet") and row["image"] is None
    assert "holds string, not image bytes" in row["reason"] and "input.image_column" in row["reason"]
    assert "2 rows per the footer, none read" in row["reason"]
