"""Curate an image pool into scored shards and a complete ledger.

    python -m jobs.curate --config configs/curate/lite.yaml --input <pool> --output <out> [key=value ...]
    ray job submit --working-dir . -- python -m jobs.curate --config configs/curate/lite.yaml --input ... --output ...

Rerunning the same command on the same --output resumes: committed input shards are skipped.
"""

from __future__ import annotations

import argparse
import sys
import time

from common.config import ConfigError, load_config
from common.ray_utils import init_ray
from common.storage import StorageError
from curation.config import CurateConfig
from curation.ledger import read_ledger, summary_table
from curation.pool import PoolError, list_shards
from curation.phases import GLOBAL_PHASES, GlobalPhases, PhaseOrderError
from curation.score import RunMismatch, ScorePhase, claim_output

PHASES = ("score", *GLOBAL_PHASES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jobs.curate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/curate/lite.yaml")
    p.add_argument("--input", required=True, help="pool: folder of images, Parquet files or WebDataset tars (local or s3://)")
    p.add_argument("--output", required=True, help="output root (local or s3://)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--new-run", action="store_true", help="discard results of a different earlier run in --output")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. filters.min_short_side=512")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(CurateConfig, args.config, args.overrides)
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise ConfigError(f"--phases: unknown phase(s) {unknown}; choose from {list(PHASES)}")
        shards = list_shards(args.input, cfg.input) if "score" in phases else []
        claim_output(args.output, cfg.results_hash(), args.input, args.new_run)
    except (ConfigError, PoolError, StorageError, RunMismatch) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    print(f"[curate] profile={cfg.profile} stages={','.join(cfg.enabled_stages)} config_hash={cfg.results_hash()}")
    start = time.monotonic()
    if "score" in phases:
        summary = ScorePhase(cfg, args.output).run(shards)
        rate = summary["inputs_this_run"] / max(summary["seconds"], 1e-9)
        print(f"[score] done: {summary['inputs_this_run']} inputs scored this run in {summary['seconds']} s ({rate:.2f} img/s)")
    try:
        for phase in (p for p in GLOBAL_PHASES if p in phases):
            GlobalPhases(cfg, args.output).run(phase)
    except PhaseOrderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ledger = read_ledger(args.output, ["status", "stage", "reason"])
    print(f"\n[curate] summary (all phases, {time.monotonic() - start:.1f} s this run)\n" + summary_table(ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
