"""Decoding helpers shared by the stages.

Only the original encoded bytes flow between stages (decoded pixels would multiply object-store traffic by ~10);
each stage decodes at the size it needs. JPEG draft mode lets libjpeg decode at 1/2, 1/4 or 1/8 scale, which is
several times cheaper than a full decode followed by a resize.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps
from PIL.JpegImagePlugin import JpegImageFile
from PIL.MpoImagePlugin import MpoImageFile

# Decode validates size limits itself (and rejects with a reason); PIL's global guard would raise first.
Image.MAX_IMAGE_PIXELS = None

# PIL's own opener, held before anything can patch it: ultralytics replaces Image.open on import with a version that
# tries to pip-install a HEIF plugin on unidentified bytes, which would turn "not an image" into an import error.
_pil_open = Image.open


def _to_mode(img: Image.Image, mode: str) -> Image.Image:
    """Normalise any PIL mode (CMYK, I;16, P with transparency, LA, ...) to ``mode`` ("RGB" or "L")."""
    if img.mode == mode:
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img, dtype=np.float32)
        peak = 65535.0 if arr.max() > 255 else 255.0
        img = Image.fromarray(np.clip(arr / peak * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif img.mode == "F":
        arr = np.asarray(img, dtype=np.float32)
        img = Image.fromarray(np.clip(arr * (255.0 if arr.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8), "L")
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        # Composite on white: transparent regions of web graphics are meant to sit on a page.
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(canvas, rgba)
    return img.convert(mode)


def open_image(data: bytes) -> Image.Image:
    """Open lazily (header only); raises on bytes PIL cannot identify."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _pil_open(io.BytesIO(data))


def is_multi_picture(img: Image.Image) -> bool:
    """A JPEG that carries more pictures after its primary one (MPO: stereo pairs, HDR gain maps, previews). The
    primary picture is the photo; PIL opens it at frame 0, which every reader here uses."""
    return isinstance(img, MpoImageFile)


def sequence_frames(img: Image.Image) -> int:
    """Frames of an animation or pages of a multi-page file; 1 for a still, a multi-picture JPEG included."""
    return 1 if is_multi_picture(img) else getattr(img, "n_frames", 1)


def picture_format(img: Image.Image) -> str | None:
    """The format of the picture curated: a multi-picture JPEG's primary picture is a plain JPEG stream."""
    return "JPEG" if is_multi_picture(img) else img.format


def open_reduced(data: bytes, max_side: int | None = None, mode: str = "RGB") -> Image.Image:
    """Decode to a PIL image in ``mode``, EXIF-oriented; JPEGs in draft mode at the smallest libjpeg scale that keeps
    the longer side at least ``max_side`` (no resampling beyond that: callers that need an exact size resize)."""
    img = open_image(data)
    if max_side is not None and isinstance(img, JpegImageFile):  # multi-picture JPEGs too
        w, h = img.size
        scale = max(w, h) / max_side
        if scale >= 2:
            img.draft(mode if img.mode in ("RGB", "L") else None, (int(w / scale) + 1, int(h / scale) + 1))
    return _to_mode(ImageOps.exif_transpose(img), mode)


def decode(data: bytes, max_side: int | None = None, mode: str = "RGB") -> np.ndarray:
    """Decode, apply EXIF orientation, normalise to ``mode``; downscale so the longer side is <= ``max_side``.

    Returns an HxW(x3) uint8 array. With ``max_side`` set, JPEGs are decoded in draft mode at the smallest scale
    that is still at least ``max_side`` on the longer side.
    """
    img = open_reduced(data, max_side, mode)
    if max_side is not None and max(img.size) > max_side:
        w, h = img.size
        s = max_side / max(w, h)
        img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BILINEAR)
    return np.asarray(img)
