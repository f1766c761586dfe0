"""The label spaces of fine-tuning, named in one place: Sapiens2's 29 body-part classes and its 308 keypoints.

Body parts (``PARTS``): the 28 classes of Sapiens' body-part segmentation (background, skin parts split left /
right and upper / lower, face parts, hair, clothing, shoes and socks, apparel) and Sapiens2's 29th, eyeglasses.
Index 0 is background; the order is Sapiens' (alphabetical within groups).

Keypoints (``KEYPOINTS``): 308 points in three groups, as Sapiens2's pose head predicts them:

| group | count | points |
|---|---|---|
| body | 25 | COCO's 17 (same order, first), big toe / small toe / heel per foot, left / right acromion |
| hands | 40 | per hand, 5 fingers (thumb .. pinky) x 4 points (third joint, second joint, first joint, tip) |
| face | 243 | jaw contour 33, eyebrows 2 x 9, eye contours 2 x 16, nose 14, outer lips 20, inner lips 12, ears 2 x 6, face mesh 102 |

Each point also says where it sits on the synthetic figure (``generators/humanoids.py``): a surface point (a primitive
and a unit direction in its local frame) or a joint centre (a bone's end). Left and right points of every group are
mirror images (``left_*`` at local x, ``right_*`` at -x), so a mirrored image keeps every label by swapping names.
OKS sigmas: COCO's for its 17, COCO-WholeBody's for the feet, and one sigma per group for the rest (sharp points:
0.025 for hands and face), so the metric is as strict as the group is precise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PARTS = (
    "background", "apparel", "face_neck", "hair", "left_foot", "left_hand", "left_lower_arm", "left_lower_leg",
    "left_shoe", "left_sock", "left_upper_arm", "left_upper_leg", "lower_clothing", "right_foot", "right_hand",
    "right_lower_arm", "right_lower_leg", "right_shoe", "right_sock", "right_upper_arm", "right_upper_leg", "torso",
    "upper_clothing", "lower_lip", "upper_lip", "lower_teeth", "upper_teeth", "tongue", "eyeglasses",
)  # fmt: skip
PART = {name: i for i, name in enumerate(PARTS)}

COCO_KEYPOINTS = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder", "left_elbow",
    "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle",
    "right_ankle",
)  # fmt: skip
COCO_SIGMAS = (
    0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087, 0.087,
    0.089, 0.089,
)  # fmt: skip
GROUPS = ("body", "hands", "face")
GROUP_SIGMA = {"hands": 0.025, "face": 0.025}
FOOT_SIGMAS = {"big_toe": 0.068, "small_toe": 0.066, "heel": 0.066}  # COCO-WholeBody
FINGERS = ("thumb", "index", "middle", "ring", "pinky")
FINGER_POINTS = ("third_joint", "second_joint", "first_joint", "tip")  # knuckle to tip
SIDES = (("left", 1.0), ("right", -1.0))


@dataclass(frozen=True)
class Keypoint:
    name: str
    group: str
    sigma: float
    # ("surface", primitive, unit direction in its frame) or ("joint", primitive, end (+1 top, -1 bottom), the
    # primitives meeting at the joint)
    anchor: tuple


def _unit(*v: float) -> np.ndarray:
    d = np.asarray(v, np.float64)
    return d / np.linalg.norm(d)


def _sided(name: str, group: str, sigma: float, prim: str, left_dir: np.ndarray) -> list[Keypoint]:
    """The left point (at ``left_dir``) and its mirror image on the right (x negated)."""
    out = []
    for side, sign in SIDES:
        d = left_dir * (sign, 1.0, 1.0)
        out.append(Keypoint(f"{side}_{name}", group, sigma, ("surface", prim.format(side=side), d)))
    return out


# COCO head points (head frame: x the figure's left, y up, z forward).
HEAD_POINTS = {
    "nose": _unit(0.0, -0.15, 1.0),
    "left_eye": _unit(0.33, 0.18, 0.93),
    "right_eye": _unit(-0.33, 0.18, 0.93),
    "left_ear": _unit(1.0, 0.0, -0.05),
    "right_ear": _unit(-1.0, 0.0, -0.05),
}
# COCO joints: (primitive, end of its bone, body parts meeting at the joint) per side.
_JOINTS = {
    "shoulder": ("upper_arm", 1, ("upper_arm", "torso")),
    "elbow": ("upper_arm", -1, ("upper_arm", "lower_arm")),
    "wrist": ("lower_arm", -1, ("lower_arm", "hand")),
    "hip": ("upper_leg", 1, ("upper_leg", "pelvis")),
    "knee": ("upper_leg", -1, ("upper_leg", "lower_leg")),
    "ankle": ("lower_leg", -1, ("lower_leg", "foot")),
}


def _body() -> list[Keypoint]:
    points = []
    for i, name in enumerate(COCO_KEYPOINTS):
        if name in HEAD_POINTS:
            anchor: tuple = ("surface", "head", HEAD_POINTS[name])
        else:
            side, joint = name.split("_", 1)
            prim, end, meet = _JOINTS[joint]
            anchor = (
                "joint",
                f"{side}_{prim}",
                end,
                tuple(m if m in ("torso", "pelvis") else f"{side}_{m}" for m in meet),
            )
        points.append(Keypoint(name, "body", COCO_SIGMAS[i], anchor))
    # Foot frame: y up the shin, z towards the toes; the big toe is on the inside (towards the other foot).
    for name, d in (("big_toe", _unit(-0.35, -0.2, 0.92)), ("small_toe", _unit(0.5, -0.2, 0.84)),
                    ("heel", _unit(0.0, -0.35, -0.94))):  # fmt: skip
        points += _sided(name, "body", FOOT_SIGMAS[name], "{side}_foot", d)
    points += _sided("acromion", "body", COCO_SIGMAS[5], "torso", _unit(0.72, 0.69, 0.05))
    return points


def _hands() -> list[Keypoint]:
    """Points on the back of each hand (its frame: y up the forearm, the hand runs along -y), thumb outermost."""
    points = []
    for side, sign in SIDES:
        for f, finger in enumerate(FINGERS):
            u = sign * (0.85 - 0.4 * f)  # across the hand, the thumb on the outside
            for j, point in enumerate(FINGER_POINTS):
                v = 0.05 - 0.3 * j  # from the knuckle towards the fingertip
                d = _unit(u, v, max(0.25, np.sqrt(max(0.0, 1 - u * u - v * v))))
                points.append(Keypoint(f"{side}_{finger}_{point}", "hands", GROUP_SIGMA["hands"],
                                       ("surface", f"{side}_hand", d)))  # fmt: skip
    return points


def _face() -> list[Keypoint]:
    """243 points on the front of the head: named features, then a fixed mesh over the rest of the face."""
    sigma, points = GROUP_SIGMA["face"], []

    def centre(name: str, d: np.ndarray) -> None:
        points.append(Keypoint(name, "face", sigma, ("surface", "head", d)))

    def pair(name: str, d: np.ndarray) -> None:
        points.extend(_sided(name, "face", sigma, "head", d))

    centre("chin", _unit(0.0, -0.85, 0.5))
    for k in range(1, 17):  # jaw: from the chin up to below the ear
        t = k / 17 * np.pi / 2
        pair(f"jaw_{k:02d}", _unit(0.95 * np.sin(t), -0.8 * np.cos(t) - 0.05, 0.5 + 0.2 * np.cos(t)))
    for k in range(9):
        pair(f"eyebrow_{k + 1}", _unit(0.1 + 0.05 * k, 0.42 + 0.05 * np.sin(np.pi * k / 8), 0.88))
    eye = HEAD_POINTS["left_eye"]
    for k in range(16):
        a = 2 * np.pi * k / 16
        pair(f"eye_contour_{k + 1:02d}", _unit(*(eye + np.array((0.13 * np.cos(a), 0.06 * np.sin(a), 0.0)))))
    for k in range(5):
        centre(f"nose_bridge_{k + 1}", _unit(0.0, 0.28 - 0.08 * k, 1.0))
    centre("nose_tip", _unit(0.0, -0.12, 1.0))
    for k in range(4):
        pair(f"nostril_{k + 1}", _unit(0.05 + 0.035 * k, -0.2 + 0.02 * k, 0.98))
    for name, count, (w, h) in (("outer_lip", 20, (0.3, 0.12)), ("inner_lip", 12, (0.2, 0.04))):
        for k in range(count // 2 + 1):  # top centre, down one side, bottom centre; the other side mirrored
            a = np.pi * k / (count // 2)
            d = _unit(w * np.sin(a), -0.45 + h * np.cos(a), 0.9)
            if k in (0, count // 2):
                centre(f"{name}_{'top' if k == 0 else 'bottom'}", d)
            else:
                pair(f"{name}_{k:02d}", d)
    ear = HEAD_POINTS["left_ear"]
    for k in range(6):
        a = 2 * np.pi * k / 6
        pair(f"ear_{k + 1}", _unit(*(ear + np.array((0.0, 0.22 * np.cos(a), 0.18 * np.sin(a))))))
    for k in range(10):  # the mesh: the midline, then a fixed random spread over the left half, mirrored
        centre(f"face_midline_{k + 1:02d}", _unit(0.0, 0.75 - 0.09 * k if k < 6 else -0.62 - 0.06 * (k - 6), 0.95))
    rng = np.random.default_rng(243)
    for k in range(46):
        x, y = rng.uniform(0.08, 0.8), rng.uniform(-0.7, 0.75)
        pair(f"face_mesh_{k + 1:02d}", _unit(x, y, np.sqrt(max(0.05, 1 - x * x - y * y))))
    return points


KEYPOINTS: tuple[Keypoint, ...] = (*_body(), *_hands(), *_face())
MAX_KEYPOINTS = len(KEYPOINTS)
KEYPOINT_NAMES = tuple(k.name for k in KEYPOINTS)
assert MAX_KEYPOINTS == 308 and len(set(KEYPOINT_NAMES)) == MAX_KEYPOINTS
assert [sum(k.group == g for k in KEYPOINTS) for g in GROUPS] == [25, 40, 243]
assert KEYPOINT_NAMES[: len(COCO_KEYPOINTS)] == COCO_KEYPOINTS


def keypoints(k: int = MAX_KEYPOINTS) -> tuple[Keypoint, ...]:
    """The first ``k`` keypoints: 17 is COCO, 25 the body group, 65 body and hands, 308 all."""
    if not len(COCO_KEYPOINTS) <= k <= MAX_KEYPOINTS:
        raise ValueError(f"num_keypoints must be in [{len(COCO_KEYPOINTS)}, {MAX_KEYPOINTS}], got {k}")
    return KEYPOINTS[:k]
