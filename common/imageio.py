"""Decoding helpers shared by the stages.

Only the original encoded bytes flow between stages (decoded pixels would multiply object-store traffic by ~10);
each stage decodes at the size it needs. JPEG draft mode lets libjpeg decode at 1/2, 1/4 or 1/8 scale, which is
several times cheaper than a full decode followed by a resize.

Headers lie. What a file declares (its size, its EXIF orientation) is read here once, by the helpers the decode
stage records from and every decode applies (``declared_size``, ``exif_orientation``), so the ledger's size is the
size of the image every later stage sees. Decoding with ``max_pixels`` runs under ``pixel_limit``: PIL then sizes
every picture it opens, those inside ICNS and ICO containers and GIF frames that grow the canvas included, against
the limit before decoding it, and a decoded picture that differs from the declared one raises ``PictureMismatch``.
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import threading
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image
from PIL.GifImagePlugin import GifImageFile
from PIL.IcoImagePlugin import IcoImageFile
from PIL.JpegImagePlugin import JpegImageFile
from PIL.MpoImagePlugin import MpoImageFile
from PIL.PngImagePlugin import PngImageFile
from PIL.TiffImagePlugin import TiffImageFile

# Decode validates size limits itself (and rejects with a reason); PIL's global guard would raise first. Decodes that
# pass max_pixels set it back for their own duration (pixel_limit).
Image.MAX_IMAGE_PIXELS = None

# PIL's own opener, held before anything can patch it: ultralytics replaces Image.open on import with a version that
# tries to pip-install a HEIF plugin on unidentified bytes, which would turn "not an image" into an import error.
_pil_open = Image.open

_ORIENTATION = 0x0112
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that turn the picture by 90 degrees
_ICO_MAGIC = b"\x00\x00\x01\x00"  # PIL decodes an ICO's largest picture while opening it

BOMB_ERRORS = (Image.DecompressionBombError, Image.DecompressionBombWarning)


class PictureMismatch(ValueError):
    """A picture PIL would decode, or has decoded, whose size is not the one its file's header declares."""


_limit_lock = threading.Lock()
_active_limits: list[int] = []  # limits of the pixel_limit blocks running in this process


@contextlib.contextmanager
def pixel_limit(max_pixels: int | None) -> Iterator[None]:
    """Run a block with PIL's size check on at ``max_pixels`` (None: off) and its warnings silenced, but a
    DecompressionBombWarning (a picture over the limit, under twice it) raised as an error, as the
    DecompressionBombError above twice it is. PIL checks each ``Image.open``, the pictures an ICNS or ICO holds and the
    canvas a GIF frame grows to, before decoding them."""
    if max_pixels is not None:
        with _limit_lock:  # the limit is PIL's global: concurrent blocks share the smallest, the last restores "off"
            _active_limits.append(max_pixels)
            Image.MAX_IMAGE_PIXELS = min(_active_limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if max_pixels is not None:
                warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        if max_pixels is not None:
            with _limit_lock:
                _active_limits.remove(max_pixels)
                Image.MAX_IMAGE_PIXELS = min(_active_limits) if _active_limits else None


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


def open_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Open lazily (header only); raises on bytes PIL cannot identify. PIL decodes an ICO's picture while opening
    it, so with ``max_pixels`` an ICO opens under ``pixel_limit`` (and may raise one of ``BOMB_ERRORS``)."""
    with pixel_limit(max_pixels if data.startswith(_ICO_MAGIC) else None):
        return _pil_open(io.BytesIO(data))


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation (1-8) that the decode stage records and every decode here applies. A value that is not
    one of 1-8 (0, 9, 65535, text, several values) or an unreadable EXIF block is 1: shown as stored. Read as PIL's
    TIFF reader applies it while loading, so a TIFF's orientation agrees too.

    A PNG may carry its EXIF after its pixels, so PIL decodes a PNG to read it: a broken PNG stream raises here."""
    if isinstance(img, PngImageFile):
        img.load()
    try:
        value = img.getexif().get(_ORIENTATION, 1)
        return int(value) if value in _TRANSPOSE or value == 1 else 1
    except Exception:  # noqa: BLE001 - a broken EXIF block is not a broken image
        return 1


def oriented_size(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """The displayed size of a picture stored at ``size``."""
    return (size[1], size[0]) if orientation in SWAPS_AXES else size


def _stored_size(img: Image.Image) -> tuple[int, int]:
    """The size PIL will decode the current frame at, before any orientation: PIL's TIFF reader reports the
    displayed size and turns the picture while loading."""
    if isinstance(img, TiffImageFile):
        return int(img.tag_v2[256]), int(img.tag_v2[257])  # ImageWidth, ImageLength
    return img.size


def declared_size(img: Image.Image, data: bytes) -> tuple[int, int]:
    """The stored size (before EXIF orientation) the file's header declares for the picture curated: a GIF's logical
    screen (PIL grows it to fit a first frame that extends past it), an ICO's largest directory entry (PIL takes
    the size of the picture it found there), else what PIL read from the header."""
    if isinstance(img, GifImageFile):
        w, h = struct.unpack("<HH", data[6:10])
        return w, h
    if isinstance(img, IcoImageFile):
        return img.ico.entry[0].dim
    return _stored_size(img)


def is_multi_picture(img: Image.Image) -> bool:
    """A JPEG that carries more pictures after its primary one (MPO: stereo pairs, HDR gain maps, previews). The
    primary picture is the photo; PIL opens it at frame 0, which every reader here uses."""
    return isinstance(img, MpoImageFile)


def sequence_frames(img: Image.Image) -> int:
    """Frames of an animation or pages of a multi-page file; 1 for a still, a multi-picture JPEG included."""
    return 1 if is_multi_picture(img) else getattr(img, "n_frames", 1)


def frame_sizes(img: Image.Image) -> Iterator[tuple[int, int]]:
    """The stored size each page of a multi-page TIFF declares, read from its directory alone (no pixels); leaves
    the image at its first page. Other formats: the size PIL will decode the current frame at (a GIF's canvas as its
    first frame grew it)."""
    if not isinstance(img, TiffImageFile) or sequence_frames(img) == 1:
        yield _stored_size(img)
        return
    try:
        for page in range(img.n_frames):
            img.seek(page)
            yield _stored_size(img)
    finally:
        img.seek(0)


def picture_format(img: Image.Image) -> str | None:
    """The format of the picture curated: a multi-picture JPEG's primary picture is a plain JPEG stream."""
    return "JPEG" if is_multi_picture(img) else img.format


def open_reduced(
    data: bytes, max_side: int | None = None, mode: str = "RGB", max_pixels: int | None = None
) -> Image.Image:
    """Decode to a PIL image in ``mode``, EXIF-oriented; JPEGs in draft mode at the smallest libjpeg scale that keeps
    the longer side at least ``max_side`` (no resampling beyond that: callers that need an exact size resize).

    Raises ``PictureMismatch`` where the picture decoded is not the size the header declares, and, with
    ``max_pixels``, one of ``BOMB_ERRORS`` where a picture or frame inside the file is larger than that."""
    with pixel_limit(max_pixels):
        img = _pil_open(io.BytesIO(data))
        declared, stored = declared_size(img, data), _stored_size(img)
        if stored != declared:  # checked before decoding: PIL would allocate ``stored``
            raise PictureMismatch(
                f"{img.format} picture is {stored[0]}x{stored[1]}, its header declares {declared[0]}x{declared[1]}"
            )
        orientation = exif_orientation(img)
        if max_side is not None and isinstance(img, JpegImageFile):  # multi-picture JPEGs too
            w, h = img.size
            scale = max(w, h) / max_side
            if scale >= 2:
                img.draft(mode if img.mode in ("RGB", "L") else None, (int(w / scale) + 1, int(h / scale) + 1))
        expected = oriented_size(_stored_size(img), orientation)
        img.load()
        out: Image.Image = img
        method = _TRANSPOSE.get(orientation)
        if method is not None and not isinstance(img, TiffImageFile):  # PIL's TIFF reader turned it while loading
            out = img.transpose(method)
        if out.size != expected:
            raise PictureMismatch(
                f"{img.format} decoded picture is {out.size[0]}x{out.size[1]}, its header declares "
                f"{expected[0]}x{expected[1]} (as displayed)"
            )
        return _to_mode(out, mode)


def decode(data: bytes, max_side: int | None = None, mode: str = "RGB", max_pixels: int | None = None) -> np.ndarray:
    """Decode, apply EXIF orientation, normalise to ``mode``; downscale so the longer side is <= ``max_side``.

    Returns an HxW(x3) uint8 array. With ``max_side`` set, JPEGs are decoded in draft mode at the smallest scale
    that is still at least ``max_side`` on the longer side. Raises as ``open_reduced`` does.
    """
    img = open_reduced(data, max_side, mode, max_pixels)
    if max_side is not None and max(img.size) > max_side:
        w, h = img.size
        s = max_side / max(w, h)
        img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BILINEAR)
    return np.asarray(img)


# --- error details that never echo the input ---------------------------------------------------------------------

_MAX_DETAIL = 120
_QUOTED = re.compile(r"""[bBrRuU]{0,2}(?:'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*")""")
_UNCLOSED = re.compile(r"""[bBrRuU]{0,2}['"].*""", re.DOTALL)
_OBJECT_REPR = re.compile(r"<[^<>]*>")
_TOKEN = re.compile(r"[A-Za-z0-9]+")


def safe_error(exc: BaseException, data: bytes = b"") -> str:
    """``Type: message`` of an exception raised on ``data``, fit for the ledger (``safe_message``), at most 120
    characters in all."""
    name = type(exc).__name__
    if isinstance(exc, PictureMismatch):  # ours: sizes and PIL's format name only, which redaction would garble
        return f"{name}: {exc}"[:_MAX_DETAIL]
    text = safe_message(str(exc), data, _MAX_DETAIL - len(name) - 2)
    return f"{name}: {text}" if text else name


def safe_message(text: str, data: bytes = b"", limit: int = _MAX_DETAIL) -> str:
    """A message about ``data`` fit for the ledger: decoders quote the bytes they choke on (``invalid literal for
    int() with base 10: b'...'``), and a "file" may be anything, secrets included. Quoted parts, object reprs,
    non-printable and non-ASCII characters are dropped, every word of 3+ characters found in ``data`` (ignoring case;
    for longer words, any 4 characters of it) is redacted, a message that still shares 8 characters with ``data`` is
    dropped (""), and the rest is at most ``limit`` characters."""
    text = _UNCLOSED.sub("", _QUOTED.sub("", _OBJECT_REPR.sub("", text)))  # a bytes message is quoted whole
    text = "".join(c for c in text if " " <= c <= "~")
    haystack = data.lower()

    def redact(m: re.Match[str]) -> str:
        word = m.group().lower()
        if len(word) < 3:
            return m.group()
        if any(word[i : i + 4].encode() in haystack for i in range(max(1, len(word) - 3))):
            return "*"
        return m.group()

    text = " ".join(_TOKEN.sub(redact, text).split()).strip(" :,;-")
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    low = text.lower().encode()
    if any(low[i : i + 8] in haystack for i in range(len(low) - 7)):
        text = ""
    return text
