"""Distributed pHash pairs (curation.phases.dedup.phash_pairs) list exactly the pairs of the single-process kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.layout import LAYOUT
from common.storage import resolve, write_parquet_atomic
from curation.phases import reference as single_process
from curation.phases.dedup.phash_pairs import PAIR_SCHEMA, SHUFFLE_DIR, run_phash_pairs
from curation.phases.survivors import make_uid, partition_path, survivors_schema
from curation.steps.output import Output
from curation.steps.runner import StepRunner

DIM = 4


def write_survivors(out: Path, uid: np.ndarray, phash: np.ndarray, valid: np.ndarray, n_files: int) -> list[str]:
    """Survivor files in the shared schema: rows in uid order, cut into ``n_files`` contiguous files."""
    order = np.argsort(uid)
    uid, phash, valid = uid[order], phash[order], valid[order]
    fs, root = resolve(str(out))
    files = []
    for i, idx in enumerate(np.array_split(np.arange(uid.size), n_files)):
        n = idx.size
        embedding = np.zeros((n, DIM), np.float32)
        embedding[:, 0] = 1
        table = pa.table(
            {
                "uid": pa.array(uid[idx], pa.int64()),
                "shard_id": pa.array([f"shard-{u >> 32}" for u in uid[idx].tolist()], pa.string()),
                "source": pa.array([f"img-{u & 0xFFFFFFFF}" for u in uid[idx].tolist()], pa.string()),
                "key": pa.array([f"key-{u}" for u in uid[idx].tolist()], pa.string()),
                "phash": pa.array(phash[idx], pa.uint64(), mask=~valid[idx]),
                "pdq": pa.nulls(n, pa.binary(32)),
                "pdq_crops": pa.nulls(n, pa.binary()),
                "score": pa.array(np.full(n, np.nan)),
                "width": pa.array(np.full(n, 512, np.int32)),
                "height": pa.array(np.full(n, 512, np.int32)),
                "encoding_quality": pa.nulls(n, pa.int8()),
                "released": np.zeros(n, bool),
                "balance": pa.array([None] * n, pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding.ravel()), DIM),
            },
            schema=survivors_schema(DIM),
        )
        rel = partition_path(i)
        write_parquet_atomic(fs, f"{root}/{rel}", table, row_group_size=4096)
        files.append(rel)
    return files


def planted(n: int, rng: np.random.Generator, *, exact_copies: bool) -> np.ndarray:
    """Random hashes, a tenth of them replaced by copies of others at 1..10 bits (0..10 with ``exact_copies``)."""
    hashes = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    low = 0 if exact_copies else 1
    for src in rng.choice(n, size=n // 10, replace=False).tolist():
        bits = rng.choice(64, size=int(rng.integers(low, 11)), replace=False)
        hashes[rng.integers(n)] = hashes[src] ^ np.uint64(sum(1 << int(b) for b in bits))
    return hashes


def uids(n: int, rng: np.random.Generator) -> np.ndarray:
    """Unique uids over several input shards, in no particular order."""
    shard = rng.integers(0, 40, size=n)
    return rng.permutation(make_uid(np.sort(shard), np.arange(n)))


def read_pairs(out: Path, out_dir: str = "dedup/pairs/phash") -> list[tuple[int, int, int]]:
    """Every pair of every part file, after checking each file's schema and (a, b) order."""
    rows = []
    for path in sorted((out / out_dir).glob("part-*.parquet")):
        t = pq.read_table(path)
        assert t.schema.equals(PAIR_SCHEMA)
        a, b = t.column("a").to_numpy(), t.column("b").to_numpy()
        assert np.all(a < b)
        key = list(zip(a.tolist(), b.tolist()))
        assert key == sorted(key) and len(set(key)) == len(key)
        rows.extend(zip(a.tolist(), b.tolist(), t.column("distance").to_numpy().tolist()))
    return rows


def reference(uid, hashes, valid, radius: int, *, brute: bool) -> list[tuple[int, int, int]]:
    """The single-process kernel on the rows with a hash, in uid order, as uid pairs."""
    order = np.argsort(uid)
    keep = valid[order]
    u, h = uid[order][keep], hashes[order][keep]
    p = single_process.brute_force_hash_pairs(h, radius) if brute else single_process.phash_pairs(h, radius)
    return sorted(zip(u[p.i].tolist(), u[p.j].tolist(), p.distance.tolist()))


def run(out: Path, files: list[str], radius: int, **kwargs) -> dict:
    return run_phash_pairs(StepRunner(Output.at(str(out)), "dedup", "settings", window=4), files, radius, **kwargs)


@pytest.mark.parametrize(
    ("radius", "options"),
    [(8, {}), (8, {"n_bands": 3}), (10, {"n_bands": 4}), (3, {}), (8, {"max_kernel_hashes": 300})],
    ids=["r8", "r8-3bands", "r10-4bands", "r3", "r8-blocks"],
)
def test_equals_brute_force(tmp_path, ray_local, radius, options):
    rng = np.random.default_rng(radius + len(options))
    n = 3000
    hashes, uid = planted(n, rng, exact_copies=False), uids(n, rng)
    valid = rng.random(n) > 0.05
    files = write_survivors(tmp_path, uid, hashes, valid, n_files=3)
    summary = run(tmp_path, files, radius, partitions=5, **options)
    got = sorted(read_pairs(tmp_path))
    want = reference(uid, hashes, valid, radius, brute=True)
    assert got == want
    assert summary["pairs"] == len(want) and summary["partitions"] == 5
    assert len(want) > 10 * radius
    if "max_kernel_hashes" in options:  # the search really ran block against block
        assert summary["largest_family_hashes"] > options["max_kernel_hashes"]
    assert not (tmp_path / "dedup/pairs/phash" / SHUFFLE_DIR).exists()


@pytest.mark.parametrize("radius", [8, 0])
def test_planted_copies_equal_the_single_process_search(tmp_path, ray_local, radius):
    rng = np.random.default_rng(7)
    n = 100_000
    hashes, uid = planted(n, rng, exact_copies=True), uids(n, rng)
    hashes[rng.choice(n, 3000, replace=False)] = hashes[0]  # a blank-image hash, in every file
    valid = rng.random(n) > 0.02
    files = write_survivors(tmp_path, uid, hashes, valid, n_files=4)
    summary = run(tmp_path, files, radius, partitions=7)
    want = reference(uid, hashes, valid, radius, brute=False)
    assert sorted(read_pairs(tmp_path)) == want
    assert summary["exact_pairs_computed"] == sum(d == 0 for _, _, d in want) > 3000
    assert summary["largest_partition_rows"] < summary["shuffle_rows"] / 3


def test_rerun_skips_done_partitions_and_gives_the_same_bytes(tmp_path, ray_local):
    rng = np.random.default_rng(3)
    n = 5000
    hashes, uid = planted(n, rng, exact_copies=True), uids(n, rng)
    files = write_survivors(tmp_path, uid, hashes, np.ones(n, bool), n_files=3)
    folder = tmp_path / "dedup/pairs/phash"
    first = run(tmp_path, files, 8, partitions=4)
    snapshot = {p.name: p.read_bytes() for p in folder.glob("part-*.parquet")}
    assert first["partitions_computed"] == 4 and len(snapshot) == 4
    written = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")}

    again = run(tmp_path, files, 8, partitions=4)  # done: the recorded summary, nothing runs
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in first.items() if k != "seconds"}

    # a kill during the reduce: one partition neither written nor receipted, the map step's shuffle not yet removed
    (folder / "part-00002.parquet").unlink()
    for rel in (
        LAYOUT.step_unit("dedup", "phash/reduce", "part-00002"),
        LAYOUT.step_done("dedup", "phash/reduce"),
        LAYOUT.step_done("dedup", "phash/map"),
    ):
        (tmp_path / rel).unlink()
    for receipt in (tmp_path / LAYOUT.step_units("dedup", "phash/map")).glob("*.json"):
        receipt.unlink()
    run(tmp_path, files, 8, partitions=4)
    assert {p.name: p.read_bytes() for p in folder.glob("part-*.parquet")} == snapshot
    again_written = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")}
    assert [name for name in written if written[name] != again_written[name]] == ["part-00002.parquet"]
    assert not (folder / SHUFFLE_DIR).exists()

    other = run(tmp_path, files, 8, partitions=3)  # other settings: the old files are not mixed in
    assert other["partitions_computed"] == 3 and sorted(p.name for p in folder.glob("part-*.parquet")) == [
        f"part-{p:05d}.parquet" for p in range(3)
    ]
    assert sorted(read_pairs(tmp_path)) == reference(uid, hashes, np.ones(n, bool), 8, brute=False)
