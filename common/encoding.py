"""How faithfully an image file's bytes encode its picture, read from the header alone (no pixel is decoded).

On the IJG quality scale, 1-100: a JPEG's quality setting, estimated from its luminance quantization table; 100 for
a lossless encoding; None where the header tells nothing. Dedup's keep rule prefers, between copies of one size, the
better-encoded one (a re-save at quality 40 loses to its original). The header cannot tell the loss of an earlier
generation: a full-size re-save at a higher quality counts as the better copy.
"""

from __future__ import annotations

import struct

import numpy as np
from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile
from PIL.TiffImagePlugin import TiffImageFile

from common.imageio import picture_format

# The luminance table of the JPEG standard (ITU T.81 Annex K.1), natural order: the IJG encoder's base table.
_IJG_LUMINANCE = np.array(
    [
        [16, 11, 10, 16, 24, 40, 51, 61],
        [12, 12, 14, 19, 26, 58, 60, 55],
        [14, 13, 16, 24, 40, 57, 69, 56],
        [14, 17, 22, 29, 51, 87, 80, 62],
        [18, 22, 37, 56, 68, 109, 103, 77],
        [24, 35, 55, 64, 81, 104, 113, 92],
        [49, 64, 78, 87, 103, 121, 120, 101],
        [72, 92, 95, 98, 112, 100, 103, 99],
    ],
    np.int64,
).ravel()


def _ijg_tables() -> np.ndarray:
    """Row q-1: the luminance table libjpeg's ``jpeg_set_quality(q, force_baseline)`` writes, q = 1..100."""
    q = np.arange(1, 101)
    scale = np.where(q < 50, 5000 // q, 200 - 2 * q)
    return np.clip((_IJG_LUMINANCE[None, :] * scale[:, None] + 50) // 100, 1, 255)


_LOG_IJG_TABLES = np.log(_ijg_tables())
LOSSLESS_QUALITY = 100  # a lossless encoding: its picture exactly, as good as any copy of that size can be
_LOSSLESS_FORMATS = frozenset({"PNG", "GIF", "BMP", "DIB", "PPM", "TGA", "QOI", "PCX", "SGI", "ICO", "ICNS"})
_LOSSLESS_TIFF = frozenset({"raw", "tiff_lzw", "tiff_adobe_deflate", "tiff_deflate", "packbits", "group3", "group4"})


def jpeg_quality(luminance: list[int]) -> int:
    """The IJG quality (1-100) whose luminance table is closest to ``luminance`` (64 entries, natural order) in mean
    absolute log ratio; ties go to the higher quality. Exact for the tables libjpeg, Pillow, OpenCV and most
    software write at a quality setting; for another encoder's tables (cameras, Photoshop) it is the IJG quality of
    the same overall coarseness, every frequency weighing alike (the log keeps the large high-frequency steps from
    outweighing the rest)."""
    table = np.log(np.clip(np.asarray(luminance, np.float64)[:64], 1, None))
    error = np.abs(_LOG_IJG_TABLES - table[None, :]).mean(axis=1)
    return int(100 - np.argmin(error[::-1]))  # reversed: argmin's first hit is the highest quality


def _webp_lossless(data: bytes) -> bool:
    """Whether a WebP file's picture is a VP8L (lossless) bitstream: the first image chunk after the RIFF header."""
    at = 12
    while at + 8 <= len(data):
        fourcc, size = data[at : at + 4], struct.unpack("<I", data[at + 4 : at + 8])[0]
        if fourcc in (b"VP8 ", b"VP8L"):
            return fourcc == b"VP8L"
        at += 8 + size + (size & 1)
    return False


def encoding_quality(img: Image.Image, data: bytes) -> int | None:
    """How faithful the encoding of an opened (header-only) picture is, 1-100: a JPEG's ``jpeg_quality`` from its
    luminance quantization table; ``LOSSLESS_QUALITY`` for a lossless encoding (PNG, GIF, BMP, lossless WebP, TIFF
    without lossy compression, ...); None where the header tells nothing (lossy WebP, AVIF, JPEG 2000, a JPEG-
    compressed TIFF)."""
    tables = getattr(img, "quantization", None)
    if isinstance(img, JpegImageFile) and tables:
        return jpeg_quality(tables[min(tables)])  # table 0 by convention: the luminance one
    fmt = picture_format(img)
    if fmt in _LOSSLESS_FORMATS:
        return LOSSLESS_QUALITY
    if fmt == "WEBP":
        return LOSSLESS_QUALITY if _webp_lossless(data) else None
    if isinstance(img, TiffImageFile) and img.info.get("compression") in _LOSSLESS_TIFF:
        return LOSSLESS_QUALITY
    return None
