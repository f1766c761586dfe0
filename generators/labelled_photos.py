"""A labelled check of the person filter on real photos that ship inside installed packages.

The question it asks is the person stage's: does the image show at least one prominent person? Every image carries
that answer (``person``) and a ``kind`` that says what makes it hard:

- ``people``: ultralytics ``bus`` / ``zidane``, matplotlib ``grace_hopper``, scikit-image ``astronaut`` / ``camera``,
  each as shipped, mirrored, recompressed at JPEG quality 30, shrunk to 60 % and turned into greyscale;
- ``painted_people``: the same photos as paintings (OpenCV's edge-preserving stylisation): still people;
- ``animals``: scikit-image ``chelsea`` (a cat's face) and ``horse`` (a horse's silhouette), and chelsea mirrored
  and painted;
- ``scenes``: scikit-learn ``china`` / ``flower``, scikit-image ``coffee`` / ``rocket`` / ``retina`` /
  ``hubble_deep_field`` / ``moon`` / ``coins`` and their paintings;
- ``textures``: scikit-image ``brick`` / ``grass`` / ``gravel``, ``text`` / ``page`` (print);
- ``crowds``: grids of small people (the person photos shrunk into the cells of a 4 x 4 or 6 x 6 grid, apart from
  each other): many people, none prominent, so the answer is no.

Small shipped images are enlarged so their short side reaches ``min_side`` (decode's default minimum).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

PEOPLE = ("bus", "zidane", "grace_hopper", "astronaut", "camera")
SCENES = ("china", "flower", "coffee", "rocket", "retina", "hubble_deep_field", "moon", "coins")
TEXTURES = ("brick", "grass", "gravel", "text", "page")
ANIMALS = ("chelsea", "horse")


@dataclass(frozen=True)
class LabelledPhoto:
    name: str
    rgb: np.ndarray  # H x W x 3 uint8
    person: bool  # at least one prominent person
    kind: str


def _shipped(name: str) -> Image.Image:
    from generators.sample_pool import load_photos, ultralytics_assets

    if name in ("bus", "zidane"):
        return Image.open(ultralytics_assets() / f"{name}.jpg")
    if name in ("grace_hopper", "china", "flower"):
        return load_photos()[name].image
    import skimage.data

    arr = getattr(skimage.data, name)()
    if arr.dtype == bool:
        arr = np.where(arr, 255, 0).astype(np.uint8)
    return Image.fromarray(arr)


def upscaled_rgb(img: Image.Image, min_side: int) -> np.ndarray:
    """RGB pixels with the short side raised to ``min_side`` (Lanczos) where it is shorter."""
    img = img.convert("RGB")
    if min(img.size) < min_side:
        s = min_side / min(img.size)
        img = img.resize(
            (max(min_side, round(img.width * s)), max(min_side, round(img.height * s))), Image.Resampling.LANCZOS
        )
    return np.asarray(img)


def painted(rgb: np.ndarray) -> np.ndarray:
    """A painting of the photo: OpenCV's edge-preserving stylisation (flat colour regions, inked edges)."""
    import cv2

    return cv2.stylization(rgb, sigma_s=60, sigma_r=0.45)


def _jpeg_again(rgb: np.ndarray, quality: int) -> np.ndarray:
    import io

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return np.asarray(Image.open(buf).convert("RGB"))


def crowd(photos: list[np.ndarray], cells: int, side: int = 960, fill: float = 0.7) -> np.ndarray:
    """A ``cells`` x ``cells`` grid of the photos (cycled) on grey, each shrunk to ``fill`` of its cell and centred
    in it: small people apart from each other (touching tiles would stack one photo's head on another's legs)."""
    cell = side // cells
    out = np.full((cell * cells, cell * cells, 3), 128, np.uint8)
    inner = round(cell * fill)
    for i in range(cells * cells):
        img = Image.fromarray(photos[i % len(photos)])
        img.thumbnail((inner, inner), Image.Resampling.LANCZOS)
        y = (i // cells) * cell + (cell - img.height) // 2
        x = (i % cells) * cell + (cell - img.width) // 2
        out[y : y + img.height, x : x + img.width] = np.asarray(img)
    return out


def person_check(min_side: int = 384) -> Iterator[LabelledPhoto]:
    """The labelled photos, in a fixed order."""
    people = {n: upscaled_rgb(_shipped(n), min_side) for n in PEOPLE}
    for name, rgb in people.items():
        h, w = rgb.shape[:2]
        s = max(0.6, min_side / min(h, w))
        variants = {
            "": rgb,
            "_mirrored": np.ascontiguousarray(rgb[:, ::-1]),
            "_q30": _jpeg_again(rgb, 30),
            "_small": np.asarray(Image.fromarray(rgb).resize((round(w * s), round(h * s)), Image.Resampling.BILINEAR)),
            "_grey": np.asarray(ImageOps.grayscale(Image.fromarray(rgb)).convert("RGB")),
        }
        for suffix, v in variants.items():
            yield LabelledPhoto(name + suffix, v, True, "people")
        yield LabelledPhoto(f"{name}_painted", painted(rgb), True, "painted_people")
    for name in ANIMALS:
        rgb = upscaled_rgb(_shipped(name), min_side)
        yield LabelledPhoto(name, rgb, False, "animals")
        if name == "chelsea":
            yield LabelledPhoto(f"{name}_mirrored", np.ascontiguousarray(rgb[:, ::-1]), False, "animals")
            yield LabelledPhoto(f"{name}_painted", painted(rgb), False, "animals")
    for name in SCENES:
        rgb = upscaled_rgb(_shipped(name), min_side)
        yield LabelledPhoto(name, rgb, False, "scenes")
        yield LabelledPhoto(f"{name}_painted", painted(rgb), False, "scenes")
    for name in TEXTURES:
        yield LabelledPhoto(name, upscaled_rgb(_shipped(name), min_side), False, "textures")
    shots = list(people.values())
    for cells in (4, 6):
        yield LabelledPhoto(f"crowd_{cells}x{cells}", crowd(shots, cells), False, "crowds")
        yield LabelledPhoto(f"crowd_{cells}x{cells}_shifted", crowd(shots[2:] + shots[:2], cells), False, "crowds")


def precision_recall(truth: list[bool], said: list[bool]) -> tuple[float, float]:
    tp = sum(t and s for t, s in zip(truth, said))
    fp = sum(s and not t for t, s in zip(truth, said))
    fn = sum(t and not s for t, s in zip(truth, said))
    return tp / max(tp + fp, 1), tp / max(tp + fn, 1)
