"""Does pretraining help? Tiny backbone pretrained on the curated sample vs random init, then seg fine-tuning.

    python benchmarks/finetune_experiment.py --work out/finetune_experiment [--shards <curated>/shards]
        [--pretrain-steps 300] [--steps 600] [--eval-every 100] [--n 1000] [--val 128] [--probe]

1. Curated shards: ``--shards``, or the sample pool built and curated with the lite profile under ``--work``.
2. ``jobs.pretrain`` trains the tiny backbone (``configs/pretrain/tiny.yaml``) for ``--pretrain-steps`` steps and
   exports it.
3. ``jobs.make_synthetic`` renders ``--n`` training and ``--val`` validation humanoids (128x96).
4. ``jobs.finetune --task seg`` trains the same head for the same steps, data order and schedule from the
   pretrained backbone and from a random one, evaluating mIoU every ``--eval-every`` steps. ``--probe`` adds the
   same pair with the backbone frozen (dense probing: how much the features alone carry).

Prints both mIoU curves and a Markdown table for ``benchmarks/RESULTS.md``. Every step reuses an existing result
under ``--work`` (the jobs resume), so a rerun only redoes what is missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.ray_utils import init_ray  # noqa: E402
from jobs import curate, make_sample_pool, make_synthetic  # noqa: E402
from jobs import finetune as finetune_job  # noqa: E402
from jobs import pretrain as pretrain_job  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="out/finetune_experiment", help="folder for every artefact of the experiment")
    p.add_argument("--shards", default=None, help="curated shards to pretrain on (default: curate the sample pool)")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=600, help="fine-tuning steps of every run")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--n", type=int, default=1000, help="synthetic training samples")
    p.add_argument("--val", type=int, default=128, help="synthetic validation samples")
    p.add_argument("--probe", action="store_true", help="also compare with the backbone frozen")
    return p.parse_args()


def step(title: str, fn, *args) -> None:
    start = time.monotonic()
    print(f"\n=== {title}", flush=True)
    if fn(*args) != 0:
        raise SystemExit(f"{title} failed")
    print(f"=== {title}: {time.monotonic() - start:.0f} s", flush=True)


def curated_shards(work: Path) -> Path:
    pool, out = work / "pool", work / "curated"
    if not (out / "shards" / "manifest.json").exists():
        if not (pool / "_manifest.jsonl").exists():
            step("sample pool", make_sample_pool.main, ["--out", str(pool)])
        step("curate", curate.main, ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(pool),
                                     "--output", str(out)])  # fmt: skip
    return out / "shards"


def main() -> int:
    args = parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    init_ray(None, 2)
    shards = Path(args.shards).resolve() if args.shards else curated_shards(work)
    n_images = sum(s["rows"] for s in json.loads((shards / "manifest.json").read_text())["shards"])

    runs = work / "runs"
    backbone = runs / "pretrain" / "backbone.safetensors"
    if not backbone.exists():
        step(f"pretrain tiny, {args.pretrain_steps} steps on {n_images} curated images", pretrain_job.main,
             ["--config", str(REPO / "configs/pretrain/tiny.yaml"), "--data", str(shards), "--storage", str(runs),
              "--name", "pretrain", f"steps={args.pretrain_steps}"])  # fmt: skip

    synthetic = work / "synthetic"
    if not (synthetic / "val" / "manifest.json").exists():
        step("synthetic data", make_synthetic.main,
             ["--out", str(synthetic), "--n", str(args.n), "--val", str(args.val), "--workers", "2"])  # fmt: skip

    variants = [("random", None, False), ("pretrained", backbone, False)]
    if args.probe:
        variants += [("random-frozen", None, True), ("pretrained-frozen", backbone, True)]
    curves: dict[str, dict[int, dict]] = {}
    common = [f"steps={args.steps}", f"eval.every={args.eval_every}", "eval.max_samples=null"]
    for name, init, frozen in variants:
        run = runs / f"seg-{name}-{args.steps}"
        if not (run / "metrics.json").exists():
            extra = ["--backbone", str(init)] if init else []
            step(f"fine-tune seg from {name} backbone", finetune_job.main,
                 ["--task", "seg", "--config", str(REPO / "configs/finetune/tiny.yaml"), "--data", str(synthetic),
                  "--storage", str(runs), "--name", run.name, *extra, *common,
                  f"optim.freeze_backbone={str(frozen).lower()}"])  # fmt: skip
        report = json.loads((run / "metrics.json").read_text())
        curves[name] = {c["step"]: c for c in report["curve"]}

    steps = sorted(set.union(*(set(c) for c in curves.values())))
    names = list(curves)
    print(f"\nseg fine-tuning on {args.n} synthetic renders (val {args.val}), tiny backbone, {args.steps} steps; "
          f"pretrained: {args.pretrain_steps} steps on {n_images} curated images")  # fmt: skip
    print(f"{platform.machine()}, {platform.python_version()}")
    header = "| step | " + " | ".join(f"mIoU {n}" for n in names) + " |"
    print(header)
    print("|" + "---|" * (len(names) + 1))
    for s in steps:
        cells = [f"{curves[n][s]['mIoU']:.4f}" if s in curves[n] else "" for n in names]
        print(f"| {s} | " + " | ".join(cells) + " |")
    last = steps[-1]
    for n in names:
        if last in curves[n]:
            r = curves[n][last]
            print(f"final {n}: mIoU {r['mIoU']:.4f}, mAcc {r['mAcc']:.4f}, aAcc {r['aAcc']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
