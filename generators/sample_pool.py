"""A sample image pool built from real photos that ship inside installed packages, plus generated variants and
deliberately bad inputs: what the README's end-to-end command curates and what the tests use.

Every curation stage both keeps and rejects something on it. Categories (the folder of each file in the folder
format, and ``category`` in the manifest):

- ``people``: person photos (ultralytics ``bus``/``zidane``, matplotlib ``grace_hopper``, scikit-image
  ``astronaut``/``camera``) and their near-duplicates (mirrored, JPEG q=40, resized, 90 % crop) plus one exact
  byte copy; ``--n`` adds more near-duplicates with seeded parameters.
- ``no_person``: scikit-learn ``china``/``flower``, scikit-image ``coffee``/``rocket``/``chelsea`` (and, at larger
  ``--n``, their near-duplicates).
- ``text``: person photos with large captions drawn over them; scikit-image ``text()`` and ``page()`` upscaled.
- ``low_quality``: heavy blur, very dark, blown out, heavy noise.
- ``tiny``: short side below 384 px, and a 4:1 strip (1600x400: its short side passes, its aspect ratio does not).
- ``bad``: inputs decode must reject, each with the reason code it should produce (empty, truncated, text/HTML/
  random bytes with image names, a PNG header declaring 100000x100000, an animated GIF, a broken symlink).
- ``odd``: unusual but valid inputs decode must accept (a JPEG named .png, CMYK JPEG, 16-bit grey PNG, palette PNG
  with transparency, a JPEG stored landscape with EXIF orientation 6 so it displays portrait).

Output formats and how the pipeline names each input (``path`` in the manifest; ``curation.score.pool`` names the input
``<pool root>/<path>``):

- ``folder``: files under ``<category>/``; path ``people/bus_flip.jpg``.
- ``parquet``: ``pool-00000.parquet`` ... of up to 25 rows with ``image`` struct<bytes, path> (the Hugging Face
  Image layout; ``image.path`` is the folder-format name) and ``source`` (the same name); path
  ``pool-00000.parquet#row=3`` (the reader's default naming; ``input.source_column=source`` names them by
  ``source`` instead). The broken symlink has no bytes and is left out.
- ``webdataset``: ``pool-00000.tar`` ... of up to 25 samples with one member ``<key>.<ext>`` each, key the folder
  name with ``/`` turned into ``-`` (no dots); path ``pool-00000.tar#people-bus_flip.jpg``. No symlink either.

Parquet rows and tar members are shuffled by the seed so every shard mixes categories.

``_manifest.jsonl`` (ignored by the pipeline: names starting with ``_``) has one object per input: ``path``,
``name`` (the folder-format name, the same in every format), ``category``, ``origin`` (source photo), ``variant``,
``params``, ``sha256``, ``size_bytes``, the header facts decode should find (``format``, ``mode``, ``width``,
``height`` after EXIF orientation, ``frames``), ``has_person`` (what the content shows, whatever a detector makes
of it), ``dup_group`` (near-duplicates of one photo that phase 1 may keep and dedup should collapse),
``exact_copy_of``, ``encoding_quality`` (what decode reads of the encoding, which dedup's keep rule ranks), and the
expected outcome of phase 1 with the lite profile's default thresholds:

- ``{"expect": "kept"}``
- ``{"expect": "rejected", "stage": S, "reason": R}`` where both are certain; ``"stage_any"`` / ``"reason_any"``
  lists replace them where the image is certainly rejected but the first stage to do it is not.
- ``{"expect": "any", "stage_any": [...]}``: kept, or rejected by one of those stages (never by another), with
  ``why``. Used where the lite detectors' answer on real content is borderline (measured with the lite stages).

``expected_curation`` carries that on to the end of a lite run: which copy of each photo dedup keeps and how many
sampling selects (``jobs.make_sample_pool`` prints it).

Output is byte-identical for a given ``n`` and seed (fixed encoder settings, no timestamps or tool metadata), and
the variants of a smaller ``n`` are a subset of those of a larger one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import struct
import tarfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont, ImageOps

from common import storage

DEFAULT_N = 60
MIN_N = 40  # the fixed structure (36 inputs) plus one of each of the four near-duplicate kinds
SHARD_ROWS = 25
MIN_SIDE = 400  # generated photos keep the short side at least this (decode's default minimum is 384)
MANIFEST = "_manifest.jsonl"

PERSON_PHOTOS = ("bus", "zidane", "grace_hopper", "astronaut", "camera")
NO_PERSON_PHOTOS = ("china", "flower", "coffee", "rocket", "chelsea")
VARIANT_KINDS = ("flip", "q40", "resize", "crop")
CATEGORIES = ("people", "no_person", "text", "low_quality", "tiny", "bad", "odd")
FORMATS = ("folder", "parquet", "webdataset")
Format = Literal["folder", "parquet", "webdataset"]

_EXIF_ORIENTATION = 0x0112
_PERSON_REASONS = ["no_person", "no_prominent_person"]
_NO_PERSON_CONTENT = (*NO_PERSON_PHOTOS, "text", "page")


class FixtureMissing(RuntimeError):
    """A package that ships one of the sample photos is not installed."""


# --- expected outcomes ---------------------------------------------------------------------------------------


def _kept() -> dict[str, Any]:
    return {"expect": "kept"}


def _rejected(stage: str, reason: str) -> dict[str, Any]:
    return {"expect": "rejected", "stage": stage, "reason": reason}


def _rejected_somewhere(stages: list[str], reasons: list[str], why: str) -> dict[str, Any]:
    return {"expect": "rejected", "stage_any": stages, "reason_any": reasons, "why": why}


def _either(stages: list[str], why: str) -> dict[str, Any]:
    return {"expect": "any", "stage_any": stages, "why": why}


def _no_person() -> dict[str, Any]:
    return {"expect": "rejected", "stage": "person", "reason_any": list(_PERSON_REASONS)}


# What a photo and its near-duplicates should do in phase 1: the plain answer where the lite models give it
# (checked against the lite stages on this pool), else "any" with the reason.
_PHOTO_EXPECT: dict[str, dict[str, Any]] = {
    "zidane": _kept(),
    "astronaut": _kept(),
    "bus": _either(["text_overlay"], "scene text on the bus covers close to filters.max_text_area_frac"),
    "grace_hopper": _either(["text_overlay"], "insignia on the uniform can read as text"),
    "camera": _either(["quality"], "greyscale and soft: technical quality sits near filters.min_quality"),
    **{name: _no_person() for name in NO_PERSON_PHOTOS},
}


# --- photos ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Photo:
    name: str
    image: Image.Image  # RGB, or L for greyscale photos; at least MIN_SIDE on the short side
    data: bytes  # the encoded file: the shipped JPEG where there is one, else our JPEG of the pixels


def _need(package: str, what: str) -> FixtureMissing:
    return FixtureMissing(
        f"the sample pool needs the '{package}' package ({what}); install the test extras: pip install -e '.[test]'"
    )


def _jpeg(img: Image.Image, quality: int = 90, exif: bytes | None = None) -> bytes:
    buf = io.BytesIO()
    # Fixed settings, no optimise pass, no metadata unless asked: the same pixels give the same bytes every run.
    extra = {"exif": exif} if exif else {}
    img.save(buf, "JPEG", quality=quality, optimize=False, progressive=False, **extra)
    return buf.getvalue()


def _png(img: Image.Image, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", optimize=False, compress_level=6, **kwargs)
    return buf.getvalue()


def _at_least(img: Image.Image, side: int = MIN_SIDE) -> Image.Image:
    """Upscale so the short side is at least ``side`` (small shipped photos would fail decode's size gate)."""
    short = min(img.size)
    if short >= side:
        return img
    s = side / short
    return img.resize((max(side, round(img.width * s)), max(side, round(img.height * s))), Image.Resampling.LANCZOS)


def _photo_from_array(name: str, arr: np.ndarray) -> Photo:
    img = _at_least(Image.fromarray(np.ascontiguousarray(arr)))
    return Photo(name, img, _jpeg(img, 95))


def _photo_from_file(name: str, path: Path) -> Photo:
    data = path.read_bytes()
    img = Image.open(io.BytesIO(data))
    img.load()
    if min(img.size) < MIN_SIDE:
        return _photo_from_array(name, np.asarray(img))
    return Photo(name, img, data)


def ultralytics_assets() -> Path:
    """ultralytics' ``ASSETS`` folder, located without importing ultralytics: its import patches
    ``PIL.Image.open`` so that an unidentifiable file triggers a pip install attempt (of pi-heif) and then raises
    ModuleNotFoundError instead of UnidentifiedImageError, which would change decode's verdict on bad inputs."""
    spec = importlib.util.find_spec("ultralytics")
    if spec is None or not spec.submodule_search_locations:
        raise _need("ultralytics-opencv-headless", "bus.jpg and zidane.jpg")
    assets = Path(next(iter(spec.submodule_search_locations))) / "assets"  # = ultralytics.utils.ASSETS
    if not (assets / "bus.jpg").is_file():
        raise FixtureMissing(f"{assets} holds no bus.jpg; reinstall ultralytics-opencv-headless")
    return assets


def load_photos() -> dict[str, Photo]:
    """The ten shipped photos, found through their packages' own APIs."""
    photos: dict[str, Photo] = {}
    for name in ("bus", "zidane"):
        photos[name] = _photo_from_file(name, ultralytics_assets() / f"{name}.jpg")
    try:
        from matplotlib import cbook
    except ImportError:
        raise _need("matplotlib", "grace_hopper.jpg and the DejaVuSans font") from None
    grace = Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    photos["grace_hopper"] = _photo_from_file("grace_hopper", grace)
    try:
        import skimage.data
    except ImportError:
        raise _need("scikit-image", "astronaut, camera, coffee, rocket, chelsea, text, page") from None
    for name in ("astronaut", "camera", "coffee", "rocket", "chelsea", "text", "page"):
        photos[name] = _photo_from_array(name, getattr(skimage.data, name)())
    try:
        from sklearn.datasets import load_sample_image
    except ImportError:
        raise _need("scikit-learn", "china.jpg and flower.jpg") from None
    for name in ("china", "flower"):
        photos[name] = _photo_from_array(name, load_sample_image(f"{name}.jpg"))
    return photos


def _font_path() -> Path:
    try:
        import matplotlib
    except ImportError:
        raise _need("matplotlib", "the DejaVuSans font") from None
    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    if not path.is_file():
        raise FixtureMissing(f"matplotlib's font {path} is missing; reinstall matplotlib")
    return path


# --- items -------------------------------------------------------------------------------------------------------


@dataclass
class PoolItem:
    name: str  # folder-format path, e.g. "people/bus_flip.jpg"
    data: bytes | None  # None only for the broken symlink
    category: str
    origin: str | None
    variant: str
    expect: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    dup_group: str | None = None
    exact_copy_of: str | None = None
    link_target: str | None = None  # folder format: written as a symlink to this (missing) target

    def facts(self) -> dict[str, Any]:
        """What decode should find in the header: format, mode, displayed size, frames (nulls for non-images)."""
        # the readings decode records (declared size, EXIF orientation); also lifts PIL's bomb guard, as decode does
        from common.encoding import encoding_quality
        from common.imageio import declared_size, exif_orientation, open_image, oriented_size

        out: dict[str, Any] = dict.fromkeys(("format", "mode", "encoding_quality", "width", "height", "frames"))
        if not self.data:
            return out
        try:
            img = open_image(self.data)
        except Exception:  # noqa: BLE001 - not an image: the nulls are the fact
            return out
        w, h = oriented_size(declared_size(img, self.data), exif_orientation(img))
        out.update(format=img.format, mode=img.mode, encoding_quality=encoding_quality(img, self.data))
        out.update(width=w, height=h, frames=getattr(img, "n_frames", 1))
        return out


def _rng(seed: int, *salt: int) -> np.random.Generator:
    # One stream per (seed, item): an item's bytes do not depend on how many items come before it.
    return np.random.default_rng([seed, *salt])


def _variant(photo: Photo, kind: str, rng: np.random.Generator, jitter: bool) -> tuple[bytes, dict[str, Any]]:
    """One near-duplicate of ``photo``; ``jitter`` draws the kind's parameter from a range instead of the default."""
    img = photo.image
    if kind == "flip":
        q = int(rng.integers(70, 96)) if jitter else 90
        return _jpeg(ImageOps.mirror(img), q), {"mirror": True, "quality": q}
    if kind == "q40":
        q = int(rng.integers(25, 61)) if jitter else 40
        return _jpeg(img, q), {"quality": q}
    if kind == "resize":
        scale = float(rng.uniform(0.6, 0.85)) if jitter else 0.7
        short = min(img.size)
        # Keep the short side >= MIN_SIDE; a photo already near it is enlarged instead, still a resampled copy.
        scale = max(scale, MIN_SIDE / short)
        if scale > 0.95:
            scale = 1.25
        size = (round(img.width * scale), round(img.height * scale))
        return _jpeg(img.resize(size, Image.Resampling.LANCZOS), 90), {"scale": round(scale, 4), "size": list(size)}
    if kind == "crop":
        frac = float(rng.uniform(0.82, 0.95)) if jitter else 0.9
        cw, ch = round(img.width * frac), round(img.height * frac)
        if jitter:
            x0, y0 = int(rng.integers(0, img.width - cw + 1)), int(rng.integers(0, img.height - ch + 1))
        else:
            x0, y0 = (img.width - cw) // 2, (img.height - ch) // 2
        box = (x0, y0, x0 + cw, y0 + ch)
        return _jpeg(_at_least(img.crop(box)), 90), {"fraction": round(frac, 4), "box": list(box)}
    raise ValueError(f"unknown variant kind {kind!r}")


def _variant_items(photos: dict[str, Photo], count: int, seed: int) -> list[PoolItem]:
    """Near-duplicates in a fixed order: every (person photo, kind) pair first (the first four cover all four
    kinds), then every (no-person photo, kind) pair, then seeded parameter draws over all ten photos."""
    items = []
    for i in range(count):
        if i < 20:
            origin, kind, jitter = PERSON_PHOTOS[i % 5], VARIANT_KINDS[i % 4], False
        elif i < 40:
            origin, kind, jitter = NO_PERSON_PHOTOS[(i - 20) % 5], VARIANT_KINDS[(i - 20) % 4], False
        else:
            j = i - 40
            origin, kind, jitter = (PERSON_PHOTOS + NO_PERSON_PHOTOS)[j % 10], VARIANT_KINDS[(j // 10) % 4], True
        data, params = _variant(photos[origin], kind, _rng(seed, 1, i), jitter)
        category = "people" if origin in PERSON_PHOTOS else "no_person"
        name = f"{category}/{origin}_{kind}.jpg" if not jitter else f"{category}/{origin}_{kind}_{i:04d}.jpg"
        expect = dict(_PHOTO_EXPECT[origin])
        items.append(PoolItem(name, data, category, origin, kind, expect, params, dup_group=origin))
    return items


def _caption(img: Image.Image, lines: list[str], font_path: Path) -> Image.Image:
    """Meme-style caption at the bottom: large white text with a black outline, faces above it left clear."""
    out = img.convert("RGB")
    draw = ImageDraw.Draw(out)
    size = out.height // 8
    while True:
        font = ImageFont.truetype(str(font_path), size)
        stroke = max(2, size // 12)
        boxes = [draw.textbbox((0, 0), line, font=font, stroke_width=stroke) for line in lines]
        if max(b[2] - b[0] for b in boxes) <= 0.94 * out.width or size <= 12:
            break
        size = int(size * 0.9)
    line_h = max(b[3] - b[1] for b in boxes)
    y = out.height - len(lines) * (line_h + size // 6) - out.height // 30
    for line, b in zip(lines, boxes):
        x = (out.width - (b[2] - b[0])) // 2 - b[0]
        draw.text((x, y - b[1]), line, font=font, fill=(255, 255, 255), stroke_width=stroke, stroke_fill=(0, 0, 0))
        y += line_h + size // 6
    return out


def _text_items(photos: dict[str, Photo], font_path: Path) -> list[PoolItem]:
    memes = [
        ("zidane", ["WHEN THE TESTS PASS", "ON THE FIRST TRY"], _rejected("text_overlay", "text_overlay")),
        ("astronaut", ["MONDAY MORNING", "STANDUP MEETING"], _rejected("text_overlay", "text_overlay")),
        (
            "grace_hopper",
            ["IT'S NOT A BUG", "IT'S A FEATURE"],
            _rejected_somewhere(
                ["person", "text_overlay"], [*_PERSON_REASONS, "text_overlay"], "the portrait may already fail person"
            ),
        ),
    ]
    items = []
    for origin, lines, expect in memes:
        img = _caption(photos[origin].image, lines, font_path)
        name = f"text/{origin}_caption.jpg"
        items.append(PoolItem(name, _jpeg(img, 90), "text", origin, "caption", expect, {"lines": lines}))
    for origin in ("text", "page"):
        photo = photos[origin]
        expect = _rejected_somewhere(
            ["person", "quality", "text_overlay"],
            [*_PERSON_REASONS, "low_quality", "text_overlay"],
            "no person, but a text-only greyscale image; which stage rejects it first depends on the detectors",
        )
        params = {"size": list(photo.image.size)}
        items.append(PoolItem(f"text/{origin}.jpg", photo.data, "text", origin, "upscaled", expect, params))
    return items


def _low_quality_items(photos: dict[str, Photo], seed: int) -> list[PoolItem]:
    why = "degraded enough that person detection may fail before quality scores it"
    expect = _rejected_somewhere(["person", "quality"], [*_PERSON_REASONS, "low_quality"], why)
    zidane = np.asarray(photos["zidane"].image, dtype=np.float32)
    astronaut = np.asarray(photos["astronaut"].image, dtype=np.float32)
    noise = _rng(seed, 2).normal(0.0, 70.0, astronaut.shape).astype(np.float32)
    radius = max(photos["zidane"].image.size) / 60
    blurred = photos["zidane"].image.filter(ImageFilter.GaussianBlur(radius))

    def u8(a: np.ndarray) -> Image.Image:
        return Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8))

    made: list[tuple[str, str, Image.Image, dict[str, Any]]] = [
        ("zidane", "blur", blurred, {"radius": round(radius, 2)}),
        ("astronaut", "dark", u8(astronaut * 0.07), {"gain": 0.07}),
        ("zidane", "blown", u8(zidane * 3.0 + 140.0), {"gain": 3.0, "offset": 140}),
        ("astronaut", "noise", u8(astronaut + noise), {"sigma": 70}),
    ]
    return [
        PoolItem(f"low_quality/{origin}_{kind}.jpg", _jpeg(img, 90), "low_quality", origin, kind, dict(expect), params)
        for origin, kind, img, params in made
    ]


def _tiny_items(photos: dict[str, Photo], seed: int) -> list[PoolItem]:
    bus, zidane = photos["bus"].image, photos["zidane"].image
    rng = _rng(seed, 3)
    x0, y0 = int(rng.integers(0, bus.width - 200)), int(rng.integers(0, bus.height - 150))
    crop = bus.crop((x0, y0, x0 + 200, y0 + 150))
    thumb = zidane.resize((320, 180), Image.Resampling.LANCZOS)
    wide = zidane.resize((1600, 900), Image.Resampling.LANCZOS)
    strip = wide.crop((0, 150, 1600, 550))  # the band through both faces
    made = [
        ("bus_crop200x150", crop, "bus", "crop", "too_small", {"box": [x0, y0, x0 + 200, y0 + 150]}),
        ("zidane_thumb", thumb, "zidane", "thumbnail", "too_small", {"size": [320, 180]}),
        ("zidane_strip", strip, "zidane", "strip", "extreme_aspect", {"size": [1600, 400]}),
    ]
    return [
        PoolItem(f"tiny/{name}.jpg", _jpeg(img), "tiny", origin, variant, _rejected("decode", reason), params)
        for name, img, origin, variant, reason, params in made
    ]


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def huge_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A well-formed PNG whose IHDR declares ``width`` x ``height`` 8-bit grey; its IDAT holds just two rows, so
    the file is tiny and only a decoder that trusts the header would try to allocate the whole image."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (width + 1) * 2, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


_NOT_AN_IMAGE_TEXT = b"Field notes, day 3\n\nThis file is plain text that was saved under an image name.\n" * 4
_HTML_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n"
    b"<body><h1>Not Found</h1><p>The requested image was not found on this server.</p></body></html>\n"
)


def _bad_items(photos: dict[str, Photo], seed: int) -> list[PoolItem]:
    zidane = photos["zidane"]
    # Four panning frames: an animation is a sequence of related pictures, not one repeated.
    small = zidane.image.resize((640, 360), Image.Resampling.LANCZOS)
    # Quantised here with the fast octree method: GIF's own median-cut pass costs a second per pool.
    frames = [small.crop((x, 30, x + 400, 330)).quantize(64, Image.Quantize.FASTOCTREE) for x in (0, 60, 120, 180)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=120, loop=0, optimize=False)
    bad: list[tuple[str, bytes, str | None, str, dict[str, Any], dict[str, Any]]] = [
        ("empty.jpg", b"", None, "empty", _rejected("decode", "empty_file"), {}),
        (
            "truncated.jpg",
            zidane.data[: len(zidane.data) // 2],
            "zidane",
            "truncated",
            _rejected("decode", "corrupt"),
            {"kept_bytes": len(zidane.data) // 2, "of": len(zidane.data)},
        ),
        ("notes.jpg", _NOT_AN_IMAGE_TEXT, None, "text_file", _rejected("decode", "not_an_image"), {}),
        ("random.png", _rng(seed, 4).bytes(4096), None, "random_bytes", _rejected("decode", "not_an_image"), {}),
        ("error_page.jpg", _HTML_PAGE, None, "html_page", _rejected("decode", "not_an_image"), {}),
        (
            "huge_header.png",
            huge_png(),
            None,
            "huge_header",
            _rejected("decode", "decompression_bomb"),
            {"declared": [100_000, 100_000]},
        ),
        (
            "animated.gif",
            buf.getvalue(),
            "zidane",
            "animated",
            _rejected("decode", "animated"),
            {"frames": len(frames)},
        ),
    ]
    items = [
        PoolItem(f"bad/{name}", data, "bad", origin, variant, expect, params)
        for name, data, origin, variant, expect, params in bad
    ]
    items.append(
        PoolItem(
            "bad/broken_link.jpg",
            None,
            "bad",
            None,
            "broken_symlink",
            _rejected("decode", "unreadable"),
            link_target="does-not-exist/photo.jpg",
        )
    )
    return items


def _odd_items(photos: dict[str, Photo]) -> list[PoolItem]:
    grace, zidane, camera = photos["grace_hopper"], photos["zidane"], photos["camera"]
    astronaut, bus = photos["astronaut"], photos["bus"]
    # Palette PNG with a transparent frame: decode composites it on white.
    pal = astronaut.image.convert("RGB").quantize(colors=255, method=Image.Quantize.FASTOCTREE)
    idx = np.array(pal)
    idx[:24, :] = idx[-24:, :] = idx[:, :24] = idx[:, -24:] = 255
    palette_img = Image.fromarray(idx, "P")
    palette = pal.getpalette() or []
    palette_img.putpalette(palette + [0] * (768 - len(palette)))
    # Stored landscape, displayed portrait: orientation 6 tells viewers to turn the stored pixels 90 degrees clockwise.
    exif = Image.Exif()
    exif[_EXIF_ORIENTATION] = 6
    stored = bus.image.transpose(Image.Transpose.ROTATE_90)
    gray16 = Image.fromarray(np.asarray(camera.image.convert("L"), dtype=np.uint16) * 257)
    odd: list[tuple[str, bytes, Photo, str, dict[str, Any]]] = [
        ("grace_hopper_jpeg.png", _jpeg(grace.image, 85), grace, "jpeg_named_png", {"quality": 85}),
        ("zidane_cmyk.jpg", _jpeg(zidane.image.convert("CMYK"), 90), zidane, "cmyk", {}),
        ("camera_gray16.png", _png(gray16), camera, "gray16", {"bit_depth": 16}),
        (
            "astronaut_palette.png",
            _png(palette_img, transparency=255),
            astronaut,
            "palette_transparency",
            {"colors": 255, "transparent_index": 255, "frame_px": 24},
        ),
        (
            "bus_exif6.jpg",
            _jpeg(stored, 92, exif=exif.tobytes()),
            bus,
            "exif_orientation_6",
            {"orientation": 6, "stored_size": list(stored.size)},
        ),
    ]
    items = []
    for name, data, photo, variant, params in odd:
        expect = dict(_PHOTO_EXPECT[photo.name])
        if variant in ("cmyk", "gray16", "palette_transparency"):
            # Colour conversion, 256 dithered colours or a white frame may move the scores of the original.
            stages = sorted(set(expect.get("stage_any", [])) | {"person", "quality", "text_overlay"})
            expect = _either(stages, "valid but converted content: decode must accept it; later stages may differ")
        items.append(PoolItem(f"odd/{name}", data, "odd", photo.name, variant, expect, params, dup_group=photo.name))
    return items


def build_pool(n: int = DEFAULT_N, seed: int = 0) -> list[PoolItem]:
    """All items of an ``n``-input pool (folder format counts the broken symlink), sorted by name."""
    if n < MIN_N:
        raise ValueError(f"n={n}: the sample pool needs at least {MIN_N} inputs to hold every category")
    photos = load_photos()
    font = _font_path()
    items: list[PoolItem] = []
    for name in PERSON_PHOTOS + NO_PERSON_PHOTOS:
        category = "people" if name in PERSON_PHOTOS else "no_person"
        photo = photos[name]
        expect, params = dict(_PHOTO_EXPECT[name]), {"size": list(photo.image.size)}
        path = f"{category}/{name}.jpg"
        items.append(PoolItem(path, photo.data, category, name, "original", expect, params, dup_group=name))
    items.append(
        PoolItem(
            "people/zidane_copy.jpg",
            photos["zidane"].data,
            "people",
            "zidane",
            "exact_copy",
            _kept(),
            dup_group="zidane",
            exact_copy_of="people/zidane.jpg",
        )
    )
    items += _text_items(photos, font)
    items += _low_quality_items(photos, seed)
    items += _tiny_items(photos, seed)
    items += _bad_items(photos, seed)
    items += _odd_items(photos)
    items += _variant_items(photos, n - len(items), seed)
    items.sort(key=lambda it: it.name)
    names = [it.name for it in items]
    assert len(set(names)) == len(names), "duplicate names in the sample pool"
    return items


# --- writing -----------------------------------------------------------------------------------------------------


def wds_member(name: str) -> str:
    """WebDataset member for a folder name: key = name without extension, '/' -> '-' (keys hold no dots)."""
    stem, ext = name.rsplit(".", 1)
    key = stem.replace("/", "-")
    if "." in key:
        raise ValueError(f"{name}: a WebDataset key may not contain dots")
    return f"{key}.{ext}"


def _shards(items: list[PoolItem], seed: int) -> list[list[PoolItem]]:
    storable = [it for it in items if it.data is not None]
    order = np.random.default_rng([seed, 5]).permutation(len(storable))
    mixed = [storable[i] for i in order]
    return [mixed[i : i + SHARD_ROWS] for i in range(0, len(mixed), SHARD_ROWS)]


def _write_folder(items: list[PoolItem], out: Path) -> list[tuple[str, PoolItem]]:
    placed = []
    for it in items:
        path = out / it.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if it.link_target is not None:
            os.symlink(it.link_target, path)
        else:
            assert it.data is not None
            path.write_bytes(it.data)
        placed.append((it.name, it))
    return placed


def pool_metadata(it: PoolItem, key: str) -> dict[str, Any]:
    """What a crawler such as img2dataset records beside an image (its ``.json`` sidecar): where it came from, its
    caption, licence and the size the crawler saw."""
    facts = it.facts()
    return {
        "key": key,
        "url": f"https://pool.example/{it.name}",
        "caption": f"{it.category}: {it.variant}",
        "license": "see the source package's licence",
        "original_width": facts["width"],
        "original_height": facts["height"],
    }


def _write_parquet(items: list[PoolItem], out: Path, seed: int) -> list[tuple[str, PoolItem]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.schema import IMAGE_TYPE

    placed = []
    for k, shard in enumerate(_shards(items, seed)):
        fname = f"pool-{k:05d}.parquet"
        metadata = [pool_metadata(it, f"{k:05d}{r:04d}") for r, it in enumerate(shard)]
        table = pa.table(
            {
                "image": pa.array([{"bytes": it.data, "path": it.name} for it in shard], IMAGE_TYPE),
                "source": pa.array([it.name for it in shard], pa.string()),
                **{name: [m[name] for m in metadata] for name in metadata[0]},
            }
        )
        pq.write_table(table, out / fname, compression="zstd", row_group_size=SHARD_ROWS)
        placed += [(f"{fname}#row={r}", it) for r, it in enumerate(shard)]
    return placed


def _write_webdataset(items: list[PoolItem], out: Path, seed: int) -> list[tuple[str, PoolItem]]:
    placed = []
    for k, shard in enumerate(_shards(items, seed)):
        fname = f"pool-{k:05d}.tar"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for r, it in enumerate(shard):
                assert it.data is not None
                info = storage.fixed_tarinfo(wds_member(it.name), len(it.data))
                tar.addfile(info, io.BytesIO(it.data))
                placed.append((f"{fname}#{info.name}", it))
                # img2dataset's sidecars: the crawl's record and the caption
                metadata = pool_metadata(it, f"{k:05d}{r:04d}")
                stem = info.name.rsplit(".", 1)[0]
                for member, data in (
                    (f"{stem}.json", json.dumps(metadata).encode()),
                    (f"{stem}.txt", metadata["caption"].encode()),
                ):
                    tar.addfile(storage.fixed_tarinfo(member, len(data)), io.BytesIO(data))
        (out / fname).write_bytes(buf.getvalue())
    return placed


def manifest_row(path: str, it: PoolItem) -> dict[str, Any]:
    row: dict[str, Any] = {
        "path": path,
        "name": it.name,
        "category": it.category,
        "origin": it.origin,
        "variant": it.variant,
        "params": it.params,
        "sha256": hashlib.sha256(it.data).hexdigest() if it.data is not None else None,
        "size_bytes": len(it.data) if it.data is not None else None,
        "dup_group": it.dup_group,
        "exact_copy_of": it.exact_copy_of,
        # Ground truth of the content, apart from what any detector makes of it (null: not a photo of either kind).
        "has_person": True if it.origin in PERSON_PHOTOS else False if it.origin in _NO_PERSON_CONTENT else None,
        **it.facts(),
        **it.expect,
    }
    if it.link_target is not None:
        row["link_target"] = it.link_target
    return row


def write_pool(items: list[PoolItem], out: str | Path, fmt: Format = "folder", seed: int = 0) -> list[dict[str, Any]]:
    """Write ``items`` under ``out`` (created; must not hold files) in ``fmt`` plus ``_manifest.jsonl``."""
    out = Path(out)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "folder":
        placed = _write_folder(items, out)
    elif fmt == "parquet":
        placed = _write_parquet(items, out, seed)
    else:
        placed = _write_webdataset(items, out, seed)
    rows = [manifest_row(path, it) for path, it in placed]
    with open(out / MANIFEST, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return rows


def make_sample_pool(
    out: str | Path, n: int = DEFAULT_N, seed: int = 0, fmt: Format = "folder"
) -> list[dict[str, Any]]:
    """Build and write a pool; returns the manifest rows."""
    return write_pool(build_pool(n, seed), out, fmt, seed)


def read_manifest(out: str | Path) -> list[dict[str, Any]]:
    with open(Path(out) / MANIFEST, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- the end-to-end expectation ----------------------------------------------------------------------------------
# What ``jobs.curate --config configs/curate/lite.yaml`` should keep of the pool: phase 1 as the manifest's
# ``expect`` says, the borderline ("any") inputs passing as they do with the lite models; dedup linking every copy of
# a photo that reaches it except the variants below, and keeping one per photo by the keep rule's header-readable
# part (most pixels, then best encoding; the score only breaks ties, which the default pool has none of at the top);
# sampling selecting lite.yaml's fraction of what is left.

LITE_TARGET_FRACTION = 0.8  # configs/curate/lite.yaml's sample.target_fraction (a test holds them equal)
# Copies the lite signals do not link to their photo (measured): a mirror image moves both the pHash and the
# colour-gradient layout. (The palette PNG's white frame and 255 dithered colours move the pHash 14 bits, but its PDQ
# crop distance is 32 at cosine 0.93: linked.)
UNLINKED_VARIANTS = frozenset({"flip"})


@dataclass(frozen=True)
class Expectation:
    """The curation of a pool, end to end, as its manifest predicts it."""

    inputs: int
    rejected: dict[str, int]  # phase-1 rejections by stage ("person or quality" where either may come first)
    kept_copy: dict[str, tuple[str, ...]]  # photo -> the copy dedup keeps (several: tied, the score decides)
    duplicates: int
    after_dedup: int
    kept: int


def _pixels_and_encoding(row: dict[str, Any]) -> tuple[int, int]:
    return row["width"] * row["height"], row["encoding_quality"] if row["encoding_quality"] is not None else -1


def expected_curation(rows: list[dict[str, Any]], target_fraction: float = LITE_TARGET_FRACTION) -> Expectation:
    """What the lite curation of the pool whose manifest ``rows`` are should do (see the section's comment)."""
    rejected: Counter[str] = Counter()
    groups: dict[str, list[dict[str, Any]]] = {}
    singles = 0
    for r in rows:
        if r["expect"] == "rejected":
            rejected[" or ".join(r.get("stage_any") or [r["stage"]])] += 1
        elif r["dup_group"] is None or r["variant"] in UNLINKED_VARIANTS:
            singles += 1
        else:
            groups.setdefault(r["dup_group"], []).append(r)
    kept_copy = {}
    for photo, copies in sorted(groups.items()):
        best = max(_pixels_and_encoding(r) for r in copies)
        tied = sorted({r["sha256"]: r["name"] for r in copies if _pixels_and_encoding(r) == best}.values())
        kept_copy[photo] = tuple(tied)  # one name per distinct bytes: an exact copy ties on everything
    after = singles + len(groups)
    kept = min(after, int(target_fraction * after + 0.5))  # curation.phases.sample.kmeans.target_size
    duplicates = sum(len(c) for c in groups.values()) - len(groups)
    return Expectation(len(rows), dict(sorted(rejected.items())), kept_copy, duplicates, after, kept)


def _outcome_words(expect: Counter, total: int) -> str:
    """What phase 1 should do with a category's inputs, by their manifest's ``expect``: keep them ("kept"), reject
    them ("rejected"), or either, as the lite detectors happen to judge them ("any", borderline)."""
    words = {
        "kept": "must keep {}",
        "rejected": "must reject {}",
        "any": "may keep or reject {} (borderline for the lite detectors)",
    }
    parts = [words[k].format(f"all {n}" if n == total else n) for k in words if (n := expect[k])]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per category: how many inputs and what phase 1 (the lite profile's default thresholds) should do
    with them, in words; then what the lite curation should keep in the end, and which stage drops the rest."""
    lines = []
    for category in CATEGORIES:
        mine = [r for r in rows if r["category"] == category]
        if not mine:
            continue
        expect = Counter(r["expect"] for r in mine)
        variants = Counter(r["variant"] for r in mine)
        shown = ", ".join(f"{v} {c}" if c > 1 else v for v, c in sorted(variants.items()))
        lines.append(
            f"{category:<12} {len(mine):>3} inputs  phase 1 {_outcome_words(expect, len(mine))}  (variants: {shown})"
        )
    e = expected_curation(rows)
    borderline = sum(r["expect"] == "any" for r in rows)
    survivors = e.inputs - sum(e.rejected.values())
    kept_copies = ", ".join(" or ".join(n.split("/")[-1] for n in names) for names in e.kept_copy.values())
    rejected = ", ".join(f"{s} {n}" for s, n in e.rejected.items())
    lines += [
        f"configs/curate/lite.yaml end to end: {e.kept} of the {e.inputs} inputs should end up kept (the {borderline} "
        "borderline inputs pass phase 1, as they do with the lite models)",
        f"  phase 1 rejects {sum(e.rejected.values())}, by the stage that rejects them: {rejected}",
        f"  dedup keeps one copy of each of {len(e.kept_copy)} photos, the most pixels then the best encoding "
        f"({kept_copies}), and drops {e.duplicates} of the {survivors} left; mirrored copies are "
        "not linked to their photo",
        f"  sample selects {e.kept} of the {e.after_dedup} left (sample.target_fraction {LITE_TARGET_FRACTION})",
    ]
    return lines
