"""Real photos that ship in installed packages (ultralytics, matplotlib, scikit-image, scikit-learn), encoded as a
pipeline input would be: the JPEG files as shipped where there are files, else arrays encoded at quality 95 with the
short side raised to decode's size gate."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import matplotlib
import numpy as np
import skimage.data
from PIL import Image
from sklearn.datasets import load_sample_image

from generators.sample_pool import ultralytics_assets

MIN_SHORT_SIDE = 384  # rows reaching the scoring stages have passed decode's size gate


def jpeg(rgb: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def upscale_to_min_short(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    if min(h, w) >= MIN_SHORT_SIDE:
        return img
    s = MIN_SHORT_SIDE / min(h, w)
    return cv2.resize(img, (round(w * s), round(h * s)), interpolation=cv2.INTER_CUBIC)


def package_photo_files() -> dict[str, bytes]:
    """Encoded photos by name."""
    assets = ultralytics_assets()
    files = {
        "bus": (assets / "bus.jpg").read_bytes(),
        "zidane": (assets / "zidane.jpg").read_bytes(),
        "grace_hopper": (Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").read_bytes(),
    }
    arrays = {
        "astronaut": skimage.data.astronaut(),
        "camera": skimage.data.camera(),  # grayscale
        "chelsea": skimage.data.chelsea(),
        "coffee": skimage.data.coffee(),
        "rocket": skimage.data.rocket(),
        "china": load_sample_image("china.jpg"),
        "flower": load_sample_image("flower.jpg"),
        "text": skimage.data.text(),  # grayscale
        "page": skimage.data.page(),  # grayscale scan
    }
    files.update({name: jpeg(upscale_to_min_short(img)) for name, img in arrays.items()})
    return files
