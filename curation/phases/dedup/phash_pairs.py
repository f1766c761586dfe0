"""Exact pHash near-duplicate pairs over the survivors table: a Ray map / shuffle / reduce over Parquet partitions.

``run_phash_pairs`` writes ``<out_dir>/part-<p:05d>.parquet`` (columns ``a`` int64 < ``b`` int64 survivor uids,
``distance`` uint8), rows sorted by (a, b) in each file; over all files every pair is listed exactly once. The
pair set is the one ``reference.phash_pairs`` (``spanning=True``) gives on the same rows in uid order: each distinct
hash is represented by its smallest uid; every other survivor with that hash is paired with it (distance 0, a
star, never a clique), and two distinct hashes within ``radius`` bits pair their representatives. A null pHash
is no signal: that survivor is in no pair.

Why it is exact without gathering the hashes. ``phash_bands.plan_bands`` cuts the 64 bits into ``n`` bands, and two
hashes within ``radius`` differ in at most ``f = radius // n`` bits of some band. Cutting each band into ``f + 1``
sub-bands, a band that differs in at most ``f`` bits agrees exactly on one of its sub-bands. A *family* is one
(band, sub-band); a *group* is the hashes with one value of that sub-band. So every pair within ``radius`` shares a
group, and groups can be placed anywhere: the map step sends each hash to the shuffle partition of each of its
``n (f + 1)`` groups; the reduce step runs ``phash_bands.band_pairs`` on each family's hashes of its partition, with the
flip masks kept off the family's sub-band (``SubBandPlan``), so only hashes of one group are ever compared. A pair
is reported only by the first family, in (band, sub-band) order, in which the two hashes agree on the sub-band and
are within ``f`` bits over the band (``band_pairs`` already skips earlier bands; earlier sub-bands are checked
here), a condition of the two hashes alone: no second shuffle is needed to list each pair once.

Exact duplicates. The first family carries every survivor's (hash, uid); the others only each map file's
distinct hashes with their smallest uid, so a hash repeated a million times costs one row per file there. The
reducer of the first family's group of a hash sees all its uids: it lists the star, and every family takes the
minimum uid of a hash over all files, which is the global representative.

Steps and files (``S`` = survivors with a pHash, ``M`` = survivor files, ``P`` = partitions, ``K = n (f + 1)``):

- map, one task per survivor file: reads ``uid`` and ``phash`` only, writes ``<out_dir>/_shuffle/<p>/<m>.parquet``
  (family int8, hash uint64, uid int64; sorted) for every partition still to be reduced. About
  ``rows(file) * K * 40`` bytes of memory.
- reduce, one task per partition: reads its ``M`` shuffle files (about ``K S / P`` rows, some 60 bytes of memory
  each while sorted), writes ``part-<p>.parquet``, deletes its shuffle folder. A family's hashes above
  ``max_kernel_hashes`` are searched in blocks, block against block, so the kernel's memory (about 100 bytes per
  hash, a 16 MiB band table and ``phash_bands.MAX_CANDIDATES_PER_STEP`` candidates) never grows with ``S``.
- the driver holds the file lists, the plan and one small receipt per task. The two steps run on the phase's
  ``StepRunner`` (``curation.steps.runner``): a rerun skips every receipted task, a task skips a shuffle file or a
  partition whose output exists, and another plan or other inputs clear the folder first.

At 10^9 survivors and radius 8: 3 bands (22, 21, 21 bits), ``f = 2``, ``K = 9`` families of 7-8 bit sub-bands,
1280 groups in all. With uniform hashes a group holds about ``S / 128 = 7.8M`` hashes, so
``P = ceil(K S / rows_per_partition)`` is capped at the 1280 groups: about 7M shuffle rows (~0.4 GB) per reduce,
each family's hashes searched in blocks of ``max_kernel_hashes`` (~0.4 GB each). The shuffle holds about
``K S = 9e9`` rows (~150 GB before compression) in ``M x P`` files (1000 x 1280 for 1M-row survivor files). Real
pHashes are not uniform: a frequent sub-band value makes a larger group (more blocks in one task), and a hash
repeated ``c`` times puts its ``c`` uids and ``c - 1`` star pairs in one reduce task. The search grows like
``S^2``: each family checks about ``S^2 masks / 2^(band width + 1)`` candidates, ~2e14 in all at 10^9 uniform
hashes, spread over the reduce tasks. Per hash it probes ~1.4x the flip masks of the single-process search (each
family flips only the ~14 bits outside its sub-band, but there are ``f + 1`` families per band), so its CPU time is
about 1.7x ``reference.phash_pairs``'s, in exchange for never holding more than a partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common.console import plural
from common.layout import LAYOUT
from common.storage import delete_quietly, exists, join, resolve, write_parquet_atomic
from curation.phases.dedup import phash_bands
from curation.phases.dedup.phash_plan import MAX_KERNEL_HASHES, ROWS_PER_PARTITION, PairPlan, family_pairs, plan_pairs
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner
from curation.steps.window import parquet_rows

log = logging.getLogger(__name__)

SHUFFLE_DIR = "_shuffle"  # "_" names are skipped by readers listing the pair files
ROW_GROUP_SIZE = 1 << 20

PAIR_SCHEMA = pa.schema(
    [
        pa.field("a", pa.int64(), nullable=False),
        pa.field("b", pa.int64(), nullable=False),
        pa.field("distance", pa.uint8(), nullable=False),
    ]
)
SHUFFLE_SCHEMA = pa.schema(
    [
        pa.field("family", pa.int8(), nullable=False),
        pa.field("hash", pa.uint64(), nullable=False),
        pa.field("uid", pa.int64(), nullable=False),
    ]
)


# ---------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------


def _shuffle_path(root: str, out_dir: str, partition: int, map_index: int) -> str:
    return join(root, out_dir, SHUFFLE_DIR, f"{partition:05d}", f"{map_index:06d}.parquet")


def _runs(sorted_keys: np.ndarray) -> np.ndarray:
    """True where a run of equal values starts."""
    return np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]) if sorted_keys.size else np.empty(0, bool)


@ray.remote(num_cpus=1)
def _map_task(
    out_uri: str, out_dir: str, survivor_file: str, map_index: int, plan: PairPlan, needed: list[int]
) -> dict:
    """Send one survivor file's hashes to their groups' partitions (only the partitions still to be reduced)."""
    cpu = time.process_time()
    fs, root = resolve(out_uri)
    paths = {p: _shuffle_path(root, out_dir, p, map_index) for p in needed}
    infos = fs.get_file_info(list(paths.values()))
    todo = [p for p, info in zip(paths, infos) if info.type == pafs.FileType.NotFound]
    if not todo:
        return {"rows": 0, "files": 0, "cpu_s": 0.0}
    t = pq.read_table(join(root, survivor_file), columns=["uid", "phash"], filesystem=fs)
    t = t.filter(pc.is_valid(t.column("phash")))
    uid = t.column("uid").to_numpy().astype(np.int64)
    hashes = phash_bands.as_hashes(t.column("phash").to_numpy())
    order = np.lexsort((uid, hashes))
    hashes, uid = hashes[order], uid[order]
    first = _runs(hashes)  # each distinct hash once, with its smallest uid in this file
    pieces = []  # (family, hash, uid, partition) per family
    for index in range(len(plan.families)):
        fh, fu = (hashes, uid) if index == 0 else (hashes[first], uid[first])
        pieces.append((np.full(fh.size, index, np.int8), fh, fu, plan.partition_of(index, fh)))
    family, h, u, part = (np.concatenate(x) for x in zip(*pieces))
    order = np.argsort(part, kind="stable")  # within a partition: by family, hash, uid as built
    family, h, u, part = family[order], h[order], u[order], part[order]
    bounds = np.searchsorted(part, np.arange(plan.partitions + 1))
    for p in todo:
        lo, hi = bounds[p], bounds[p + 1]
        table = pa.table([family[lo:hi], h[lo:hi], u[lo:hi]], schema=SHUFFLE_SCHEMA)
        write_parquet_atomic(fs, paths[p], table, row_group_size=ROW_GROUP_SIZE)
    return {"rows": int(bounds[-1]), "files": len(todo), "cpu_s": time.process_time() - cpu}


@ray.remote(num_cpus=1)
def _reduce_task(
    out_uri: str, out_dir: str, partition: int, n_maps: int, plan: PairPlan, max_kernel_hashes: int
) -> dict:
    """All pairs whose reporting group lives in this partition, sorted, as one file; then drop the shuffle input."""
    cpu = time.process_time()
    fs, root = resolve(out_uri)
    out_path = join(root, LAYOUT.pair_part(out_dir, partition))
    if exists(fs, out_path):
        return {"partition": partition, "skipped": True}
    parts = [pq.read_table(_shuffle_path(root, out_dir, partition, m), filesystem=fs) for m in range(n_maps)]
    t = pa.concat_tables(parts).combine_chunks() if parts else SHUFFLE_SCHEMA.empty_table()
    rows = t.num_rows
    family = t.column("family").to_numpy()
    hashes = t.column("hash").to_numpy()
    uid = t.column("uid").to_numpy()
    del t
    order = np.lexsort((uid, hashes, family))
    family, hashes, uid = family[order], hashes[order], uid[order]
    bounds = np.searchsorted(family, np.arange(len(plan.families) + 1))
    out_a, out_b, out_d = [], [], []
    n_exact = largest = 0
    for index in range(len(plan.families)):
        fh, fu = hashes[bounds[index] : bounds[index + 1]], uid[bounds[index] : bounds[index + 1]]
        first = _runs(fh)
        unique, rep = fh[first], fu[first]  # uids are sorted within a hash: the first is the smallest
        largest = max(largest, unique.size)
        if index == 0:  # every uid of each hash is here: the star of exact duplicates
            others = ~first
            out_a.append(rep[np.cumsum(first)[others] - 1])
            out_b.append(fu[others])
            out_d.append(np.zeros(int(others.sum()), np.uint8))
            n_exact = int(others.sum())
        if plan.radius > 0 and unique.size > 1:
            u, v, d = family_pairs(unique, plan, index, max_kernel_hashes)
            out_a.append(np.minimum(rep[u], rep[v]))
            out_b.append(np.maximum(rep[u], rep[v]))
            out_d.append(d.astype(np.uint8))
    a = np.concatenate(out_a) if out_a else np.empty(0, np.int64)
    b = np.concatenate(out_b) if out_b else np.empty(0, np.int64)
    d = np.concatenate(out_d) if out_d else np.empty(0, np.uint8)
    order = np.lexsort((b, a))
    table = pa.table([a[order].astype(np.int64), b[order].astype(np.int64), d[order]], schema=PAIR_SCHEMA)
    write_parquet_atomic(fs, out_path, table, row_group_size=ROW_GROUP_SIZE)
    delete_quietly(fs, join(root, out_dir, SHUFFLE_DIR, f"{partition:05d}"))
    return {
        "partition": partition,
        "skipped": False,
        "rows": rows,
        "pairs": int(a.size),
        "exact_pairs": n_exact,
        "largest_family": largest,
        "cpu_s": time.process_time() - cpu,
    }


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


class PhashMap(Step):
    """Each survivor file's hashes to the shuffle partitions of their groups."""

    name = "phash/map"
    unit_name = "survivor files"

    def __init__(self, output: Output, survivor_files: Sequence[str], plan: PairPlan, out_dir: str):
        self.output, self.files, self.plan, self.out_dir = output, list(survivor_files), plan, out_dir

    def fingerprint(self) -> dict:
        return {**self.plan.describe(), "inputs": self.files}

    def outputs(self) -> list[str]:
        return [self.out_dir]  # the shuffle and the pairs: the reduce step's fingerprint follows this one's

    def units(self) -> list[str]:
        return [f"file-{m:06d}" for m in range(len(self.files))]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        m = int(unit.removeprefix("file-"))
        partitions = list(range(self.plan.partitions))
        return _map_task.remote(self.output.uri, self.out_dir, self.files[m], m, self.plan, partitions)


class PhashReduce(Step):
    """Each partition's pairs, from its shuffle files."""

    name = "phash/reduce"
    unit_name = "partitions"

    def __init__(self, output: Output, n_maps: int, plan: PairPlan, out_dir: str, max_kernel_hashes: int):
        self.output, self.n_maps, self.plan, self.out_dir = output, n_maps, plan, out_dir
        self.max_kernel_hashes = max_kernel_hashes

    def units(self) -> list[str]:
        return [f"part-{p:05d}" for p in range(self.plan.partitions)]

    def run_unit(self, unit: str) -> ray.ObjectRef:
        p = int(unit.removeprefix("part-"))
        return _reduce_task.remote(self.output.uri, self.out_dir, p, self.n_maps, self.plan, self.max_kernel_hashes)

    def reduce(self, receipts: Sequence[dict]) -> dict:
        done = [r for r in receipts if not r["skipped"]]
        return {
            "partitions_computed": len(done),
            "exact_pairs_computed": sum(r["exact_pairs"] for r in done),
            "largest_partition_rows": max((r["rows"] for r in done), default=0),
            "largest_family_hashes": max((r["largest_family"] for r in done), default=0),
            "task_cpu_s": round(sum(r["cpu_s"] for r in done), 1),
        }


def run_phash_pairs(
    runner: StepRunner,
    survivor_files: Sequence[str],
    radius: int,
    out_dir: str = LAYOUT.phash_pairs,
    partitions: int | None = None,
    *,
    n_bands: int | None = None,
    rows_per_partition: int = ROWS_PER_PARTITION,
    max_kernel_hashes: int = MAX_KERNEL_HASHES,
) -> dict:
    """Write every pair of survivors within Hamming distance ``radius`` (exact) under ``out_dir`` (see module doc).

    ``survivor_files`` are paths relative to the output in the survivors schema (only ``uid`` and ``phash`` are
    read). ``partitions`` defaults to ``plan_pairs``'s choice from the survivors' row count. Returns a summary.
    """
    start = time.monotonic()
    out = runner.output
    n_rows = sum(parquet_rows(out.fs, [out.path(f) for f in survivor_files]))
    plan = plan_pairs(n_rows, radius, partitions, n_bands=n_bands, rows_per_partition=rows_per_partition)
    log.info(
        f"[phash pairs] {plural(n_rows, 'survivor')}, radius {radius}: {plural(len(plan.bands.bands), 'band')}, "
        f"{plural(len(plan.families), 'family', 'families')}, {plural(plan.partitions, 'partition')}"
    )
    mapped = runner.run(PhashMap(out, survivor_files, plan, out_dir))
    reduced = runner.run(PhashReduce(out, len(survivor_files), plan, out_dir, max_kernel_hashes))
    delete_quietly(out.fs, out.path(join(out_dir, SHUFFLE_DIR)))
    n_pairs = sum(parquet_rows(out.fs, [out.path(LAYOUT.pair_part(out_dir, p)) for p in range(plan.partitions)]))
    summary = {
        **plan.describe(),
        **reduced,
        "survivors": n_rows,
        "pairs": n_pairs,
        "shuffle_rows": mapped.get("rows", 0),
        "task_cpu_s": round(reduced["task_cpu_s"] + mapped.get("cpu_s", 0.0), 1),
        "seconds": round(time.monotonic() - start, 2),
    }
    log.info(f"[phash pairs] {plural(n_pairs, 'pair')} in {plural(plan.partitions, 'file')}, {summary['seconds']} s")
    return summary
