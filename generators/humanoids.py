"""Synthetic humanoids with exact labels for all five fine-tuning tasks, in numpy alone (no assets).

A figure is an articulated set of ellipsoids (head, hair, neck, torso, pelvis, upper and lower arms, hands, thighs,
shins, feet) posed by forward kinematics from random joint angles, scaled and shaped at random, seen from a random
direction by a pinhole camera. Every pixel's ray is intersected analytically with every ellipsoid and the nearest
hit gives, exactly and consistently:

- the body-part label (``finetune.labels.PARTS``, Sapiens2's 29 classes; 0 is background): skin parts, and the
  regions of a surface that are something else: clothing (a top with or without sleeves, trousers or shorts),
  a belt, shoes and socks, lips, teeth and tongue, eyeglasses,
- the camera-frame 3D point (OpenCV axes: x right, y down, z forward; metres), so depth is ``point[..., 2]``,
- the unit surface normal (facing the camera: the first hit of a ray enters a convex body),
- the albedo: per-region materials (skin, clothing with stripes / checks / speckles, hair, shoes, eyes, mouth),
- the shaded colour: albedo x (ambient + Lambertian from a random light) x light colour,

composited on a procedural background (gradient, floor, low-frequency texture, clutter shapes, sensor noise).
Keypoints: the first ``K`` of Sapiens2's 308 (``finetune.labels.KEYPOINTS``: 25 body, 40 hand, 243 face points),
each a surface point of a primitive or a joint centre inside the limbs. Visibility follows COCO: 0 outside the image, 1 occluded, 2 visible. A surface landmark is
visible when nothing lies in front of it on its own ray; a joint centre when the first surface on its ray belongs to
a limb that meets at the joint.

Pixel convention: pixel (row i, col j) has its centre at (x=j, y=i), and its ray goes through that centre, so a
keypoint at (x, y) lies in pixel (round(y), round(x)) and the principal point is ((W-1)/2, (H-1)/2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field, model_validator

from common.config import Strict
from finetune.labels import COCO_KEYPOINTS, HEAD_POINTS, MAX_KEYPOINTS, PART, keypoints


class RenderConfig(Strict):
    height: int = Field(128, ge=16)
    width: int = Field(96, ge=16)
    num_keypoints: int = Field(MAX_KEYPOINTS, ge=len(COCO_KEYPOINTS), le=MAX_KEYPOINTS)
    fill: tuple[float, float] = (0.45, 0.9)  # the figure's height as a fraction of the image height
    focal: tuple[float, float] = (0.9, 2.0)  # focal length in units of the image's longer side
    offset: float = Field(0.15, ge=0)  # figure centre jitter, fraction of the image size
    noise: float = Field(0.02, ge=0)  # max std of Gaussian sensor noise (colour in [0, 1])
    yaw: float = Field(np.pi, ge=0, le=np.pi)  # largest |yaw| of the view in radians: pi is any direction, 0 frontal

    @model_validator(mode="after")
    def _ranges(self) -> RenderConfig:
        for name in ("fill", "focal"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be an increasing range of positive numbers, got {(lo, hi)}")
        return self


@dataclass
class Render:
    image: np.ndarray  # [H, W, 3] uint8
    parts: np.ndarray  # [H, W] uint8, index into PARTS
    points: np.ndarray  # [H, W, 3] float32, camera frame (metres); 0 on background
    normals: np.ndarray  # [H, W, 3] float32 unit vectors; 0 on background
    albedo: np.ndarray  # [H, W, 3] float32 in [0, 1]; 0 on background
    keypoints: np.ndarray  # [K, 2] float32 (x, y) pixels
    visibility: np.ndarray  # [K] uint8: 0 outside the image, 1 occluded, 2 visible
    keypoints_3d: np.ndarray  # [K, 3] float32, camera frame
    camera: dict[str, float]  # fx, fy, cx, cy
    extra: dict = field(default_factory=dict)

    @property
    def mask(self) -> np.ndarray:
        return self.parts > 0


# --- geometry -------------------------------------------------------------------------------------------------


def _rx(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def _ry(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _rz(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


Region = tuple[int, Callable[[np.ndarray], np.ndarray], dict]  # (part, which local points, material)


@dataclass
class Ellipsoid:
    name: str
    part: int
    centre: np.ndarray  # (3,)
    rot: np.ndarray  # (3, 3): columns are the local axes (local y runs along a limb)
    radii: np.ndarray  # (3,)
    material: dict = field(default_factory=dict)
    regions: list[Region] = field(default_factory=list)  # parts of the surface with another label and material

    def moved(self, rot: np.ndarray, shift: np.ndarray) -> Ellipsoid:
        return dataclasses.replace(self, centre=rot @ self.centre + shift, rot=rot @ self.rot)

    def point(self, local: np.ndarray) -> np.ndarray:
        """A point given in the ellipsoid's local frame (metres) -> the ellipsoid's frame of reference."""
        return self.centre + self.rot @ local


# Primitive names in drawing order; keypoints refer to them by name (``finetune.labels``).
PRIMITIVES = (
    "head", "hair", "neck", "torso", "pelvis", "left_upper_arm", "right_upper_arm", "left_lower_arm",
    "right_lower_arm", "left_hand", "right_hand", "left_upper_leg", "right_upper_leg", "left_lower_leg",
    "right_lower_leg", "left_foot", "right_foot",
)  # fmt: skip
_BONE_OVERLAP = 1.12  # limb ellipsoids reach a little past their joints, so neighbouring limbs meet


# --- the figure -------------------------------------------------------------------------------------------------


def _bone(name: str, top: np.ndarray, rot: np.ndarray, length: float, rx: float, rz: float) -> Ellipsoid:
    """An ellipsoid along local -y from ``top`` for ``length`` metres."""
    centre = top + rot @ np.array([0.0, -length / 2, 0.0])
    return Ellipsoid(name, 0, centre, rot, np.array([rx, length / 2 * _BONE_OVERLAP, rz]))


def _figure(rng: np.random.Generator) -> list[Ellipsoid]:
    """Ellipsoids of a posed figure in its body frame: y up, z the way it faces, x its left; pelvis at 0."""
    s, g = rng.uniform(0.85, 1.1), rng.uniform(0.8, 1.3)  # size, girth
    u = rng.uniform
    v = np.array
    prims = [Ellipsoid("pelvis", 0, np.zeros(3), _ry(u(-0.2, 0.2)), v([0.16 * g, 0.11, 0.11 * g]) * s)]
    r_torso = _ry(u(-0.5, 0.5)) @ _rx(u(-0.25, 0.4))  # twist, then lean (positive: forward)
    prims.append(Ellipsoid("torso", 0, r_torso @ v([0, 0.28 * s, 0]), r_torso, v([0.17 * g, 0.28, 0.11 * g]) * s))
    neck_base = r_torso @ v([0, 0.52 * s, 0])
    r_neck = r_torso @ _rx(u(-0.2, 0.3))
    prims.append(Ellipsoid("neck", 0, neck_base + r_neck @ v([0, 0.06 * s, 0]), r_neck, v([0.05, 0.08, 0.05]) * s))
    r_head = r_neck @ _ry(u(-0.9, 0.9)) @ _rx(u(-0.35, 0.35))
    head_c = neck_base + r_neck @ v([0, 0.11 * s, 0]) + r_head @ v([0, 0.09 * s, 0.01 * s])
    head_r = v([0.085, 0.115, 0.1]) * s
    prims.append(Ellipsoid("head", 0, head_c, r_head, head_r))
    hair_c = head_c + r_head @ (v([0, 0.03, -0.02]) * s)  # above and behind: the face stays bare
    prims.append(Ellipsoid("hair", 0, hair_c, r_head, head_r * v([1.07, 0.93, 1.06]) * u(0.9, 1.12)))
    for side, sign in (("left", 1.0), ("right", -1.0)):
        shoulder = r_torso @ np.array([sign * 0.2 * g * s, 0.47 * s, 0])
        r_ua = r_torso @ _rz(sign * u(0.05, 1.6)) @ _rx(-u(-0.6, 2.0))  # abduction, flexion
        prims.append(_bone(f"{side}_upper_arm", shoulder, r_ua, 0.29 * s, 0.05 * g * s, 0.05 * g * s))
        elbow = shoulder + r_ua @ np.array([0, -0.29 * s, 0])
        r_la = r_ua @ _rx(-u(0.0, 2.2))  # the elbow bends forward
        prims.append(_bone(f"{side}_lower_arm", elbow, r_la, 0.26 * s, 0.04 * g * s, 0.04 * g * s))
        wrist = elbow + r_la @ np.array([0, -0.26 * s, 0])
        r_hand = r_la @ _rx(-u(-0.5, 0.5)) @ _ry(u(-0.8, 0.8))
        prims.append(_bone(f"{side}_hand", wrist, r_hand, 0.17 * s, 0.045 * s, 0.022 * s))
        hip = np.array([sign * 0.09 * g * s, -0.06 * s, 0])
        r_th = _rz(sign * u(-0.1, 0.5)) @ _rx(-u(-0.35, 1.6))
        prims.append(_bone(f"{side}_upper_leg", hip, r_th, 0.43 * s, 0.075 * g * s, 0.075 * g * s))
        knee = hip + r_th @ np.array([0, -0.43 * s, 0])
        r_sh = r_th @ _rx(u(0.0, 2.0))  # the knee bends backward
        prims.append(_bone(f"{side}_lower_leg", knee, r_sh, 0.42 * s, 0.055 * g * s, 0.055 * g * s))
        ankle = knee + r_sh @ np.array([0, -0.42 * s, 0])
        r_ft = r_sh @ _rx(u(-0.3, 0.3))
        foot_c = ankle + r_ft @ (np.array([0, -0.045, 0.06]) * s)
        prims.append(Ellipsoid(f"{side}_foot", 0, foot_c, r_ft, np.array([0.045, 0.035, 0.11]) * s))
    order = {n: i for i, n in enumerate(PRIMITIVES)}
    return sorted(prims, key=lambda p: order[p.name])


def _dress(rng: np.random.Generator, prims: list[Ellipsoid]) -> None:
    """Each primitive's part label and material, and the regions of its surface that are something else: clothing
    over skin (a top with no, short or long sleeves and a neckline; trousers or shorts), a belt (apparel), shoes and
    socks, lips (teeth and tongue when the mouth is open) and eyeglasses on the face. Regions paint in order."""
    skin = {"base": np.array([0.95, 0.75, 0.6]) * rng.uniform(0.25, 1.0) + rng.uniform(-0.05, 0.05, 3)}

    def cloth() -> dict:
        a, b = rng.uniform(0.05, 0.95, 3), rng.uniform(0.05, 0.95, 3)
        return {"base": a, "alt": b, "pattern": rng.choice(["plain", "stripes", "checks", "speckles"]),
                "freq": rng.uniform(3, 9), "phase": rng.uniform(0, 2 * np.pi)}  # fmt: skip

    def plain(colour) -> dict:
        return {"base": np.asarray(colour, np.float64)}

    top, bottom = cloth(), cloth()
    shirt = rng.uniform() > 0.1
    sleeves = rng.choice(["none", "short", "long"], p=[0.3, 0.4, 0.3]) if shirt else "none"
    trousers = rng.uniform() < 0.6
    belt = rng.uniform() < 0.5
    shoes, socks = rng.uniform() < 0.7, rng.uniform() < 0.5
    glasses, mouth_open = rng.uniform() < 0.3, rng.uniform() < 0.5
    hair = plain(np.array([0.25, 0.16, 0.08]) * rng.uniform(0.2, 3.0))
    shoe, sock = plain(rng.uniform(0.02, 0.6, 3)), plain(rng.uniform(0.1, 0.95, 3))
    upper, lower = PART["upper_clothing"], PART["lower_clothing"]

    def everywhere(local: np.ndarray) -> np.ndarray:
        return np.ones(len(local), bool)

    def above(y: float) -> Callable[[np.ndarray], np.ndarray]:
        return lambda local: local[:, 1] > y

    def below(y: float) -> Callable[[np.ndarray], np.ndarray]:
        return lambda local: local[:, 1] < y

    for p in prims:
        n, side = p.name, p.name.split("_")[0]
        p.part, p.material, p.regions = PART.get(n, PART["face_neck"]), skin, []
        if n == "hair":
            p.material = hair
        elif n == "head":
            p.material = {**skin, "pattern": "face"}
            p.regions = _face_regions(skin["base"], glasses, mouth_open, rng)
        elif n == "torso" and shirt:
            p.part, p.material = upper, top
            p.regions = [(PART["torso"], lambda local: (local[:, 1] > 0.8) & (local[:, 2] > 0), skin)]  # neckline
        elif n == "pelvis":
            p.part, p.material = lower, bottom
            if belt:
                p.regions = [(PART["apparel"], lambda local: local[:, 1] > 0.6, plain(rng.uniform(0.05, 0.3, 3)))]
        elif n.endswith("upper_arm") and sleeves != "none":
            p.regions = [(upper, everywhere if sleeves == "long" else above(-0.2), top)]
        elif n.endswith("lower_arm") and sleeves == "long":
            p.regions = [(upper, everywhere, top)]
        elif n.endswith("upper_leg"):
            p.regions = [(lower, everywhere if trousers else above(-0.3), bottom)]
        elif n.endswith("lower_leg"):
            p.regions = [(lower, everywhere, bottom)] if trousers else []
            if socks and not trousers:
                p.regions.append((PART[f"{side}_sock"], below(-0.75), sock))
        elif n.endswith("foot"):
            if shoes:
                p.part, p.material = PART[f"{side}_shoe"], shoe
            elif socks:
                p.part, p.material = PART[f"{side}_sock"], sock


def _face_regions(skin: np.ndarray, glasses: bool, mouth_open: bool, rng: np.random.Generator) -> list[Region]:
    """Lips around a mouth below the nose, open: upper teeth, tongue, lower teeth inside; eyeglasses over both
    eyes (frame and tinted lenses) with a bridge. Coordinates: the head's unit sphere (x left, y up, z forward)."""
    mouth_y, half_open = -0.45, (0.07 if mouth_open else 0.0)

    def within(w: float, h: float) -> Callable[[np.ndarray], np.ndarray]:
        return lambda local: ((local[:, 0] / w) ** 2 + ((local[:, 1] - mouth_y) / h) ** 2 < 1) & (local[:, 2] > 0)

    lip = {"base": skin * (0.75, 0.4, 0.4)}
    regions: list[Region] = [
        (PART["upper_lip"], lambda local: within(0.3, 0.12 + half_open)(local) & (local[:, 1] >= mouth_y), lip),
        (PART["lower_lip"], lambda local: within(0.3, 0.12 + half_open)(local) & (local[:, 1] < mouth_y), lip),
    ]
    if mouth_open:
        inner = within(0.2, half_open)
        third = half_open / 3
        regions += [
            (PART["upper_teeth"], lambda local: inner(local) & (local[:, 1] > mouth_y + third), {"base": np.array([0.92, 0.9, 0.82])}),
            (PART["tongue"], lambda local: inner(local) & (np.abs(local[:, 1] - mouth_y) <= third), {"base": np.array([0.8, 0.35, 0.4])}),
            (PART["lower_teeth"], lambda local: inner(local) & (local[:, 1] < mouth_y - third), {"base": np.array([0.92, 0.9, 0.82])}),
        ]  # fmt: skip
    if glasses:
        eyes = np.stack([HEAD_POINTS["left_eye"], HEAD_POINTS["right_eye"]])
        frame = {"base": rng.uniform(0.0, 0.3, 3)}

        def lens(local: np.ndarray) -> np.ndarray:
            return (local @ eyes.T).max(1) > np.cos(0.2)

        def rims(local: np.ndarray) -> np.ndarray:
            near = local @ eyes.T
            bridge = (np.abs(local[:, 0]) < 0.2) & (np.abs(local[:, 1] - 0.2) < 0.04) & (local[:, 2] > 0.8)
            return ((near.max(1) > np.cos(0.22)) & (near.max(1) <= np.cos(0.17))) | bridge

        regions += [(PART["eyeglasses"], lens, {"base": skin * 0.5 + 0.15, "pattern": "face"}),
                    (PART["eyeglasses"], rims, frame)]  # fmt: skip
    return regions


def _albedo(m: dict, local: np.ndarray) -> np.ndarray:
    """Albedo [N, 3] at points ``local`` [N, 3] on the unit sphere of a primitive's frame."""
    base = np.broadcast_to(np.clip(m["base"], 0, 1), local.shape).copy()
    kind = m.get("pattern", "plain")
    if kind in ("stripes", "checks", "speckles"):
        f, ph = m["freq"], m["phase"]
        if kind == "stripes":
            on = np.sin(f * np.pi * local[:, 1] + ph) > 0
        elif kind == "checks":
            on = np.sin(f * 2 * local[:, 0] + ph) * np.sin(f * 2 * local[:, 1]) * np.sin(f * 2 * local[:, 2]) > 0
        else:
            on = np.sin(3 * f * local[:, 0] + ph) * np.sin(3 * f * local[:, 1] + 2 * ph) > 0.6
        base[on] = np.clip(m["alt"], 0, 1)
    elif kind == "face":  # dark eyes
        for name in ("left_eye", "right_eye"):
            base[local @ HEAD_POINTS[name] > 0.985] = (0.05, 0.04, 0.04)
    return np.clip(base, 0.0, 1.0)


def surface(p: Ellipsoid, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(part labels [N], albedo [N, 3]) of primitive ``p`` at its unit-sphere points ``local``."""
    labels = np.full(len(local), p.part, np.uint8)
    albedo = _albedo(p.material, local)
    for part, where, material in p.regions:
        sel = where(local)
        labels[sel] = part
        albedo[sel] = _albedo(material, local[sel])
    return labels, albedo


def first_hits(prims: list[Ellipsoid], dirs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rays from the camera centre along ``dirs`` [N, 3] (z = 1, so the ray parameter is the depth) against
    every ellipsoid: (depth [N] (inf: no hit), primitive index [N] (-1: none), hit on the unit sphere [N, 3])."""
    n = len(dirs)
    best_t = np.full(n, np.inf)
    best_i = np.full(n, -1, np.int64)
    best_local = np.zeros((n, 3))
    for i, p in enumerate(prims):
        o = (p.rot.T @ -p.centre) / p.radii  # ray origin in the unit-sphere frame
        d = (dirs @ p.rot) / p.radii  # row-wise R^T d, scaled
        a = np.einsum("ij,ij->i", d, d)
        b = 2 * d @ o
        c = o @ o - 1
        disc = b * b - 4 * a * c
        ok = disc > 0
        t = np.full(n, np.inf)
        t[ok] = (-b[ok] - np.sqrt(disc[ok])) / (2 * a[ok])
        t[t <= 0] = np.inf  # behind the camera (the camera is never inside a body part)
        closer = t < best_t
        best_t[closer], best_i[closer] = t[closer], i
        best_local[closer] = o + t[closer, None] * d[closer]
    return best_t, best_i, best_local


# --- background -------------------------------------------------------------------------------------------------


def background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """[h, w, 3] float in [0, 1]: a gradient wall, a floor below a horizon, soft texture and a few clutter shapes."""
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    ang = rng.uniform(0, 2 * np.pi)
    t = (np.cos(ang) * xx + np.sin(ang) * yy)[..., None]
    t = (t - t.min()) / max(np.ptp(t), 1e-6)
    c0, c1 = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
    img = c0 * (1 - t) + c1 * t
    if rng.uniform() < 0.7:
        horizon = rng.uniform(0.4, 0.85) * h / max(h, w)
        floor = rng.uniform(0, 1, 3)
        below = yy > horizon + 0.05 * np.sin(rng.uniform(1, 4) * xx)
        img[below] = floor * (0.7 + 0.3 * np.sin(rng.uniform(20, 60) * yy[below])[..., None] ** 2)
    for _ in range(rng.integers(2, 5)):  # low-frequency texture
        kx, ky = rng.normal(0, 12, 2)
        img += rng.uniform(0.02, 0.08) * np.sin(kx * xx + ky * yy + rng.uniform(0, 6))[..., None] * rng.normal(0, 1, 3)
    i, j = np.mgrid[0:h, 0:w]
    for _ in range(rng.integers(0, 5)):  # clutter: rectangles and discs
        cx, cy, rx, ry = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(2, w / 4), rng.uniform(2, h / 4)
        inside = (np.abs(j - cx) < rx) & (np.abs(i - cy) < ry)
        if rng.uniform() < 0.5:
            inside = ((j - cx) / rx) ** 2 + ((i - cy) / ry) ** 2 < 1
        img[inside] = rng.uniform(0, 1, 3)
    return np.clip(img, 0, 1)


# --- rendering --------------------------------------------------------------------------------------------------


def render(cfg: RenderConfig, rng: np.random.Generator | int) -> Render:
    """One random figure on a random background, with every label."""
    rng = np.random.default_rng(rng)
    H, W = cfg.height, cfg.width
    body = _figure(rng)
    _dress(rng, body)

    # Camera: body frame (y up, z facing) -> OpenCV camera frame (y down, z forward) after a random yaw (any
    # direction, back views included), a little pitch and roll.
    rot = (
        _rx(np.pi) @ _rz(rng.uniform(-0.15, 0.15)) @ _rx(rng.uniform(-0.25, 0.25)) @ _ry(rng.uniform(-cfg.yaw, cfg.yaw))
    )
    extent = np.array([rot @ p.point(p.radii * d) for p in body for d in np.eye(3).tolist() + (-np.eye(3)).tolist()])
    lo, hi = extent.min(0), extent.max(0)
    f = rng.uniform(*cfg.focal) * max(H, W)
    fill = rng.uniform(*cfg.fill)
    depth = max(f * (hi[1] - lo[1]) / (fill * H), f * (hi[0] - lo[0]) / (0.95 * W), 3 * (hi[2] - lo[2]), 0.5)
    shift_px = rng.uniform(-cfg.offset, cfg.offset, 2) * (W, H)
    centre = (lo + hi) / 2
    shift = np.array([-centre[0] + shift_px[0] * depth / f, -centre[1] + shift_px[1] * depth / f, depth - centre[2]])
    prims = [p.moved(rot, shift) for p in body]
    cx, cy = (W - 1) / 2, (H - 1) / 2

    jj, ii = np.meshgrid(np.arange(W, dtype=np.float64), np.arange(H, dtype=np.float64))
    dirs = np.stack([(jj - cx) / f, (ii - cy) / f, np.ones_like(jj)], -1).reshape(-1, 3)
    t, idx, local = first_hits(prims, dirs)
    hit = idx >= 0
    parts = np.zeros(H * W, np.uint8)
    points = np.zeros((H * W, 3))
    normals = np.zeros((H * W, 3))
    albedo = np.zeros((H * W, 3))
    for i, p in enumerate(prims):
        sel = idx == i
        if not sel.any():
            continue
        parts[sel], albedo[sel] = surface(p, local[sel])
        points[sel] = t[sel, None] * dirs[sel]
        n = (local[sel] / p.radii) @ p.rot.T  # gradient of the implicit surface, rotated to the camera frame
        normals[sel] = n / np.linalg.norm(n, axis=1, keepdims=True)

    # Lighting: a directional light from the camera's side of the scene, plus ambient.
    light = np.array([rng.uniform(-1, 1), rng.uniform(-1, 0.3), -rng.uniform(0.3, 1.0)])
    light /= np.linalg.norm(light)
    ambient = rng.uniform(0.25, 0.5)
    tint = 1 + rng.uniform(-0.15, 0.15, 3)
    shade = ambient + (1 - ambient) * np.clip(normals @ light, 0, None)
    colour = background(rng, H, W).reshape(-1, 3)
    colour[hit] = albedo[hit] * shade[hit, None] * tint
    colour += rng.normal(0, rng.uniform(0, cfg.noise), colour.shape)
    image = (np.clip(colour, 0, 1) * 255 + 0.5).astype(np.uint8).reshape(H, W, 3)

    kp3d, vis, kp2d = _keypoints(cfg, prims, f, cx, cy)
    return Render(
        image=image,
        parts=parts.reshape(H, W),
        points=points.reshape(H, W, 3).astype(np.float32),
        normals=normals.reshape(H, W, 3).astype(np.float32),
        albedo=albedo.reshape(H, W, 3).astype(np.float32),
        keypoints=kp2d.astype(np.float32),
        visibility=vis,
        keypoints_3d=kp3d.astype(np.float32),
        camera={"fx": float(f), "fy": float(f), "cx": float(cx), "cy": float(cy)},
    )


def _keypoints(
    cfg: RenderConfig, prims: list[Ellipsoid], f: float, cx: float, cy: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    anchors = [k.anchor for k in keypoints(cfg.num_keypoints)]
    by_name = {p.name: (i, p) for i, p in enumerate(prims)}
    pts = []
    for a in anchors:
        _, p = by_name[a[1]]
        if a[0] == "surface":
            pts.append(p.point(p.radii * a[2]))
        else:  # the joint is the bone's end, inside the overlapping ellipsoid ends
            pts.append(p.point(np.array([0.0, a[2] * p.radii[1] / _BONE_OVERLAP, 0.0])))
    kp3d = np.array(pts)
    z = kp3d[:, 2]
    kp2d = np.stack([f * kp3d[:, 0] / z + cx, f * kp3d[:, 1] / z + cy], -1)
    t, idx, _ = first_hits(prims, kp3d / z[:, None])
    vis = np.ones(len(kp3d), np.uint8)
    for k, a in enumerate(anchors):
        if a[0] == "surface":
            seen = t[k] >= z[k] * (1 - 1e-6)  # nothing nearer on its ray than the point itself
        else:
            seen = idx[k] >= 0 and prims[idx[k]].name in a[3]
        vis[k] = 2 if seen else 1
    inside = (z > 0) & (kp2d[:, 0] >= -0.5) & (kp2d[:, 0] < cfg.width - 0.5)
    inside &= (kp2d[:, 1] >= -0.5) & (kp2d[:, 1] < cfg.height - 0.5)
    vis[~inside] = 0
    return kp3d, vis, kp2d
