"""Training-time augmentation of labelled samples: mirror, zoom / shift, colour jitter; labels follow the image.

Label-efficient fine-tuning (64 or 256 labelled images) memorises its training set within a few hundred steps
without it. The operations are the usual ones of the pose and segmentation pipelines Sapiens2's configs build on
(random flip with left/right swap, random scale and shift, photometric distortion), restricted to what keeps every
label exact:

- mirror: body parts and keypoints swap their ``left_`` / ``right_`` names. Offered only when every label has a
  mirror image: Sapiens2's part classes and 308 keypoints (``finetune.labels``) all do (a name without a side
  sits on the midline and is its own image); a label set with a ``left_`` name and no ``right_`` one gets none.
- zoom / shift: one affine warp of image and labels (parts by nearest neighbour; keypoints moved, those leaving the
  frame marked unlabelled; the person's area scaled). Pixels it brings in are black background. Only for pose and
  segmentation: a warped pointmap or normal map would no longer match the camera that made it.
- colour: brightness, contrast and saturation. Not for albedo, whose target is the surface colour itself.

Each sample's draw comes from (seed, step, rank, slot): the same for every run with the same seed whatever the
backbone, and the same again after a resume.
"""

from __future__ import annotations

import cv2
import numpy as np
from pydantic import Field

from common.config import Strict

GEOMETRIC_TASKS = ("pose", "seg")
COLOUR_TASKS = ("pose", "seg", "pointmap", "normal")


class AugmentSettings(Strict):
    flip: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Probability of a mirror image, where the labels allow one: pose and seg, when every left / "
        "right name of the label set has its partner. 0: none.",
    )
    scale: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Zoom factor drawn from [1 - scale, 1 + scale]; pose and seg only. 0: no zoom.",
    )
    shift: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="Shift drawn from +-shift of the image's width and height; pose and seg only. 0: no shift.",
    )
    colour: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="Brightness, contrast and saturation factors drawn from [1 - colour, 1 + colour]; not for "
        "albedo. 0: no colour change.",
    )


def mirror_order(names: tuple[str, ...]) -> np.ndarray | None:
    """Index map that swaps every ``left_*`` with its ``right_*`` (others map to themselves), or None when some
    name has no partner in ``names``."""
    index = {n: i for i, n in enumerate(names)}
    order = []
    for name in names:
        if "left" in name or "right" in name:
            other = name.replace("left", "\0").replace("right", "left").replace("\0", "right")
            if other not in index:
                return None
            order.append(index[other])
        else:
            order.append(index[name])
    return np.asarray(order)


class Augmenter:
    """Augments decoded samples (``finetune.data.decode_sample``'s dicts) of one task in place."""

    def __init__(self, cfg: AugmentSettings, task: str, parts: tuple[str, ...], keypoint_names: tuple[str, ...]):
        self.cfg = cfg
        self.geometric = task in GEOMETRIC_TASKS and (cfg.scale > 0 or cfg.shift > 0)
        self.colour = task in COLOUR_TASKS and cfg.colour > 0
        self.parts_order, self.keypoint_order = None, None
        if task == "seg" and (order := mirror_order(parts)) is not None:
            # A lookup over every uint8 label: values past the classes (the ignore index, 255) stay as they are.
            self.parts_order = np.arange(256)
            self.parts_order[: len(order)] = order
        if task == "pose":
            self.keypoint_order = mirror_order(keypoint_names)
        self.flip = cfg.flip if (self.parts_order is not None or self.keypoint_order is not None) else 0.0

    @property
    def active(self) -> bool:
        return bool(self.geometric or self.colour or self.flip)

    def __call__(self, sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        c = self.cfg
        flip = rng.uniform() < self.flip
        if self.geometric or flip:
            _, H, W = sample["image"].shape
            s = rng.uniform(1 - c.scale, 1 + c.scale) if self.geometric else 1.0
            tx, ty = (rng.uniform(-c.shift, c.shift, 2) * (W, H)) if self.geometric else (0.0, 0.0)
            # Zoom about the image centre, then shift; mirrored about the vertical centre line first.
            cx, cy = (W - 1) / 2, (H - 1) / 2
            fx = -s if flip else s
            M = np.array([[fx, 0, cx - fx * cx + tx], [0, s, cy - s * cy + ty]], np.float32)
            self._warp(sample, M, (W, H), s, flip)
        if self.colour:
            sample["image"] = _jitter(sample["image"], rng, c.colour)
        return sample

    def _warp(self, sample: dict[str, np.ndarray], M: np.ndarray, size: tuple[int, int], s: float, flip: bool):
        image = cv2.warpAffine(sample["image"].transpose(1, 2, 0), M, size, flags=cv2.INTER_LINEAR,
                               borderMode=cv2.BORDER_CONSTANT, borderValue=0)  # fmt: skip
        sample["image"] = np.ascontiguousarray(image.transpose(2, 0, 1))
        if "parts" in sample:
            parts = cv2.warpAffine(sample["parts"].astype(np.uint8), M, size, flags=cv2.INTER_NEAREST,
                                   borderMode=cv2.BORDER_CONSTANT, borderValue=0)  # fmt: skip
            if flip:
                assert self.parts_order is not None  # a seg sample flips only when its parts have a mirror order
                parts = self.parts_order[parts]
            sample["parts"] = parts.astype(np.int64)
        if "keypoints" in sample:
            kp, vis = sample["keypoints"], sample["visibility"].copy()
            kp = kp @ M[:, :2].T + M[:, 2]
            W, H = size
            vis[(kp[:, 0] < -0.5) | (kp[:, 0] >= W - 0.5) | (kp[:, 1] < -0.5) | (kp[:, 1] >= H - 0.5)] = 0
            if flip:
                kp, vis = kp[self.keypoint_order], vis[self.keypoint_order]
            sample["keypoints"], sample["visibility"] = kp.astype(np.float32), vis
            sample["area"] = np.asarray(sample["area"] * s * s, np.float32)


def _jitter(image: np.ndarray, rng: np.random.Generator, strength: float) -> np.ndarray:
    """Brightness, contrast and saturation of a [3, H, W] uint8 image, each by a factor in [1 - s, 1 + s]."""
    b, c, sat = rng.uniform(1 - strength, 1 + strength, 3)
    x = image.astype(np.float32) * b
    x = (x - x.mean()) * c + x.mean()
    grey = x.mean(axis=0, keepdims=True)
    x = (x - grey) * sat + grey
    return np.clip(x + 0.5, 0, 255).astype(np.uint8)
