"""Full profile person detection and head pose: an ultralytics YOLO detector for person boxes and a YOLO pose model
whose face keypoints (nose, eyes, ears) give each person's head yaw, pitch and roll.

One stage, one decode and one letterboxed batch for both models: the keypoints are needed only to compute the head
pose, so they do not flow to another stage. The pose model's detections are matched to the detector's boxes by IoU;
with ``models.yolo.detector: null`` the pose model's own boxes are the persons (one model, less accuracy).

Written columns follow the lite profile's conventions (curation/stages/person_rules.py): boxes in pixels of the
EXIF-oriented image, ``persons[0]`` the main person, the same prominent-person rule and reject reasons, the same
``head_yaw_class`` values. ``faces`` holds a face box estimated from the fitted head model for every person whose
face is visible, with its view.

Head pose (``estimate_head_pose``) fits a generic 3D head (``HEAD_MODEL``) to the visible face keypoints under
scaled orthographic projection: a grid search over yaw and pitch, with the in-plane rotation (roll), scale and
shift solved in closed form for each candidate (a weighted 2D Procrustes fit), refined twice on finer grids. Angles:

- ``head_yaw``: positive when the nose points to the image's right (the subject turns to their own left), so
  yaw < -``frontal_max_yaw`` is ``left_profile`` (the face turned towards the image's left, as in lite) and
  yaw > ``frontal_max_yaw`` is ``right_profile``;
- ``head_pitch``: positive when the face tilts up (chin raised);
- ``head_roll``: positive when the head is tilted clockwise as displayed (as in lite).

The rotation applied to the head model is R = Rz(roll) Rx(pitch) Ry(yaw) in image axes (x right, y down, z
towards the camera). A face is estimable when the nose, at least one eye and three face keypoints in all are
visible (confidence >= ``keypoint_min_conf``); otherwise its class is ``not_visible``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from common.imageio import decode
from curation.score.stage import Row, Stage, Update
from curation.stages.person_rules import (
    HEAD_FIELDS,
    PERSON_FIELDS,
    Face,
    order_main_first,
    person_update,
    prominence,
    yaw_class,
)

if TYPE_CHECKING:
    pass

# COCO keypoint order of YOLO pose models; the first five are the face. "left" is the subject's left.
NOSE, LEFT_EYE, RIGHT_EYE, LEFT_EAR, RIGHT_EAR = range(5)
FACE_KEYPOINTS = 5

# A generic adult head in millimetres, origin between the pupils, axes of a face looking into the camera: x to the
# image's right (so the subject's left eye has x > 0), y down, z towards the camera. Anthropometric averages:
# interpupillary distance 64, nose tip 40 below and 25 in front of the eyes, ear canals 140 apart, 20 below and
# 85 behind the eyes.
HEAD_MODEL = np.array(
    [
        [0.0, 40.0, 25.0],  # nose tip
        [32.0, 0.0, 0.0],  # left eye
        [-32.0, 0.0, 0.0],  # right eye
        [70.0, 20.0, -85.0],  # left ear
        [-70.0, 20.0, -85.0],  # right ear
    ]
)
_FACE_CENTRE = np.array([0.0, 15.0, 0.0])  # centre of a face box (brows to chin, cheek to cheek), same axes
_FACE_SIDE_MM = 130.0
_YAW_RANGE, _PITCH_RANGE = 90.0, 60.0  # degrees searched either side of zero
_COARSE_STEP = 5.0
_PITCH_PRIOR = 1e-3  # breaks near-ties (three keypoints fit several poses) towards a level head
_FIT_TOLERANCE = 0.02  # relative squared residual at which confidence drops by 1/e


def rotation(yaw: np.ndarray, pitch: np.ndarray) -> np.ndarray:
    """Rx(pitch) @ Ry(yaw) for angles in radians, shape (..., 3, 3)."""
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    zero, one = np.zeros_like(cy), np.ones_like(cy)
    ry = np.stack([np.stack([cy, zero, sy], -1), np.stack([zero, one, zero], -1), np.stack([-sy, zero, cy], -1)], -2)
    # pitch > 0 moves the nose (z > 0) up the image (towards y < 0)
    rx = np.stack([np.stack([one, zero, zero], -1), np.stack([zero, cp, -sp], -1), np.stack([zero, sp, cp], -1)], -2)
    return rx @ ry


def _projected(yaw: np.ndarray, pitch: np.ndarray, points: np.ndarray = HEAD_MODEL) -> np.ndarray:
    """The first two rows of ``rotation(yaw, pitch)`` applied to ``points`` (N, 3), as complex x + iy: (..., N)."""
    cy, sy, cp, sp = (a[..., None] for a in (np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)))
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    return (cy * x + sy * z) + 1j * (sp * sy * x + cp * y - sp * cy * z)


def project_head(
    yaw: float,
    pitch: float,
    roll: float,
    scale: float = 1.0,
    offset: tuple[float, float] = (0.0, 0.0),
    points: np.ndarray = HEAD_MODEL,
) -> np.ndarray:
    """Image positions (N, 2) of head-model points for a pose in degrees: the forward model the fit inverts."""
    p = points @ rotation(np.radians(yaw), np.radians(pitch)).T
    z = (p[:, 0] + 1j * p[:, 1]) * scale * np.exp(1j * np.radians(roll)) + complex(*offset)
    return np.stack([z.real, z.imag], -1)


def _fit(xc: np.ndarray, w: np.ndarray, pc: np.ndarray) -> tuple[np.ndarray, ...]:
    """For F faces (keypoints ``xc`` (F, 5) as complex x + iy, weights ``w`` (F, 5)) and candidate projections
    ``pc`` ((G, 5) shared or (F, G, 5)): the relative residual of the best 2D similarity from each candidate to the
    keypoints, its complex factor (scale * e^{i roll}), and the weighted centroids of projection and keypoints."""
    w3 = w[:, None, :]
    total = w.sum(-1)
    p_mean = (w3 * pc).sum(-1) / total[:, None]  # (F, G)
    x_mean = (w * xc).sum(-1) / total
    X = xc - x_mean[:, None]
    spread = (w * np.abs(X) ** 2).sum(-1)
    # Sums over centred projections expanded, so the (F, G, 5) centred array is never built.
    num = (w3 * np.conj(pc) * X[:, None, :]).sum(-1) - np.conj(p_mean) * (w * X).sum(-1)[:, None]
    den = (w3 * np.abs(pc) ** 2).sum(-1) - total[:, None] * np.abs(p_mean) ** 2
    residual = spread[:, None] - np.abs(num) ** 2 / den
    return np.clip(residual / np.maximum(spread, 1e-12)[:, None], 0, None), num / den, p_mean, x_mean


@dataclass
class HeadPoses:
    """Per face: angles in degrees (NaN where not estimable), confidence in [0, 1], a face box (x0, y0, x1, y1)."""

    yaw: np.ndarray
    pitch: np.ndarray
    roll: np.ndarray
    confidence: np.ndarray
    valid: np.ndarray
    face_box: np.ndarray


def estimate_head_pose(xy: np.ndarray, conf: np.ndarray, min_conf: float = 0.5) -> HeadPoses:
    """Head pose of F faces from their five face keypoints ``xy`` (F, 5, 2, pixels) with confidences ``conf`` (F, 5)."""
    xy = np.asarray(xy, np.float64).reshape(-1, FACE_KEYPOINTS, 2)
    conf = np.asarray(conf, np.float64).reshape(-1, FACE_KEYPOINTS)
    n = len(xy)
    visible = (conf >= min_conf) & (conf > 0)  # confidence 0: no keypoint (a person the pose model missed)
    valid = visible[:, NOSE] & (visible[:, LEFT_EYE] | visible[:, RIGHT_EYE]) & (visible.sum(-1) >= 3)
    out = HeadPoses(
        np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.zeros(n), valid, np.full((n, 4), np.nan)
    )
    if not valid.any():
        return out
    xc = xy[valid, :, 0] + 1j * xy[valid, :, 1]
    w = np.where(visible[valid], conf[valid], 0.0)
    rows = np.arange(len(xc))
    # Coarse grid shared by all faces, then three finer grids around each face's best (1, 0.2, 0.04 degrees).
    yaw, pitch = (
        np.radians(a.ravel())
        for a in np.meshgrid(
            np.arange(-_YAW_RANGE, _YAW_RANGE + 1e-9, _COARSE_STEP),
            np.arange(-_PITCH_RANGE, _PITCH_RANGE + 1e-9, _COARSE_STEP),
        )
    )
    yaw, pitch = np.broadcast_to(yaw, (len(xc), yaw.size)), np.broadcast_to(pitch, (len(xc), yaw.size))
    pc = _projected(yaw[0], pitch[0])
    step = np.radians(_COARSE_STEP)
    for level in range(4):
        cost = _fit(xc, w, pc)[0] + _PITCH_PRIOR * (pitch / np.radians(90)) ** 2
        best = np.argmin(cost, -1)
        by, bp = yaw[rows, best], pitch[rows, best]
        if level == 3:
            break
        dy, dp = (a.ravel() for a in np.meshgrid(np.linspace(-step, step, 11), np.linspace(-step, step, 11)))
        yaw = np.clip(by[:, None] + dy, -np.radians(_YAW_RANGE), np.radians(_YAW_RANGE))
        pitch = np.clip(bp[:, None] + dp, -np.radians(_PITCH_RANGE), np.radians(_PITCH_RANGE))
        pc = _projected(yaw, pitch)
        step /= 5
    residual, factor, p_mean, x_mean = (a[:, 0] if a.ndim == 2 else a for a in _fit(xc, w, _projected(by, bp)[:, None]))
    # Sure of a pose when its landmarks are (all five present count fully) and the head model fits them.
    confidence = conf[valid].mean(-1) * np.exp(-residual / _FIT_TOLERANCE)
    centre = x_mean + factor * (_projected(by, bp, _FACE_CENTRE[None])[:, 0] - p_mean)
    half = _FACE_SIDE_MM * np.abs(factor) / 2
    out.yaw[valid], out.pitch[valid] = np.degrees(by), np.degrees(bp)
    out.roll[valid] = np.degrees(np.angle(factor))
    out.confidence[valid] = confidence
    out.face_box[valid] = np.stack([centre.real - half, centre.imag - half, centre.real + half, centre.imag + half], -1)
    return out


def _iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ix = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    iy = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = ix * iy
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def match_boxes(det: np.ndarray, pose: np.ndarray, min_iou: float) -> dict[int, int]:
    """detector box index -> pose box index, one to one, greedily by IoU (at least ``min_iou``)."""
    if not len(det) or not len(pose):
        return {}
    iou = _iou_matrix(det, pose)
    match: dict[int, int] = {}
    for flat in np.argsort(-iou, axis=None):
        i, j = divmod(int(flat), iou.shape[1])
        if iou[i, j] < min_iou:
            break
        if i not in match and j not in match.values():
            match[i] = j
    return match


def _none_if_nan(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


class YoloPersonStage(Stage):
    name = "yolo_person"
    reads = ("image", "width", "height")
    columns = (*PERSON_FIELDS, *HEAD_FIELDS)
    column_order = 10  # with the lite profile's person columns
    model_section = "yolo"
    thresholds = ("person_min_score", "person_min_height_frac", "person_min_area_frac")
    uses_actors = True

    def setup(self) -> None:
        import torch

        from curation import models

        m = self.cfg.models.yolo
        store = models.ModelStore.from_settings(self.cfg.models.store)
        torch.set_num_threads(self.threads)
        self.device, self.dtype = models.device_and_dtype(m.precision)
        # Resolve both references before loading either, so a missing one fails before minutes of loading.
        pose_path = store.fetch(m.pose, "models.yolo.pose")
        det_path = store.fetch(m.detector, "models.yolo.detector") if m.detector else None
        self.pose = self._prepare(models.load_yolo(pose_path))
        kpt_shape = tuple(getattr(self.pose, "kpt_shape", ()) or ())
        if len(kpt_shape) != 2 or kpt_shape[0] < FACE_KEYPOINTS or kpt_shape[1] != 3:
            raise ValueError(
                f"models.yolo.pose {m.pose!r} is not a COCO-keypoint pose model (kpt_shape {kpt_shape}); "
                "head pose needs nose, eyes and ears with visibility (a kpt_shape of [17, 3])"
            )
        self.det = self._prepare(models.load_yolo(det_path)) if det_path else None
        names = dict(self.det.names if self.det is not None else self.pose.names)
        person_class = next((int(k) for k, v in names.items() if v == m.person_class), None)
        if person_class is None:
            which = "detector" if self.det is not None else "pose"
            raise ValueError(
                f"models.yolo.{which} has no class named {m.person_class!r} (models.yolo.person_class); "
                f"its classes: {list(names.values())[:10]}..."
            )
        self.person_class = person_class
        from ultralytics.data.augment import LetterBox
        from ultralytics.utils import nms, ops

        self._nms, self._ops = nms, ops
        self._letterbox = LetterBox((m.imgsz, m.imgsz), auto=False, stride=32)
        self._decoder = ThreadPoolExecutor(self.threads)  # PIL releases the GIL while decoding

    def _prepare(self, model: Any) -> Any:
        model = model.fuse(verbose=False) if hasattr(model, "fuse") else model
        return model.to(self.device, self.dtype).eval()

    # -- inference ---------------------------------------------------------------------------------------------

    def _detect(self, model: Any, x: Any, classes: list[int] | None, nc: int) -> list[np.ndarray]:
        m = self.cfg.models.yolo
        preds = model(x)
        preds = preds[0] if isinstance(preds, (list, tuple)) else preds
        out = self._nms.non_max_suppression(
            preds.float(),
            m.min_candidate_score,
            m.nms_iou,
            classes=classes,
            max_det=m.max_det,
            max_nms=m.max_nms,
            nc=nc,
            end2end=bool(getattr(model, "end2end", False)),
        )
        return [o.cpu().numpy() for o in out]

    def infer(self, images: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per RGB image: person boxes (N, 4) and scores (N,) in its pixels, and keypoints (N, K, 3: x, y, confidence),
        NaN for a person the pose model did not find. One letterboxed batch, one forward pass per model."""
        import torch

        # cast: LetterBox returns the image alone when given no labels (its annotation is for both uses)
        batch = np.stack([cast(np.ndarray, self._letterbox(image=im)) for im in images])
        x = torch.from_numpy(batch).to(self.device).permute(0, 3, 1, 2).to(self.dtype).div_(255)
        shape = (x.shape[2], x.shape[3])
        with torch.inference_mode():
            pose = self._detect(self.pose, x, None, len(self.pose.names))
            det = self._detect(self.det, x, [self.person_class], 0) if self.det is not None else None
        k = int(self.pose.kpt_shape[0])
        out = []
        for i, im in enumerate(images):
            p = pose[i]
            # cast: scale_boxes returns the array type it is given; its annotation is the union of both
            p_boxes = cast(np.ndarray, self._ops.scale_boxes(shape, p[:, :4].copy(), im.shape[:2]))
            kpts = p[:, 6 : 6 + 3 * k].reshape(-1, k, 3).copy()
            kpts = self._ops.scale_coords(shape, kpts, im.shape[:2]) if len(kpts) else kpts
            if det is None:
                out.append((p_boxes, p[:, 4], kpts))
                continue
            d = det[i]
            boxes = cast(np.ndarray, self._ops.scale_boxes(shape, d[:, :4].copy(), im.shape[:2]))
            match = match_boxes(boxes, p_boxes, self.cfg.models.yolo.pose_match_iou)
            person_kpts = np.full((len(boxes), k, 3), np.nan)  # NaN: the pose model did not see this person
            for a, b in match.items():
                person_kpts[a] = kpts[b]
            out.append((boxes, d[:, 4], person_kpts))
        return out

    def process_batch(self, rows: list[Row]) -> list[Update]:
        m = self.cfg.models.yolo
        images = list(self._decoder.map(lambda r: decode(r["image"]["bytes"], max_side=m.imgsz), rows))
        found = self.infer(images)
        # Head pose of every person in the batch in one vectorised fit.
        scaled, faces_xy, faces_conf = [], [], []
        for row, im, (boxes, scores, kpts) in zip(rows, images, found):
            sx, sy = int(row["width"]) / im.shape[1], int(row["height"]) / im.shape[0]
            kpts = kpts * np.array([sx, sy, 1.0])  # to the pixels of the full image, as the boxes
            scaled.append((boxes * np.array([sx, sy, sx, sy]), scores, kpts))
            faces_xy.append(kpts[:, :FACE_KEYPOINTS, :2])
            faces_conf.append(kpts[:, :FACE_KEYPOINTS, 2])
        heads = estimate_head_pose(
            np.nan_to_num(np.concatenate(faces_xy)), np.nan_to_num(np.concatenate(faces_conf)), m.keypoint_min_conf
        )
        updates, at = [], 0
        for row, (boxes, scores, kpts) in zip(rows, scaled):
            idx = np.arange(at, at + len(boxes))
            at += len(boxes)
            updates.append(self._row_update(row, boxes, scores, kpts, heads, idx))
        return updates

    def _row_update(
        self, row: Row, boxes: np.ndarray, scores: np.ndarray, kpts: np.ndarray, heads: HeadPoses, idx: np.ndarray
    ) -> Update:
        m, f = self.cfg.models.yolo, self.cfg.filters
        width, height = int(row["width"]), int(row["height"])
        clip = np.array([width, height, width, height], dtype=np.float64)
        records = []
        faces: list[Face] = []
        for b, s, k, h in zip(boxes, scores, kpts, idx):
            c = k[:FACE_KEYPOINTS, 2]
            x0, y0, x1, y1 = (float(v) for v in np.clip(b, 0, clip))
            if x1 <= x0 or y1 <= y0:
                continue
            hf, af = (y1 - y0) / height, (x1 - x0) * (y1 - y0) / (width * height)
            cls = yaw_class(heads.yaw[h], m.frontal_max_yaw)
            if cls == "not_visible":
                # How sure the face is hidden: the pose model's doubt about nose and eyes; no keypoints, no evidence.
                seen = c[[NOSE, LEFT_EYE, RIGHT_EYE]]
                head_conf = 0.0 if np.isnan(seen).all() else 1.0 - float(np.nanmax(seen))
            else:
                head_conf = float(heads.confidence[h])
                fx0, fy0, fx1, fy1 = (float(v) for v in np.clip(heads.face_box[h], 0, clip))
                if fx1 > fx0 and fy1 > fy0:
                    faces.append({"x0": fx0, "y0": fy0, "x1": fx1, "y1": fy1, "score": head_conf, "view": cls})
            records.append(
                {
                    "x0": x0,
                    "y0": y0,
                    "x1": x1,
                    "y1": y1,
                    "score": float(s),
                    "detector": "yolo",
                    "height_frac": hf,
                    "area_frac": af,
                    "prominent": prominence(f, float(s), hf, af) >= 1.0,
                    "head_yaw_class": cls,
                    "head_confidence": head_conf,
                    "head_yaw": _none_if_nan(heads.yaw[h]),
                    "head_pitch": _none_if_nan(heads.pitch[h]),
                    "head_roll": _none_if_nan(heads.roll[h]),
                    "keypoints": None if np.isnan(k).all() else np.nan_to_num(k).reshape(-1).tolist(),
                }
            )
        order_main_first(records, f)  # persons[0] is the main person, as in the lite profile
        faces.sort(key=lambda fc: -fc["score"])
        main = records[0] if records else None
        return person_update(
            records,
            faces,
            f,
            nobody="no person detected",
            head_yaw_class=main["head_yaw_class"] if main else None,
            head_confidence=main["head_confidence"] if main else None,
        )
