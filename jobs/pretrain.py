"""Pretrain a Sapiens2-style backbone on curated shards with Ray Train (FSDP2), resumable.

    python -m jobs.pretrain --config configs/pretrain/tiny.yaml --data <out>/shards --storage <dir or s3://...> \\
        --name run1 [key=value ...]
    ray job submit --working-dir . -- python -m jobs.pretrain --config configs/pretrain/sapiens2_0.4b.yaml \\
        --data s3://... --storage s3://... --name run1

Running the same command again (same --storage and --name) resumes from the run's newest checkpoint that reads
back, with the settings the run started with: a change to one that alters the result is refused unless
``--allow-change`` names it (``--allow-change steps`` with a larger ``steps=`` extends a finished run). At the end the student backbone is exported to <storage>/<name>/backbone.safetensors;
``--export teacher`` exports the EMA teacher's to <storage>/<name>/teacher_backbone.safetensors instead, and
``--export student,teacher`` both.
One driver at a time trains a run: it holds a lease on <storage>/<name> (``common.lease``; --break-lease takes it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import folders, storage
from common.config import ConfigError, load_config
from common.console import (
    beside,
    configure_console,
    exit_code_interruptible,
    next_steps,
    shown_path,
    shown_place,
)
from common.lease import Lease, LeaseHeld, exit_code_holding, interrupt_main
from common.ray_utils import init_ray
from common.storage import StorageError
from common.watchdog import Watchdog
from finetune.config import FinetuneConfig
from finetune.frozen_eval import RunProbe
from jobs.finetune import resolve_data
from pretrain.backbone import count_params
from pretrain.config import PretrainConfig
from pretrain.data import DataError, DataIndex, find_index, save_index
from pretrain.export import EXPORT_FILES, EXPORTS, export_backbone
from pretrain.takedowns import replaced_files
from pretrain.train import fit
from training import checkpoint
from training.failures import Exhausted, Permanent
from training.metrics import METRICS
from training.metrics_sinks import describe
from training.runner import (
    add_allow_change,
    check_free_space,
    check_run,
    claim_run,
    committed,
    describe_changes,
    ended_with,
    run_uri_for,
)
from training.schedules import peak_lr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/pretrain/tiny.yaml")
    p.add_argument("--data", required=True, help="curated shards: the curate job's <out>/shards (local or s3://)")
    p.add_argument("--storage", required=True, help="runs root (local or s3://); the run lives in <storage>/<name>")
    p.add_argument("--name", required=True, help="run name; the same name resumes")
    p.add_argument("--break-lease", action="store_true", help="take the run over from another driver that holds it")
    add_allow_change(p)
    p.add_argument(
        "--export", default="student", type=_exports, metavar="WHICH[,WHICH]",
        help=f"backbones to export at the end, of {', '.join(sorted(EXPORTS))} (default: student)",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. ray.workers=8")
    return p.parse_intermixed_args(argv)  # key=value overrides may come before or after the options


def _exports(text: str) -> list[str]:
    which = [w.strip() for w in text.split(",") if w.strip()]
    if not which or any(w not in EXPORTS for w in which):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(sorted(EXPORTS))}, comma-separated")
    return list(dict.fromkeys(which))


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    return exit_code_interruptible("pretrain", lambda: _pretrain(args), lambda: committed(args.storage, args.name))


def _pretrain(args: argparse.Namespace) -> int:
    # every check reads only, so a refused command leaves <storage> as it was and its corrected form is not refused
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
        run_uri = run_uri_for(args.storage, args.name)
        folders.refuse_other_kind(args.storage, folders.RUNS, "--storage")
        folders.refuse_other_kind(run_uri, folders.TRAINING_RUN, "the run folder")
        data_uri = args.data if "://" in args.data else os.path.abspath(args.data)
        if cfg.probe.every:
            assert cfg.probe.data is not None  # PretrainProbe requires it when on
            resolve_data(cfg.probe.data, None)  # train/ and val/ are there
            if "://" not in cfg.probe.data:  # the workers' working directory is not this one
                cfg.probe.data = os.path.abspath(os.path.expanduser(cfg.probe.data))
        identity = {"data": storage.redact(data_uri), "model_hash": cfg.model_hash()}
        check_run(run_uri, identity, cfg.result_settings(), args.allow_change)
        index, scanned = find_index(data_uri, run_uri, verify_sha256=cfg.data.verify_sha256)
        if not scanned:
            index.check_present(replaced_files(data_uri))
        check_free_space(run_uri, checkpoint_bytes(cfg), cfg.checkpoint.keep)
        cfg.split(cfg.ray.workers)  # a global batch that does not divide among the workers is refused here
        lease = Lease(run_uri, holder="jobs.pretrain", on_lost=interrupt_main).acquire(force=args.break_lease)
    except (ConfigError, DataError, StorageError, LeaseHeld) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return exit_code_holding(lease, lambda: _train(args, cfg, run_uri, data_uri, lease, identity, index, scanned))


def checkpoint_bytes(cfg: PretrainConfig) -> int:
    """About the size of one checkpoint: the student with its two AdamW moments and the EMA teacher, fp32 (the MAE
    decoder and the projection heads add a little)."""
    return count_params(cfg.model.backbone()) * 4 * (3 + 1)


def _train(
    args: argparse.Namespace, cfg: PretrainConfig, run_uri: str, data_uri: str, lease: Lease, identity: dict,
    index: DataIndex, scanned: bool,
) -> int:  # fmt: skip
    try:  # checks again: another run may have claimed the name since
        changes = claim_run(run_uri, identity, cfg.result_settings(), args.allow_change, {"size": cfg.model.size})
    except (ConfigError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if scanned:
        save_index(run_uri, index)

    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    per_step, split = cfg.samples_per_step(), cfg.split(cfg.ray.workers)
    shown = shown_place(run_uri)
    print(
        f"[pretrain] {'starting' if changes is None else 'resuming'} {shown}{describe_changes(changes)}: "
        f"size={cfg.model.size} steps={cfg.steps} "
        f"workers={cfg.ray.workers} gpu={cfg.ray.use_gpu} global batch={per_step} "
        f"(= {cfg.ray.workers} workers x {split[1]} micro-batches x {split[0]} images) "
        f"lr={peak_lr(cfg.optim, per_step):.3g} (optim.lr {cfg.optim.lr:g} x {per_step} / 256) "
        f"data={index.num_samples} samples in {index.num_units} row groups "
        f"({index.num_samples // per_step} steps/epoch)",
        flush=True,
    )
    start = time.monotonic()
    try:
        with Watchdog("jobs.pretrain", cfg.watchdog.minutes):
            fit(
                cfg.for_workers(cfg.ray.workers),
                args.storage,
                args.name,
                data_uri,
                RunProbe if cfg.probe.every else None,
            )
    except (Permanent, Exhausted) as exc:
        return ended_with(exc)
    lease.check()  # the export below is this run's to write only while it holds the run
    latest = checkpoint.latest_committed(run_uri)
    print(f"[pretrain] done in {time.monotonic() - start:.0f} s")
    newest = shown_place(latest) if latest else None
    where = [
        ("checkpoints", f"{storage.join(shown, checkpoint.CHECKPOINTS)} (latest: {newest})"),
        ("metrics", f"{storage.join(shown, METRICS)}/*.jsonl; {describe(cfg.log.backends, run_uri)}"),
    ]
    if latest is not None:
        for which in args.export:
            out = storage.join(run_uri, EXPORT_FILES[which])
            meta = export_backbone(latest, out, which)
            where.append(
                (
                    "backbone" if which == "student" else which,
                    f"{shown_place(out)} (size {meta['size']}, step {meta['step']})",
                )
            )
    next_steps("pretrain", where, next_commands(cfg, args) if latest is not None else [])
    return 0


FINETUNE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "tiny-seg.yaml"


def next_commands(cfg: PretrainConfig, args: argparse.Namespace) -> list[list[str]]:
    """The commands that use the exported backbone: labelled data beside the runs (the README's
    ``out/synthetic``), a frozen-feature probe of the backbone, and a fine-tuning run that starts from it."""
    run = storage.join(storage.redact(args.storage), args.name)  # as given: a relative --storage stays relative
    backbone = storage.join(run, EXPORT_FILES[args.export[0]])
    data = beside(args.storage, "synthetic")
    config = shown_path(FINETUNE_CONFIG)
    finetune_model = load_config(FinetuneConfig, str(FINETUNE_CONFIG), []).model
    model = [
        f"model.{key}={mine}"
        for key, mine, theirs in (
            ("size", cfg.model.size, finetune_model.size),
            ("patch_size", cfg.model.patch_size, finetune_model.patch_size),
        )
        if mine != theirs
    ]
    return [
        ["python", "-m", "jobs.make_synthetic", "--out", data, "--n", "2000", "--val", "200"],
        ["python", "-m", "jobs.probe", "--data", data, "--backbone", backbone, "--out",
         storage.join(run, "probe.json"),
         "--config", config, *model],
        ["python", "-m", "jobs.finetune", "--task", "seg", "--config", config, "--data", data,
         "--storage", storage.redact(args.storage), "--name", f"{args.name}-seg", "--backbone", backbone, *model],
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
