"""Learning-rate and weight-decay schedules, by optimiser step (so gradient accumulation does not stretch them)."""

from __future__ import annotations

import math

from training.config import OptimSettings

LR_REFERENCE_BATCH = 256  # ``optim.lr`` is the learning rate of this many images per optimiser step


def peak_lr(o: OptimSettings, global_batch: int) -> float:
    """The linear scaling rule (MAE, Sapiens v1): ``o.lr x global_batch / 256``, ``global_batch`` being the images of
    one optimiser step over all workers (micro-batches included). ``o.min_lr`` is absolute, as in MAE's code."""
    return o.lr * global_batch / LR_REFERENCE_BATCH


def lr_at(step: int, o: OptimSettings, total: int, global_batch: int) -> float:
    """Linear warm-up to ``peak_lr`` over ``warmup_steps``, then cosine to ``min_lr`` at ``total`` (optimiser
    steps)."""
    peak = peak_lr(o, global_batch)
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + (peak - o.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def wd_at(step: int, o: OptimSettings, total: int) -> float:
    """Cosine from ``weight_decay`` at step 0 to ``weight_decay_end`` at ``total``; constant without an end."""
    if o.weight_decay_end is None:
        return o.weight_decay
    progress = min(1.0, step / max(1, total))
    return o.weight_decay_end + (o.weight_decay - o.weight_decay_end) * 0.5 * (1 + math.cos(math.pi * progress))
