"""Text overlay: reject images whose pixels are largely covered by text (captions, memes, banners, screenshots).

Runs RapidOCR's PP-OCR text detector (DB segmentation), detection only: no orientation classifier, no recogniser, so
one ONNX model per actor. Its file is pinned (``models.ocr.detector``: PP-OCRv6 small, by sha256) rather than
whichever detector the installed rapidocr happens to ship. The score is the fraction of the image covered by the
union of the detected text boxes (polygons rasterised into one mask, so overlapping boxes count once).
Incidental scene text (a sign, a bus route display, a name tag) covers a percent or two of a photo and is kept;
overlaid captions and document-like images cover far more.

On natural photos the detector also fires on text-like textures (rows of stars on a flag, a cup on a saucer, a
pagoda) and returns thick, squat boxes for them: wide patches that are hardly longer than they are tall. A real
text line is either thin relative to the image or several glyphs long, so such boxes are not counted
(``models.ocr.thick_box_side_frac`` and ``thick_box_min_aspect``). Elongated false hits (a close-up of a cat's
pair of eyes) still count.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from common.imageio import decode
from curation.models.runtimes import OpenVinoNetwork, choose_runtime
from curation.score.stage import Row, Stage, StageSettings, Update
from curation.settings import Filters


def text_area_fraction(boxes: list[np.ndarray], height: int, width: int) -> float:
    """Fraction of a ``height`` x ``width`` image covered by the union of the polygons in ``boxes`` (pixels, x/y)."""
    import cv2

    if not boxes:
        return 0.0
    mask = np.zeros((height, width), dtype=np.uint8)
    # One fill per box: fillPoly given several polygons applies the even-odd rule, so overlaps would cancel out.
    for box in boxes:
        cv2.fillConvexPoly(mask, np.round(box).astype(np.int32).reshape(-1, 1, 2), 1)
    return float(np.count_nonzero(mask)) / float(height * width)


def is_text_line(box: np.ndarray, height: int, width: int, thick_side_frac: float, thick_min_aspect: float) -> bool:
    """Whether a detected quadrilateral is shaped like a text line rather than a text-like texture patch."""
    import cv2

    (_, _), (w, h), _ = cv2.minAreaRect(box.astype(np.float32))
    thickness, length = min(w, h), max(w, h)
    if thickness <= thick_side_frac * min(height, width):
        return True
    return length >= thick_min_aspect * thickness


def _shipped_detector(det_cfg: Any) -> Path:
    """Where the installed rapidocr wheel keeps the detector its own model registry names (it may not be there)."""
    import rapidocr
    from rapidocr.inference_engine.base import FileInfo, InferSession

    info = InferSession.get_model_url(
        FileInfo(
            engine_type=det_cfg.engine_type,
            ocr_version=det_cfg.ocr_version,
            task_type=det_cfg.task_type,
            lang_type=det_cfg.lang_type,
            model_type=det_cfg.model_type,
        )
    )
    return Path(rapidocr.__file__).parent / "models" / Path(str(info["model_dir"])).name


class TextOverlayStage(Stage):
    name = "text_overlay"
    reads = ("image",)
    columns = (pa.field("text_area_frac", pa.float32()), pa.field("text_boxes", pa.int16()))
    model_section = "ocr"
    thresholds = decided = ("max_text_area_frac",)
    decision_codes = ("text_overlay",)
    uses_actors = True
    default_settings = StageSettings(batch_size=8, num_cpus=0.5, actors=(1, 2))
    default_order = 40

    def setup(self) -> None:
        import rapidocr
        from rapidocr.ch_ppocr_det import TextDetector
        from rapidocr.utils.log import logger as rapidocr_logger
        from rapidocr.utils.parse_parameters import ParseParams

        from curation.models import ModelStore

        rapidocr_logger.setLevel(logging.WARNING)  # it logs the engine and model path at INFO on every load
        settings = self.cfg.models.ocr
        cfg = ParseParams.load(Path(rapidocr.__file__).parent / "config.yaml")
        det = cfg.Det
        det.engine_cfg = cfg.EngineConfig.onnxruntime
        # rapidocr ignores a thread count above os.cpu_count() (and then uses every core): clamp it.
        det.engine_cfg.intra_op_num_threads = min(self.threads, os.cpu_count() or 1)
        det.engine_cfg.inter_op_num_threads = 1
        # Its memory arena keeps the activation buffers between images (rapidocr turns it off: ~15% slower here).
        det.engine_cfg.enable_cpu_mem_arena = True
        # An explicit model_path makes rapidocr skip its download step entirely.
        det.model_path = str(self._detector_file(det))
        # Images arrive already decoded at max_side; "max" keeps them at that size (rounded to multiples of 32)
        # instead of rapidocr's default of upscaling the short side to 736.
        det.limit_type = "max"
        det.limit_side_len = settings.max_side
        det.box_thresh = settings.box_score
        self.detector = TextDetector(det)
        # rapidocr's detector calls its session with the preprocessed (1, 3, H, W) array and post-processes the
        # (1, 1, H, W) map it returns; any callable will do. auto times both on the largest input (max_side square,
        # a multiple of 32) and keeps the faster; rapidocr's onnxruntime session is dropped where OpenVINO wins.
        side = -(-settings.max_side // 32) * 32
        self.runtime, self.detector.session = choose_runtime(
            settings.runtime,
            "models.ocr.runtime",
            {
                "openvino": lambda: OpenVinoNetwork(Path(det.model_path), self.threads),
                "onnxruntime": lambda: self.detector.session,
            },
            np.zeros((1, 3, side, side), np.float32),
            Path(det.model_path),
            self.threads,
            ModelStore.from_settings(self.cfg.models.store).cache,
        )
        # rapidocr normalises in float64 (its mean and std are float64 arrays) and then casts to float32: the same
        # preprocessing in float32 is ~3x faster and gives the same boxes. It builds the preprocessing on every call;
        # build it once.
        preprocess = self.detector.get_preprocess()
        preprocess.mean, preprocess.std = preprocess.mean.astype(np.float32), preprocess.std.astype(np.float32)
        self.detector.get_preprocess = lambda: preprocess  # type: ignore[method-assign]

    def _detector_file(self, det_cfg: Any) -> Path:
        """``models.ocr.detector``: the installed wheel's own file where it is the pinned one, else the store's copy.
        Never rapidocr's downloader: workers may be offline, and it fetches whatever its registry names today."""
        from curation.models import ModelStore
        from curation.models.packages import sha256_of
        from curation.models.settings import PinnedModel

        pinned, shipped = self.cfg.models.ocr.detector, _shipped_detector(det_cfg)
        if pinned is None:
            if not shipped.is_file():
                raise FileNotFoundError(f"text detector weights not found in the rapidocr wheel: {shipped}")
            return shipped
        if isinstance(pinned, PinnedModel) and shipped.is_file() and sha256_of(shipped) == pinned.sha256:
            return shipped
        return ModelStore.from_settings(self.cfg.models.store).fetch(pinned, "models.ocr.detector")

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    def _one(self, row: Row) -> Update:
        import cv2

        settings = self.cfg.models.ocr
        rgb = decode(row["image"]["bytes"], max_side=settings.max_side, mode="RGB")
        height, width = rgb.shape[:2]
        # PP-OCR models are trained on OpenCV's BGR channel order.
        result = self.detector(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        found = [] if result.boxes is None else list(result.boxes)
        lines = [
            b
            for b in found
            if is_text_line(b, height, width, settings.thick_box_side_frac, settings.thick_box_min_aspect)
        ]
        frac = text_area_fraction(lines, height, width)
        return {"text_area_frac": frac, "text_boxes": min(len(lines), np.iinfo(np.int16).max)}

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        frac, count, limit = row["text_area_frac"], row["text_boxes"], filters.max_text_area_frac
        if frac > limit:
            boxes = f"{count} box" if count == 1 else f"{count} boxes"
            return f"text_overlay: text covers {frac:.1%} of the image in {boxes} (max {limit:.1%})"
        return None
