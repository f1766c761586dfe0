"""The person rules both profiles' person stages share (lite: ``person`` and ``head_pose``; full: ``yolo_person``):
the columns they write, the prominent-person rule and its verdict, which person is the main one, yaw classes, and
head size from COCO keypoints.

Conventions:

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
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pyarrow as pa

from common.schema import FACE_TYPE, PERSON_TYPE
from curation.score.stage import Update, reject

if TYPE_CHECKING:
    from curation.settings import Filters

COCO_NOSE, COCO_L_EYE, COCO_R_EYE, COCO_L_EAR, COCO_R_EAR, COCO_L_SHOULDER, COCO_R_SHOULDER = range(7)
COCO_L_HIP, COCO_R_HIP, COCO_L_KNEE, COCO_R_KNEE, COCO_L_ANKLE, COCO_R_ANKLE = 11, 12, 13, 14, 15, 16
COCO_KEYPOINTS = 17
HEAD_KEYPOINTS = (COCO_NOSE, COCO_L_EYE, COCO_R_EYE, COCO_L_EAR, COCO_R_EAR)

# What every person stage writes (the full profile's adds the main person's head pose, as head_pose does).
PERSON_FIELDS = (
    pa.field("persons", pa.list_(PERSON_TYPE)),
    pa.field("faces", pa.list_(FACE_TYPE)),
    pa.field("person_count", pa.int16()),
    pa.field("prominent_count", pa.int16()),
    pa.field("main_person_score", pa.float32()),
    pa.field("main_person_height_frac", pa.float32()),
    pa.field("main_person_area_frac", pa.float32()),
)
# The main (most prominent) person's head pose.
HEAD_FIELDS = (
    pa.field("head_yaw_class", pa.string()),
    pa.field("head_confidence", pa.float32()),
)
PERSON_COLUMNS = tuple(f.name for f in PERSON_FIELDS)


def sigmoid(x: np.ndarray | float) -> Any:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0)))


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


def yaw_class(yaw: float, frontal_max_yaw: float) -> str:
    """The coarse class for a yaw in degrees (NaN: face not visible); both profiles name views with it."""
    if math.isnan(yaw):
        return "not_visible"
    if yaw < -frontal_max_yaw:
        return "left_profile"
    if yaw > frontal_max_yaw:
        return "right_profile"
    return "frontal"
