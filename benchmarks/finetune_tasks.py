"""Every fine-tuning task through ``jobs.finetune`` after a fixed short run: one table of each task's metrics.

    python benchmarks/finetune_tasks.py                  # 512 labelled renders, 300 steps per task (~8 min, 2 CPUs)
    python benchmarks/finetune_tasks.py --steps 1000 --n 2048 --work out/ft_long

Renders a labelled set (128x96, Sapiens2's 29 part classes and 308 keypoints), then fine-tunes the tiny backbone
from a random initialisation with each task's shipped config (``configs/finetune/tiny-<task>.yaml``) and prints
a Markdown table: the task's metrics on the validation set and the run's wall time. A rerun reuses finished runs
under ``--work`` (jobs resume), so only what is missing runs again.
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

from benchmarks.pretrain_value import step  # noqa: E402
from jobs import finetune as finetune_job  # noqa: E402
from jobs import make_synthetic  # noqa: E402

METRICS = {
    "pose": ("AP", "AP_body", "AP_hands", "AP_face", "OKS"),
    "seg": ("mIoU", "mAcc", "aAcc"),
    "pointmap": ("rel_point", "abs_rel_depth"),
    "normal": ("mean", "median", "within_11.25"),
    "albedo": ("mae", "psnr"),
}
BETTER = {"rel_point": "lower", "abs_rel_depth": "lower", "mean": "lower, degrees", "median": "lower, degrees",
          "mae": "lower", "psnr": "higher, dB", "within_11.25": "higher, %"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=REPO / "out/finetune_tasks")
    p.add_argument("--n", type=int, default=512, help="labelled training renders")
    p.add_argument("--val", type=int, default=64, help="validation renders")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tasks", default=",".join(METRICS), help="comma-separated subset of " + ",".join(METRICS))
    args = p.parse_args(argv)
    labelled = args.work / f"labelled-{args.n}"
    if not (labelled / "val/manifest.json").exists():
        step(f"labelled renders: {args.n} train + {args.val} val", make_synthetic.main,
             ["--out", str(labelled), "--n", str(args.n), "--val", str(args.val), "--seed", "1", "--workers", "2"])  # fmt: skip
    rows = []
    for task in args.tasks.split(","):
        name = f"{task}-{args.n}-{args.steps}"
        start = time.monotonic()
        step(f"fine-tune {task}", finetune_job.main,
             ["--task", task, "--config", str(REPO / f"configs/finetune/tiny-{task}.yaml"), "--data", str(labelled),
              "--storage", str(args.work / "runs"), "--name", name, f"steps={args.steps}",
              "eval.max_samples=null"])  # fmt: skip
        report = json.loads((args.work / "runs" / name / "metrics.json").read_text())
        values = ", ".join(
            f"{k} {report['metrics'][k]:.4g}" + (f" ({BETTER[k]})" if k in BETTER else "") for k in METRICS[task]
        )
        rows.append(f"| {task} | {args.steps} | {values} | {time.monotonic() - start:.0f} s |")
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}: tiny backbone (random init), {args.n} train / "
          f"{args.val} val renders at 128x96")  # fmt: skip
    print("| task | steps | validation metrics | wall (this run) |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
