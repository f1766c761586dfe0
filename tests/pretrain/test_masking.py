"""Mixed blockwise / patchwise masking: exact counts, block statistics, block geometry, determinism, batching."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain.masking import MaskingConfig, block_scores, generate_masks, num_masked

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("grid", "ratio"), [((64, 48), 0.75), ((14, 14), 0.75), ((4, 3), 0.75), ((8, 8), 0.6), ((5, 7), 0.4)]
)
def test_exact_count_and_consistent_indices(grid: tuple[int, int], ratio: float) -> None:
    n = grid[0] * grid[1]
    m = generate_masks(512, grid, MaskingConfig(ratio=ratio), generator=_gen())
    n_mask = num_masked(n, ratio)
    assert m.mask.shape == (512, n) and m.mask.dtype == torch.bool
    assert (m.mask.sum(1) == n_mask).all()  # exact, per image, blockwise and patchwise alike
    assert m.keep.shape == (512, n - n_mask) and m.masked.shape == (512, n_mask)
    assert (m.keep.diff(dim=1) > 0).all() and (m.masked.diff(dim=1) > 0).all()  # ascending, no repeats
    # Distinct visible indices + distinct masked ones, n in all: together they are every patch exactly once.
    assert not m.mask.gather(1, m.keep).any() and m.mask.gather(1, m.masked).all()


def test_mask_count_follows_mae_rounding() -> None:
    assert num_masked(3072, 0.75) == 2304  # the 64x48 grid at 1024x768
    assert num_masked(12, 0.75) == 9
    assert num_masked(10, 0.75) == 8  # visible = int(10 * 0.25) = 2


def test_block_fraction_near_probability() -> None:
    m = generate_masks(8192, (16, 12), generator=_gen(1))
    # 0.4 +- 5 sigma (sigma = sqrt(0.4 * 0.6 / 8192) = 0.0054)
    assert abs(m.blockwise.float().mean().item() - 0.4) < 0.027


def _neighbours_masked(mask: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Per sample: the fraction of masked interior patches whose four neighbours are all masked."""
    m = mask.view(-1, *grid).float()
    inner = m[:, 1:-1, 1:-1]
    around = m[:, :-2, 1:-1] * m[:, 2:, 1:-1] * m[:, 1:-1, :-2] * m[:, 1:-1, 2:]
    return (inner * around).sum((1, 2)) / inner.sum((1, 2))


def test_blockwise_masks_are_blocks_and_patchwise_are_uniform() -> None:
    grid = (32, 24)
    m = generate_masks(2048, grid, generator=_gen(2))
    clustered = _neighbours_masked(m.mask, grid)
    # Uniform patches at 75 %: about 0.75 ** 4 = 0.32 of masked patches have four masked neighbours; unions of
    # rectangles have almost all of theirs inside.
    assert clustered[~m.blockwise].mean() == pytest.approx(0.75**4, abs=0.02)
    assert clustered[m.blockwise].mean() > 0.8
    # Patchwise: every position is masked equally often (no spatial bias from tie-breaking or the block path).
    small = (8, 6)
    pw = generate_masks(6000, small, MaskingConfig(block_prob=0.0), generator=_gen(3))
    assert not pw.blockwise.any()
    freq = pw.mask.float().mean(0)
    assert (freq - 0.75).abs().max() < 0.03  # 5 sigma at 6000 samples


def test_single_block_is_an_exact_rectangle() -> None:
    # One 4x4 block (area fixed at 16, aspect 1) and a budget of exactly 16 patches: the mask is that square.
    cfg = MaskingConfig(
        ratio=0.25, block_prob=1.0, blocks=1, min_block_patches=16, max_block_frac=0.25, aspect=(1.0, 1.0)
    )
    m = generate_masks(256, (8, 8), cfg, generator=_gen(4))
    for sample in m.mask.view(-1, 8, 8):
        rows, cols = sample.nonzero().unbind(1)
        assert rows.max() - rows.min() == 3 and cols.max() - cols.min() == 3  # 16 patches in a 4x4 box: the box
    # Bigger budget: the square is kept whole and random patches top the mask up.
    m = generate_masks(256, (8, 8), cfg.model_copy(update={"ratio": 0.5}), generator=_gen(4))
    squares = m.mask.view(-1, 8, 8).float().unfold(1, 4, 1).unfold(2, 4, 1).sum((-1, -2))
    assert (squares.amax((1, 2)) == 16).all()
    # Smaller budget than one block: the mask stays inside the block.
    big = cfg.model_copy(update={"min_block_patches": 36, "max_block_frac": 36 / 64})
    m = generate_masks(256, (8, 8), big, generator=_gen(4))
    for sample in m.mask.view(-1, 8, 8):
        rows, cols = sample.nonzero().unbind(1)
        assert rows.max() - rows.min() <= 5 and cols.max() - cols.min() <= 5


def test_earlier_blocks_rank_above_later_ones() -> None:
    cfg = MaskingConfig(blocks=3)
    scores = block_scores(64, (16, 12), cfg, generator=_gen(5))
    # Weights 4, 2, 1: every combination of covering blocks gives a distinct score in 0..7.
    assert set(scores.unique().tolist()) <= set(range(8))
    assert (scores >= 4).any(1).all()  # the first block always lands somewhere


def test_deterministic_under_seed_and_varies_with_it() -> None:
    a = generate_masks(64, (16, 12), generator=_gen(7))
    b = generate_masks(64, (16, 12), generator=_gen(7))
    c = generate_masks(64, (16, 12), generator=_gen(8))
    assert torch.equal(a.mask, b.mask) and torch.equal(a.keep, b.keep) and torch.equal(a.blockwise, b.blockwise)
    assert not torch.equal(a.mask, c.mask)
    assert len({tuple(row.tolist()) for row in a.keep}) == 64  # every image gets its own mask


class _CountCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_batched_without_per_sample_or_per_patch_loops() -> None:
    # The number of torch calls must not grow with the batch or the grid: no Python loop over samples or patches.
    counts = []
    for batch, grid in [(1, (4, 3)), (256, (64, 48)), (17, (32, 24))]:
        with _CountCalls() as mode:
            generate_masks(batch, grid, generator=_gen())
        counts.append(mode.calls)
    assert counts[0] > 10 and counts[0] == counts[1] == counts[2]
    # Nor with the number of blocks: they are one batched dimension, not a loop.
    with _CountCalls() as mode:
        generate_masks(1, (4, 3), MaskingConfig(blocks=2), generator=_gen())
    assert counts[0] == mode.calls


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        MaskingConfig(aspect=(2.0, 1.0))
    with pytest.raises(ValueError):
        MaskingConfig(ratio=1.0)
    with pytest.raises(ValueError):
        MaskingConfig(blocks=17)  # 2**16 scores would no longer stay exact next to the tie-breaks
    with pytest.raises(ValueError, match="no visible patch"):
        generate_masks(2, (1, 2), MaskingConfig(ratio=0.9))
