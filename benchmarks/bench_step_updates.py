"""The two parameter-wide updates at the end of a pretraining step, side by side: the EMA teacher update and AdamW.

    python benchmarks/bench_step_updates.py [--size tiny] [--repeats 30]

On the parameters the step updates (``pretrain.train.build_model``: FSDP2 over a process group of one, so DTensors),
and on the same parameters as plain tensors:

- EMA teacher (``JointObjective.update_teacher``): a ``lerp_`` per parameter, one ``torch._foreach_lerp_`` over the
  lists (what it runs), and ``_foreach_mul_`` + ``_foreach_add_``; all three from the same start must agree;
- AdamW over the trainable parameters: the per-tensor loop (``foreach=False``), ``foreach=True`` and ``fused=True``
  (what ``build_optimizer`` uses).

Prints the median ms of each and its speed-up over the per-tensor loop, beside the whole step's median. These
machines are shared and noisy: compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from pretrain.config import PretrainConfig
from pretrain.train import Trainer, build_model

TINY = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "tiny.yaml"


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ema_variants(teacher: list[torch.Tensor], student: list[torch.Tensor], m: float) -> dict[str, Callable[[], None]]:
    def loop() -> None:
        for t, s in zip(teacher, student):
            t.lerp_(s, 1 - m)

    def foreach_lerp() -> None:
        torch._foreach_lerp_(teacher, student, 1 - m)

    def foreach_mul_add() -> None:
        torch._foreach_mul_(teacher, m)
        torch._foreach_add_(teacher, student, alpha=1 - m)

    return {"lerp_ per tensor": loop, "_foreach_lerp_": foreach_lerp, "_foreach_mul_ + _foreach_add_": foreach_mul_add}


def adamw_variants(params: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    return {
        name: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.04, **kw).step
        for name, kw in (
            ("per tensor", {"foreach": False}),
            ("foreach=True", {"foreach": True}),
            ("fused=True", {"fused": True}),
        )
    }


def side_by_side(title: str, variants: dict[str, Callable[[], None]], repeats: int, step_ms: float) -> None:
    times = {name: median_ms(fn, repeats) for name, fn in variants.items()}
    base = next(iter(times.values()))
    print(f"\n{title}")
    for name, ms in times.items():
        print(f"  {name:<32} {ms:8.3f} ms  x{base / ms:5.2f} vs per tensor  {ms / step_ms:6.1%} of the step")


def local(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="backbone size (pretrain/backbone.py SIZES)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config(PretrainConfig, TINY, ["ray.workers=1", f"model.size={args.size}"])
    device = torch.device("cpu")
    model = build_model(cfg, device)
    trainer = Trainer(model, cfg, device)
    images = [torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8)]
    step_ms = median_ms(lambda: trainer.train_step(0, images), max(3, args.repeats // 5))
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread")
    print(f"size {args.size}, {cfg.image_size}, batch {cfg.data.batch_size}: the whole step {step_ms:.1f} ms (median)")

    teacher = [*model.teacher["backbone"].parameters(), *model.teacher["head"].parameters()]
    student = [*model.student.parameters(), *model.head.parameters()]
    m = 0.996
    # the same start for each variant: they must land on the same teacher
    start = [t.detach().clone() for t in local(teacher)]
    results = []
    for fn in ema_variants(teacher, student, m).values():
        with torch.no_grad():
            for t, t0 in zip(local(teacher), start):
                t.copy_(t0)
            fn()
        results.append([t.detach().clone() for t in local(teacher)])
    worst = max(float((a - b).abs().max()) for other in results[1:] for a, b in zip(results[0], other))
    print(f"EMA: {len(teacher)} tensors; largest difference between the variants {worst:.2e}")
    with torch.no_grad():
        for name, (t, s) in {
            "sharded (DTensor)": (teacher, student),
            "plain": (local(teacher), local(student)),
        }.items():
            side_by_side(f"EMA teacher update, {name}", ema_variants(t, s, m), args.repeats, step_ms)

    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.randn_like(p)
    plain = [torch.nn.Parameter(t.detach().clone()) for t in local(trainable)]
    for p, q in zip(plain, local(trainable)):
        p.grad = torch.randn_like(q)
    side_by_side(
        f"AdamW, {len(trainable)} tensors, sharded (DTensor)", adamw_variants(trainable), args.repeats, step_ms
    )
    side_by_side("AdamW, plain", adamw_variants(plain), args.repeats, step_ms)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
