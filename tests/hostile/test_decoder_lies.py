"""Image files whose own headers lie: containers whose embedded picture is not the one declared (ICNS, ICO), GIF
frames past their canvas, TIFF pages over the pixel limit, decoder errors that would quote the file's bytes, EXIF
orientations that are not one. Decode must size every picture before decoding it, reject what differs from the
header, record the size every later decode yields, and never write the input's bytes into the ledger."""

from __future__ import annotations

import hashlib
import io
import struct
import zlib

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageFile

from common import schema
from common.imageio import decode, open_reduced
from curation.config import CurateConfig
from curation.score.stage import REJECT
from curation.score.stage_runner import StageRunner
from curation.stages.decode import DecodeStage
from tests.stage_calls import decided

MAX_PIXELS = 2_000_000  # small, so that the pictures over it stay cheap to build
MARKER = b"SECRET-7f3a"


def _stage(**filters) -> DecodeStage:
    return DecodeStage(CurateConfig.model_validate({"filters": {"max_pixels": MAX_PIXELS, **filters}}))


def _decode_row(data: bytes, **filters) -> dict:
    return decided(_stage(**filters), [{"image": {"bytes": data, "path": "x"}, "reason": None}])[0]


def _code(update: dict) -> str | None:
    return update[REJECT].split(":")[0] if REJECT in update else None


@pytest.fixture
def decoded_sizes(monkeypatch):
    """The size of every picture PIL allocates to decode into (every ImageFile's load passes load_prepare)."""
    sizes: list[tuple[int, int]] = []
    prepare = ImageFile.ImageFile.load_prepare

    def recording(self):
        sizes.append(self.size)
        return prepare(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load_prepare", recording)
    return sizes


def _png(size: tuple[int, int], color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def _icns(inner: bytes) -> bytes:
    """An ICNS whose one "ic10" block (512x512 @2x: declares 1024x1024) holds ``inner``."""
    block = b"ic10" + struct.pack(">I", 8 + len(inner)) + inner
    return b"icns" + struct.pack(">I", 8 + len(block)) + block


def _ico(inner: bytes) -> bytes:
    """An ICO whose one directory entry declares 256x256 (width and height bytes 0) and holds ``inner``."""
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(inner), 6 + 16)
    return b"\x00\x00\x01\x00" + struct.pack("<H", 1) + entry + inner


def _gif(canvas: tuple[int, int], frame: tuple[int, int]) -> bytes:
    """A one-frame GIF whose logical screen says ``canvas`` and whose frame covers ``frame`` from the corner."""
    buf = io.BytesIO()
    Image.new("P", frame, 3).save(buf, "GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = struct.pack("<HH", *canvas)
    descriptor = data.index(b",", 13)
    data[descriptor + 1 : descriptor + 9] = struct.pack("<HHHH", 0, 0, *frame)
    return bytes(data)


# --- pictures inside containers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("side", [3000, 1500], ids=["over-twice-the-limit", "over-the-limit"])
def test_an_icns_whose_embedded_png_exceeds_max_pixels_is_a_bomb_sized_before_it_is_decoded(side, decoded_sizes):
    update = _decode_row(_icns(_png((side, side))))
    assert update[REJECT].startswith("decompression_bomb: an embedded picture or frame exceeds filters.max_pixels")
    assert (update["format"], update["width"], update["height"]) == ("ICNS", 1024, 1024)  # the header's own claim
    assert all(w * h <= MAX_PIXELS for w, h in decoded_sizes), decoded_sizes


def test_an_icns_whose_embedded_png_is_not_the_declared_size_is_corrupt():
    update = _decode_row(_icns(_png((512, 512))))  # the one scale PIL accepts in place of 1024x1024
    assert _code(update) == "corrupt", update.get(REJECT)
    assert "512x512" in update[REJECT] and "1024x1024" in update[REJECT]
    assert _code(_decode_row(_icns(_png((1024, 1024))))) is None  # the declared size decodes


def test_an_ico_whose_embedded_png_exceeds_max_pixels_is_a_bomb_sized_before_it_is_decoded(decoded_sizes):
    update = _decode_row(_ico(_png((3000, 3000))))
    assert update[REJECT].startswith("decompression_bomb: an embedded picture or frame exceeds filters.max_pixels")
    assert update.get("width") is None  # not 3000x3000: PIL's open found that size only by decoding it
    assert all(w * h <= MAX_PIXELS for w, h in decoded_sizes), decoded_sizes


def test_an_ico_whose_embedded_png_is_not_the_declared_size_is_corrupt():
    update = _decode_row(_ico(_png((1000, 1000))), min_short_side=64)
    assert _code(update) == "corrupt", update.get(REJECT)
    assert "1000x1000" in update[REJECT] and "256x256" in update[REJECT]
    assert _code(_decode_row(_ico(_png((256, 256))), min_short_side=64)) is None


# --- frames past the canvas, pages over the limit -----------------------------------------------------------------


def test_a_gif_frame_past_its_canvas_is_corrupt_and_records_the_canvas():
    update = _decode_row(_gif((500, 400), (900, 800)))
    assert _code(update) == "corrupt", update.get(REJECT)
    assert (update["width"], update["height"]) == (500, 400) and "900x800" in update[REJECT]
    assert _code(_decode_row(_gif((500, 400), (500, 400)))) is None


def test_a_gif_frame_that_grows_the_canvas_past_max_pixels_is_a_bomb_and_is_never_allocated(decoded_sizes):
    update = _decode_row(_gif((500, 400), (4000, 3000)))
    assert update[REJECT].startswith("decompression_bomb: an embedded picture or frame exceeds"), update[REJECT]
    assert (update["width"], update["height"]) == (500, 400)  # what the header declares, not PIL's grown canvas
    assert all(w * h <= MAX_PIXELS for w, h in decoded_sizes), decoded_sizes


def _tiff_pages(*sizes: tuple[int, int]) -> bytes:
    pages = [Image.new("RGB", size, (30, 30 * i, 90)) for i, size in enumerate(sizes)]
    buf = io.BytesIO()
    pages[0].save(buf, "TIFF", save_all=True, append_images=pages[1:], compression="tiff_deflate")
    return buf.getvalue()


@pytest.mark.parametrize("reject_animated", [True, False])
def test_a_multi_page_tiff_with_a_page_over_max_pixels_is_a_bomb(reject_animated, decoded_sizes):
    data = _tiff_pages((500, 400), (2000, 1500))
    update = _decode_row(data, reject_animated=reject_animated)
    assert update[REJECT].startswith("decompression_bomb: "), update[REJECT]
    assert "frame 1 declares 2000x1500" in update[REJECT]
    assert (update["width"], update["height"]) == (500, 400)
    assert all(w * h <= MAX_PIXELS for w, h in decoded_sizes), decoded_sizes
    # pages within the limit: still the animation they are, or the first page when animations are let through
    fine = _tiff_pages((500, 400), (600, 500))
    assert _code(_decode_row(fine, reject_animated=reject_animated)) == ("animated" if reject_animated else None)


# --- decoder messages never quote the input -----------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_broken_chunk_name() -> bytes:
    """A PNG whose pixels span two IDAT chunks with a chunk named from the secret between them: PIL meets it while
    decoding and names it in its error."""
    raw = b"".join(b"\x00" + bytes(500 * 3) for _ in range(420))
    stream = zlib.compress(raw)
    ihdr = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 500, 420, 8, 2, 0, 0, 0))
    half = len(stream) // 2
    bad = struct.pack(">I", len(MARKER)) + MARKER[:2] + b"-" + MARKER[3:4] + MARKER + b"\x00" * 4
    return b"\x89PNG\r\n\x1a\n" + ihdr + _png_chunk(b"IDAT", stream[:half]) + bad + _png_chunk(b"IDAT", stream[half:])


HOSTILE = {  # name: (file, what PIL's error message quotes of it)
    # text saved as .jpg that PIL takes for a PPM header; int() quotes the token it cannot read
    "ppm_header_token": (b"P6\nSECRET 12\n255\n" + MARKER * 40, b"SECRET"),
    "ppm_header_long_token": (b"P6\n" + MARKER + b" 12\n255\n" + bytes(100), MARKER),  # a bytes message
    "ppm_plain_data_token": (b"P3\n600 500\n255\n1 2 3 " + MARKER + b" 5 6\n" + b"7 " * 100, MARKER),
    "png_broken_chunk_name": (_png_broken_chunk_name(), b"SE-R"),
}


def _substrings(data: bytes, n: int = 8) -> set[bytes]:
    low = data.lower()
    return {low[i : i + n] for i in range(len(low) - n + 1)}


@pytest.mark.parametrize("name", HOSTILE)
def test_no_reason_quotes_the_input(name):
    data, quoted = HOSTILE[name]
    table = pa.Table.from_pylist(
        [{"source": name, "image": {"bytes": data, "path": name}, "status": schema.PENDING}],
        schema=schema.working_schema(CurateConfig().embedding_dim),
    )
    row = StageRunner(DecodeStage, CurateConfig()).__call__(table).to_pylist()[0]
    reason = row["reason"]
    assert row["status"] == schema.REJECTED and reason.split(":")[0] in ("corrupt", "not_an_image"), reason
    assert row["key"] == hashlib.sha256(data).hexdigest()
    low = reason.lower().encode()
    assert MARKER.lower() not in low and b"secret" not in low and b"7f3a" not in low, reason
    assert quoted.lower() not in low and "b'" not in reason, reason
    leaked = {s for s in _substrings(data) if s in low}
    assert not leaked, (reason, leaked)
    assert reason.isascii() and reason.isprintable()
    detail = reason.split(": ", 1)[1].removeprefix("header unreadable: ")
    assert len(detail) <= 120, reason


def test_safe_error_keeps_the_kind_of_error_and_nothing_of_the_input():
    from common.imageio import safe_error

    data = b"junk " + MARKER + b" more junk \xff\xfe " + b"Zebra" * 3
    exc = ValueError(f"bad token {MARKER.decode()} near 'quoted {MARKER!r}' zebra\x00\u00e9 " + "word " * 60)
    out = safe_error(exc, data)
    assert out.startswith("ValueError: bad token") and len(out) <= 120, out
    assert "secret" not in out.lower() and "7f3a" not in out.lower() and "zebra" not in out.lower(), out
    assert out.isascii() and out.isprintable() and "quoted" not in out
    assert safe_error(OSError(b"Token too long in file header: " + MARKER), data) == "OSError"


# --- EXIF orientations that are not one ---------------------------------------------------------------------------


def _exif(kind: int, count: int, payload: bytes) -> bytes:
    """A little-endian EXIF block with one Orientation entry of TIFF type ``kind``."""
    field, extra = (payload.ljust(4, b"\x00"), b"") if len(payload) <= 4 else (struct.pack("<I", 26), payload)
    entry = struct.pack("<HHHI", 1, 0x0112, kind, count) + field + struct.pack("<I", 0)
    return b"Exif\x00\x00II*\x00" + struct.pack("<I", 8) + entry + extra


SHORT, ASCII, LONG, RATIONAL, UNDEFINED = 3, 2, 4, 5, 7
ORIENTATIONS = {
    "zero": _exif(SHORT, 1, struct.pack("<H", 0)),
    "nine": _exif(SHORT, 1, struct.pack("<H", 9)),
    "65535": _exif(SHORT, 1, struct.pack("<H", 65535)),
    "text_6": _exif(ASCII, 2, b"6\x00"),  # int() reads it as 6; it is not an orientation
    "undefined_6": _exif(UNDEFINED, 1, b"6"),
    "rational_6": _exif(RATIONAL, 1, struct.pack("<II", 6, 1)),
    "two_values": _exif(SHORT, 2, struct.pack("<HH", 6, 8)),
    "long_8": _exif(LONG, 1, struct.pack("<I", 8)),
    "truncated_block": _exif(SHORT, 1, struct.pack("<H", 6))[:14],
}


def _jpeg(size=(700, 450), exif: bytes | None = None) -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85, **({"exif": exif} if exif else {}))
    return buf.getvalue()


def _tiff_oriented(orientation: int) -> bytes:
    """Stored 700x450; PIL's TIFF reader reports it turned and turns it while loading."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (700, 450), (20, 90, 160)).save(buf, "TIFF", exif=exif, compression="tiff_deflate")
    return buf.getvalue()


def _png_exif_after_pixels(orientation: int) -> bytes:
    """A PNG with its eXIf chunk after IDAT, where readers find it only by decoding the pixels."""
    data = _png((700, 450))
    end = data.index(b"IEND") - 4
    return data[:end] + _png_chunk(b"eXIf", _exif(SHORT, 1, struct.pack("<H", orientation))[6:]) + data[end:]


WELL_FORMED = {
    "jpeg_6": _jpeg(exif=_exif(SHORT, 1, struct.pack("<H", 6))),
    "png_exif_after_pixels_6": _png_exif_after_pixels(6),
}


def _recorded_and_displayed(data: bytes) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    update = _decode_row(data, max_pixels=120_000_000)
    assert REJECT not in update, update[REJECT]
    assert update["orientation"] in range(1, 9)
    # later stages decode at reduced sizes (people, clip, phash): the same orientation as the full decode
    return (update["width"], update["height"]), decode(data).shape[1::-1], open_reduced(data, max_side=100).size


def test_a_malformed_exif_orientation_records_the_size_of_the_displayed_image():
    wrong = {}
    for name, block in {**ORIENTATIONS, **WELL_FORMED}.items():
        data = block if name in WELL_FORMED else _jpeg(exif=block)
        recorded, displayed, reduced = _recorded_and_displayed(data)
        if recorded != displayed or (reduced[0] > reduced[1]) != (recorded[0] > recorded[1]):
            wrong[name] = (recorded, displayed, reduced)
    assert not wrong, wrong


@pytest.mark.parametrize("orientation", [6, 8])
def test_a_tiff_orientation_is_applied_once_and_recorded_as_displayed(orientation):
    recorded, displayed, reduced = _recorded_and_displayed(_tiff_oriented(orientation))
    assert recorded == displayed == (450, 700) and reduced[0] < reduced[1]


def _gif_second_frame_past_canvas(canvas: tuple[int, int], frame: tuple[int, int]) -> bytes:
    """A two-frame GIF whose second frame's descriptor covers ``frame``, past the logical screen ``canvas``."""
    first = _gif(canvas, canvas)
    assert first.endswith(b";")
    descriptor = b"," + struct.pack("<HHHH", 0, 0, *frame) + b"\x00"
    return first[:-1] + descriptor + b"\x02\x02\x4c\x01\x00" + b";"


def test_a_later_gif_frame_cannot_grow_the_canvas_past_the_limit_under_pixel_limit():
    from common.imageio import BOMB_ERRORS, pixel_limit

    data = _gif_second_frame_past_canvas((500, 400), (4000, 3000))
    with pixel_limit(MAX_PIXELS):
        img = Image.open(io.BytesIO(data))
        img.load()
        with pytest.raises(BOMB_ERRORS):
            img.seek(1)  # PIL grows the canvas to fit the frame: sized before anything is allocated
    assert Image.MAX_IMAGE_PIXELS is None  # the guard is lifted after the block
    assert _code(_decode_row(data, reject_animated=False)) is None  # decode curates the first frame only
