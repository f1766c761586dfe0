"""Curate an image pool into scored shards and a complete ledger.

    python -m jobs.curate --config configs/curate/lite.yaml --input <pool> --output <out> [key=value ...]
    ray job submit --working-dir . -- python -m jobs.curate --config configs/curate/lite.yaml --input ... --output ...

Rerunning the same command on the same --output resumes: committed input shards are skipped. One run at a time
writes an output: it holds a lease on it (``common.lease``); --break-lease takes it from a run that is gone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import folders
from common.config import ConfigError, load_config
from common.console import beside, configure_console, exit_code_interruptible, next_steps, plural, shown_path
from common.layout import GLOBAL_PHASES, LAYOUT, PHASES
from common.lease import Lease, LeaseHeld, exit_code_holding, interrupt_main
from common.ray_utils import init_ray
from common.storage import DamagedRecordError, StorageError, join, redact
from common.takedown_lists import TakedownError, blocklist
from common.watchdog import Watchdog
from curation.config import CurateConfig
from curation.phases.dedup.chance import ChanceBoundError
from curation.phases.pipeline import GlobalPhases, PhaseOrderError, check_order, phase_done
from curation.phases.release import Release, ReleaseError, open_release
from curation.records import commit_files, read_commits, read_run_record
from curation.score.chain import io_note
from curation.score.inputs import InputShard
from curation.score.ledger import CAUSE_COLUMNS, likely_causes, read_ledger, summary_table
from curation.score.originals import OriginalsMissing
from curation.score.phase import ScorePhase
from curation.score.pool import Pool, PoolError, list_shards, pin_listing, pinned_listing
from curation.score.redecide import (
    NeedsNewRun,
    apply_thresholds,
    decided_config,
    output_what_if,
    plan_thresholds,
    scored_config,
    scoring_record,
    threshold_changes,
)
from curation.steps.output import Output, RunMismatch, claim_output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.curate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/curate/lite.yaml")
    p.add_argument(
        "--input", required=True, help="pool: folder of images, Parquet files or WebDataset tars (local or s3://)"
    )
    p.add_argument("--output", required=True, help="output root (local or s3://)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument(
        "--against",
        default=None,
        metavar="RELEASE",
        help="a published curated output: its kept images count as chosen (copies of them are duplicates), and "
        "this output becomes its next version",
    )
    p.add_argument("--new-run", action="store_true", help="discard results of a different earlier run in --output")
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a threshold to try on --output's stored scores (repeatable), e.g. filters.min_short_side=512: prints "
        "phase 1's funnel before and after and the inputs that would need model work; writes nothing",
    )
    p.add_argument(
        "--break-lease", action="store_true", help="take --output over from another run that holds its lease"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. filters.min_short_side=512"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    lease = Lease(args.output, holder="jobs.curate", on_lost=interrupt_main)
    return exit_code_interruptible(
        "curate", lambda: exit_code_holding(lease, lambda: _curate(args, lease)), lambda: committed(args.output)
    )


def committed(out_uri: str) -> str:
    """What an interrupted run leaves committed in ``out_uri``, which a rerun keeps."""
    out = Output.at(out_uri)
    shards = len(commit_files(out.fs, out.root))
    done = [p for p in PHASES if phase_done(out, p)]
    return (
        f"{plural(shards, 'input shard')} scored and committed in {redact(out_uri)}; "
        f"phases complete: {', '.join(done) or 'none'}"
    )


def _curate(args: argparse.Namespace, lease: Lease) -> int:
    try:
        cfg = load_config(CurateConfig, args.config, args.overrides)
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise ConfigError(
                f"--phases: {'an unknown phase' if len(unknown) == 1 else 'unknown phases'} {', '.join(unknown)}; "
                f"choose from {', '.join(PHASES)}"
            )
        # before anything is written: the lease's record would be the first curation file in a foreign folder
        folders.refuse_other_kind(args.output, folders.CURATED, "--output")
        release = open_release(args.against, cfg.models.embedding.name) if args.against else None
        cfg = _with_release(cfg, release)
        if args.what_if:
            new = _with_release(load_config(CurateConfig, args.config, [*args.overrides, *args.what_if]), release)
            print("\n".join(f"[what-if] {line}" for line in output_what_if(args.output, cfg, new)))
            return 0
        # the output's and the pool's filesystem and root, resolved once for the whole run
        out, pool = Output.at(args.output), Pool.at(args.input) if "score" in phases else None
        # A resumed run works on the listing pinned by its first run, so the pool changing cannot remap shards.
        pinned = None if args.new_run or pool is None else pinned_listing(out, cfg.input)
        shards = pinned if pinned is not None else list_shards(pool, cfg.input) if pool is not None else []
        for uri in cfg.filters.blocklists:  # before anything is written: a list that cannot be read stops the run
            blocklist(uri, cfg.filters.blocklist_distance)
        check_order(cfg, out, phases, release)
        lease.acquire(force=args.break_lease)  # before claim_output can delete another run's results
        claimed = claim_output(out, cfg.results_hash(), args.input, args.new_run, scoring_record(cfg))
        redecide = _plan_redecide(out, cfg, claimed) if claimed is not None else None
        if pinned is None and pool is not None:
            pin_listing(out, shards, cfg.input)
    except (
        ConfigError, PoolError, StorageError, RunMismatch, LeaseHeld, ReleaseError, PhaseOrderError, TakedownError,
        NeedsNewRun,
    ) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 2

    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    print(f"[curate] profile={cfg.profile} stages={','.join(cfg.enabled_stages)} config_hash={cfg.results_hash()}")
    try:
        with Watchdog("jobs.curate", cfg.watchdog.minutes):
            return _run_phases(cfg, args, out, pool, lease, phases, shards, pinned is not None, release, redecide)
    except (PhaseOrderError, DamagedRecordError, OriginalsMissing, ChanceBoundError) as exc:  # each says what to do
        print(f"error: {getattr(exc, 'cause', exc)}", file=sys.stderr)  # a Ray task's error: its own message
        return 2


def _plan_redecide(out: Output, cfg: CurateConfig, run: dict) -> tuple[dict, CurateConfig, dict[str, dict], int]:
    """An output scored alike with other thresholds: what re-deciding it to ``cfg``'s does, in words (the inputs that
    need a stage run again among them), before anything is written; the run record, the scored config and the commit
    records (read once) and the inputs that need model work, which ``apply_thresholds`` takes."""
    commits = read_commits(out.fs, out.root)
    funnel = plan_thresholds(out.uri, run, cfg, commits)
    for line in funnel.lines(cfg.enabled_stages, threshold_changes(decided_config(run, cfg), cfg)):
        print(f"[re-decide] {line}")
    return run, scored_config(run, cfg), commits, sum(funnel.needs.values())


def _with_release(cfg: CurateConfig, release: Release | None) -> CurateConfig:
    """The config with the release's takedowns among its blocklists: they keep their images out of the new crawl."""
    if release is None:
        return cfg
    blocklists = [*cfg.filters.blocklists, release.uri]
    return cfg.model_copy(update={"filters": cfg.filters.model_copy(update={"blocklists": blocklists})})


def _run_phases(
    cfg: CurateConfig,
    args: argparse.Namespace,
    out: Output,
    pool: Pool | None,
    lease: Lease,
    phases: list[str],
    shards: list[InputShard],
    resumed: bool,
    release: Release | None,
    redecide: tuple[dict, CurateConfig, dict[str, dict], int] | None,
) -> int:
    start = time.monotonic()
    scored_hash = (read_run_record(out.fs, out.root).get("scoring") or {}).get("results_hash")
    if pool is not None:
        if resumed:
            print(
                f"[score] resuming on the input listing pinned by the first run ({len(shards)} shards); "
                "files added to the pool since are not part of this run"
            )
        summary = ScorePhase(cfg, out, pool, scored_hash).run(shards, guard=lease.check)
        rate = summary["inputs_this_run"] / max(summary["seconds"], 1e-9)
        peak = summary["peak_task_memory_mb"]
        memory = f"; peak task memory {peak} MiB of the {summary['task_memory_mb']} MiB each requests" if peak else ""
        print(
            f"[score] done: {summary['inputs_this_run']} inputs scored this run in {summary['seconds']} s "
            f"({rate:.2f} img/s){memory}{io_note(summary)}"
        )
    if redecide is not None:
        began = time.monotonic()
        run, scored, commits, model_work = redecide
        applied = apply_thresholds(out, run, scored, cfg, commits, args.input, model_work)
        print(
            f"[re-decide] done: {applied.shards} input shards re-decided in {time.monotonic() - began:.1f} s; "
            f"{applied.words()}"
        )
    for phase in (p for p in GLOBAL_PHASES if p in phases):
        GlobalPhases(cfg, out, guard=lease.check, against=release, pool=args.input).run(phase)
    ledger = read_ledger(args.output, CAUSE_COLUMNS)
    print(f"\n[curate] summary (all phases, {time.monotonic() - start:.1f} s this run)\n" + summary_table(ledger))
    for cause in likely_causes(ledger, cfg.filters.min_short_side):
        print(f"[curate] likely cause: {cause}")
    where, commands = next_commands(args, out)
    print()
    next_steps("curate", where, commands)
    return 0


PRETRAIN_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "tiny.yaml"


def next_commands(args: argparse.Namespace, output: Output) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """Where the output's results are and the commands that come next: the rest of the phases while the output has
    no final shards; else the audit with its report, pretraining on the shards and their WebDataset export (folders
    beside the output, as the README's ``out/runs`` and ``out/wds``)."""
    out = redact(args.output)
    curate = ["python", "-m", "jobs.curate", "--config", args.config, "--input", redact(args.input), "--output", out]
    curate += ["--against", redact(args.against)] if args.against else []
    if not output.exists(LAYOUT.manifest):
        rest = [p for p in GLOBAL_PHASES if not phase_done(output, p)]
        where = [("ledger", f"{join(out, LAYOUT.ledger)}/ (phase 1: one row per input)")]
        return where, [[*curate, "--phases", ",".join(rest), *args.overrides]] if rest else []
    shards = join(out, LAYOUT.shards)
    where = [
        ("shards", f"{shards}/ ({LAYOUT.manifest_name} lists them)"),
        ("ledger", f"{join(out, LAYOUT.final_ledger)}/ (one row per input)"),
        ("card", join(out, LAYOUT.card)),
        ("report", f"{join(out, LAYOUT.report, 'index.html')} (written by jobs.audit --report)"),
    ]
    pretrain = shown_path(PRETRAIN_CONFIG)
    return where, [
        ["python", "-m", "jobs.audit", out, "--report", "--config", args.config, *args.overrides],
        ["python", "-m", "jobs.pretrain", "--config", pretrain, "--data", shards, "--storage", beside(out, "runs"),
         "--name", PRETRAIN_CONFIG.stem],
        ["python", "-m", "jobs.export", "--shards", shards, "--format", "webdataset", "--output", beside(out, "wds")],
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
