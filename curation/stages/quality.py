"""Technical quality: the lite profile's stand-in for a learned aesthetic model.

Five measurements on one decode at ``cfg.models.quality.max_side`` (long side), each mapped to a part score in
[0, 1] by a smoothstep ramp ``_ramp(x, lo, hi)`` (0 at or below ``lo``, 1 at or above ``hi``; reversed where a
larger value is worse). The thresholds were set on real photos and on degraded copies of them (heavy blur,
x0.15 brightness, x3 brightness, sigma-40 noise, near-flat); see tests/curation/stages/test_quality_phash_embedding.py.

- sharpness: RMS Laplacian / RMS gradient magnitude over the 10 % strongest-gradient pixels. For an edge
  blurred by a Gaussian of sigma s pixels this ratio falls as 1/s and it does not depend on contrast, so dark
  or flat-lit photos are not called blurry. Images decoded smaller than ``max_side`` are scaled by
  long_side / max_side, i.e. judged as if shown at ``max_side``. Part = ramp(ratio, 0.35, 1.50)
  (sharp photos measure about 1.0-2.1, a sigma-3 px blur about 0.2-0.35).
- exposure: product of three terms: highlight clipping, the fraction of channel samples >= 250, scored
  1 - ramp(f, 0.07, 0.22); crushed shadows, the fraction of pixels with luma < 16, scored 1 - ramp(f, 0.40, 0.90)
  (generous: low-key photos have large black areas); and the key, mean luma / 255, scored ramp(m, 0.08, 0.25)
  (under-exposure shows as a low mean long before shadows are fully crushed).
- contrast: luma 1st-99th percentile range / 255, part = ramp(range, 0.15, 0.80).
- colourfulness: Hasler and Suesstrunk's M (2003), part = ramp(M, 5, 45); 33 is "moderately colourful".
- noise: Immerkaer's (1996) Laplacian-difference estimate of sigma in 8-bit levels, made robust to edges and
  texture by taking the median absolute response instead of the mean; part = 1 - ramp(sigma, 2.0, 5.0).

``quality`` is the weighted geometric mean of the parts (``cfg.models.quality.weights``), each floored at
``_FLOOR`` so that one part at zero pulls the score far down without making it exactly zero. Colourfulness has
a small weight so grayscale photos (part 0) lose about a fifth of their score, not all of it. With the default
weights one decisive part at zero leaves at most about 0.36, under the default ``filters.min_quality`` of 0.5,
while an otherwise perfect grayscale photo scores 0.79.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from common.imageio import decode
from common.schema import QUALITY_PARTS_TYPE
from curation.score.stage import Row, Stage, StageSettings, Update
from curation.settings import Filters

PARTS = tuple(field.name for field in QUALITY_PARTS_TYPE)
_FLOOR = 0.01
_WEAK = 0.5  # parts below this are named in a rejection detail (the weakest one always is)

# Immerkaer's kernel: the difference of two Laplacians, zero response to locally planar intensity.
_NOISE_KERNEL = np.array([[1, -2, 1], [-2, 4, -2], [1, -2, 1]], np.float32)
# |response| of N(0, s^2) noise is half-normal with scale 6 s (the kernel's L2 norm is 6); its median is 0.6745 * 6 s.
_NOISE_MEDIAN_TO_SIGMA = 1.0 / (0.6745 * 6.0)


def _ramp(x: float, lo: float, hi: float) -> float:
    """Smoothstep from 0 at ``lo`` to 1 at ``hi``."""
    t = min(1.0, max(0.0, (x - lo) / (hi - lo)))
    return t * t * (3.0 - 2.0 * t)


def measure(rgb: np.ndarray, max_side: int) -> dict[str, float]:
    """The raw measurements of an RGB (or grayscale) uint8 image decoded with long side <= ``max_side``."""
    import cv2

    if rgb.ndim == 2:
        rgb = cv2.cvtColor(rgb, cv2.COLOR_GRAY2RGB)
    luma8 = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    luma = luma8.astype(np.float32)
    n = luma.size

    gx = cv2.Sobel(luma, cv2.CV_32F, 1, 0, ksize=3, scale=0.125)  # scale: per-pixel intensity difference
    gy = cv2.Sobel(luma, cv2.CV_32F, 0, 1, ksize=3, scale=0.125)
    g2 = (gx * gx + gy * gy).ravel()
    lap = cv2.Laplacian(luma, cv2.CV_32F, ksize=1).ravel()
    edges = g2 >= np.partition(g2, int(0.9 * (n - 1)))[int(0.9 * (n - 1))]
    g2_edges = float(g2[edges].mean())
    ratio = float(np.sqrt(np.mean(lap[edges] ** 2) / g2_edges)) if g2_edges > 1e-6 else 0.0
    ratio *= min(1.0, max(rgb.shape[:2]) / max_side)

    hist = np.bincount(luma8.ravel(), minlength=256)
    cdf = np.cumsum(hist) / n
    p1, p99 = int(np.searchsorted(cdf, 0.01)), int(np.searchsorted(cdf, 0.99))

    f = rgb.astype(np.float32)
    rg = f[..., 0] - f[..., 1]
    yb = 0.5 * (f[..., 0] + f[..., 1]) - f[..., 2]
    colourfulness = float(np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean()))

    # Integer kernel on integer luma: the responses are exact integers, so a histogram gives the median cheaply.
    response = np.abs(cv2.filter2D(luma8, cv2.CV_16S, _NOISE_KERNEL)[1:-1, 1:-1].astype(np.int32))
    counts = np.cumsum(np.bincount(response.ravel()))
    noise_sigma = float(np.searchsorted(counts, counts[-1] / 2.0)) * _NOISE_MEDIAN_TO_SIGMA

    return {
        "edge_ratio": ratio,
        "highlight_clip": float(np.count_nonzero(rgb >= 250)) / rgb.size,
        "shadow_clip": float(hist[:16].sum()) / n,
        "mean_luma": float(luma8.mean()) / 255.0,
        "luma_range": (p99 - p1) / 255.0,
        "colourfulness": colourfulness,
        "noise_sigma": noise_sigma,
    }


def part_scores(m: dict[str, float]) -> dict[str, float]:
    """Map raw measurements to part scores in [0, 1] (thresholds documented in the module docstring)."""
    exposure = (
        (1.0 - _ramp(m["highlight_clip"], 0.07, 0.22))
        * (1.0 - _ramp(m["shadow_clip"], 0.40, 0.90))
        * _ramp(m["mean_luma"], 0.08, 0.25)
    )
    return {
        "sharpness": _ramp(m["edge_ratio"], 0.35, 1.50),
        "exposure": exposure,
        "contrast": _ramp(m["luma_range"], 0.15, 0.80),
        "colourfulness": _ramp(m["colourfulness"], 5.0, 45.0),
        "noise": 1.0 - _ramp(m["noise_sigma"], 2.0, 5.0),
    }


def combine(parts: dict[str, float], weights: dict[str, float]) -> float:
    """Weighted geometric mean of the parts, each floored at ``_FLOOR``."""
    total = sum(weights.values())
    log_q = sum(w * np.log(max(parts[k], _FLOOR)) for k, w in weights.items()) / total
    return float(np.exp(log_q))


def quality_of(rgb: np.ndarray, max_side: int, weights: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``(quality, parts)`` of a decoded image: the code path the stage, tests and benchmarks share."""
    parts = part_scores(measure(rgb, max_side))
    return combine(parts, weights), parts


def weakest(parts: dict[str, float]) -> str:
    """'name=score' of the parts below ``_WEAK``, weakest first (at least the weakest one)."""
    ranked = sorted(parts.items(), key=lambda kv: kv[1])
    named = [kv for kv in ranked if kv[1] < _WEAK] or ranked[:1]
    return ", ".join(f"{k}={v:.2f}" for k, v in named)


class QualityStage(Stage):
    name = "quality"
    reads = ("image",)
    columns = (pa.field("quality", pa.float32()), pa.field("quality_parts", QUALITY_PARTS_TYPE))
    model_section = "quality"
    thresholds = decided = ("min_quality",)
    decision_codes = ("low_quality",)
    default_settings = StageSettings(batch_size=16, num_cpus=0.5)
    default_order = 30

    def setup(self) -> None:
        import cv2

        cv2.setNumThreads(self.threads)

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row["image"]["bytes"]) for row in rows]

    def _one(self, data: bytes) -> Update:
        settings = self.cfg.models.quality
        rgb = decode(data, max_side=settings.max_side, mode="RGB")
        quality, parts = quality_of(rgb, settings.max_side, settings.weights)
        return {"quality": quality, "quality_parts": parts}

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        quality, threshold = row["quality"], filters.min_quality
        if quality < threshold:
            return f"low_quality: quality {quality:.3f} < {threshold}; weakest: {weakest(row['quality_parts'])}"
        return None
