"""The global phases (dedup, sample, write) at pool scale: driver memory, time, and what dedup drops, as N grows.

    python benchmarks/bench_scale.py --sizes 200000,1000000
    python benchmarks/bench_scale.py --sizes 200000 --phash-bits 48 --previous-rule   # chance links at 10^9 density
    python benchmarks/bench_scale.py --sizes 1000000 --baseline /tmp/before --pairs 3   # beside another commit

For each size N, a scored output of N phase-1 survivors is synthesised in the real schema (commit records, scored
and ledger parts per input shard of ``--rows-per-shard``; small real JPEGs keyed by their sha256, lite 384-d
embeddings and pHashes as the section "synthesis" below describes, with planted copies of real copies' kinds),
with no scoring needed. The global phases then run in a fresh process on a local Ray (``--cpus``), as ``jobs.curate
--phases dedup,sample,write`` would run them, on a hard-linked copy of that output, while a sampler thread records
that driver's RSS and the bytes Ray's object store holds in ``/dev/shm``, and after it the output's size at rest per
folder. ``--baseline`` runs another checkout's
global phases on the same inputs (their image bytes in the scored parts, as phase 1 wrote them before
``scored_images/``), alternating ``--pairs`` times; ``--previous-rule`` this tree's with the link rule
of before (pHash within 8 bits or cosine >= 0.95). Printed per run and phase: wall time, driver peak RSS,
object-store peak; the survivors dedup dropped as copies of an image outside their planted group (chance links)
and the planted copies found with their original, per kind; then the time slope between sizes and one closing
line to compare run to run:

    this: driver peak RSS 0.61 GiB at 200000, 0.63 GiB at 1000000; global phases (fastest run) 41 s, 170 s
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import schema  # noqa: E402
from common.config import load_config  # noqa: E402
from common.layout import GLOBAL_PHASES as PHASES  # noqa: E402
from common.layout import LAYOUT  # noqa: E402
from common.storage import join, resolve, write_json_atomic, write_parquet_atomic  # noqa: E402
from curation.config import CurateConfig  # noqa: E402
from curation.score.chain import split_images  # noqa: E402
from curation.stages.phash import CROP_COUNT, PhashStage  # noqa: E402

LITE = REPO / "configs/curate/lite.yaml"
GIB = 2**30


def config(extra: list[str]) -> CurateConfig:
    return load_config(CurateConfig, str(LITE), extra)


# --- synthesis --------------------------------------------------------------------------------------------------------
# Unrelated survivors: embeddings from a two-level mixture (concepts, and sub-concepts inside them) whose items are
# spread by a noise of per-item scale, so that the cosines of unrelated survivors sharing a k-means cluster spread as
# real photos' do (``MIXTURE`` was chosen by ``--calibrate`` against the quantiles in ``CALIBRATION``, measured by
# ``benchmarks/dedup_truth.py`` on real photos: not near-orthogonal, with a tail above 0.9). pHashes random over
# ``--phash-bits`` bits spread over the 64, half of them set as imagehash's pHash sets 32 of 64 (so distances are
# even; 48 bits at 200k survivors: 0.73 chance neighbours within 8 bits per survivor, as in a 10^9 pool of balanced
# 64-bit hashes, 0.72). PDQs random over their 256 bits, 32 of each 64 set (unrelated PDQs 128 +- 8 bits apart, as
# real photos' are: 127.9 +- 8.5; their chance at 10^9 is the estimator's, from the real photos' spread: it cannot be
# emulated at 200k by fewer bits, as the copies' distances are on 256); each sub-crop's PDQ is its own with 20-80 bits
# flipped (a window of 90-95% of each side hashes near the whole). Planted copies: each copy takes the (pHash
# distance, cosine, PDQ crop distance, PDQ distance) of a real copy of its kind, drawn from ``CALIBRATION``
# (re-encodes and resizes close on every signal, crops close on the embedding and the crop distance only, ...): its
# PDQs move from the original's by one mask (its sub-crops with its whole), and where its crop distance is the
# smaller, one window of the original is set that close to the copy's PDQ. Image bytes are small real JPEGs, keyed by their sha256; a resized copy has fewer pixels than its
# original.

CALIBRATION = REPO / "benchmarks/dedup_calibration.json"
CONCEPTS, SUB_CONCEPTS = 256, 16
# noise scales in units of sqrt(D): log-uniform over [noise_lo, noise_hi], and for a share ``tight`` of the items
# (near-identical studio shots, stock series) over [TIGHT_NOISE, noise_lo]
MIXTURE = {"concept": 1.0, "sub_concept": 0.5, "noise_lo": 0.3, "noise_hi": 1.2, "tight": 0.05}
TIGHT_NOISE = 0.05


def _mixture_centres(dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    concepts = rng.normal(0, 1, (CONCEPTS, dim)).astype(np.float32)
    concepts /= np.linalg.norm(concepts, axis=1, keepdims=True)
    subs = rng.normal(0, 1, (CONCEPTS, SUB_CONCEPTS, dim)).astype(np.float32)
    subs /= np.linalg.norm(subs, axis=2, keepdims=True)
    return concepts, subs


def _embeddings(n: int, rng: np.random.Generator, centres: tuple[np.ndarray, np.ndarray], mix: dict) -> np.ndarray:
    """Unrelated survivors from the two-level mixture (a long tail of concepts: some fill much of the pool)."""
    concepts, subs = centres
    dim = concepts.shape[1]
    weights = rng.zipf(1.3, CONCEPTS).astype(np.float64)
    which = rng.choice(CONCEPTS, n, p=weights / weights.sum())
    sub = rng.integers(0, SUB_CONCEPTS, n)
    tight = rng.random(n) < mix["tight"]
    lo = np.where(tight, TIGHT_NOISE, mix["noise_lo"])
    hi = np.where(tight, mix["noise_lo"], mix["noise_hi"])
    scale = np.exp(rng.uniform(np.log(lo), np.log(hi))).astype(np.float32)
    noise = rng.normal(0, 1, (n, dim)).astype(np.float32) * (scale / np.sqrt(dim))[:, None]
    x = mix["concept"] * concepts[which] + mix["sub_concept"] * subs[which, sub] + noise
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _at_cosine(e: np.ndarray, cosine: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors at exactly ``cosine`` from the unit rows of ``e``, in random directions."""
    u = rng.normal(0, 1, e.shape).astype(np.float32)
    u -= (u * e).sum(axis=1, keepdims=True) * e
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    c = cosine.astype(np.float32)[:, None]
    return c * e + np.sqrt(np.maximum(1 - c * c, 0)) * u


def _varying_bits(bits: int) -> np.ndarray:
    """The positions of a hash's ``bits`` random bits: spread over all 64, so that every band of the pHash search
    holds its share of them (fixed bits gathered in one band would put every hash in one bucket of it)."""
    fixed = np.linspace(0, 63, 64 - bits).round().astype(int) if bits < 64 else np.empty(0, int)
    return np.setdiff1d(np.arange(64), fixed)


def _random_hashes(n: int, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Hashes with half of their ``bits`` random bits set, as imagehash's pHash sets 32 of 64 (distances are even)."""
    varying = _varying_bits(bits)
    ones = rng.random((n, varying.size)).argsort(axis=1).argsort(axis=1) < varying.size // 2
    values = np.uint64(1) << varying.astype(np.uint64)
    return np.bitwise_or.reduce(np.where(ones, values, np.uint64(0)), axis=1)


def _flip(hashes: np.ndarray, distance: np.ndarray, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Each hash (any shape) with ``distance`` (one per hash) of its ``bits`` random bits flipped, half of them set
    and half unset, so that a balanced hash stays balanced (an odd distance is taken one lower)."""
    varying = _varying_bits(bits)
    shape, half = hashes.shape, np.minimum(np.asarray(distance, np.int64).ravel(), varying.size) // 2
    values = np.uint64(1) << varying.astype(np.uint64)
    is_set = (hashes.reshape(-1, 1) & values) != 0
    key = rng.random(is_set.shape)
    rank_set = np.where(is_set, key, 2.0).argsort(axis=1).argsort(axis=1)  # set bits first, in a random order
    rank_unset = np.where(is_set, 2.0, key).argsort(axis=1).argsort(axis=1)
    chosen = (is_set & (rank_set < half[:, None])) | (~is_set & (rank_unset < half[:, None]))
    masks = np.bitwise_or.reduce(np.where(chosen, values, np.uint64(0)), axis=1)
    return hashes ^ masks.reshape(shape)


def _pdq_flip(words: np.ndarray, distance: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each PDQ (``words``: (..., 4) uint64, 32 of each word's bits set) with ``distance`` (one per PDQ, even) of its
    bits flipped, spread over its words at random, each word staying balanced."""
    half = np.asarray(distance, np.int64).ravel() // 2
    per_word = 2 * rng.multinomial(half, [0.25] * 4)  # (PDQs, 4), each even
    flat = words.reshape(-1, 4)
    return _flip(flat, per_word, 64, rng).reshape(words.shape)


def _jpeg(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A small real JPEG: a smooth colour field with noise."""
    import io

    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    a, b, c = rng.uniform(0, 255, 3), rng.uniform(-2, 2, 3), rng.uniform(-2, 2, 3)
    rgb = a + b * x[..., None] + c * y[..., None] + rng.normal(0, 12, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=int(rng.integers(70, 95)))
    return buf.getvalue()


def _images(width: np.ndarray, height: np.ndarray, shard: int, rng: np.random.Generator) -> list[bytes]:
    """One JPEG per survivor, each of its size: encoded once per size in the shard, made unique by the survivor's
    index after the end-of-image marker (decoders stop there; the bytes, and so the keys, differ)."""
    base = {size: _jpeg(rng, *size) for size in set(zip(width.tolist(), height.tolist()))}
    return [base[(w, h)] + f"{shard}:{i}".encode() for i, (w, h) in enumerate(zip(width.tolist(), height.tolist()))]


def within_cluster_cosines(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Cosines of the pairs that share a k-means cluster of ``default_cluster_size`` (as dedup's search cuts them)."""
    from curation.phases.dedup.embedding_clusters import default_cluster_size, kmeans, nearest

    n = len(x)
    home = nearest(x, kmeans(x, max(1, n // default_cluster_size(n)), seed))
    out = []
    for members in np.split(np.argsort(home, kind="stable"), np.flatnonzero(np.diff(np.sort(home))) + 1):
        i, j = np.triu_indices(members.size, 1)
        out.append(np.einsum("ij,ij->i", x[members[i]], x[members[j]]))
    return np.concatenate(out)


def calibrate(dim: int, target: list[float], n: int = 20_000, seed: int = 0) -> dict:
    """The mixture (a grid over its sub-concept weight, noise range and tight share) whose within-cluster cosines come nearest to
    the ``target`` quantiles (0, 1, ..., 100 %), weighting the upper tail as much as the bulk."""
    rng = np.random.default_rng(seed)
    centres = _mixture_centres(dim, rng)
    want = np.asarray(target)
    levels = np.asarray([50, 75, 90, 95, 99, 99.5, 99.9])
    best: tuple[float, dict] = (math.inf, MIXTURE)
    for sub, hi, tight in itertools.product((0.5, 0.7), (1.2, 1.5, 2.0), (0.02, 0.05, 0.1)):
        mix = {"concept": 1.0, "sub_concept": sub, "noise_lo": 0.3, "noise_hi": hi, "tight": tight}
        got = np.percentile(within_cluster_cosines(_embeddings(n, rng, centres, mix), seed), levels)
        aim = np.interp(levels, np.linspace(0, 100, len(want)), want)
        err = float(np.abs(np.log1p(-np.minimum(got, 0.9999)) - np.log1p(-np.minimum(aim, 0.9999))).sum())
        print(f"  {mix}: {np.round(got, 3).tolist()} (want {np.round(aim, 3).tolist()}) error {err:.3f}")
        if err < best[0]:
            best = (err, mix)
    return best[1]


def load_calibration(path: Path = CALIBRATION) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def synthesise(
    out: Path,
    n: int,
    rows_per_shard: int,
    cfg: CurateConfig,
    seed: int = 0,
    dup_rate: float = 0.02,
    processes: int | None = None,
    phash_bits: int = 64,
    mix: dict | None = None,
) -> dict:
    """A committed phase-1 output of ``n`` survivors, and beside it ``_bench_truth/<shard>.parquet`` (each survivor's
    key, planted group and copy kind); returns the copies planted of each kind. Input shards are made in parallel
    processes, each from its own seed, so the output does not depend on how many."""
    rng = np.random.default_rng(seed)
    centres = _mixture_centres(cfg.embedding_dim, rng)
    copies = load_calibration()["copies_crop"]
    n_shards = math.ceil(n / rows_per_shard)
    jobs = [
        (str(out), f"files-{s:06d}", min(rows_per_shard, n - s * rows_per_shard), cfg.model_dump_json(), centres,
         (seed, s), dup_rate, phash_bits, copies, mix or MIXTURE)
        for s in range(n_shards)
    ]  # fmt: skip
    with ProcessPoolExecutor(processes or os.cpu_count()) as pool:
        counts = list(pool.map(_synthesise_shard, jobs))
    fs, root = resolve(str(out))
    write_json_atomic(fs, join(root, LAYOUT.run_record), {"results_hash": cfg.results_hash(), "input": "synthetic"})
    write_json_atomic(fs, join(root, LAYOUT.done("score")), {"shards": n_shards, "settings_hash": cfg.results_hash()})
    planted: dict[str, int] = {}
    for c in counts:
        for kind, k in c.items():
            planted[kind] = planted.get(kind, 0) + k
    return planted


def _synthesise_shard(job: tuple) -> dict[str, int]:
    """One committed input shard of survivors; returns the copies planted of each kind."""
    out, shard_id, rows, cfg_json, centres, seed, dup_rate, phash_bits, calibration, mix = job
    cfg = CurateConfig.model_validate_json(cfg_json)
    rng = np.random.default_rng(seed)
    dim = cfg.embedding_dim
    fs, root = resolve(out)
    scored_schema = schema.with_metadata(
        schema.scored_schema(dim),
        table="scored",
        config_hash=cfg.results_hash(),
        extra={"embedding_model": cfg.models.embedding.name, "embedding_dim": dim},
    )
    ledger_schema = schema.with_metadata(schema.ledger_schema(), table="ledger", config_hash=cfg.results_hash())
    emb = _embeddings(rows, rng, centres, mix)
    phash = _random_hashes(rows, phash_bits, rng)
    pdq = _random_hashes(rows * 4, 64, rng).reshape(rows, 4)
    crops = _pdq_flip(np.repeat(pdq[:, None], CROP_COUNT, axis=1), 2 * rng.integers(10, 41, (rows, CROP_COUNT)), rng)
    width = rng.integers(64, 97, rows)
    height = rng.integers(48, 97, rows)
    group = np.full(rows, -1, np.int64)
    kind = np.full(rows, "", object)
    # planted copies inside the shard: copy dst[k] of original src[k], at a real copy's distances of its kind
    m = int(rows * dup_rate)
    dst = rng.choice(rows, m, replace=False)
    pool = np.setdiff1d(np.arange(rows), dst)
    src = pool[rng.integers(0, pool.size, m)]
    kinds = sorted(calibration)
    kind[dst] = np.asarray(kinds, object)[rng.integers(0, len(kinds), m)]
    measured = {k: np.asarray(calibration[k], np.float64) for k in kinds}
    dc = np.asarray([measured[k][rng.integers(0, len(measured[k]))] for k in kind[dst]]).reshape(m, 4)
    phash[dst] = _flip(phash[src], dc[:, 0].astype(np.int64), phash_bits, rng)
    pdq[dst] = _pdq_flip(pdq[src], dc[:, 3].astype(np.int64), rng)
    crops[dst] = crops[src] ^ (pdq[dst] ^ pdq[src])[:, None]  # the copy's windows move with its whole
    closer = dc[:, 2] < dc[:, 3]  # a window of the original frames the copy better than the whole does
    window = rng.integers(0, CROP_COUNT, m)
    crops[src[closer], window[closer]] = _pdq_flip(pdq[dst[closer]], dc[closer, 2].astype(np.int64), rng)
    emb[dst] = _at_cosine(emb[src], np.minimum(dc[:, 1], 1.0), rng)
    resized = kind[dst] == "resize"
    width[dst], height[dst] = width[src], height[src]
    width[dst[resized]], height[dst[resized]] = width[src[resized]] * 2 // 3, height[src[resized]] * 2 // 3
    group[src] = src + (int(seed[1]) << 32)  # the original's row, unique over shards
    group[dst] = group[src]
    images = _images(width, height, int(seed[1]), rng)
    keys = [hashlib.sha256(b).hexdigest() for b in images]
    sources = [f"synthetic://pool/{shard_id}/{i:07d}.jpg" for i in range(rows)]
    columns = {
        "key": pa.array(keys, pa.string()),
        "source": pa.array(sources, pa.string()),
        "shard_id": pa.array([shard_id] * rows, pa.string()),
        "file_size": pa.array([len(b) for b in images], pa.int64()),
        "format": pa.array(["JPEG"] * rows, pa.string()),
        "mode": pa.array(["RGB"] * rows, pa.string()),
        "width": pa.array(width.astype(np.int32)),
        "height": pa.array(height.astype(np.int32)),
        "orientation": pa.array(np.ones(rows, np.int8)),
        "image": pa.array([{"bytes": b, "path": f"{i:07d}.jpg"} for i, b in enumerate(images)], schema.IMAGE_TYPE),
        "quality": pa.array(rng.random(rows).astype(np.float32)),
        "head_yaw_class": pa.array(rng.choice(list(schema.HEAD_YAW_CLASSES), rows).tolist(), pa.string()),
        "phash": pa.array(phash, pa.uint64()),
        "pdq": pa.array([r.tobytes() for r in pdq], PhashStage.columns[1].type),
        "pdq_crops": pa.array([r.tobytes() for r in crops], PhashStage.columns[2].type),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
    }
    scored = pa.table({f.name: columns.get(f.name, pa.nulls(rows, f.type)) for f in scored_schema}, scored_schema)
    ledger_cols = {
        **columns,
        "status": pa.array([schema.KEPT] * rows, pa.string()),
        "stage": pa.array(["embedding"] * rows, pa.string()),
    }
    ledger = pa.table({f.name: ledger_cols.get(f.name, pa.nulls(rows, f.type)) for f in ledger_schema}, ledger_schema)
    part = f"{shard_id}/part-0000000000000000.parquet"
    scored_file, ledger_file = f"{LAYOUT.scored}/{part}", f"{LAYOUT.ledger}/{part}"
    for path, table in zip((scored_file, LAYOUT.images_of(scored_file)), split_images(scored), strict=True):
        write_parquet_atomic(fs, join(root, path), table, row_group_size=cfg.output.row_group_size)
    write_parquet_atomic(fs, join(root, ledger_file), ledger, row_group_size=cfg.output.ledger_row_group_size)
    truth = pa.table({"key": keys, "group": group, "kind": kind.astype(str)})
    write_parquet_atomic(fs, join(root, TRUTH_DIR, f"{shard_id}.parquet"), truth, row_group_size=1 << 20)
    write_json_atomic(
        fs,
        join(root, LAYOUT.score_commit(shard_id)),
        {
            "fingerprint": "synthetic",  # no score step ran; only the global phases read these
            "receipt": {
                "shard_id": shard_id,
                "rows": rows,
                "kept": rows,
                "ledger_files": [ledger_file],
                "scored_files": [scored_file],
                "results_hash": cfg.results_hash(),
            },
        },
    )
    return {k: int((kind[dst] == k).sum()) for k in kinds}


TRUTH_DIR = "_bench_truth"


def dedup_truth(out: str) -> dict:
    """The dedup decisions against the planted truth: survivors dropped as copies of an image outside their group
    (a chance link), and planted copies in one group with their original, per kind."""
    import pyarrow.parquet as pq

    truth = pq.read_table(Path(out) / TRUTH_DIR).to_pandas()
    decisions = pq.read_table(Path(out) / LAYOUT.dedup_decisions).to_pandas()
    group = dict(zip(truth["key"], truth["group"]))
    kept_of = dict(zip(decisions["key"], decisions["duplicate_of"]))  # a dropped key -> its component's kept key
    wrong = sum(1 for k, of in kept_of.items() if group[k] < 0 or group[k] != group[of])
    component = truth["key"].map(lambda k: kept_of.get(k, k))
    originals = truth[(truth["group"] >= 0) & (truth["kind"] == "")]
    comp_of_group = dict(zip(originals["group"], component[originals.index]))
    copies = truth[truth["kind"] != ""]
    found = component[copies.index].to_numpy() == copies["group"].map(comp_of_group).to_numpy()
    by_kind = {k: round(float(found[(copies["kind"] == k).to_numpy()].mean()), 4) for k in sorted(set(copies["kind"]))}
    # the pairs each search listed between survivors of different planted groups: the chance links, counted
    survivors = pq.read_table(Path(out) / LAYOUT.survivors, columns=["uid", "key"]).to_pandas()
    group_of_uid = dict(zip(survivors["uid"], survivors["key"].map(group)))
    chance_pairs = {}
    for signal, folder in (("phash", LAYOUT.phash_pairs), ("embedding", LAYOUT.embedding_pairs)):
        files = sorted((Path(out) / folder).glob("part-*.parquet"))
        if files:
            pairs = pq.read_table(files, columns=["a", "b"]).to_pandas()
            ga, gb = pairs["a"].map(group_of_uid), pairs["b"].map(group_of_uid)
            chance_pairs[signal] = int(((ga < 0) | (gb < 0) | (ga != gb)).sum())
    return {
        "chance_pairs": chance_pairs,
        "survivors": len(truth),
        "dropped": len(kept_of),
        "dropped_by_chance": wrong,
        "chance_fraction": wrong / len(truth),
        "copies": len(copies),
        "copies_found": round(float(found.mean()), 4),
        "found_by_kind": by_kind,
    }


# --- measuring one run of the global phases (in its own process) ------------------------------------------------------


def _shm_used() -> int:
    usage = shutil.disk_usage("/dev/shm")
    return usage.used


class Sampler(threading.Thread):
    """Peak RSS of this process and peak bytes in /dev/shm (Ray's object store) since the last ``take``."""

    def __init__(self, every_s: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.every_s = psutil.Process(), every_s
        self.rss = self.shm = 0
        self.shm_base = _shm_used()
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            rss, shm = self.proc.memory_info().rss, _shm_used() - self.shm_base
            with self.lock:
                self.rss, self.shm = max(self.rss, rss), max(self.shm, shm)
            time.sleep(self.every_s)

    def take(self) -> tuple[int, int]:
        with self.lock:
            peaks = (self.rss, self.shm)
            self.rss = self.shm = 0
        return peaks


def run_phases(out: str, cpus: int, overrides: list[str]) -> dict:
    import ray

    from curation.phases.pipeline import GlobalPhases
    from curation.steps.output import Output

    cfg = config(overrides)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level="ERROR")
    lines = logging.StreamHandler(sys.stderr)  # the phases' progress; stdout carries the report
    lines.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("curation").addHandler(lines)
    logging.getLogger("curation").setLevel(logging.INFO)
    sampler = Sampler()
    sampler.start()
    report = {}
    for phase in PHASES:
        sampler.take()
        start = time.monotonic()
        record = GlobalPhases(cfg, Output.at(str(out))).run(phase)
        seconds = time.monotonic() - start
        rss, shm = sampler.take()
        report[phase] = {"seconds": seconds, "rss": rss, "shm": shm, "record": record}
    ray.shutdown()
    return report


# --- the benchmark ----------------------------------------------------------------------------------------------------

PREVIOUS_RULE = ["dedup.links=[{radius: 8}, {radius: 64, min_cosine: 0.95}]", "dedup.fit_radii=false",
                 "dedup.allow_chance=true"]  # fmt: skip


def inline_images(out: Path, to: Path) -> Path:
    """A copy of the synthetic output ``out`` (hard links) whose scored parts hold their image bytes themselves, as
    phase 1 wrote them before the image files (``scored_images/``): what a ``--baseline`` of that time reads."""
    if not to.exists():
        shutil.copytree(out, to, copy_function=os.link, ignore=shutil.ignore_patterns(LAYOUT.scored_images))
        fs, root = resolve(str(to))
        for images in sorted((out / LAYOUT.scored_images).rglob("*.parquet")):
            scored_file = f"{LAYOUT.scored}/{images.relative_to(out / LAYOUT.scored_images)}"
            scored = pq.read_table(out / scored_file)
            at = scored.schema.get_field_index("image")
            scored = scored.set_column(at, scored.schema.field(at), pq.read_table(images).column("image"))
            (to / scored_file).unlink()  # a link to the input's file: replaced, not written through
            write_parquet_atomic(fs, join(root, scored_file), scored, row_group_size=100)
    return to


def _measure(repo: Path, synthesised: Path, run_dir: Path, cpus: int, overrides: list[str]) -> dict:
    """The global phases of ``repo``'s checkout on a hard-linked copy of ``synthesised`` (the phases write new files
    and never change an input in place), with the dedup truth; the copy is removed after."""
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(synthesised, run_dir, copy_function=os.link)
    try:
        cmd = [sys.executable, str(repo / "benchmarks/bench_scale.py"), "--run-phases", str(run_dir), "--cpus",
               str(cpus), *overrides]  # fmt: skip
        done = subprocess.run(cmd, cwd=repo, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the global phases of {repo} failed (exit {done.returncode})")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        report["truth"] = dedup_truth(str(run_dir))
        report["at_rest"] = folder_sizes(run_dir)
        report["steps"] = step_seconds(run_dir)
        return report
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _print_run(label: str, report: dict) -> None:
    for phase in PHASES:
        r = report[phase]
        print(
            f"  {label:<10} {phase:<7} {r['seconds']:8.1f} s   driver peak RSS {r['rss'] / GIB:6.2f} GiB   "
            f"object store peak {r['shm'] / GIB:6.2f} GiB"
        )
        steps = report["steps"].get(phase, {})
        print(f"  {label:<10}   steps: " + ", ".join(f"{name} {sec:.1f} s" for name, sec in steps.items()))
    t = report["truth"]
    chance = report["dedup"]["record"].get("chance")
    print(
        f"  {label:<10} dedup: {t['dropped']:,} dropped, {t['dropped_by_chance']:,} of them copies of an unrelated "
        f"image ({t['chance_fraction']:.3%} of survivors); planted copies found {t['copies_found']:.2%} ("
        + ", ".join(f"{kind} {share:.2%}" for kind, share in t["found_by_kind"].items())
        + ")"
    )
    if chance:
        print(f"  {label:<10} rule {chance['rule']}: {chance['expected_chance_links']:.3g} chance links expected")
        for r in chance["regions"]:
            print(f"  {label:<10}   {r['region']} at radius {r['radius']}: {r['expected_chance_links']:.3g} expected")
    counted = ", ".join(f"{signal} {n:,}" for signal, n in t["chance_pairs"].items()) or "no pair files"
    print(f"  {label:<10} chance pairs counted in the pair files: {counted}")
    at_rest = report["at_rest"]
    print(
        f"  {label:<10} output at rest {sum(at_rest.values()) / GIB:.2f} GiB ("
        + ", ".join(f"{name} {size / GIB:.3f}" for name, size in at_rest.items())
        + f"); {report['write']['record']['rows']:,} images in the shards"
    )


def step_seconds(out: Path) -> dict[str, dict[str, float]]:
    """Each phase's steps and their seconds, from the step runner's done records."""
    steps: dict[str, dict[str, float]] = {}
    for done in sorted(out.glob("_state/steps/*/*.done.json"), key=lambda p: p.stat().st_mtime):
        steps.setdefault(done.parent.name, {})[done.name.removesuffix(".done.json")] = json.loads(done.read_text())[
            "seconds"
        ]
    return steps


def folder_sizes(out: Path) -> dict[str, int]:
    """Bytes under each top-level entry of an output, largest first: what it keeps at rest after the run."""
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
             for p in out.iterdir() if not p.name.startswith("_bench")}  # fmt: skip
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="200000,1000000", help="comma-separated numbers of survivors")
    p.add_argument("--rows-per-shard", type=int, default=10_000, help="survivors per input shard")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--phash-bits", type=int, default=64, help="random pHash bits of unrelated survivors (48 at 200k: "
                   "the chance density of a 10^9 pool)")  # fmt: skip
    p.add_argument("--dup-rate", type=float, default=0.02, help="planted copies per survivor")
    p.add_argument("--previous-rule", action="store_true", help="also run the previous link rule (pHash <= 8 or "
                   "cosine >= 0.95) on the same inputs")  # fmt: skip
    p.add_argument("--baseline", help="a checkout of another commit whose global phases run on the same inputs")
    p.add_argument("--pairs", type=int, default=1, help="alternating runs of this tree and --baseline")
    p.add_argument("--work", default=None, help="folder for the synthetic outputs (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic outputs")
    p.add_argument("--input", help="a synthetic output an earlier run kept (--keep): the runs use it, nothing is "
                   "synthesised (--sizes: its one size)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true", help="choose MIXTURE against the real photos' within-cluster "
                   "cosines (benchmarks/dedup_calibration.json) and print it")  # fmt: skip
    p.add_argument("--run-phases", default=None, help=argparse.SUPPRESS)  # internal: measure one output
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. dedup.links=[]")
    args = p.parse_args()
    if args.run_phases:
        print(json.dumps(run_phases(args.run_phases, args.cpus, args.overrides), default=str))
        return 0

    cfg = config(args.overrides)
    if args.calibrate:
        target = load_calibration()["within_cluster_cosine_quantiles"]
        print(f"MIXTURE = {calibrate(cfg.embedding_dim, target)}")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.input and len(sizes) != 1:
        p.error("--input is one output of one size: give that size in --sizes")
    work = Path(args.work or (Path(args.input).parent if args.input else tempfile.mkdtemp(prefix="bench-scale-")))
    print(
        f"global phases on synthetic scored outputs; lite profile, {cfg.embedding_dim}-d embeddings, "
        f"{args.phash_bits} random pHash bits, {args.cpus} CPUs for Ray, {os.cpu_count()} on the machine; "
        f"overrides {args.overrides or 'none'}"
    )
    runs = [("this", REPO, args.overrides)]
    if args.baseline:
        runs.append(("baseline", Path(args.baseline).resolve(), []))  # on the inline_images copy of each input
    results: dict[int, dict] = {}
    for n in sizes:
        if args.input:
            out = Path(args.input)
            print(f"\nN = {n:,}: the output kept in {out}")
        else:
            out = work / f"n{n}"
            for stale in (out, work / f"n{n}-inline"):
                shutil.rmtree(stale, ignore_errors=True)
            start = time.monotonic()
            planted = synthesise(out, n, args.rows_per_shard, cfg, dup_rate=args.dup_rate, phash_bits=args.phash_bits)
            print(f"\nN = {n:,}: synthesised in {time.monotonic() - start:.0f} s; copies planted {planted}")
        inputs = {"this": out}
        if args.baseline and (out / LAYOUT.scored_images).exists():
            inputs["baseline"] = inline_images(out, work / f"n{n}-inline")
        elif args.baseline:
            inputs["baseline"] = out
        for k in range(args.pairs):
            for label, repo, overrides in runs:
                report = _measure(repo, inputs[label], work / f"n{n}-{label}", args.cpus, overrides)
                results.setdefault(n, {}).setdefault(label, []).append(report)
                _print_run(f"{label}#{k + 1}", report)
        if args.previous_rule:
            report = _measure(REPO, out, work / f"n{n}-previous", args.cpus, [*args.overrides, *PREVIOUS_RULE])
            _print_run("previous", report)
        if not (args.keep or args.input):
            for done in (out, work / f"n{n}-inline"):
                shutil.rmtree(done, ignore_errors=True)
    for label, _, _ in runs:
        totals = {n: min(sum(r[p]["seconds"] for p in PHASES) for r in results[n][label]) for n in sizes}
        peaks = {n: max(max(r[p]["rss"] for p in PHASES) for r in results[n][label]) for n in sizes}
        for a, b in itertools.pairwise(sizes):
            slope = math.log(totals[b] / totals[a]) / math.log(b / a)
            print(f"{label}: time slope {a:,} -> {b:,}: N^{slope:.2f} (N log N would be ~N^1.0x)")
        print(
            f"{label}: driver peak RSS "
            + ", ".join(f"{peaks[n] / GIB:.2f} GiB at {n}" for n in sizes)
            + "; global phases (fastest run) "
            + ", ".join(f"{totals[n]:.0f} s" for n in sizes)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
