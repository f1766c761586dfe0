"""A hostile-input corpus: files that break naive image pipelines, each with the fate the pipeline must give it.

Complements the sample pool's ``bad/`` and ``odd/`` folders with more kinds (special files, link loops, names with
unicode and spaces, bombs in other formats, multi-page TIFFs, formats PIL does not read...). ``write_bad_inputs``
writes them into a folder and returns one expectation per input: the decode reason code it must produce, or
``None`` where the file is a valid image whose fate is left to the later stages.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _noise(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A small valid JPEG whose SOF0 header is rewritten to declare ``width`` x ``height``."""
    data = bytearray(_jpeg(_noise(64, 48, 7)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _png_bad_crc() -> bytes:
    data = bytearray(_png(_noise(500, 420, 3)))
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4 : idat])[0]
    crc_at = idat + 4 + length
    data[crc_at : crc_at + 4] = struct.pack(">I", (zlib.crc32(b"x") ^ 0xFFFFFFFF) & 0xFFFFFFFF)
    return bytes(data)


def _tiff_pages(n: int) -> bytes:
    buf = io.BytesIO()
    frames = [_noise(400, 400, i) for i in range(n)]
    frames[0].save(buf, "TIFF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def write_bad_inputs(out: str | Path, person_jpeg: bytes) -> dict[str, str | None]:
    """Write the corpus under ``out``; returns file name -> expected decode reason code (None: decodes fine)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    big_png = _png(_noise(480, 400, 1))
    files: dict[str, tuple[bytes, str | None]] = {
        "one_pixel.png": (_png(Image.new("RGB", (1, 1), "red")), "too_small"),
        "photo ünïcödé 写真 with spaces.jpg": (person_jpeg, None),
        ("x" * 150) + ".jpg": (person_jpeg, None),
        "truncated.png": (big_png[: len(big_png) // 3], "corrupt"),
        "bad_crc_intact_pixels.png": (_png_bad_crc(), None),  # decoders ignore chunk CRCs; the pixels are whole
        "drawing.svg.jpg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="500" height="500"></svg>', "not_an_image"),
        "document.pdf.jpg": (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << >>\n%%EOF\n", "not_an_image"),
        "gzipped.jpg": (gzip.compress(person_jpeg, mtime=0), "not_an_image"),
        "soi_only.jpg": (b"\xff\xd8", "not_an_image"),
        "jpeg_bomb.jpg": (_jpeg_declaring(60000, 60000), "decompression_bomb"),
        "pages.tiff": (_tiff_pages(3), "animated"),
        "small.webp": (_webp(), "too_small"),
        "plain.bmp": (_bmp(), None),
        "trailing_garbage.jpg": (person_jpeg + b"\x00GARBAGE" * 100, None),
    }
    expected: dict[str, str | None] = {}
    for name, (data, reason) in files.items():
        (out / name).write_bytes(data)
        expected[name] = reason
    os.mkfifo(out / "named_pipe.jpg")
    expected["named_pipe.jpg"] = "not_a_file"
    os.symlink("link_loop.jpg", out / "link_loop.jpg")
    expected["link_loop.jpg"] = "unreadable"
    return expected


def _webp() -> bytes:
    buf = io.BytesIO()
    _noise(200, 150, 4).save(buf, "WEBP", quality=80)
    return buf.getvalue()


def _bmp() -> bytes:
    buf = io.BytesIO()
    _noise(500, 400, 5).save(buf, "BMP")
    return buf.getvalue()
