"""Decode and validate: the cheap gate every input passes first.

Size checks use the header alone (declared size, EXIF orientation), so decompression bombs are rejected before any
pixel is decoded. Survivors are then decoded once at reduced (draft) scale, which reads the
whole compressed stream and so catches truncated and corrupt files at a fraction of a full decode's cost.

Headers lie, so the decode runs under ``filters.max_pixels`` (every picture and frame PIL opens inside the file is
sized against it first: a PNG inside an ICNS or ICO, a GIF frame past its canvas, each TIFF page) and must yield the
picture declared, at the size recorded. Reason details never quote the input (``safe_error``). The size thresholds
(``filters.min_short_side``, ``max_aspect_ratio``) are decided on the recorded size after that (``decide``), so a
change of them is re-decided from the ledger; a small image is decoded at its draft scale first (a few ms).
"""

from __future__ import annotations

import hashlib

from PIL import UnidentifiedImageError

from common.encoding import encoding_quality
from common.imageio import (
    BOMB_ERRORS,
    declared_size,
    exif_orientation,
    frame_sizes,
    open_image,
    open_reduced,
    oriented_size,
    picture_format,
    safe_error,
    sequence_frames,
)
from curation.score.inputs import split_read_reason
from curation.score.stage import Row, Stage, StageSettings, Update, reject
from curation.settings import Filters

_DRAFT_SCALES = (1, 2, 4, 8)  # libjpeg's draft reductions; other formats decode at scale 1


class DecodeStage(Stage):
    name = "decode"
    reads = ("image", "reason")
    writes = ("key", "file_size", "format", "mode", "encoding_quality", "width", "height", "orientation")  # identity
    thresholds = ("min_short_side", "max_pixels", "max_aspect_ratio", "max_file_bytes", "reject_animated")
    decided = ("min_short_side", "max_aspect_ratio")
    decision_codes = ("too_small", "extreme_aspect")
    default_settings = StageSettings(batch_size=32, num_cpus=0.5)
    default_order = 0

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    def _one(self, row: Row) -> Update:
        f = self.cfg.filters
        image = row["image"]
        if image is None or image.get("bytes") is None:
            return reject(*split_read_reason(row.get("reason")))
        data: bytes = image["bytes"]
        update: Update = {"key": hashlib.sha256(data).hexdigest(), "file_size": len(data)}
        if not data:
            return {**update, **reject("empty_file", "0 bytes")}
        if len(data) > f.max_file_bytes:
            return {**update, **reject("file_too_large", f"{len(data)} bytes > {f.max_file_bytes}")}
        bomb = f"an embedded picture or frame exceeds filters.max_pixels ({f.max_pixels} px)"
        try:
            img = open_image(data, max_pixels=f.max_pixels)  # header only, but an ICO's picture is decoded here
            stored = declared_size(img, data)
            update.update(format=picture_format(img), mode=img.mode, encoding_quality=encoding_quality(img, data))
        except UnidentifiedImageError:
            if (picture := unsupported_picture(data)) is not None:  # a picture, of a format with no decoder here
                return {**update, **reject("unsupported_format", f"{picture}: no decoder for it is installed")}
            # named by its kind, never by its bytes: a non-image may be anything, secrets included
            return {**update, **reject("not_an_image", f"no image format recognised ({sniff_kind(data)})")}
        except BOMB_ERRORS:
            return {**update, **reject("decompression_bomb", bomb)}
        except Exception as exc:  # noqa: BLE001 - malformed headers raise many types
            return {**update, **reject("corrupt", f"header unreadable: {safe_error(exc, data)}")}

        # Before the orientation: reading a PNG's EXIF decodes it when the EXIF follows the pixels.
        sw, sh = stored
        if sw * sh > f.max_pixels:
            update.update(width=sw, height=sh)  # as stored: the orientation is not read
            return {**update, **reject("decompression_bomb", f"declared {sw}x{sh} = {sw * sh} px > {f.max_pixels}")}
        if sw <= 0 or sh <= 0:
            return {**update, **reject("corrupt", f"declared size {sw}x{sh}")}
        try:
            orientation = exif_orientation(img)
        except Exception as exc:  # noqa: BLE001 - reading a PNG's EXIF decodes its stream, which can be broken
            return {**update, **reject("corrupt", safe_error(exc, data))}
        w, h = oriented_size(stored, orientation)
        update.update(width=w, height=h, orientation=orientation)
        try:
            frames = sequence_frames(img)  # a JPEG carrying a second picture (MPO) is a still: its primary flows on
            pages = list(frame_sizes(img)) if frames > 1 else []
        except Exception as exc:  # noqa: BLE001 - a later frame's header can be as broken as any
            return {**update, **reject("corrupt", f"frame headers unreadable: {safe_error(exc, data)}")}
        for k, (fw, fh) in enumerate(pages):
            if fw * fh > f.max_pixels:
                return {**update, **reject("decompression_bomb", f"{bomb}: frame {k} declares {fw}x{fh}")}
        if f.reject_animated and frames > 1:
            return {**update, **reject("animated", f"{img.format} with {frames} frames")}
        try:
            decoded = open_reduced(data, max_side=max(64, max(w, h) // 8), max_pixels=f.max_pixels).size
        except BOMB_ERRORS:
            return {**update, **reject("decompression_bomb", bomb)}
        except MemoryError:
            raise  # the worker's memory, not the file: an error row, not a rejection
        except Exception as exc:  # noqa: BLE001 - a corrupt stream raises many types; PictureMismatch too
            return {**update, **reject("corrupt", safe_error(exc, data))}
        # The size recorded is the size every later decode yields (JPEGs at a draft scale of it).
        if decoded not in [(-(-w // s), -(-h // s)) for s in _DRAFT_SCALES]:
            return {**update, **reject("corrupt", f"decoded {decoded[0]}x{decoded[1]}, declared {w}x{h}")}
        return update

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        w, h = row["width"], row["height"]
        if min(w, h) < filters.min_short_side:
            return f"too_small: short side {min(w, h)} px < {filters.min_short_side}"
        if max(w, h) / min(w, h) > filters.max_aspect_ratio:
            return f"extreme_aspect: {w}x{h}, ratio {max(w, h) / min(w, h):.2f} > {filters.max_aspect_ratio}"
        return None


_SIGNATURES = (
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "gzip data"),
    (b"PK\x03\x04", "a zip archive"),
    (b"<?xml", "XML"),
    (b"<svg", "SVG vector graphics"),
    (b"{", "JSON or text"),
    (b"\x7fELF", "an executable"),
)


# ISO-BMFF brands of HEIF pictures (AVIF decodes through Pillow's own plugin, so only what it does not take lands here)
_HEIF_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis")


def unsupported_picture(data: bytes) -> str | None:
    """The picture format of bytes PIL cannot open, told by signature alone; None when they are no known picture."""
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return f"HEIF ({data[8:12].decode()})"
    if data.startswith(b"\xff\x0a") or data.startswith(b"\x00\x00\x00\x0cJXL \r\n\x87\n"):
        return "JPEG XL"
    if data.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF-based (camera raw or an unsupported TIFF variant)"
    return None


def sniff_kind(data: bytes) -> str:
    """What a non-image looks like, from its signature only."""
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "looks like HTML"
    for signature, kind in _SIGNATURES:
        if head.startswith(signature.lower()):
            return f"looks like {kind}"
    if b"<svg" in head:
        return "looks like SVG vector graphics"
    return "unknown content" if b"\x00" in head else "looks like text" if head.isascii() else "unknown content"
