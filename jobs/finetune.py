"""Fine-tune a (pretrained) backbone with a task head on labelled shards, with Ray Train, then evaluate it.

    python -m jobs.finetune --task seg --config configs/finetune/tiny.yaml --data <labelled> --storage <runs> \\
        --name seg1 [--backbone <runs>/<pretrain run>/backbone.safetensors] [key=value ...]

``--task`` is one of pose, seg, pointmap, normal, albedo. ``--data`` is a folder with ``train/`` and ``val/``
labelled shards (as ``jobs.make_synthetic`` writes), or the training shards themselves with ``--val-data``.
Without ``--backbone`` the backbone starts from a random initialisation; ``--backbone`` also takes another run's
``finetuned.safetensors``, whose backbone (not its head) then starts this run. The run lives in <storage>/<name>:
``metrics.json`` (final metrics and the evaluation curve), ``pictures/*.png`` (input | target | prediction),
``finetuned.safetensors``, ``metrics/*.jsonl`` and checkpoints; the same command again resumes it, with the settings
it started with (``--allow-change KEY[,KEY]`` takes a changed one, e.g. ``steps`` to train on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common import folders, storage
from common.config import ConfigError, load_config
from common.console import configure_console, exit_code_interruptible
from common.lease import Lease, LeaseHeld, exit_code_holding, interrupt_main
from common.ray_utils import init_ray
from common.storage import StorageError
from common.watchdog import Watchdog
from finetune import data, tasks
from finetune.config import FinetuneConfig
from finetune.train import FINETUNED_FILE, METRICS_FILE, PICTURES, check_architecture, fit
from pretrain.backbone import count_params
from pretrain.data import DataError, DataIndex
from pretrain.export import backbone_config
from training.checkpoint import safetensors_meta
from training.failures import Exhausted, Permanent
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--task", required=True, choices=data.TASKS)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/finetune/tiny.yaml")
    p.add_argument("--data", required=True, help="labelled shards: a folder with train/ and val/ (local or s3://)")
    p.add_argument("--val-data", default=None, help="validation shards, when --data holds the training shards")
    p.add_argument("--storage", required=True, help="runs root (local or s3://); the run lives in <storage>/<name>")
    p.add_argument("--name", required=True, help="run name; the same name resumes")
    p.add_argument(
        "--backbone",
        default=None,
        help="exported pretrained backbone, or a fine-tuned model's finetuned.safetensors (its backbone); default: random",
    )
    p.add_argument("--break-lease", action="store_true", help="take the run over from another driver that holds it")
    add_allow_change(p)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=3e-4")
    return p.parse_intermixed_args(argv)  # key=value overrides may come before or after the options


def _absolute(uri: str) -> str:
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def resolve_data(data_uri: str, val_uri: str | None) -> tuple[str, str]:
    if val_uri is not None:
        return _absolute(data_uri), _absolute(val_uri)
    fs, root = storage.resolve(data_uri)
    train, val = storage.join(data_uri, "train"), storage.join(data_uri, "val")
    missing = [s for s in ("train", "val") if not storage.exists(fs, storage.join(root, s))]
    if missing:
        raise DataError(
            f"{storage.redact(data_uri)} has no {' or '.join(f'{m}/' for m in missing)} folder; pass a folder written by "
            "`python -m jobs.make_synthetic --out <dir> --n N`, or the training shards with --val-data <shards>"
        )
    return _absolute(train), _absolute(val)


def check_backbone(backbone: str, cfg: FinetuneConfig) -> None:
    """Refuse a ``--backbone`` that is not an exported backbone or a fine-tuned model, or whose architecture is not the
    config's (from its metadata alone, before Ray starts)."""
    fs, path = storage.resolve(backbone)
    uri = storage.redact(backbone)  # named in messages
    if not storage.exists(fs, path):
        raise StorageError(
            f"--backbone {uri} does not exist (jobs.pretrain writes <storage>/<name>/backbone.safetensors)"
        )
    try:
        meta = safetensors_meta(backbone)  # its header alone: the driver reads no weights
    except Exception as exc:  # noqa: BLE001 - any failure to parse means it is not a safetensors file
        raise StorageError(f"--backbone {uri} is not a safetensors file: {exc}") from None
    if "backbone_config" not in meta:
        raise StorageError(f"--backbone {uri} carries no backbone_config metadata: not an exported backbone")
    if meta.get("size") and meta["size"] != cfg.model.size:
        raise ConfigError(
            f"--backbone {uri} is size {meta['size']!r}, the config says model.size={cfg.model.size!r}; "
            f"add model.size={meta['size']}"
        )
    check_architecture(backbone_config(meta), cfg, uri)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    return exit_code_interruptible("finetune", lambda: _main(args), lambda: committed(args.storage, args.name))


def _main(args: argparse.Namespace) -> int:
    # every check reads only, so a refused command leaves <storage> as it was
    try:
        cfg = load_config(FinetuneConfig, args.config, args.overrides)
        run_uri = run_uri_for(args.storage, args.name)
        folders.refuse_other_kind(args.storage, folders.RUNS, "--storage")
        folders.refuse_other_kind(run_uri, folders.TRAINING_RUN, "the run folder")
        train_uri, val_uri = resolve_data(args.data, args.val_data)
        info = data.read_info(DataIndex.scan(train_uri), train_uri)
        val_index = DataIndex.scan(val_uri)
        if data.read_info(val_index, val_uri) != info:
            raise DataError(
                f"{storage.redact(val_uri)} labels differ from {storage.redact(train_uri)} (classes, keypoints or "
                "image size)"
            )
        tasks.make(args.task, cfg, info)  # validates the task against the data and the config
        backbone = _absolute(args.backbone) if args.backbone else None
        if backbone:
            check_backbone(backbone, cfg)
        spec = {"task": args.task, "train": train_uri, "val": val_uri, "backbone": backbone}
        # run.json records names, never credentials a URI may carry
        identity = {**{k: v and storage.redact(v) for k, v in spec.items()}, "size": cfg.model.size}
        check_run(run_uri, identity, cfg.result_settings(), args.allow_change)
        check_free_space(run_uri, count_params(cfg.model.backbone()) * 4 * 3, cfg.checkpoint.keep)  # + 2 AdamW moments
        lease = Lease(run_uri, holder="jobs.finetune", on_lost=interrupt_main).acquire(force=args.break_lease)
    except (ConfigError, DataError, StorageError, ValueError, LeaseHeld) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return exit_code_holding(lease, lambda: _finetune(args, cfg, spec, identity, info, run_uri))


def _finetune(
    args: argparse.Namespace, cfg: FinetuneConfig, spec: dict, identity: dict, info: data.LabelInfo, run_uri: str
) -> int:
    backbone = spec["backbone"]
    try:  # checks again: another run may have claimed the name since
        changes = claim_run(run_uri, identity, cfg.result_settings(), args.allow_change)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    shown = storage.redact(run_uri)  # the console gets no query or credentials
    print(
        f"[finetune] {'starting' if changes is None else 'resuming'} {shown}{describe_changes(changes)}: "
        f"task={args.task} size={cfg.model.size} "
        f"steps={cfg.steps} workers={cfg.ray.workers} backbone={storage.redact(backbone or 'random init')} "
        f"image {info.image_size[0]}x{info.image_size[1]}, {info.num_classes} classes, {info.num_keypoints} keypoints",
        flush=True,
    )
    start = time.monotonic()
    try:
        with Watchdog("jobs.finetune", cfg.watchdog.minutes):
            fit(cfg, spec, args.storage, args.name)
    except (Permanent, Exhausted) as exc:
        return ended_with(exc)
    fs, run = storage.resolve(run_uri)
    report = storage.read_json(fs, storage.join(run, METRICS_FILE))
    final = {k: v for k, v in report["metrics"].items() if isinstance(v, float)}
    print(f"[finetune] done in {time.monotonic() - start:.0f} s; {args.task} at step {report['step']}: "
          + " ".join(f"{k}={v:.4f}" for k, v in final.items()))  # fmt: skip
    print(f"[finetune] metrics:  {storage.join(shown, METRICS_FILE)}; {describe(cfg.log.backends, run_uri)}")
    print(f"[finetune] pictures: {storage.join(shown, PICTURES)}/")
    print(f"[finetune] model:    {storage.join(shown, FINETUNED_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
