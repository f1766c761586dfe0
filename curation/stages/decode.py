"""Decode and validate: the cheap gate every input passes first.

Size checks use the header alone (declared size, EXIF orientation), so tiny images and decompression bombs are
rejected before any pixel is decoded. Survivors are then decoded once at reduced (draft) scale, which reads the
whole compressed stream and so catches truncated and corrupt files at a fraction of a full decode's cost.
"""

from __future__ import annotations

import hashlib

from PIL import Image, UnidentifiedImageError

from curation.imageio import decode, open_image
from curation.stage import Row, Stage, Update, reject

_EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = {5, 6, 7, 8}  # EXIF orientations that rotate by 90 degrees


class DecodeStage(Stage):
    name = "decode"
    reads = ("image", "reason")
    writes = ("key", "file_size", "format", "mode", "width", "height", "orientation")

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    def _one(self, row: Row) -> Update:
        f = self.cfg.filters
        image = row["image"]
        if image is None or image.get("bytes") is None:
            return reject("unreadable", row.get("reason") or "no bytes could be read")
        data: bytes = image["bytes"]
        update: Update = {"key": hashlib.sha256(data).hexdigest(), "file_size": len(data)}
        if not data:
            return {**update, **reject("empty_file", "0 bytes")}
        if len(data) > f.max_file_bytes:
            return {**update, **reject("file_too_large", f"{len(data)} bytes > {f.max_file_bytes}")}
        try:
            img = open_image(data)
        except UnidentifiedImageError:
            return {**update, **reject("not_an_image", f"no image format recognised (starts with {data[:8]!r})")}
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
        update.update(format=img.format, mode=img.mode, width=w, height=h, orientation=orientation)

        if w * h > f.max_pixels:
            return {**update, **reject("decompression_bomb", f"declared {w}x{h} = {w * h} px > {f.max_pixels}")}
        if w <= 0 or h <= 0:
            return {**update, **reject("corrupt", f"declared size {w}x{h}")}
        frames = getattr(img, "n_frames", 1)
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
