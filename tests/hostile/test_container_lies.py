"""Containers whose own headers and footers lie: tar members that declare more bytes than the file holds, gzip'ed
tars, links and special members, members of formats the reader does not list, Parquet footers that promise rows
that are not there, cells far larger than their compressed pages, every Arrow binary type, paths over PATH_MAX.
What a file claims about itself is checked against what it holds; every input still gets exactly one row."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.score.ledger import reason_code
from curation.score.pool import Pool, list_shards
from curation.score.reader import ShardReader
from curation.settings import InputSettings
from tests.hostile.test_pool_inputs import MB, add_member, ledger_rows, photo, read_all, run

BLOCK = tarfile.BLOCKSIZE


class ReadBudget:
    """A file that allows a bounded number of reads: a reader that streams on past the end of a file fails the test
    instead of hanging it."""

    def __init__(self, f, calls: int = 2000):
        self.f, self.calls = f, calls

    def read(self, *args):
        self.calls -= 1
        if self.calls < 0:
            raise AssertionError("the reader kept reading past what the file holds")
        return self.f.read(*args)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def budgeted_reader(root: Path, **kw) -> ShardReader:
    reader = ShardReader(str(root), InputSettings(**kw.pop("settings", {})), 8, kw.pop("max_file_bytes", 64 * MB))
    opened = reader._open
    reader._open = lambda path: ReadBudget(opened(path))  # type: ignore[method-assign]
    return reader


def rows_of(reader: ShardReader, root: Path) -> list[dict]:
    (shard,) = list_shards(Pool.at(str(root)), reader.settings)
    return reader.read_table(shard).to_pylist()


def member_header(name: str, size: int, fmt: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=fmt)


def lying_tar(declared: int, fmt: int) -> bytes:
    """A sound member, then one whose header declares ``declared`` bytes while 10 follow, then another sound one."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        add_member(tar, "a.jpg", photo(1))
        head = buf.getvalue()[: tar.offset]  # without the end-of-archive blocks
    tail = io.BytesIO()
    with tarfile.open(fileobj=tail, mode="w") as tar:
        add_member(tar, "c.jpg", photo(3))
    return head + member_header("b.jpg", declared, fmt) + b"0123456789".ljust(BLOCK, b"\0") + tail.getvalue()


@pytest.mark.parametrize(
    "declared,fmt",
    [(10**15, tarfile.PAX_FORMAT), (2**80, tarfile.GNU_FORMAT), (5 * 2**20, tarfile.USTAR_FORMAT)],
    ids=["pax-1e15", "gnu-base256-2^80", "ustar-5MiB"],
)
def test_a_member_larger_than_what_is_left_of_the_file_is_one_row_and_the_tar_is_read_no_further(
    tmp_path, declared, fmt
):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "lies.tar").write_bytes(lying_tar(declared, fmt))
    rows = rows_of(budgeted_reader(pool), pool)
    by_name = {r["source"].rsplit("#", 1)[1]: r for r in rows}
    assert list(by_name) == ["a.jpg", "b.jpg"]
    assert by_name["a.jpg"]["image"] is not None
    lie = by_name["b.jpg"]
    assert lie["image"] is None and reason_code(lie["reason"]) == "unreadable"
    assert f"declares {declared} bytes" in lie["reason"] and "read no further" in lie["reason"]


def test_a_gzipped_member_that_declares_more_than_the_stream_can_expand_to_is_a_lie(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "lies.tar.gz").write_bytes(gzip.compress(lying_tar(10**15, tarfile.PAX_FORMAT)))
    rows = rows_of(budgeted_reader(pool), pool)
    assert [r["source"].rsplit("#", 1)[1] for r in rows] == ["a.jpg", "b.jpg"]
    assert "read no further" in rows[1]["reason"]


def test_an_oversized_member_of_a_compressed_tar_cut_off_ends_at_the_stream_end(tmp_path):
    """bz2 can expand past any ratio: a lying size there is found where the stream ends, never streamed forever."""
    import bz2

    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "lies.tar.bz2").write_bytes(bz2.compress(lying_tar(2**80, tarfile.GNU_FORMAT)))
    rows = rows_of(budgeted_reader(pool, max_file_bytes=MB), pool)
    assert [r["source"].rsplit("#", 1)[1] for r in rows] == ["a.jpg", "b.jpg"]
    assert reason_code(rows[1]["reason"]) == "unreadable" and "read no further" in rows[1]["reason"]


def sound_tar(names: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, name in enumerate(names):
            add_member(tar, name, photo(10 + i))
    return buf.getvalue()


@pytest.mark.parametrize("suffix,compress", [(".tar.gz", gzip.compress), (".tgz", gzip.compress)])
def test_a_complete_gzipped_tar_is_read_whole_and_never_called_cut_off(tmp_path, suffix, compress):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / f"shard{suffix}").write_bytes(compress(sound_tar(["a.jpg", "b.png", "c.jpg"])))
    (pool / "other.tar").write_bytes(sound_tar(["d.jpg"]))
    shards = list_shards(Pool.at(str(pool)), InputSettings())
    assert {s.kind for s in shards} == {"webdataset"}  # both tars, not one tar plus a loose file
    rows = [r for s in shards for r in read_all(pool, s).to_pylist()]
    assert sorted(r["source"].rsplit("#", 1)[1] for r in rows) == ["a.jpg", "b.png", "c.jpg", "d.jpg"]
    assert all(r["image"] is not None and r["reason"] is None for r in rows)


def test_a_gzipped_tar_cut_off_keeps_what_was_read_and_says_so(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    data = gzip.compress(sound_tar(["a.jpg", "b.jpg", "c.jpg", "d.jpg"]), mtime=0)
    (pool / "cut.tar.gz").write_bytes(data[: len(data) * 2 // 3])
    rows = rows_of(budgeted_reader(pool), pool)
    names = [r["source"].rsplit("#", 1)[1] for r in rows]
    assert names[:-1] == ["a.jpg", "b.jpg", "c.jpg"][: len(names) - 1] and len(names) >= 2
    assert names[-1] in ("b.jpg", "c.jpg", "d.jpg") or names[-1].startswith("<after ")
    assert all(r["image"] is not None for r in rows[:-1]) and reason_code(rows[-1]["reason"]) == "unreadable"


def test_every_member_but_folders_and_sidecars_gets_one_row(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        add_member(tar, "0001.jpg", photo(1))
        add_member(tar, "0001.json", b'{"caption": "a person"}')
        add_member(tar, "0001.txt", b"a person")
        add_member(tar, "0002.avif", b"\0\0\0\x1cftypavif" + bytes(64))  # a picture format the reader never listed
        add_member(tar, "0003.jxl", b"\xff\x0a" + bytes(64))
        add_member(tar, "0004.bin", photo(4))  # a JPEG under a name that does not say so
        add_member(tar, "0005", b"no suffix at all")
        folder = tarfile.TarInfo("sub")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, kind in [("link.jpg", tarfile.SYMTYPE), ("hard.jpg", tarfile.LNKTYPE)]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "0001.jpg"
            tar.addfile(info)
        for name, kind in [("pipe.jpg", tarfile.FIFOTYPE), ("tty.jpg", tarfile.CHRTYPE), ("disk", tarfile.BLKTYPE)]:
            info = tarfile.TarInfo(name)
            info.type = kind
            tar.addfile(info)
    (pool / "odd.tar").write_bytes(buf.getvalue())
    rows = {r["source"].rsplit("#", 1)[1]: r for r in rows_of(budgeted_reader(pool), pool)}
    assert sorted(rows) == sorted(
        ["0001.jpg", "0002.avif", "0003.jxl", "0004.bin", "0005", "link.jpg", "hard.jpg", "pipe.jpg", "tty.jpg", "disk"]
    )
    for name in ("0001.jpg", "0002.avif", "0003.jxl", "0004.bin", "0005"):
        assert rows[name]["image"] is not None  # bytes go to the decode stage, which tells a picture from the rest
    for name, kind in [("link.jpg", "symbolic link"), ("hard.jpg", "hard link"), ("pipe.jpg", "FIFO")]:
        assert reason_code(rows[name]["reason"]) == "not_a_file" and kind in rows[name]["reason"]
    assert reason_code(rows["tty.jpg"]["reason"]) == reason_code(rows["disk"]["reason"]) == "not_a_file"


# --- Parquet -------------------------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def lie_about_rows(path: Path, claimed: int) -> None:
    """Rewrite the footer's file-level ``num_rows`` (thrift compact: field 3, i64, zigzag varint) to ``claimed``."""
    data = path.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    footer = data[start:-8]
    actual = pq.ParquetFile(path).metadata.num_rows
    needle = b"\x16" + _varint(actual * 2)
    for at in range(len(footer)):
        if footer[at : at + len(needle)] != needle:
            continue
        new = footer[:at] + b"\x16" + _varint(claimed * 2) + footer[at + len(needle) :]
        candidate = data[:start] + new + len(new).to_bytes(4, "little") + b"PAR1"
        path.write_bytes(candidate)
        try:
            if pq.ParquetFile(path).metadata.num_rows == claimed:
                return
        except Exception:  # noqa: BLE001 - not the field: try the next occurrence
            pass
    path.write_bytes(data)
    raise AssertionError("num_rows not found in the footer")


@pytest.mark.parametrize("claimed", [20_000, 2**62])
def test_a_footer_that_promises_rows_that_are_not_there_gives_the_rows_read_and_one_row_for_the_lie(tmp_path, claimed):
    pool = tmp_path / "pool"
    pool.mkdir()
    pq.write_table(pa.table({"image": pa.array([photo(1), photo(2)], pa.binary())}), pool / "lies.parquet")
    lie_about_rows(pool / "lies.parquet", claimed)
    rows = rows_of(budgeted_reader(pool), pool)
    assert len(rows) <= 3  # never one row per promised row
    assert [r["reason"] for r in rows if r["image"] is not None] in ([None, None], [])
    (lie,) = [r for r in rows if r["image"] is None]
    assert reason_code(lie["reason"]) == "unreadable" and str(claimed) in lie["reason"]


def test_a_parquet_file_damaged_mid_file_keeps_the_rows_read_and_one_row_for_the_rest(tmp_path):
    pool = tmp_path / "damaged"
    pool.mkdir()
    images = [photo(40 + i) for i in range(6)]
    table = pa.table({"image": pa.array(images, pa.binary())})
    pq.write_table(table, pool / "a.parquet", row_group_size=2, compression="none", write_statistics=False)
    data = bytearray((pool / "a.parquet").read_bytes())
    start = data.index(images[4][4000:4064]) - 4000  # the third row group's first value
    data[start - 48 : start + 8] = b"\xff" * 56  # its page header and length prefix; the footer stays whole
    (pool / "a.parquet").write_bytes(bytes(data))
    rows = rows_of(budgeted_reader(pool), pool)
    names = [r["source"].rsplit("#", 1)[1] for r in rows]
    read = len(names) - 1  # the damage is in the third row group's page or just before it
    assert read in (2, 4) and names == [f"row={i}" for i in range(read)] + [f"<from row {read}>"]
    assert "of the 6 its footer promises" in rows[-1]["reason"]


@pytest.mark.parametrize("arrow_type", [pa.large_binary(), pa.binary_view()], ids=["large_binary", "binary_view"])
def test_every_arrow_binary_type_is_image_bytes(tmp_path, arrow_type):
    pool = tmp_path / "pool"
    pool.mkdir()
    pq.write_table(pa.table({"image": pa.array([photo(1), None, photo(2)], arrow_type)}), pool / "a.parquet")
    rows = rows_of(budgeted_reader(pool), pool)
    assert [r["image"] is not None for r in rows] == [True, False, True]
    assert rows[0]["image"]["bytes"] == photo(1) and "null" in rows[1]["reason"]


READ_PEAK = """
import sys
import pyarrow.parquet  # the reader's own imports, so that the baseline below holds them
from curation.settings import InputSettings
from curation.score.pool import Pool, list_shards
from curation.score.reader import ShardReader
settings = InputSettings(read_chunk_mb=8, max_row_group_mb=int(sys.argv[2]))
(shard,) = list_shards(Pool.at(sys.argv[1]), settings)
def peak_mb():  # VmHWM: this process's own peak (ru_maxrss would carry the parent's across fork and exec)
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) // 1024
base = peak_mb()
reasons = [(r or "kept").split(":")[0] for t in ShardReader(sys.argv[1], settings, 8, 4 * 2**20).read(shard)
           for r in t.column("reason").to_pylist()]
print(" ".join(reasons), peak_mb() - base)
"""


def read_peak(pool: Path, max_row_group_mb: int) -> tuple[list[str], int]:
    """(reason codes, MiB the reading added to the process's peak), read in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", READ_PEAK, str(pool), str(max_row_group_mb)], capture_output=True, text=True,
        check=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    *reasons, peak = out.stdout.split()
    return reasons, int(peak)


def test_oversized_parquet_cells_are_sized_before_they_are_copied_and_big_row_groups_are_not_read(tmp_path):
    """Cells of zeros make a zstd file of a few KB whatever their size. Parquet's reader holds a row group's column
    whole, so a row group over input.max_row_group_mb is one row, unread; cells over filters.max_file_bytes in a
    row group under it are sized before any becomes a Python object."""
    pool = tmp_path / "pool"
    pool.mkdir()
    schema = pa.schema([("image", pa.binary())])
    with pq.ParquetWriter(pool / "bomb.parquet", schema, compression="zstd", use_dictionary=False) as writer:
        writer.write_table(pa.table({"image": [photo(1), photo(2)]}, schema=schema))
        writer.write_table(pa.table({"image": [bytes(6 * MB)] * 8}, schema=schema))  # 48 MiB: read, cells too large
        writer.write_table(pa.table({"image": [bytes(40 * MB)] * 8}, schema=schema))  # 320 MiB: not read
    assert (pool / "bomb.parquet").stat().st_size < 1 * MB
    reasons, peak_mb = read_peak(pool, max_row_group_mb=64)
    assert reasons == ["kept"] * 2 + ["file_too_large"] * 8 + ["unreadable"]
    assert peak_mb < 250, f"reading the file added {peak_mb} MiB to the reader's peak"
    reasons, peak_mb = read_peak(pool, max_row_group_mb=1024)  # the same file read whole, for comparison
    assert reasons == ["kept"] * 2 + ["file_too_large"] * 16 and peak_mb > 400


# --- names ---------------------------------------------------------------------------------------------------------


def test_a_path_longer_than_path_max_gets_its_row_saying_so(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "short.jpg").write_bytes(photo(1))
    fd = os.open(pool, os.O_RDONLY)
    depth, name = 0, "d" * 250
    try:
        while depth * 251 < 4400:  # past PATH_MAX (4096), built relative to an open folder
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd, depth = child, depth + 1
        out = os.open("deep.jpg", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        os.write(out, photo(2))
        os.close(out)
    finally:
        os.close(fd)
    settings = InputSettings()
    rows = [r for s in list_shards(Pool.at(str(pool)), settings) for r in read_all(pool, s, settings).to_pylist()]
    assert sum(r["source"].endswith("short.jpg") for r in rows) == 1
    (deep,) = [r for r in rows if not r["source"].endswith("short.jpg")]
    assert deep["image"] is None and reason_code(deep["reason"]) == "unreadable" and "PATH_MAX" in deep["reason"]


# --- through the job -----------------------------------------------------------------------------------------------

MARKER = b"LEAK-7f3a9c"


@pytest.mark.slow  # a curation run
def test_a_pool_of_lying_containers_runs_through_the_job_each_input_once_and_nothing_leaks(
    repo_root, tmp_path, ray_local
):
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "lies.tar").write_bytes(lying_tar(10**15, tarfile.PAX_FORMAT))
    (pool / "sound.tar.gz").write_bytes(gzip.compress(sound_tar(["s1.jpg", "s2.jpg"])))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        add_member(tar, "x.jpg", b"P6\n" + MARKER + b" 12\n255\n")  # PPM header whose width is the marker
        add_member(tar, "y.avif", b"\0\0\0\x1cftypavif" + MARKER + bytes(32))
        info = tarfile.TarInfo("z.jpg")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    (pool / "odd.tar").write_bytes(buf.getvalue())
    out = tmp_path / "out"
    assert run(repo_root, str(pool), out) == 0
    rows = ledger_rows(out)
    names = sorted(r["source"].rsplit("#", 1)[1] for r in rows)
    assert names == ["a.jpg", "b.jpg", "s1.jpg", "s2.jpg", "x.jpg", "y.avif", "z.jpg"]
    assert MARKER.decode() not in repr(read_all_ledger_text(rows))
    by_name = {r["source"].rsplit("#", 1)[1]: r for r in rows}
    assert reason_code(by_name["z.jpg"]["reason"]) == "not_a_file"
    assert reason_code(by_name["b.jpg"]["reason"]) == "unreadable"


def read_all_ledger_text(rows: list[dict]) -> list[str]:
    return [f"{r['source']} {r['stage']} {r['reason']}" for r in rows]
