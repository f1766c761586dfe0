"""Frozen-feature evaluation of a backbone on labelled renders, written as one JSON (``finetune.frozen_eval``).

    python -m jobs.probe --data <labelled> --backbone <backbone.safetensors | random> --out <result.json> \\
        [--val-data <shards>] [--labels 16,64] [--grayscale] [--seed N] [--size tiny --patch-size 8] \\
        [--config configs/finetune/tiny.yaml] [--k 10] [--iters 50] [--threads N] [--device cuda] [key=value ...]

For every transformer block's output and the final normed output of the frozen backbone: a 1x1 linear probe of
the 29 body-part labels (pixel mIoU), dense k-NN label transfer (pixel mIoU) and a left-vs-right probe of the
tokens of sided parts (balanced accuracy); weight decay and the reported ``best`` layer are chosen on held-out
training images, so the evaluation split is only scored.

``--data`` is a folder with ``train/`` and ``val/`` labelled shards (as ``jobs.make_synthetic`` writes), or the
training shards with ``--val-data`` (e.g. ``<folder>/test``). ``--labels 16,64`` probes the first 16 and the first
64 training samples (prefixes, from one feature pass). ``--backbone random`` is the backbone fine-tuning starts from
without ``--backbone``: the config's model initialised from the config's seed (``--seed``), so seed s here is the
random init of ``jobs.finetune ... seed=s``. ``--grayscale`` feeds both splits as grayscale (luma in all three
channels). The model size defaults to the exported backbone's; ``--size`` / ``--patch-size`` (or ``model.*``
overrides) set it for a random one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from common import storage
from common.config import ConfigError, load_config
from common.console import configure_console, exit_code_interruptible
from common.storage import StorageError
from finetune.config import FinetuneConfig
from finetune.frozen_eval import FrozenEval, ProbeSettings, backbone_features, read_split
from finetune.train import build_backbone
from jobs.finetune import check_backbone, resolve_data
from pretrain.data import DataError
from training.checkpoint import safetensors_meta

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "tiny.yaml"
RANDOM = "random"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", required=True, help="labelled shards: a folder with train/ and val/ (local or s3://)")
    p.add_argument("--val-data", default=None, help="the split to evaluate on, when not <data>/val")
    p.add_argument("--backbone", required=True, help=f"an exported backbone (safetensors), or {RANDOM!r}")
    p.add_argument("--out", required=True, help="where the JSON result goes (local or s3://)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="fine-tuning config whose model is probed")
    p.add_argument("--labels", default=None, help="training prefixes to probe, comma-separated (default: all)")
    p.add_argument("--val-limit", type=int, default=None, help="evaluate on the first N samples only")
    p.add_argument("--grayscale", action="store_true", help="grayscale inputs (train and evaluation)")
    p.add_argument("--seed", type=int, default=0, help="the random init's seed and the hold-out draw")
    p.add_argument("--size", default=None, help="model.size (default: the backbone file's, else the config's)")
    p.add_argument("--patch-size", type=int, default=None, help="model.patch_size")
    p.add_argument("--k", type=int, default=ProbeSettings.k, help="neighbours of the k-NN transfer")
    p.add_argument("--iters", type=int, default=ProbeSettings.iters, help="L-BFGS iterations per linear fit")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="where the backbone runs (default: cuda when there is one)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="fine-tuning config overrides")
    return p.parse_args(argv)


def _absolute(uri: str) -> str:
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def _size_of(backbone: str) -> str | None:
    try:
        return safetensors_meta(backbone).get("size")
    except Exception:  # noqa: BLE001 - a missing or foreign file: check_backbone then says what is wrong with it
        return None


def _config(args: argparse.Namespace, backbone: str | None) -> FinetuneConfig:
    size = args.size or (_size_of(backbone) if backbone else None)
    extra = [f"seed={args.seed}"]
    extra += [f"model.size={size}"] if size else []
    extra += [f"model.patch_size={args.patch_size}"] if args.patch_size else []
    return load_config(FinetuneConfig, args.config, [*extra, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    return exit_code_interruptible(
        "probe",
        lambda: _probe(args),
        lambda: "a probe writes its result only at the end",
        rerun="rerun the same command",
    )


def _probe(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        labels = tuple(int(x) for x in args.labels.split(",")) if args.labels else ()
        if any(n < 2 for n in labels) or args.k < 1 or args.iters < 1:
            raise ValueError("--labels need at least 2 images each; --k and --iters at least 1")
        backbone = None if args.backbone == RANDOM else _absolute(args.backbone)
        cfg = _config(args, backbone)
        if backbone is not None:
            check_backbone(backbone, cfg)
        train_uri, val_uri = resolve_data(args.data, args.val_data)
        train, info = read_split(train_uri, max(labels) if labels else None)
        if labels and max(labels) > len(train.parts):
            raise DataError(f"--labels {max(labels)}: the training split holds {len(train.parts)} samples")
        evaluate, val_info = read_split(val_uri, args.val_limit)
        if val_info != info:
            raise DataError(
                f"{storage.redact(val_uri)} labels differ from {storage.redact(train_uri)} (classes, keypoints or "
                "image size)"
            )
        model = build_backbone(cfg, backbone)
    except (ConfigError, DataError, StorageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    run = FrozenEval(ProbeSettings(k=args.k, iters=args.iters), labels, args.grayscale, args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # the probes fit on the CPU
    result = run.run(backbone_features(model, device), train, evaluate, info.parts)
    meta = safetensors_meta(backbone) if backbone else {}
    result["config"].update(
        backbone=storage.redact(backbone) if backbone else RANDOM,  # the result holds no query or credentials
        which=meta.get("which", "student") if backbone else None,
        pretrain_step=int(meta["step"]) if "step" in meta else None,
        size=cfg.model.size,
        patch_size=model.cfg.patch_size,
        train=storage.redact(train_uri),
        eval=storage.redact(val_uri),
    )
    result["timing"]["job_s"] = time.perf_counter() - started
    fs, path = storage.resolve(args.out)
    storage.write_json_atomic(fs, path, result)
    grey = " (grayscale)" if args.grayscale else ""
    shown = storage.redact(backbone) if backbone else f"random init, seed {args.seed}"
    print(f"[probe] {shown}{grey}: {len(evaluate.parts)} evaluation images, "
          f"{result['timing']['total_s']:.1f} s")  # fmt: skip
    for n, r in result["results"].items():
        p, k, s = r["probe_best"], r["knn_best"], r["left_right_best"]
        print(f"[probe] {n} labels: probe mIoU {_f(p['miou'])} ({p['layer']}), k-NN mIoU {_f(k['miou'])} "
              f"({k['layer']}), left/right {_f(s['balanced_acc'])} ({s['layer']})")  # fmt: skip
    print(f"[probe] result: {storage.redact(args.out)}")
    return 0


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


if __name__ == "__main__":
    sys.exit(main())
