"""Verify a curated output and, with --report, render an HTML report of it.

    python -m jobs.audit <out>                                   # exit 0 if sound, 1 with the list of problems
    python -m jobs.audit <out> --report [--config configs/curate/lite.yaml] [key=value ...]
    python -m jobs.audit <out> --config configs/curate/lite.yaml --what-if filters.min_quality=0.6   # writes nothing
    ray job submit --working-dir . -- python -m jobs.audit s3://bucket/curated --report

The report lands in <out>/report/index.html (a self-contained folder). Its thresholds and config section come from
--config and overrides, as given to jobs.curate; the report says whether they match the hashes the run recorded.
Rejected images are read back from the pool, on the store the run recorded (an object store's endpoint, region and
scheme; never credentials): where the pool's URI carried credentials, pass it again with --input.
"""

from __future__ import annotations

import argparse
import sys

from common import folders
from common.config import ConfigError, load_config
from common.console import configure_console, exit_code_interruptible
from common.storage import StorageError
from common.watchdog import Watchdog
from curation.audit.report import ReportOptions, write_report
from curation.audit.verify import audit
from curation.config import CurateConfig
from curation.score.redecide import NeedsNewRun, output_what_if


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("output", help="curated output root (local or s3://), as given to jobs.curate --output")
    p.add_argument("--report", action="store_true", help="also write <out>/report/index.html")
    p.add_argument("--config", help="the run's YAML config, for the report's thresholds (default: built-in defaults)")
    p.add_argument("--no-decode", action="store_true", help="skip decoding every image (hashes are still checked)")
    p.add_argument(
        "--workers", type=int, default=None, help="threads reading shards and images (default: min(8, CPUs))"
    )
    p.add_argument(
        "--input", default=None, help="the pool as given to jobs.curate --input (default: the store the run recorded)"
    )
    p.add_argument("--seed", type=int, default=0, help="which random images the report's contact sheets show")
    p.add_argument("--per-sheet", type=int, default=ReportOptions.per_sheet, help="thumbnails per contact sheet")
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="instead of auditing: a threshold to try on the output's stored scores (repeatable), as jobs.curate "
        "--what-if takes it (--config and overrides: the ones the output was curated with)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as given to jobs.curate")
    return p.parse_intermixed_args(argv)  # overrides after the options, as jobs.curate takes them


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    nothing = "an audit writes nothing until it is complete" + (", then its report" if args.report else "")
    return exit_code_interruptible("audit", lambda: _audit(args), lambda: nothing, rerun="rerun the same command")


def _audit(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(CurateConfig, args.config, args.overrides)  # watchdog.minutes too, with --report or not
        folders.require_folder(args.output)
        folders.refuse_other_kind(args.output, folders.CURATED, "the output")
        if args.what_if:
            new = load_config(CurateConfig, args.config, [*args.overrides, *args.what_if])
            print("\n".join(f"[what-if] {line}" for line in output_what_if(args.output, cfg, new)))
            return 0
        with Watchdog("jobs.audit", cfg.watchdog.minutes):
            result = audit(args.output, decode=not args.no_decode, workers=args.workers)
    except (ConfigError, StorageError, NeedsNewRun) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.report:
        source = " ".join([args.config or "built-in defaults", *args.overrides])
        options = ReportOptions(seed=args.seed, per_sheet=args.per_sheet, workers=args.workers or ReportOptions.workers)
        try:
            with Watchdog("jobs.audit", cfg.watchdog.minutes):
                write_report(args.output, cfg, result, config_source=source, options=options, pool=args.input)
        except StorageError as exc:  # a record the audit does not read (the run record), another pool's --input
            print(f"report not written: {exc}", file=sys.stderr)
            return 2 if result.ok else 1
        except Exception as exc:
            if result.ok:
                raise
            print(
                f"report not written: the output is too damaged to read: {type(exc).__name__}: {exc}", file=sys.stderr
            )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
