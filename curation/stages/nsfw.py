"""Safety: reject sexually explicit images with Yahoo's open_nsfw classifier (ResNet-50 1by2, Caffe, BSD-2-Clause).

The network and its weights are pinned by sha256 (``models.nsfw.prototxt`` and ``models.nsfw.caffemodel``: the
files shipped in the ``nsfw`` 0.3.2 source archive on the package index) and run by OpenCV's dnn module. Its
"prob" output is [sfw, nsfw]; the score is the nsfw probability, and an image scoring above
``filters.nsfw_max_score`` is rejected. The score is this model's: another classifier's scores are on another scale.

Preprocessing is open_nsfw's ``classify_nsfw.py``: the image is resized to 256x256 (PIL, bilinear) and re-encoded
as a JPEG in memory, as the training set was made; that JPEG is decoded to float RGB in [0, 1], centre-cropped to
224x224, moved to CHW, swapped to BGR, scaled by 255 and the BGR mean [104, 117, 123] subtracted.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
from PIL import Image

from curation.score.stage import Row, Stage, StageSettings, Update
from curation.settings import Filters

MODEL_NAME = "open_nsfw"
LICENCE = "BSD-2-Clause"
RESIZE = (256, 256)
CROP = 224
MEAN_BGR = np.array([104.0, 117.0, 123.0], dtype=np.float32)


def resized_jpeg(data: bytes) -> bytes:
    """classify_nsfw.py's ``resize_image``: RGB, 256x256 bilinear, saved as a JPEG with PIL's defaults."""
    with Image.open(io.BytesIO(data)) as im:
        rgb = im if im.mode == "RGB" else im.convert("RGB")
        small = rgb.resize(RESIZE, resample=Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    small.save(buf, format="JPEG")
    return buf.getvalue()


def network_input(data: bytes) -> np.ndarray:
    """One image's (3, 224, 224) float32 BGR input, from its encoded bytes."""
    with Image.open(io.BytesIO(resized_jpeg(data))) as im:
        image = np.asarray(im.convert("RGB"), dtype=np.float32) / np.float32(255.0)  # caffe.io.load_image
    h, w = image.shape[:2]
    top, left = max((h - CROP) // 2, 0), max((w - CROP) // 2, 0)
    crop = image[top : top + CROP, left : left + CROP, :]
    chw = crop.transpose(2, 0, 1)[::-1]  # HWC -> CHW, RGB -> BGR
    return np.ascontiguousarray(chw * np.float32(255.0) - MEAN_BGR[:, None, None], dtype=np.float32)


def _fmt(x: float) -> str:
    """Two decimals, or two significant digits below 0.01 (a lowered threshold should not read as 0.00)."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.01 else f"{x:.2g}"


def nsfw_detail(score: float, limit: float, model: str = MODEL_NAME) -> str:
    """The detail of an ``nsfw`` rejection; ``model`` names whose scale the score is on."""
    return f"score {_fmt(score)} > {_fmt(limit)} ({model})"


class NsfwStage(Stage):
    """The open_nsfw probability of each image; rejects those above ``filters.nsfw_max_score``."""

    name = "nsfw"
    reads = ("image",)
    columns = (pa.field("nsfw_score", pa.float32()),)
    model_section = "nsfw"
    thresholds = decided = ("nsfw_max_score",)
    decision_codes = ("nsfw",)
    uses_actors = True
    default_settings = StageSettings(batch_size=16, num_cpus=0.5, actors=(1, 2))
    default_order = 45  # after the person, quality and text rejections; before the pHash and the embedding

    def setup(self) -> None:
        import cv2

        from curation.models import ModelStore

        m = self.cfg.models.nsfw
        cv2.setNumThreads(self.threads)
        store = ModelStore.from_settings(self.cfg.models.store)
        prototxt = store.fetch(m.prototxt, "models.nsfw.prototxt")
        caffemodel = store.fetch(m.caffemodel, "models.nsfw.caffemodel")
        self.net = cv2.dnn.readNetFromCaffe(str(prototxt), str(caffemodel))
        self.net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        self.net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        self.scores(np.zeros((1, 3, CROP, CROP), np.float32))  # the first pass allocates and plans

    def scores(self, blob: np.ndarray) -> np.ndarray:
        """The nsfw probability of each image of an (N, 3, 224, 224) input."""
        self.net.setInput(blob)
        prob = self.net.forward("prob")
        return prob.reshape(len(blob), 2)[:, 1].astype(np.float32)

    def process_batch(self, rows: list[Row]) -> list[Update]:
        if not rows:
            return []
        blob = np.stack([network_input(row["image"]["bytes"]) for row in rows])
        return [{"nsfw_score": score} for score in self.scores(blob).tolist()]

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        score, limit = row["nsfw_score"], filters.nsfw_max_score
        return f"nsfw: {nsfw_detail(score, limit)}" if score > limit else None
