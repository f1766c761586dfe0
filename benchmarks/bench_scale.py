"""The global phases (dedup, sample, write) at pool scale: driver memory and time as the number of survivors grows.

    python benchmarks/bench_scale.py --sizes 200000,1000000
    python benchmarks/bench_scale.py --sizes 50000 --keep          # keep the synthetic outputs under --work

For each size N, a scored output of N phase-1 survivors is synthesised in the real schema (commit records, scored
and ledger parts per input shard of ``--rows-per-shard``; tiny placeholder image bytes, lite 384-d embeddings from a
mixture of Gaussians with planted near-duplicates by pHash and by embedding), with no scoring needed. The global
phases then run in a fresh process on a local Ray (``--cpus``), as ``jobs.curate --phases dedup,sample,write``
would run them, while a sampler thread records that driver's RSS and the bytes Ray's object store holds in
``/dev/shm``. Printed per size and phase: wall time, driver peak RSS, object-store peak, and the output's size at
rest per folder (placeholder image bytes: add the kept images' real bytes to size a real output); then the time
slope between sizes and one closing line to compare run to run:

    driver peak RSS 0.61 GiB at 200000, 0.63 GiB at 1000000; global phases 41 s, 170 s
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import schema  # noqa: E402
from common.config import load_config  # noqa: E402
from common.layout import GLOBAL_PHASES as PHASES  # noqa: E402
from common.layout import LAYOUT  # noqa: E402
from common.storage import join, resolve, write_json_atomic, write_parquet_atomic  # noqa: E402
from curation.config import CurateConfig  # noqa: E402

LITE = REPO / "configs/curate/lite.yaml"
GIB = 2**30


def config(extra: list[str]) -> CurateConfig:
    return load_config(CurateConfig, str(LITE), extra)


# --- synthesis --------------------------------------------------------------------------------------------------------


def _embeddings(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    """Points around ``centres`` (a long-tailed mixture: some concepts fill much of the pool), L2-normalised."""
    weights = rng.zipf(1.3, centres.shape[0]).astype(np.float64)
    which = rng.choice(centres.shape[0], n, p=weights / weights.sum())
    x = centres[which] + rng.normal(0, 0.35, (n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def synthesise(
    out: Path,
    n: int,
    rows_per_shard: int,
    cfg: CurateConfig,
    seed: int = 0,
    dup_rate: float = 0.02,
    processes: int | None = None,
) -> dict:
    """A committed phase-1 output of ``n`` survivors; returns how many duplicates of each kind were planted. Input
    shards are made in parallel processes, each from its own seed, so the output does not depend on how many."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (256, cfg.embedding_dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    n_shards = math.ceil(n / rows_per_shard)
    jobs = [
        (
            str(out),
            f"files-{s:06d}",
            min(rows_per_shard, n - s * rows_per_shard),
            cfg.model_dump_json(),
            centres,
            (seed, s),
            dup_rate,
        )
        for s in range(n_shards)
    ]
    with ProcessPoolExecutor(processes or os.cpu_count()) as pool:
        counts = list(pool.map(_synthesise_shard, jobs))
    fs, root = resolve(str(out))
    write_json_atomic(fs, join(root, LAYOUT.run_record), {"results_hash": cfg.results_hash(), "input": "synthetic"})
    write_json_atomic(fs, join(root, LAYOUT.done("score")), {"shards": n_shards, "settings_hash": cfg.results_hash()})
    return {"phash": sum(counts), "embedding": sum(counts)}


def _synthesise_shard(job: tuple) -> int:
    """One committed input shard of survivors; returns the copies planted of each kind."""
    out, shard_id, rows, cfg_json, centres, seed, dup_rate = job
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
    emb = _embeddings(rows, dim, rng, centres)
    phash = rng.integers(0, 2**63, rows, dtype=np.int64).astype(np.uint64) * np.uint64(2) + rng.integers(
        0, 2, rows, dtype=np.int64
    ).astype(np.uint64)
    # planted copies inside the shard: a pHash within radius 0..8, or an embedding at cosine ~0.97-0.99
    m = int(rows * dup_rate)
    dst = rng.choice(rows, 2 * m, replace=False)
    src = (dst + rng.integers(1, rows, dst.size)) % rows
    for d, o in zip(dst[:m], src[:m]):
        flips = rng.choice(64, rng.integers(0, 9), replace=False)
        phash[d] = phash[o] ^ np.uint64(sum(1 << int(b) for b in flips))
    noise = rng.normal(0, 0.012, (m, dim)).astype(np.float32)
    copies = emb[src[m:]] + noise
    emb[dst[m:]] = copies / np.linalg.norm(copies, axis=1, keepdims=True)
    keys = [os.urandom(32).hex() for _ in range(rows)]
    sources = [f"synthetic://pool/{shard_id}/{i:07d}.jpg" for i in range(rows)]
    columns = {
        "key": pa.array(keys, pa.string()),
        "source": pa.array(sources, pa.string()),
        "shard_id": pa.array([shard_id] * rows, pa.string()),
        "file_size": pa.array(np.full(rows, 16, np.int64)),
        "format": pa.array(["JPEG"] * rows, pa.string()),
        "mode": pa.array(["RGB"] * rows, pa.string()),
        "width": pa.array(rng.integers(384, 2048, rows).astype(np.int32)),
        "height": pa.array(rng.integers(384, 2048, rows).astype(np.int32)),
        "orientation": pa.array(np.ones(rows, np.int8)),
        "image": pa.array(
            [{"bytes": k[:16].encode(), "path": f"{i:07d}.jpg"} for i, k in enumerate(keys)], schema.IMAGE_TYPE
        ),
        "quality": pa.array(rng.random(rows).astype(np.float32)),
        "head_yaw_class": pa.array(rng.choice(list(schema.HEAD_YAW_CLASSES), rows).tolist(), pa.string()),
        "phash": pa.array(phash, pa.uint64()),
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
    write_parquet_atomic(fs, join(root, scored_file), scored, row_group_size=cfg.output.row_group_size)
    write_parquet_atomic(fs, join(root, ledger_file), ledger, row_group_size=cfg.output.ledger_row_group_size)
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
    return m


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


def folder_sizes(out: Path) -> dict[str, int]:
    """Bytes under each top-level entry of an output, largest first: what it keeps at rest after the run."""
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
             for p in out.iterdir()}  # fmt: skip
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="200000,1000000", help="comma-separated numbers of survivors")
    p.add_argument("--rows-per-shard", type=int, default=10_000, help="survivors per input shard")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the synthetic outputs (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic outputs")
    p.add_argument("--run-phases", default=None, help=argparse.SUPPRESS)  # internal: measure one output
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. dedup.signals=[phash]")
    args = p.parse_args()
    if args.run_phases:
        print(json.dumps(run_phases(args.run_phases, args.cpus, args.overrides), default=str))
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scale-"))
    cfg = config(args.overrides)
    print(
        f"global phases on synthetic scored outputs; lite profile, {cfg.embedding_dim}-d embeddings, "
        f"{args.cpus} CPUs for Ray, {os.cpu_count()} on the machine; overrides {args.overrides or 'none'}"
    )
    results = {}
    for n in sizes:
        out = work / f"n{n}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.monotonic()
        planted = synthesise(out, n, args.rows_per_shard, cfg)
        print(
            f"\nN = {n:,}: synthesised in {time.monotonic() - start:.0f} s "
            f"({planted['phash']:,} pHash and {planted['embedding']:,} embedding copies planted)"
        )
        cmd = [sys.executable, __file__, "--run-phases", str(out), "--cpus", str(args.cpus), *args.overrides]
        done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"  the global phases failed at N = {n} (exit {done.returncode})")
            return 1
        report = json.loads(done.stdout.strip().splitlines()[-1])
        results[n] = report
        for phase in PHASES:
            r = report[phase]
            print(
                f"  {phase:<7} {r['seconds']:8.1f} s   driver peak RSS {r['rss'] / GIB:6.2f} GiB   "
                f"object store peak {r['shm'] / GIB:6.2f} GiB"
            )
        sizes_at_rest = folder_sizes(out)
        print(
            f"  output at rest {sum(sizes_at_rest.values()) / GIB:.2f} GiB ("
            + ", ".join(f"{name} {size / GIB:.3f}" for name, size in sizes_at_rest.items())
            + f"); {report['write']['record']['rows']:,} images in the shards"
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    totals = {n: sum(results[n][p]["seconds"] for p in PHASES) for n in sizes}
    peaks = {n: max(results[n][p]["rss"] for p in PHASES) for n in sizes}
    for a, b in itertools.pairwise(sizes):
        slope = math.log(totals[b] / totals[a]) / math.log(b / a)
        print(f"time slope {a:,} -> {b:,}: N^{slope:.2f} (N log N would be ~N^1.0x)")
    print(
        "driver peak RSS "
        + ", ".join(f"{peaks[n] / GIB:.2f} GiB at {n}" for n in sizes)
        + "; global phases "
        + ", ".join(f"{totals[n]:.0f} s" for n in sizes)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
