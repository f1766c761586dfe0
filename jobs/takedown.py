"""Remove listed images from a published curated output.

    python -m jobs.takedown --output <out> --list <file> [--by NAME] [--grace-minutes 60]
    python -m jobs.takedown --output <out> --images <files or folders> [--save-list <file>] [--distance 31]
    ray job submit --working-dir . -- python -m jobs.takedown --output s3://bucket/curated --list s3://bucket/list.txt

The list names images by key (sha256 of the image bytes), ledger source, or the pool's ``url``, or by their PDQ
hash (``pdq:<64 hex>``: every image within ``--distance`` bits of it, so re-encoded, resized, lightly cropped or
watermarked copies too), one a line (``#`` starts a comment). ``--images`` makes those ``pdq:`` lines from the
pictures a report comes with (only their hashes are kept; ``--save-list`` writes the list, to use again as a
blocklist: ``filters.blocklists``). Only the shards that hold a listed image are rewritten; the manifest switches to the next version
in one atomic write, the final ledger records each removal (status ``taken_down``, the reason naming the list and
the date) and ``_state/takedown/<list id>.json`` records who asked, when and what was removed. The replaced files
stay ``--grace-minutes`` for trainers that indexed the previous manifest, then the next takedown run deletes them
(``--grace-minutes 0``: at once). The same command again is a no-op that finishes what a killed run left;
``jobs.audit`` checks that nothing a recorded list names is in the shards.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from common.console import configure_console, exit_code_interruptible
from common.lease import Lease, LeaseHeld, exit_code_holding, interrupt_main
from common.ray_utils import init_ray
from common.storage import DamagedRecordError, StorageError, redact
from common.takedown_lists import (
    PDQ_DISTANCE,
    TakedownError,
    TakedownList,
    make_list,
    picture_lines,
    read_list,
    save_list,
)
from common.watchdog import Watchdog, WatchdogSettings
from curation.phases.write.takedown_run import run_takedown


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.takedown", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", required=True, help="a curated output (local or s3://), as given to jobs.curate")
    p.add_argument(
        "--list", default=None, help="keys, sources, URLs or pdq:<hex> to remove, one a line (local or s3://)"
    )
    p.add_argument(
        "--images", nargs="+", default=None, help="pictures (files or folders, local or s3://) whose copies to remove"
    )
    p.add_argument("--save-list", default=None, help="write the list --images makes (with --list's lines) here")
    p.add_argument(
        "--distance", type=int, default=PDQ_DISTANCE,
        help=f"PDQ bits within which a pdq: line names an image (default {PDQ_DISTANCE} of 256)",
    )  # fmt: skip
    p.add_argument("--by", default=None, help="who asked for the takedown, for the record (default: this user)")
    p.add_argument(
        "--grace-minutes",
        type=float,
        default=60.0,
        help="keep the replaced files this long for trainers reading the previous manifest (default 60)",
    )
    p.add_argument("--ray-address", default=None, help="join this cluster (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--break-lease", action="store_true", help="take the output's lease from a live holder")
    p.add_argument(
        "--watchdog-minutes", type=float, default=WatchdogSettings().minutes,
        help="minutes without a shard scanned or rewritten before the job says what it waits for (0: never)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    if args.grace_minutes < 0:
        print("error: --grace-minutes must be 0 or more", file=sys.stderr)
        return 2
    if not args.list and not args.images:
        print("error: give --list, --images or both", file=sys.stderr)
        return 2
    try:
        lst = _the_list(args)  # before the lease and Ray: a bad list writes nothing
    except (TakedownError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lease = Lease(args.output, holder="jobs.takedown", on_lost=interrupt_main)
    return exit_code_interruptible(
        "takedown",
        lambda: exit_code_holding(lease, lambda: _takedown(args, lst, lease)),
        lambda: "the output holds the old version or the new one, whole (the manifest switches in one write)",
        rerun="rerun the same command to finish",
    )


def _the_list(args: argparse.Namespace) -> TakedownList:
    """``--list``, with the ``pdq:`` lines of ``--images`` added (saved at ``--save-list`` when asked)."""
    if not args.images:
        return read_list(args.list, args.distance)
    lines = list(read_list(args.list, args.distance).entries) if args.list else []
    hashed = picture_lines(args.images)
    print(f"[takedown] {len(hashed)} pdq: lines from the pictures of {' '.join(map(redact, args.images))}")
    lines += hashed
    name = redact(args.save_list or args.list or "images")
    lst = make_list(name, lines, args.distance)
    if args.save_list:
        save_list(args.save_list, lst)
        print(f"[takedown] list of {len(lst.entries)} entries written to {name}")
    return lst


def _takedown(args: argparse.Namespace, lst, lease: Lease) -> int:
    try:
        lease.acquire(force=args.break_lease)
        init_ray(args.ray_address)
        with Watchdog("jobs.takedown", args.watchdog_minutes):
            record = run_takedown(
                args.output, lst, by=args.by or getpass.getuser(), grace_minutes=args.grace_minutes, guard=lease.check
            )
    except (TakedownError, StorageError, DamagedRecordError, LeaseHeld) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"[takedown] done: {len(record['removed'])} images of list {record['id']} are out of {args.output} "
        f"(manifest version {record['version']}); check with: python -m jobs.audit {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
