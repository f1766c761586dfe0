"""Curves of the pretraining objective's terms for recipe variants, side by side, in one process.

    python benchmarks/contrastive_curves.py --data out/curated/shards --steps 1000 \\
        --variant shipped --variant "k16:objective.cl.prototypes=16 data.batch_size=8" [--plot curves.png]

Each variant is the tiny config (``--config``) plus its overrides (``name:key=value key=value``; a bare name is the
config as it is). Every variant trains with the worker's step (``pretrain.train.Trainer.train_step``: schedules,
frozen prototypes, clipping, AdamW, EMA teacher) on the plain model in this process, on the shards' images decoded
once; the global batch (``data.batch_size x ray.workers``) is one batch here (``optim.grad_accum`` micro-batches of
it), so the diagnostics and the collapse rules are over the whole global batch (a worker reads them over its
micro-batch). Prints, per variant, a row every ``--every`` steps
with the means over that window: MAE, L_CL against ln K, KoLeo, the teacher targets' entropy and information,
prototypes used, [CLS] spread and the collapse named; then a summary of where each variant ended. ``--json`` keeps
the curves, ``--plot`` draws them (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from pretrain import data
from pretrain.backbone import build
from pretrain.config import PretrainConfig
from pretrain.objective import TERMS, JointObjective, collapse_state
from pretrain.train import Trainer

REPO = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    return name, rest.split()


def run_variant(cfg: PretrainConfig, images: torch.Tensor, every: int, seed: int) -> list[dict]:
    """Train ``cfg.steps`` steps; one record per ``every`` steps (means over the window)."""
    torch.manual_seed(cfg.seed)
    model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    trainer = Trainer(model, cfg, torch.device("cpu"), seed=seed)
    batch = trainer.global_batch
    order = torch.Generator().manual_seed(seed)
    perm, cursor, window, records = torch.randperm(len(images), generator=order), 0, [], []
    for step in range(cfg.steps):
        rows = []
        while len(rows) < batch:  # epochs of a seeded shuffle, as the stream reads them
            if cursor == len(perm):
                perm, cursor = torch.randperm(len(images), generator=order), 0
            take = min(batch - len(rows), len(perm) - cursor)
            rows += perm[cursor : cursor + take].tolist()
            cursor += take
        terms, update = trainer.train_step(step, images[rows].chunk(cfg.optim.grad_accum))
        window.append(terms.tolist())
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            means = dict(zip(TERMS, (statistics.fmean(col) for col in zip(*window))))
            means["info"] = means["batch_entropy"] - means["teacher_entropy"]
            means["collapse"] = collapse_state(means, cfg.objective.cl.prototypes, batch)
            records.append({"step": step + 1, **means, "lr": update["lr"], "momentum": update["momentum"]})
            window = []
    return records


def print_curve(name: str, records: list[dict], ln_k: float) -> None:
    print(f"\n{name} (ln K {ln_k:.3f})")
    print("| step | mae | cl | koleo | Ht | info | protos | cls std/rms | collapse |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['step']} | {r['mae']:.3f} | {r['cl']:.3f} | {r['koleo']:.2f} | {r['teacher_entropy']:.2f} | "
            f"{r['info']:.2f} | {r['proto_used']:.1f} | {r['cls_std'] / max(r['cls_rms'], 1e-12):.2f} | "
            f"{r['collapse'] or ''} |",
            flush=True,
        )


def plot(curves: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, c in curves.items():
        steps = [r["step"] for r in c["records"]]
        axes[0].plot(steps, [r["mae"] for r in c["records"]], label=name)
        axes[1].plot(steps, [r["cl"] / c["ln_k"] for r in c["records"]], label=name)
        axes[2].plot(steps, [r["info"] for r in c["records"]], label=name)
    for ax, title in zip(axes, ("L_MAE", "L_CL / ln K (1: uniform student)", "target information (nats)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="out/curated/shards", help="curated shards (the curate job's <out>/shards)")
    p.add_argument("--config", default=str(REPO / "configs/pretrain/tiny.yaml"))
    p.add_argument("--steps", type=int, help="steps of every variant (default: the config's)")
    p.add_argument("--every", type=int, default=10, help="steps per printed row")
    p.add_argument("--variant", action="append", help="'name[:key=value ...]'; repeatable (default: the config)")
    p.add_argument("--seed", type=int, default=0, help="data order and view / mask draws")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--json", help="write the curves here")
    p.add_argument("--plot", help="draw the curves into this PNG")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    curves: dict[str, dict] = {}
    images_by_size: dict[tuple[int, int], torch.Tensor] = {}
    for text in args.variant or ["config"]:
        name, overrides = parse_variant(text)
        steps = [f"steps={args.steps}"] if args.steps else []
        cfg = load_config(PretrainConfig, args.config, [*steps, *overrides])
        if cfg.image_size not in images_by_size:
            images_by_size[cfg.image_size] = data.load_images(args.data, cfg.image_size)
        images = images_by_size[cfg.image_size]
        started = time.perf_counter()
        records = run_variant(cfg, images, args.every, args.seed)
        ln_k = math.log(cfg.objective.cl.prototypes)
        curves[name] = {"overrides": overrides, "ln_k": ln_k, "records": records, "seconds": 0.0}
        curves[name]["seconds"] = round(time.perf_counter() - started, 1)
        print_curve(f"{name}: {', '.join(overrides) or 'as configured'}; {len(images)} images, global batch "
                    f"{cfg.samples_per_step()}, {cfg.steps} steps, {curves[name]['seconds']} s", records, ln_k)  # fmt: skip
    print("\n| variant | last mae (first) | last cl / ln K | max cl / ln K after 10% | windows with a collapse |")
    print("|---|---|---|---|---|")
    for name, c in curves.items():
        r = c["records"]
        later = [x["cl"] / c["ln_k"] for x in r if x["step"] > 0.1 * r[-1]["step"]] or [r[-1]["cl"] / c["ln_k"]]
        named = sorted({x["collapse"] for x in r if x["collapse"]})
        print(f"| {name} | {r[-1]['mae']:.3f} ({r[0]['mae']:.3f}) | {r[-1]['cl'] / c['ln_k']:.2f} | {max(later):.2f} | "
              f"{sum(1 for x in r if x['collapse'])}/{len(r)} {', '.join(named)} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(curves, indent=1))
    if args.plot:
        plot(curves, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
