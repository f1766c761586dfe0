"""PDQ, the 256-bit perceptual hash industry hash-sharing programmes exchange (Meta's, through the ``pdqhash``
bindings): what a takedown or blocklist line ``pdq:<64 hex>`` names (``common.takedown_lists``), stored per image by
the phash stage (the ``pdq`` column).

It is computed as the reference hasher does, on the decoded RGB picture; a JPEG of 2048 px or more is decoded in draft
mode to at least ``PDQ_DRAFT_SIDE`` (PDQ's own box filters reduce it to 64x64: 0 bits from the full decode on the
package photos, a 4320 px one included). ~8 ms per image (``benchmarks/bench_pdq.py``).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from common.imageio import open_reduced

PDQ_DRAFT_SIDE = 1024
PDQ_BYTES = 32
PDQ_MIN_QUALITY = 50  # below this the reference treats a hash as too weak to match on (flat or tiny pictures)


def pdq_of_image(image: Image.Image) -> tuple[bytes, int]:
    """The PDQ hash (32 bytes, most significant bit first: ``.hex()`` is the reference's hex) and its quality
    (0-100)."""
    import pdqhash

    bits, quality = pdqhash.compute(np.asarray(image if image.mode == "RGB" else image.convert("RGB")))
    return np.packbits(np.asarray(bits, bool)).tobytes(), int(quality)  # bits: bit 255 first


def pdq_of(data: bytes) -> tuple[bytes, int]:
    """The PDQ hash and quality of encoded image bytes (``pdq_of_image`` on the decode described above)."""
    return pdq_of_image(open_reduced(data, max_side=PDQ_DRAFT_SIDE))


# A copy cropped from a reported picture: PDQ moves 40-80 bits for a crop keeping 95% of each side (the package
# photos), as far as it moves for an unrelated picture's near neighbour. So a report lists, beside its picture's hash,
# those of windows of it a light crop frames: 93%, 95% and 97% of each side at every 0.5% step of position (a window
# 0.25% off the crop is within ~20 bits of it), and of the picture at 3/4 and 1/2 size (a small picture resized moves
# by resampling: of the real photos' resized copies PDQ misses, these find 20 of 24). 398 hashes a picture, ~0.9 s;
# their chance cost is counted per line.
REPORT_SCALES = (0.75, 0.5)
REPORT_WINDOW_SCALES = (0.93, 0.95, 0.97)
REPORT_WINDOW_STEP = 0.005
REPORT_WINDOW_SIDE = 512  # the windows are cut from a thumbnail of this long side


def report_windows(width: int, height: int) -> list[tuple[float, float, float, tuple[int, int, int, int]]]:
    """(scale, x offset, y offset, box) of each window ``pdq_report`` hashes, offsets as fractions of the side."""
    out = []
    for scale in REPORT_WINDOW_SCALES:
        w, h = round(scale * width), round(scale * height)
        steps = round((1 - scale) / REPORT_WINDOW_STEP)
        for j in range(steps + 1):
            for i in range(steps + 1):
                fx, fy = i * REPORT_WINDOW_STEP, j * REPORT_WINDOW_STEP
                x, y = round(fx * width), round(fy * height)
                out.append((scale, fx, fy, (x, y, min(width, x + w), min(height, y + h))))
    return out


def pdq_report(data: bytes) -> list[tuple[bytes, int, str]]:
    """A reported picture's PDQ hashes: its own (first), at ``REPORT_SCALES``, then its windows'
    (``report_windows``), each with its quality and what it is."""
    image = open_reduced(data, max_side=PDQ_DRAFT_SIDE)
    own, quality = pdq_of_image(image)
    small = image.convert("RGB")
    small.thumbnail((REPORT_WINDOW_SIDE, REPORT_WINDOW_SIDE))
    out = [(own, quality, "the picture")]
    for scale in REPORT_SCALES:
        size = (max(8, round(image.width * scale)), max(8, round(image.height * scale)))
        digest, q = pdq_of_image(image.convert("RGB").resize(size, Image.Resampling.LANCZOS))
        out.append((digest, q, f"the picture at {scale:g} size"))
    for scale, fx, fy, box in report_windows(*small.size):
        digest, q = pdq_of_image(small.crop(box))
        out.append((digest, q, f"window {scale:.0%} at ({fx:.1%}, {fy:.1%})"))
    return out
