"""Image embedding for dedup and balanced sampling. Lite profile: a classical descriptor standing in for CLIP.

``lite-colour-gradient-v1`` knows colour and layout, not semantics: near-duplicates (recompressed, resized,
slightly cropped copies) land close together and unrelated photos further apart, which is what the kNN dedup
and k-means sampling need to run end to end; it cannot tell "a person" from "a statue". Three blocks, computed
on one decode of about ``_DECODE_SIDE`` pixels:

- colour layout (108): the image area-averaged to a 6x6 CIELAB thumbnail, L centred on mid-grey.
- colour histogram (108): HSV joint histogram, 12 hue x 3 saturation x 3 value bins, Hellinger-mapped (sqrt).
- gradient orientation pyramid (168): magnitude-weighted histograms of unsigned gradient orientation (8 bins,
  linearly interpolated between bins) on a 4x4, 2x2 and 1x1 grid of the image resized to 128x128.

Each block is power-normalised (signed square root), L2-normalised and weighted (``_BLOCK_WEIGHTS``, squared
weights summing to 1), then the whole is L2-normalised: float32, 384 values. Mirror images are not treated as
duplicates: layout and orientations are kept left to right. If ``cfg.models.embedding.dim`` differs from 384,
a fixed seeded orthonormal projection maps to it (exactly cosine-preserving when the dim is larger).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from common.imageio import decode
from curation.score.stage import Row, Stage, StageSettings, Update

LITE_NAME = "lite-colour-gradient-v1"
NATIVE_DIM = 384
_DECODE_SIDE = 256
_LAYOUT = 6  # colour layout grid
_HSV_BINS = (12, 3, 3)
_GRAD_SIDE = 128
_ORIENT_BINS = 8
_GRID_LEVELS = (4, 2, 1)
# Share of each block in the squared norm: layout and histograms carry colour, the pyramid carries structure.
_BLOCK_WEIGHTS = {"layout": 0.35, "hsv": 0.25, "gradient": 0.40}


def _power_l2(x: np.ndarray) -> np.ndarray:
    x = np.sign(x) * np.sqrt(np.abs(x))
    n = float(np.linalg.norm(x))
    return x / n if n > 1e-12 else x


def _colour_layout(rgb01: np.ndarray) -> np.ndarray:
    import cv2

    lab = cv2.cvtColor(cv2.resize(rgb01, (_LAYOUT, _LAYOUT), interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2Lab)
    # L in [0, 100], a and b within about +-100: centre L so a mid-grey image is the origin, not a direction.
    return ((lab - np.array([50.0, 0.0, 0.0], np.float32)) / 50.0).ravel()


def _hsv_histogram(rgb8: np.ndarray) -> np.ndarray:
    import cv2

    hsv = cv2.cvtColor(rgb8, cv2.COLOR_RGB2HSV_FULL)  # hue over 0..255
    hist = cv2.calcHist([hsv], [0, 1, 2], None, list(_HSV_BINS), [0, 256, 0, 256, 0, 256]).ravel()
    return np.sqrt(hist / max(float(hist.sum()), 1.0))


def _gradient_pyramid(rgb8: np.ndarray) -> np.ndarray:
    import cv2

    gray = cv2.resize(cv2.cvtColor(rgb8, cv2.COLOR_RGB2GRAY), (_GRAD_SIDE, _GRAD_SIDE), interpolation=cv2.INTER_AREA)
    gray = gray.astype(np.float32)
    gx = cv2.Sobel(gray, cv2.CV_32F, 1, 0, ksize=3)
    gy = cv2.Sobel(gray, cv2.CV_32F, 0, 1, ksize=3)
    mag, ang = cv2.cartToPolar(gx, gy)
    pos = (ang % np.pi) / np.pi * _ORIENT_BINS - 0.5  # unsigned orientation in bin units, centred bins
    lo = np.floor(pos)
    frac = pos - lo
    lo = lo.astype(np.int64) % _ORIENT_BINS
    hi = (lo + 1) % _ORIENT_BINS
    # Per-pixel soft votes into the finest grid: (cell_y, cell_x, bin).
    g = _GRID_LEVELS[0]
    cell = (np.arange(_GRAD_SIDE) * g // _GRAD_SIDE).astype(np.int64)
    cell_index = (cell[:, None] * g + cell[None, :]) * _ORIENT_BINS
    votes = np.bincount((cell_index + lo).ravel(), (mag * (1 - frac)).ravel(), g * g * _ORIENT_BINS)
    votes += np.bincount((cell_index + hi).ravel(), (mag * frac).ravel(), g * g * _ORIENT_BINS)
    finest = votes.reshape(g, g, _ORIENT_BINS)
    levels = []
    for level in _GRID_LEVELS:
        k = g // level
        levels.append(finest.reshape(level, k, level, k, _ORIENT_BINS).sum(axis=(1, 3)).ravel())
    return np.concatenate(levels) / (_GRAD_SIDE * _GRAD_SIDE)


@lru_cache(maxsize=4)
def _projection(dim: int) -> np.ndarray:
    """A fixed (NATIVE_DIM, dim) matrix with orthonormal rows (dim >= NATIVE_DIM) or columns (dim < NATIVE_DIM)."""
    rng = np.random.default_rng(20240531)
    q, _ = np.linalg.qr(rng.standard_normal((max(dim, NATIVE_DIM), min(dim, NATIVE_DIM))))
    return (q.T if dim >= NATIVE_DIM else q).astype(np.float32)


def embed(rgb: np.ndarray, dim: int = NATIVE_DIM) -> np.ndarray:
    """The ``lite-colour-gradient-v1`` embedding of a decoded uint8 RGB (or grayscale) image: unit norm, float32."""
    import cv2

    if rgb.ndim == 2:
        rgb = cv2.cvtColor(rgb, cv2.COLOR_GRAY2RGB)
    blocks = {
        "layout": _colour_layout(rgb.astype(np.float32) / 255.0),
        "hsv": _hsv_histogram(rgb),
        "gradient": _gradient_pyramid(rgb),
    }
    x = np.concatenate([np.sqrt(_BLOCK_WEIGHTS[k]) * _power_l2(v) for k, v in blocks.items()]).astype(np.float32)
    if dim != NATIVE_DIM:
        x = x @ _projection(dim)
    n = float(np.linalg.norm(x))
    return x / n if n > 1e-12 else x


class EmbeddingStage(Stage):
    name = "embedding"
    reads = ("image",)
    writes = ("embedding",)  # a column of the tables (its size is models.embedding.dim)
    model_section = "embedding"
    default_settings = StageSettings(batch_size=32, num_cpus=0.5)
    default_order = 60

    def setup(self) -> None:
        import cv2

        model = self.cfg.models.embedding.name
        if model != LITE_NAME:
            raise ValueError(f"embedding stage computes only {LITE_NAME!r}; models.embedding.name is {model!r}")
        cv2.setNumThreads(self.threads)

    def process_batch(self, rows: list[Row]) -> list[Update]:
        dim = self.cfg.models.embedding.dim
        return [
            {"embedding": embed(decode(row["image"]["bytes"], max_side=_DECODE_SIDE), dim).tolist()} for row in rows
        ]
