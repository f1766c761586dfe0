"""Decode and validate: the cheap gate every input passes first.

Size checks use the header alone (declared size, EXIF orientation), so tiny images and decompression bombs are
rejected before any pixel is decoded. Survivors are then decoded once at reduced (draft) scale, which reads the
whole compressed stream and so catches truncated and corrupt files at a fraction of a full decode's cost.
"""

from __future__ import annotations

import hashlib

from PIL import Image, UnidentifiedImageError

from common.imageio import decode, open_image, picture_format, sequence_frames
from curation.pool import split_read_reason
from curation.stage import Row, Stage, StageSettings, Update, reject

_EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees


class DecodeStage(Stage):
    name = "decode"
    reads = ("image", "reason")
    writes = ("key", "file_size", "format", "mode", "width", "height", "orientation")
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
        try:
            img = open_image(data)
        except UnidentifiedImageError:
            # named by its kind, never by its bytes: a non-image may be anything, secrets included
            return {**update, **reject("not_an_image", f"no image format recognised ({sniff_kind(data)})")}
        except Exception as exc:  # noqa: BLE001 - malformed headers raise many types
            return {**update, **reject("corrupt", f"header unreadable: {type(exc).__name__}: {exc}")}

        w, h = img.size
        try:
            orientation = int(img.getexif().get(_EXIF_ORIENTATION, 1))
        except Exception:  # noqa: BLE001 - a broken EXIF block is not a broken image
            orientation = 1
        if orientation not in range(1, 9):
            orientation = 1
        if orientation in _SWAPS_AXES:
            w, h = h, w
        update.update(format=picture_format(img), mode=img.mode, width=w, height=h, orientation=orientation)

        if w * h > f.max_pixels:
            return {**update, **reject("decompression_bomb", f"declared {w}x{h} = {w * h} px > {f.max_pixels}")}
        if w <= 0 or h <= 0:
            return {**update, **reject("corrupt", f"declared size {w}x{h}")}
        frames = sequence_frames(img)  # a JPEG carrying a second picture (MPO) is a still: its primary picture flows on
        if f.reject_animated and frames > 1:
            return {**update, **reject("animated", f"{img.format} with {frames} frames")}
        if min(w, h) < f.min_short_side:
            return {**update, **reject("too_small", f"short side {min(w, h)} px < {f.min_short_side}")}
        if max(w, h) / min(w, h) > f.max_aspect_ratio:
            ratio = max(w, h) / min(w, h)
            return {**update, **reject("extreme_aspect", f"{w}x{h}, ratio {ratio:.2f} > {f.max_aspect_ratio}")}
        try:
            decode(data, max_side=max(64, max(w, h) // 8))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            return {**update, **reject("corrupt", f"{type(exc).__name__}: {exc}")}
        return update


_SIGNATURES = (
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "gzip data"),
    (b"PK\x03\x04", "a zip archive"),
    (b"<?xml", "XML"),
    (b"<svg", "SVG vector graphics"),
    (b"{", "JSON or text"),
    (b"\x7fELF", "an executable"),
)


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
