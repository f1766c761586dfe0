"""Does pretraining on curated shards give a better backbone? Pretrained vs random init on label-efficient fine-tuning.

    python benchmarks/pretrain_value.py --quick            # <= 15 min on 2 CPUs: seg, 64 labels, one seed
    python benchmarks/pretrain_value.py                    # the full experiment (about 2.5 hours on 2 quiet CPUs)
    python benchmarks/pretrain_value.py --work out/pv --pool 4000 --labels 64,256 --tasks seg,pose --seeds 0,1,2

The real chain, every step a job a user runs:

1. ``jobs.make_synthetic --unlabelled``: an unlabelled pool of JPEG renders at 512x384 (WebDataset shards).
2. ``jobs.curate`` with the lite profile: the person, quality, dedup and sampling filters keep what they keep.
3. ``jobs.pretrain`` with ``configs/pretrain/tiny.yaml`` on the curated shards; the backbone is exported.
4. ``jobs.make_synthetic``: labelled renders at 128x96 (17 COCO keypoints), figures the pool never holds; the
   ``--labels`` sets are prefixes of one another and share one validation set.
5. ``jobs.finetune`` for every task x label count x mode (frozen backbone = probe, or full fine-tuning) x init
   (random or pretrained) x seed: the same steps, schedule, head initialisation, data order and augmentation
   draws for both inits.

Prints each cell's mean +- std over seeds and the paired difference, then one last line
``pretrained <metric> vs random <metric> (...)``. Every step reuses what an earlier run left under ``--work``
(jobs resume), so a rerun only does what is missing; a ``--work`` whose runs used other settings is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import load_config  # noqa: E402
from common.ray_utils import init_ray  # noqa: E402
from finetune.config import FinetuneConfig  # noqa: E402
from jobs import curate, make_synthetic  # noqa: E402
from jobs import finetune as finetune_job  # noqa: E402
from jobs import pretrain as pretrain_job  # noqa: E402
from training.checkpoint import read_safetensors  # noqa: E402

METRIC = {"seg": "mIoU", "pose": "AP"}  # headline metric per task; higher is better for both
MODES = {"probe": "true", "full": "false"}  # mode -> optim.freeze_backbone
POOL_SHARD = 50  # renders per pool tar shard: one shard is one unit of curation work and of its resume
PRESETS = {
    "quick": dict(pool=400, pretrain_steps=200, labels="64", tasks="seg", seeds="0", steps=300, val=64),
    "full": dict(pool=3000, pretrain_steps=2000, labels="64,256", tasks="seg,pose", seeds="0,1,2", steps=1000, val=128),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small preset (<= 15 min on 2 CPUs)")
    p.add_argument("--work", default=None, help="folder for every artefact (default out/pretrain_value[_quick])")
    p.add_argument("--pool", type=int, help="unlabelled renders in the pool before curation")
    p.add_argument("--pretrain-steps", type=int)
    p.add_argument("--labels", help="labelled training set sizes, comma-separated")
    p.add_argument("--tasks", help=f"comma-separated, of {sorted(METRIC)}")
    p.add_argument("--seeds", help="fine-tuning seeds, comma-separated")
    p.add_argument("--steps", type=int, help="fine-tuning steps of every run")
    p.add_argument("--val", type=int, help="validation renders")
    p.add_argument("--modes", default="probe,full", help=f"comma-separated, of {sorted(MODES)}")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.labels = [int(x) for x in args.labels.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.tasks, args.modes = args.tasks.split(","), args.modes.split(",")
    unknown = [t for t in args.tasks if t not in METRIC] + [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown task or mode {unknown}")
    args.work = Path(args.work or f"out/pretrain_value{'_quick' if args.quick else ''}").resolve()
    return args


def step(title: str, fn, argv: list[str]) -> None:
    start = time.monotonic()
    print(f"\n=== {title}", flush=True)
    if fn(argv) != 0:
        raise SystemExit(f"{title} failed: {' '.join(argv)}")
    print(f"=== {title}: {time.monotonic() - start:.0f} s", flush=True)


def pool_and_curate(args: argparse.Namespace) -> tuple[Path, int]:
    pool, out = args.work / "pool", args.work / "curated"
    last_shard = pool / f"pool-{math.ceil(args.pool / POOL_SHARD) - 1:05d}.tar"
    if not last_shard.exists():
        step(f"pool: {args.pool} unlabelled renders", make_synthetic.main,
             ["--out", str(pool), "--n", str(args.pool), "--unlabelled", "--height", "512", "--width", "384",
              "--max-yaw", "1.2", "--rows-per-shard", str(POOL_SHARD), "--workers", "2"])  # fmt: skip
    manifest = out / "shards" / "manifest.json"
    if not manifest.exists():
        step("curate (lite)", curate.main,
             ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(pool), "--output", str(out)])  # fmt: skip
    kept = sum(s["rows"] for s in json.loads(manifest.read_text())["shards"])
    return out / "shards", kept


def labelled_sets(args: argparse.Namespace) -> dict[int, Path]:
    sets = {}
    for n in args.labels:
        folder = args.work / f"labelled-{n}"
        if not (folder / "val" / "manifest.json").exists():
            step(f"labelled renders: {n} train + {args.val} val", make_synthetic.main,
                 ["--out", str(folder), "--n", str(n), "--val", str(args.val), "--keypoints", "17", "--seed", "1",
                  "--workers", "2"])  # fmt: skip
        sets[n] = folder
    return sets


def finetune_result(args, runs: Path, task: str, n: int, data: Path, mode: str, init: str, seed: int,
                    backbone: Path) -> float:  # fmt: skip
    run = runs / f"{task}-{n}-{mode}-{init}-s{seed}"
    overrides = [f"seed={seed}", f"steps={args.steps}", "eval.every=0", "eval.max_samples=null", "eval.visualise=0",
                 f"optim.freeze_backbone={MODES[mode]}"]  # fmt: skip
    done = run / "metrics.json"
    if done.exists():  # an earlier run's result counts only if it ran these settings
        ran = json.loads(done.read_text())["config"]
        wanted = load_config(FinetuneConfig, REPO / "configs/finetune/tiny.yaml", overrides).model_dump(mode="json")
        if ran != wanted:
            differ = sorted(k for k in wanted if ran.get(k) != wanted[k])
            raise SystemExit(f"{run} ran with other settings ({', '.join(differ)}); give another --work")
    else:
        extra = ["--backbone", str(backbone)] if init == "pretrained" else []
        step(f"fine-tune {task}, {n} labels, {mode}, {init} init, seed {seed}", finetune_job.main,
             ["--task", task, "--config", str(REPO / "configs/finetune/tiny.yaml"), "--data", str(data),
              "--storage", str(runs), "--name", run.name, *extra, *overrides])  # fmt: skip
    return float(json.loads(done.read_text())["metrics"][METRIC[task]])


def mean_std(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    init_ray(None, 2)
    started = time.monotonic()
    shards, kept = pool_and_curate(args)
    runs = args.work / "runs"
    backbone = runs / "pretrain" / "backbone.safetensors"
    if backbone.exists() and int(read_safetensors(str(backbone))[1]["step"]) != args.pretrain_steps:
        raise SystemExit(f"{backbone} was pretrained for another number of steps; give another --work")
    if not backbone.exists():
        step(f"pretrain tiny, {args.pretrain_steps} steps on {kept} curated images", pretrain_job.main,
             ["--config", str(REPO / "configs/pretrain/tiny.yaml"), "--data", str(shards), "--storage", str(runs),
              "--name", "pretrain", f"steps={args.pretrain_steps}"])  # fmt: skip
    sets = labelled_sets(args)

    rows = []
    for task in args.tasks:
        for n in args.labels:
            for mode in args.modes:
                scores = {
                    init: [finetune_result(args, runs, task, n, sets[n], mode, init, s, backbone) for s in args.seeds]
                    for init in ("random", "pretrained")
                }
                rows.append((task, n, mode, scores))

    print(f"\n{args.pool} unlabelled renders -> {kept} curated (lite) -> tiny pretrained {args.pretrain_steps} steps; "
          f"fine-tuning {args.steps} steps, seeds {args.seeds}, {args.val} validation renders; "
          f"{platform.machine()}, Python {platform.python_version()}, {time.monotonic() - started:.0f} s")  # fmt: skip
    print("| task | labels | mode | metric | random | pretrained | paired gain | gain > seed spread |")
    print("|---|---|---|---|---|---|---|---|")
    for task, n, mode, scores in rows:
        gains = [p - r for p, r in zip(scores["pretrained"], scores["random"])]
        spread = max((statistics.stdev(v) for v in scores.values()), default=0.0) if len(args.seeds) > 1 else 0.0
        verdict = "yes" if statistics.fmean(gains) > spread else "no"
        print(f"| {task} | {n} | {mode} | {METRIC[task]} | {mean_std(scores['random'])} | "
              f"{mean_std(scores['pretrained'])} | {mean_std(gains)} | {verdict} |")  # fmt: skip
    task, n, mode, scores = rows[0]
    others = "; ".join(
        f"{t} {k} {m}: {statistics.fmean(s['pretrained']):.4f} vs {statistics.fmean(s['random']):.4f}"
        for t, k, m, s in rows[1:]
    )
    print(f"pretrained {METRIC[task]} {statistics.fmean(scores['pretrained']):.4f} vs random {METRIC[task]} "
          f"{statistics.fmean(scores['random']):.4f} ({task}, {n} labels, {mode}, {len(args.seeds)} seed(s)"
          f"{'; ' + others if others else ''})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
