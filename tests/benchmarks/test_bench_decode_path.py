"""The decode-path benchmark compares like with like: every path gives the same crop of the same photo at the same
size, so its ratios are of the decode alone."""

import numpy as np
import pytest

from benchmarks.bench_decode_path import OUT_HW, full_decode_crop, rows, torchvision_decode_crop
from pretrain.data import decode_crop


@pytest.mark.parametrize("side", [1280, 3072])  # below and above the reduced decode's 2x threshold
def test_every_path_gives_the_projects_picture(side):
    row = max(rows((side,))[side], key=lambda r: r["width"] * r["height"])
    ours = decode_crop(row, OUT_HW).astype(np.float32)
    assert ours.shape == (*OUT_HW, 3)
    full = full_decode_crop(row).astype(np.float32)
    tv = torchvision_decode_crop(row)[0].permute(1, 2, 0).numpy().astype(np.float32)
    for other in (full, tv):
        assert other.shape == ours.shape
        assert np.abs(other - ours).mean() < 2  # resampling differs by ~0.3 levels; a 20-px shift gives ~35
