"""The nsfw stage on real photos of people: what it rejects, what it costs, and the lite profile's time per pool input
with and without it, side by side.

    python benchmarks/bench_nsfw.py                  # package photos + Debian's opencv-doc and darknet photos
    python benchmarks/bench_nsfw.py --no-debian --pairs 1

1. Scores: every photo ``benchmarks/dedup_truth.py`` reads (the package photos and, unless ``--no-debian``, the
   pictures of Debian's ``opencv-doc`` and ``darknet``), batched as the stage runs them: the share above
   ``filters.nsfw_max_score``, the score quantiles, and the stage's CPU seconds per image (process time, one thread).
2. The README's curate command on the sample pool (``jobs.make_sample_pool``), with the stage and with
   ``stages.nsfw.enabled=false``, alternating ``--pairs`` times, each in a fresh process and output: wall time per pool
   input, the inputs that reached the stage, and the kept count of each (it must not change).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common.config import load_config  # noqa: E402
from curation.config import CurateConfig  # noqa: E402
from curation.stages.nsfw import NsfwStage  # noqa: E402

LITE = REPO / "configs/curate/lite.yaml"


def score_photos(named: list[tuple[str, bytes]], batch: int) -> dict:
    cfg = load_config(CurateConfig, str(LITE), ["stages.nsfw.num_cpus=1"])
    stage = NsfwStage(cfg)
    stage.setup()
    scores, cpu = [], 0.0
    for at in range(0, len(named), batch):
        rows = [{"image": {"bytes": data, "path": name}} for name, data in named[at : at + batch]]
        start = time.process_time()
        scores += [u["nsfw_score"] for u in stage.process_batch(rows)]
        cpu += time.process_time() - start
    s = np.asarray(scores)
    limit = cfg.filters.nsfw_max_score
    above = [(name, round(float(v), 3)) for (name, _), v in zip(named, s) if v > limit]
    return {
        "photos": len(s),
        "rejected": len(above),
        "rejected_share": round(len(above) / max(len(s), 1), 4),
        "rejected_photos": above,
        "score_p50_p90_p99_max": [round(float(np.quantile(s, q)), 4) for q in (0.5, 0.9, 0.99, 1.0)],
        "cpu_ms_per_image": round(1000 * cpu / max(len(s), 1), 1),
    }


def curate_once(pool: Path, out: Path, enabled: bool) -> dict:
    args = [sys.executable, "-m", "jobs.curate", "--config", str(LITE), "--input", str(pool), "--output", str(out)]
    args += [] if enabled else ["stages.nsfw.enabled=false"]
    start = time.perf_counter()
    subprocess.run(args, cwd=REPO, check=True, capture_output=True)
    wall = time.perf_counter() - start
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    import pyarrow.parquet as pq

    ledger = pq.read_table(out / "final_ledger", columns=["nsfw_score", "status", "key"]).to_pylist()
    reached = sum(1 for r in ledger if r["nsfw_score"] is not None)  # scored by the stage
    return {
        "wall_s": round(wall, 1),
        "inputs": len(ledger),
        "reached_nsfw_stage": reached if enabled else None,
        "kept": manifest["totals"]["rows"],
        "kept_keys": sorted(r["key"] for r in ledger if r["status"] == "kept"),
    }


def main() -> int:
    from dedup_truth import debian_photos, package_photos

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-debian", action="store_true")
    p.add_argument("--work", default="out/dedup_truth", help="where the Debian packages are unpacked")
    p.add_argument("--pairs", type=int, default=2, help="alternating runs with and without the stage")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    named = package_photos() + ([] if args.no_debian else debian_photos(Path(args.work)))
    result: dict = {"scores": score_photos(named, args.batch)}
    print(json.dumps(result["scores"], indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        pool = Path(tmp) / "pool"
        subprocess.run([sys.executable, "-m", "jobs.make_sample_pool", "--out", str(pool)], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        runs = []
        for k in range(args.pairs):
            for enabled in (True, False):
                run = curate_once(pool, Path(tmp) / f"out-{k}-{enabled}", enabled)
                runs.append({"nsfw": enabled, **run})
                print(f"with nsfw={enabled}: {run['wall_s']} s for {run['inputs']} inputs "
                      f"({run['wall_s'] / run['inputs']:.3f} s per input), kept {run['kept']}")  # fmt: skip
    best = {e: min(r["wall_s"] for r in runs if r["nsfw"] == e) for e in (True, False)}
    inputs = runs[0]["inputs"]
    reached = runs[0]["reached_nsfw_stage"]
    stage_s = result["scores"]["cpu_ms_per_image"] / 1000 * reached
    result["curate"] = {
        "runs": [{k: v for k, v in r.items() if k != "kept_keys"} for r in runs],
        "s_per_input_with": round(best[True] / inputs, 3),
        "s_per_input_without": round(best[False] / inputs, 3),
        "same_kept_images": len({tuple(r["kept_keys"]) for r in runs}) == 1,
        "stage_cpu_s_per_pool_input": round(stage_s / inputs, 4),
        "stage_share_of_time_per_input": round(stage_s / best[True], 3),
    }
    print(json.dumps(result["curate"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
