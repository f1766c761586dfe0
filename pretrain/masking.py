"""Mixed blockwise / patchwise masks for masked image modelling, generated for a whole batch at once.

Each sample is masked blockwise with probability ``block_prob`` (0.4), else patchwise (uniformly random patches,
as MAE). Both kinds hide exactly ``num_masked(N, ratio)`` patches per image (2304 of the 64x48 grid at 75 %).

Blockwise: ``blocks`` random rectangles per sample (area uniform between ``min_block_patches`` and
``max_block_frac`` of the grid, aspect ratio log-uniform, as in BEiT / DINOv2's mask generator) are laid down in
order; block ``k`` scores ``2**(K-1-k)`` on the patches it covers, so a patch's summed score ranks it by the first
block that covers it. Taking the ``n_mask`` best-scored patches (random scores in [0, 1) break ties) therefore keeps
whole blocks in order, cuts the block that crosses the budget, and tops up with random patches when all blocks
together cover too little. Unlike the sequential generators this needs no per-sample loop: the union of all blocks
is one batched matrix product of row and column indicators.

All work is a fixed sequence of batched tensor ops on the caller's device, with no Python loop at all and no
data-dependent shapes (no host sync on a GPU). A ``torch.Generator`` makes the masks reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import Field, model_validator
from torch import Tensor

from common.config import Strict


class MaskingConfig(Strict):
    ratio: float = Field(0.75, gt=0, lt=1, description="Fraction of patches masked, exact per image.")
    block_prob: float = Field(
        0.4,
        ge=0,
        le=1,
        description="Per sample: masked blockwise with this probability, else patchwise (uniformly random patches).",
    )
    min_block_patches: int = Field(4, ge=1, description="Smallest block area, in patches.")
    max_block_frac: float = Field(0.5, gt=0, le=1, description="Largest block area, as a fraction of the grid.")
    aspect: tuple[float, float] = Field(
        (0.3, 1 / 0.3), description="(low, high) of a block's height / width, sampled log-uniformly in this range."
    )
    blocks: int = Field(
        16,
        ge=1,
        le=16,
        description="Random blocks per blockwise sample; at most 16, so that the scores 2**k stay exact next to the "
        "[0, 1) tie-breaks in float32.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> MaskingConfig:
        if not 0 < self.aspect[0] <= self.aspect[1]:
            raise ValueError("aspect must be (low, high) with 0 < low <= high")
        return self


@dataclass(frozen=True)
class Masks:
    mask: Tensor  # [B, N] bool, True = masked (hidden from the student encoder)
    keep: Tensor  # [B, n_keep] int64, visible patch indices (row-major on the grid), ascending
    blockwise: Tensor  # [B] bool, which samples were masked blockwise

    @property
    def masked(self) -> Tensor:
        """[B, n_mask] int64, masked patch indices, ascending (computed on demand: the loss uses ``mask``)."""
        return _row_indices(self.mask, self.mask.shape[1] - self.keep.shape[1])


def num_masked(n_patches: int, ratio: float) -> int:
    """Masked patches per image: the visible count is rounded down as in MAE (``int(N * (1 - ratio))``)."""
    return n_patches - int(n_patches * (1 - ratio))


def _row_indices(flags: Tensor, per_row: int) -> Tensor:
    """Column indices of the True entries of each row, ascending; every row holds exactly ``per_row`` of them."""
    if flags.device.type == "cpu":
        cols = flags.nonzero()[:, 1]
    else:  # a fixed output size keeps the GPU from waiting for the count
        cols = torch.nonzero_static(flags, size=flags.shape[0] * per_row)[:, 1]
    return cols.view(flags.shape[0], per_row)


def _block_factors(
    batch: int, grid: tuple[int, int], cfg: MaskingConfig, generator: torch.Generator | None, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Random blocks as row and column indicators, [batch, gh, K] (weighted by block order) and [batch, K, gw]."""
    gh, gw = grid
    k = cfg.blocks
    u_area, u_aspect, u_top, u_left = torch.rand(4, batch, k, 1, generator=generator, device=device)
    max_area = max(cfg.min_block_patches, cfg.max_block_frac * gh * gw)
    area = cfg.min_block_patches + u_area * (max_area - cfg.min_block_patches)
    log_lo, log_hi = math.log(cfg.aspect[0]), math.log(cfg.aspect[1])
    aspect = torch.exp(log_lo + u_aspect * (log_hi - log_lo))
    h = torch.sqrt(area * aspect).round().clamp(1, gh)
    w = torch.sqrt(area / aspect).round().clamp(1, gw)
    top = (u_top * (gh - h + 1)).floor()
    left = (u_left * (gw - w + 1)).floor()
    rows = torch.arange(gh, device=device, dtype=torch.float32)
    cols = torch.arange(gw, device=device, dtype=torch.float32)
    rank = torch.pow(2.0, torch.arange(k - 1, -1, -1, device=device, dtype=torch.float32)).view(1, k, 1)
    in_rows = ((rows >= top) & (rows < top + h)) * rank  # [B, K, gh]
    in_cols = ((cols >= left) & (cols < left + w)).float()  # [B, K, gw]
    return in_rows.transpose(1, 2), in_cols


def block_scores(
    batch: int,
    grid: tuple[int, int],
    cfg: MaskingConfig,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """[batch, gh*gw] float: the sum of ``2**(K-1-k)`` over the random blocks ``k`` covering each patch (0 if none).

    sum_k rank_k * rows_k (x) cols_k is the union of all blocks, weighted by order, in one batched matmul.
    """
    rows, cols = _block_factors(batch, grid, cfg, generator, device)
    return torch.bmm(rows, cols).view(batch, -1)


def generate_masks(
    batch: int,
    grid: tuple[int, int],
    cfg: MaskingConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Masks:
    """Masks for ``batch`` images on a ``grid`` = (gh, gw) patch grid; see the module docstring.

    ``device`` defaults to the generator's device (CPU without one). The result depends only on the generator's
    state, the batch size, the grid and the config.
    """
    cfg = cfg or MaskingConfig()
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    gh, gw = grid
    n = gh * gw
    n_keep = n - num_masked(n, cfg.ratio)
    if n_keep < 1:
        raise ValueError(f"mask ratio {cfg.ratio} leaves no visible patch on a {gh}x{gw} grid")

    blockwise = torch.rand(batch, generator=generator, device=device) < cfg.block_prob
    # Blocks are drawn for every sample and weighted 0 in patchwise ones: fixed shapes, no data-dependent indexing.
    rows, cols = _block_factors(batch, grid, cfg, generator, device)
    noise = torch.rand(batch, gh, gw, generator=generator, device=device)
    score = torch.baddbmm(noise, rows * blockwise.view(-1, 1, 1), cols).view(batch, n)  # noise + block scores
    lowest = score.topk(n_keep, dim=1, largest=False, sorted=False).indices
    visible = torch.zeros(batch, n, dtype=torch.bool, device=device).scatter_(1, lowest, True)
    return Masks(mask=~visible, keep=_row_indices(visible, n_keep), blockwise=blockwise)
