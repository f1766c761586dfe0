"""Build the sample pool: real photos that ship in installed packages, generated variants and bad inputs.

    python -m jobs.make_sample_pool --out sample_pool [--n 60] [--seed 0] [--format folder|parquet|webdataset]

The pool is byte-identical for the same --n and --seed. <out>/_manifest.jsonl says, per input, how the pipeline
names it, where it came from and what curation should do with it (see generators/sample_pool.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common.console import configure_console, exit_code_interruptible
from generators.sample_pool import DEFAULT_N, FORMATS, MANIFEST, MIN_N, FixtureMissing, make_sample_pool, summary_lines


def _count(text: str) -> int:
    n = int(text)
    if n < MIN_N:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_N} (the smallest pool that holds every category)")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.make_sample_pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output folder (created; must be empty or hold an earlier sample pool)")
    p.add_argument(
        "--n",
        type=_count,
        default=DEFAULT_N,
        help=f"number of inputs, minimum {MIN_N} (default {DEFAULT_N}); more adds near-duplicates of the photos",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for crops, noise and random bytes (default 0)")
    p.add_argument("--format", choices=FORMATS, default="folder", help="pool layout (default folder)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        # Replace an earlier sample pool (it has our manifest); never clear a folder we did not write.
        if not (out / MANIFEST).is_file():
            print(f"error: --out {out} is not empty and holds no {MANIFEST}; choose another folder", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    return exit_code_interruptible("make_sample_pool", lambda: _write(args, out), lambda: _discard_partial(out))


def _discard_partial(out: Path) -> str:
    """A pool is written whole or not at all: the manifest comes last, and a folder without one is refused."""
    shutil.rmtree(out, ignore_errors=True)
    return f"the partial pool in {out} is removed"


def _write(args: argparse.Namespace, out: Path) -> int:
    try:
        rows = make_sample_pool(out, args.n, args.seed, args.format)
    except FixtureMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in summary_lines(rows):
        print(line)
    print(f"wrote {len(rows)} inputs ({args.format}) to {out}; manifest {out / MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
