"""Task losses (Sapiens2's public configs): each is 0 for a perfect prediction and returns (total, named terms).

- pose: mean squared error on the heatmaps, over labelled keypoints only;
- seg: per-pixel class-weighted cross-entropy + Dice, both skipping ``ignore_index`` pixels;
- normal: cosine (1 - n.n*) + L1 + L1 of the spatial gradients;
- albedo: L1 + gradient L1 + chromaticity L1 (colour ratios, independent of brightness);
- pointmap: L1 after the least-squares scale alignment (the shape, free of the monocular scale ambiguity), divided
  by the mean depth, + a small absolute L1 (scale-aware) + gradient L1 of the aligned points.

Dense losses average over the labelled pixels (``mask``); gradients use pairs of neighbouring labelled pixels.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` [B, H, W] (or [B, H, W, C], averaged over C) over ``mask`` [B, H, W]; 0 when empty."""
    if x.dim() == mask.dim() + 1:
        x = x.mean(-1)
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


def gradient_l1(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """L1 between the x and y finite differences of [B, H, W, C] maps, where both pixels of a pair are labelled."""
    total, count = pred.new_zeros(()), pred.new_zeros(())
    for dim in (1, 2):
        n = pred.shape[dim] - 1
        dp = pred.narrow(dim, 1, n) - pred.narrow(dim, 0, n)
        dt = target.narrow(dim, 1, n) - target.narrow(dim, 0, n)
        pair = (mask.narrow(dim, 1, n) & mask.narrow(dim, 0, n)).to(pred.dtype)
        total = total + ((dp - dt).abs().mean(-1) * pair).sum()
        count = count + pair.sum()
    return total / count.clamp_min(1)


def heatmap_loss(pred: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """MSE over heatmaps [B, K, h, w] of keypoints with ``weight`` [B, K] > 0."""
    per_kp = ((pred.float() - target) ** 2).mean(dim=(2, 3))
    return (per_kp * weight).sum() / weight.sum().clamp_min(1)


def balanced_class_weights(counts: np.ndarray, max_weight: float = 10.0) -> list[float]:
    """Per-class CE / Dice weights from pixel counts: sqrt(median frequency / frequency), in [1/max, max].

    The square root of median-frequency balancing: rare classes (lips, socks, eyeglasses: a few pixels a person)
    weigh up to ``max_weight`` times a median class without drowning the large ones. Classes absent from the
    counts get 1."""
    counts = np.asarray(counts, np.float64)
    present = counts > 0
    if not present.any():
        return [1.0] * len(counts)
    freq = counts / counts.sum()
    weights = np.ones(len(counts))
    weights[present] = np.clip(np.sqrt(np.median(freq[present]) / freq[present]), 1 / max_weight, max_weight)
    return [round(float(w), 4) for w in weights]


def seg_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    class_weights: Tensor | None = None,
    ignore_index: int = 255,
    ce_weight: float = 1.0,
    dice_weight: float = 1.0,
    smooth: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits [B, C, H, W], labels [B, H, W] (int)."""
    logits = logits.float()
    ce = F.cross_entropy(logits, labels, weight=class_weights, ignore_index=ignore_index)
    if not torch.isfinite(ce):  # every pixel ignored
        ce = logits.sum() * 0
    valid = labels != ignore_index
    probs = logits.softmax(1) * valid[:, None]
    onehot = F.one_hot(labels.clamp(0, logits.shape[1] - 1) * valid, logits.shape[1]).permute(0, 3, 1, 2)
    onehot = onehot.to(probs.dtype) * valid[:, None]
    inter = (probs * onehot).sum(dim=(0, 2, 3))
    denom = probs.sum(dim=(0, 2, 3)) + onehot.sum(dim=(0, 2, 3))
    dice_c = 1 - (2 * inter + smooth) / (denom + smooth)
    if class_weights is not None:
        dice = (dice_c * class_weights).sum() / class_weights.sum()
    else:
        dice = dice_c.mean()
    return ce_weight * ce + dice_weight * dice, {"ce": ce.detach(), "dice": dice.detach()}


def normal_loss(
    pred: Tensor, target: Tensor, mask: Tensor, *, cos_weight: float = 1.0, l1_weight: float = 1.0,
    grad_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Unit normals [B, H, W, 3]."""
    cos = masked_mean(1 - (pred * target).sum(-1), mask)
    l1 = masked_mean((pred - target).abs(), mask)
    grad = gradient_l1(pred, target, mask)
    total = cos_weight * cos + l1_weight * l1 + grad_weight * grad
    return total, {"cos": cos.detach(), "l1": l1.detach(), "grad": grad.detach()}


def chromaticity(rgb: Tensor, eps: float = 1e-3) -> Tensor:
    return rgb / (rgb.sum(-1, keepdim=True) + eps)


def albedo_loss(
    pred: Tensor, target: Tensor, mask: Tensor, *, l1_weight: float = 1.0, grad_weight: float = 1.0,
    chroma_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Albedo [B, H, W, 3] in [0, 1]."""
    l1 = masked_mean((pred - target).abs(), mask)
    grad = gradient_l1(pred, target, mask)
    chroma = masked_mean((chromaticity(pred) - chromaticity(target)).abs(), mask)
    total = l1_weight * l1 + grad_weight * grad + chroma_weight * chroma
    return total, {"l1": l1.detach(), "grad": grad.detach(), "chroma": chroma.detach()}


def align_scale(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Per image, the s > 0 minimising sum over ``mask`` of |s * pred - target|^2: [B]."""
    m = mask[..., None].to(pred.dtype)
    num = (pred * target * m).sum(dim=(1, 2, 3))
    den = (pred * pred * m).sum(dim=(1, 2, 3))
    return (num / den.clamp_min(1e-12)).clamp_min(1e-6)


def pointmap_loss(
    pred: Tensor, target: Tensor, mask: Tensor, *, aligned_weight: float = 1.0, absolute_weight: float = 0.1,
    grad_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Camera-frame points [B, H, W, 3]."""
    scale = align_scale(pred, target, mask)
    aligned = pred * scale[:, None, None, None]
    m = mask.to(pred.dtype)
    depth = ((target[..., 2] * m).sum(dim=(1, 2)) / m.sum(dim=(1, 2)).clamp_min(1)).clamp_min(1e-6)
    norm = depth[:, None, None, None]  # errors relative to the image's mean depth: every image counts alike
    rel = masked_mean((aligned - target).abs() / norm, mask)
    absolute = masked_mean((pred - target).abs(), mask)
    grad = gradient_l1(aligned / norm, target / norm, mask)
    total = aligned_weight * rel + absolute_weight * absolute + grad_weight * grad
    return total, {"aligned": rel.detach(), "absolute": absolute.detach(), "grad": grad.detach()}
