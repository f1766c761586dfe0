"""Lite person detection and head pose: OpenCV's HOG people detector and Haar face cascades.

Both detectors ship inside the OpenCV wheel, so this profile runs offline on CPUs. Neither is strong alone:
HOG's default people detector (Dalal-Triggs) fires on text columns and lattice towers as readily as on people
and misses head-and-shoulders shots, and a single Haar cascade fires on fur, foliage and pagodas. So a face's
confidence pools the evidence of several cascades (two frontal ones, and a profile one run on the image and on
its mirror image), a HOG box alone needs a very large SVM margin to count, and a HOG box whose head region holds
a face gets the face's evidence too.

Conventions (shared with the full profile):

- Boxes are pixels of the EXIF-oriented image; ``persons`` is sorted so that ``persons[0]`` is the main person
  (the most confident prominent one, the larger on a tie; when none is prominent, the candidate nearest to
  passing the rule).
- A profile view is named after the side of the image the nose points to: ``left_profile`` means the face is
  turned towards the image's left (the viewer then sees the subject's left cheek), ``right_profile`` the mirror.
- ``head_roll`` is in degrees, positive when the head is tilted clockwise as displayed (the eye on the image's
  right side is the lower one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from curation.imageio import decode
from curation.stage import Row, Stage, Update, reject

if TYPE_CHECKING:
    import cv2

    from curation.config import Filters

# Cascade files under cv2.data.haarcascades: (evidence kind, file name).
_FACE_CASCADES = (
    ("default", "haarcascade_frontalface_default.xml"),
    ("alt2", "haarcascade_frontalface_alt2.xml"),
    ("profile", "haarcascade_profileface.xml"),
)
# Eyes for head roll; the second cascade also finds eyes behind spectacles.
_EYE_CASCADES = ("haarcascade_eye.xml", "haarcascade_eye_tree_eyeglasses.xml")
_FRONTAL_KINDS = ("default", "alt2")
_MAX_WINDOWS = 2000  # per cascade pass; tens on ordinary photos
# OpenCV's peopledetect sample: HOG windows are larger than the person inside; shrink to the body's extent.
_HOG_SHRINK = (0.1, 0.07, 0.8, 0.8)  # x offset, y offset (fractions of the window), kept width, kept height


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, x))))


def _last_stage_threshold(path: str) -> float:
    """Threshold of a cascade's final stage: windows that pass all stages score ``sum - threshold >= 0``."""
    import cv2

    fs = cv2.FileStorage(path, cv2.FILE_STORAGE_READ)
    try:
        stages = fs.getNode("cascade").getNode("stages")
        return float(stages.at(stages.size() - 1).getNode("stageThreshold").real())
    finally:
        fs.release()


def _cluster(boxes: np.ndarray, eps: float = 0.2) -> np.ndarray:
    """Label windows the way OpenCV's groupRectangles does: same cluster when every edge is within
    ``eps`` times the mean smaller side (transitively). Returns one label per box."""
    from scipy.sparse.csgraph import connected_components

    x0, y0 = boxes[:, 0], boxes[:, 1]
    x1, y1 = x0 + boxes[:, 2], y0 + boxes[:, 3]
    delta = eps * 0.5 * (np.minimum.outer(boxes[:, 2], boxes[:, 2]) + np.minimum.outer(boxes[:, 3], boxes[:, 3]))
    near = (
        (np.abs(np.subtract.outer(x0, x0)) <= delta)
        & (np.abs(np.subtract.outer(y0, y0)) <= delta)
        & (np.abs(np.subtract.outer(x1, x1)) <= delta)
        & (np.abs(np.subtract.outer(y1, y1)) <= delta)
    )
    return connected_components(near, directed=False)[1]


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of boxes ``a`` (N,4 as x0,y0,x1,y1) against one box ``b``."""
    ix = np.clip(np.minimum(a[:, 2], b[2]) - np.maximum(a[:, 0], b[0]), 0, None)
    iy = np.clip(np.minimum(a[:, 3], b[3]) - np.maximum(a[:, 1], b[1]), 0, None)
    inter = ix * iy
    area = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / np.maximum(area, 1e-9)


@dataclass
class Face:
    """A face pooled from cascade clusters; box in pixels of the image it was detected on."""

    box: np.ndarray  # x0, y0, x1, y1
    evidence: dict[str, float] = field(default_factory=dict)  # pass -> summed margins of its windows
    score: float = 0.0
    view: str = "frontal"


@dataclass
class Person:
    box: np.ndarray  # x0, y0, x1, y1 in pixels of the oriented image
    score: float
    detector: str


def person_update(records: list[dict], faces: list[dict], f: Filters, nobody: str, **extra) -> Update:
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

    return min(ratio(score, f.person_min_score),
               max(ratio(height_frac, f.person_min_height_frac), ratio(area_frac, f.person_min_area_frac)))


def order_main_first(records: list[dict], f: Filters) -> None:
    """Sort person records so persons[0] is the main person: the most confident prominent one (scores within 0.01
    count as equal, then the larger wins), else the candidate nearest to passing the rule."""
    records.sort(key=lambda r: (
        (0, -round(r["score"], 2), -r["area_frac"]) if r["prominent"]
        else (1, -prominence(f, r["score"], r["height_frac"], r["area_frac"]), 0.0)
    ))


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


class PersonStage(Stage):
    name = "person"
    reads = ("image", "width", "height")
    writes = PERSON_COLUMNS
    uses_actors = True

    def setup(self) -> None:
        import cv2

        cv2.setNumThreads(self.threads)
        self._cv2 = cv2
        self._hog = cv2.HOGDescriptor()
        self._hog.setSVMDetector(cv2.HOGDescriptor_getDefaultPeopleDetector())
        self._cascades: dict[str, tuple[cv2.CascadeClassifier, float]] = {}
        for kind, file in _FACE_CASCADES:
            path = cv2.data.haarcascades + file
            cascade = cv2.CascadeClassifier(path)
            if cascade.empty():
                raise RuntimeError(f"cannot load {path}")
            self._cascades[kind] = (cascade, _last_stage_threshold(path))

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    # -- detection -------------------------------------------------------------------------------------------

    def detect(self, rgb: np.ndarray, width: int, height: int) -> tuple[list[Person], list[Face]]:
        """Persons and faces in an RGB image whose oriented full size is ``width`` x ``height``."""
        m = self.cfg.models.person
        faces = self._faces(rgb, m.face_max_side)
        hog = self._hog_boxes(rgb, m.hog_max_side)
        # Scale everything to the oriented image's pixels.
        sx, sy = width / rgb.shape[1], height / rgb.shape[0]
        scale = np.array([sx, sy, sx, sy])
        for f in faces:
            f.box = f.box * scale
        hog = [(box * scale, s) for box, s in hog]
        persons = self._merge(hog, [f for f in faces if f.score >= m.min_candidate_score], width, height)
        return persons, faces

    def _resized(self, rgb: np.ndarray, max_side: int) -> tuple[np.ndarray, float]:
        h, w = rgb.shape[:2]
        s = min(1.0, max_side / max(h, w))
        if s == 1.0:
            return rgb, 1.0
        size = (max(1, round(w * s)), max(1, round(h * s)))
        return self._cv2.resize(rgb, size, interpolation=self._cv2.INTER_AREA), s

    def _hog_boxes(self, rgb: np.ndarray, max_side: int) -> list[tuple[np.ndarray, float]]:
        """HOG person boxes (x0,y0,x1,y1 in ``rgb`` pixels, shrunk to the body) with scores in [0,1]."""
        m = self.cfg.models.person
        img, s = self._resized(rgb, max_side)
        # Colour input: OpenCV takes the strongest gradient over channels, which helps on coloured clothing.
        rects, weights = self._hog.detectMultiScale(img, winStride=(8, 8), padding=(8, 8), scale=m.hog_scale)
        out = []
        for (x, y, w, h), wt in zip(np.asarray(rects).reshape(-1, 4), np.ravel(weights)):
            ox, oy, kw, kh = _HOG_SHRINK
            box = np.array([x + ox * w, y + oy * h, x + (ox + kw) * w, y + (oy + kh) * h], dtype=np.float64) / s
            out.append((box, _sigmoid((float(wt) - m.hog_weight_mid) / m.hog_weight_scale)))
        return out

    def _faces(self, rgb: np.ndarray, max_side: int) -> list[Face]:
        """Faces with pooled cascade evidence, in ``rgb`` pixels."""
        cv2 = self._cv2
        m = self.cfg.models.person
        img, s = self._resized(rgb, max_side)
        gray = cv2.equalizeHist(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY))
        h, w = gray.shape
        min_side = max(20, round(m.face_min_side_frac * min(h, w)))
        clusters: list[tuple[str, np.ndarray, float]] = []  # (kind, x0y0x1y1 box, summed margin)
        passes = [("default", False), ("alt2", False), ("left_profile", False), ("right_profile", True)]
        for kind, mirrored in passes:
            cascade, last = self._cascades["profile" if kind.endswith("profile") else kind]
            src = np.ascontiguousarray(gray[:, ::-1]) if mirrored else gray
            # minNeighbors=0 returns every window that passed all stages with its final-stage sum, so a
            # cluster's confidence can pool both how many windows fired and by what margin.
            rects, _, sums = cascade.detectMultiScale3(
                src, scaleFactor=m.face_scale_factor, minNeighbors=0, minSize=(min_side, min_side),
                outputRejectLevels=True,
            )
            rects = np.asarray(rects, dtype=np.float32).reshape(-1, 4)
            if len(rects) < 2:
                continue
            margins = np.clip(np.ravel(sums) - last, 0, None)
            if len(rects) > _MAX_WINDOWS:  # clustering is quadratic in windows: keep the strongest
                top = np.argsort(-margins)[:_MAX_WINDOWS]
                rects, margins = rects[top], margins[top]
            labels = _cluster(rects)
            for lab in np.unique(labels):
                sel = labels == lab
                if sel.sum() < 2:  # a lone window is noise
                    continue
                x, y, bw, bh = rects[sel].mean(axis=0)
                if mirrored:
                    x = w - x - bw
                clusters.append((kind, np.array([x, y, x + bw, y + bh], dtype=np.float64), float(margins[sel].sum())))
        faces = self._score_faces(self._pool(clusters))
        for f in faces:
            f.box = f.box / s
        return faces

    def _pool(self, clusters: list[tuple[str, np.ndarray, float]]) -> list[Face]:
        """Pool clusters of the cascade passes that cover the same face; the strongest cluster gives the box."""
        m = self.cfg.models.person
        weight = {"default": m.face_weight_default, "alt2": m.face_weight_alt2,
                  "left_profile": m.face_weight_profile, "right_profile": m.face_weight_profile}
        order = sorted(clusters, key=lambda c: -weight[c[0]] * math.log1p(c[2]))
        faces: list[Face] = []
        for kind, box, total in order:
            side = box[2] - box[0]
            home = None
            for f in faces:
                fs = f.box[2] - f.box[0]
                ix = max(0.0, min(box[2], f.box[2]) - max(box[0], f.box[0]))
                iy = max(0.0, min(box[3], f.box[3]) - max(box[1], f.box[1]))
                # Same face: overlapping by half of the smaller box and of similar size; profile boxes sit
                # off-centre relative to frontal ones, so IoU alone would split one face.
                if ix * iy >= 0.5 * min(side, fs) ** 2 and max(side, fs) <= 2.0 * min(side, fs):
                    home = f
                    break
            if home is None:
                home = Face(box=box)
                faces.append(home)
            home.evidence[kind] = home.evidence.get(kind, 0.0) + total
        return faces

    def _score_faces(self, faces: list[Face]) -> list[Face]:
        """Score each face from its pooled evidence and name its view; best first."""
        m = self.cfg.models.person
        weight = {"default": m.face_weight_default, "alt2": m.face_weight_alt2}
        for f in faces:
            ev = f.evidence
            frontal = sum(weight[k] * math.log1p(ev.get(k, 0.0)) for k in _FRONTAL_KINDS)
            left = math.log1p(ev.get("left_profile", 0.0))
            right = math.log1p(ev.get("right_profile", 0.0))
            # A face shows one profile: the weaker direction (both fire weakly on three-quarter views and on
            # clutter alike) adds nothing.
            profile = m.face_weight_profile * max(left, right)
            f.score = _sigmoid(frontal + profile - m.face_bias)
            if frontal >= profile:
                f.view = "frontal"
            else:
                f.view = "left_profile" if left >= right else "right_profile"
        return sorted(faces, key=lambda f: -f.score)

    def _merge(self, hog: list[tuple[np.ndarray, float]], faces: list[Face], width: int, height: int) -> list[Person]:
        """HOG boxes and face-anchored bodies -> persons; a face in a HOG box's head region joins that box."""
        m = self.cfg.models.person
        persons: list[Person] = []
        used: set[int] = set()
        for box, s_hog in sorted(hog, key=lambda b: -b[1]):
            bh = box[3] - box[1]
            best = None
            for i, f in enumerate(faces):
                if i in used:
                    continue
                fs = f.box[2] - f.box[0]
                cx, cy = (f.box[0] + f.box[2]) / 2, (f.box[1] + f.box[3]) / 2
                head = box[0] <= cx <= box[2] and box[1] - fs <= cy <= box[1] + 0.3 * bh
                if head and bh / 14 <= fs <= bh / 3 and (best is None or f.score > faces[best].score):
                    best = i
            if best is None:
                persons.append(Person(box, s_hog, "hog"))
                continue
            used.add(best)
            f = faces[best]
            union = np.concatenate([np.minimum(box[:2], f.box[:2]), np.maximum(box[2:], f.box[2:])])
            persons.append(Person(union, 1 - (1 - s_hog) * (1 - f.score), "hog+face"))
        for i, f in enumerate(faces):
            if i not in used:
                persons.append(Person(self._body_from_face(f.box), f.score, "face"))
        clip = np.array([width, height, width, height], dtype=np.float64)
        for p in persons:
            p.box = np.clip(p.box, 0, clip)
        # Non-maximum suppression: one person per body.
        persons.sort(key=lambda p: -p.score)
        kept: list[Person] = []
        for p in persons:
            if p.score < m.min_candidate_score or p.box[2] <= p.box[0] or p.box[3] <= p.box[1]:
                continue
            if kept and _iou(np.stack([k.box for k in kept]), p.box).max() > m.nms_iou:
                continue
            kept.append(p)
        return kept

    def _body_from_face(self, face: np.ndarray) -> np.ndarray:
        """The body a face implies: hair above it, shoulders about three faces wide, legs far below."""
        m = self.cfg.models.person
        side = face[2] - face[0]
        cx = (face[0] + face[2]) / 2
        return np.array(
            [cx - m.body_face_widths * side / 2, face[1] - 0.4 * side,
             cx + m.body_face_widths * side / 2, face[1] + m.body_face_heights * side]
        )

    # -- the row ---------------------------------------------------------------------------------------------

    def _one(self, row: Row) -> Update:
        m, f = self.cfg.models.person, self.cfg.filters
        width, height = int(row["width"]), int(row["height"])
        rgb = decode(row["image"]["bytes"], max_side=max(m.hog_max_side, m.face_max_side), mode="RGB")
        persons, faces = self.detect(rgb, width, height)
        area = float(width * height)
        records = []
        for p in persons:
            x0, y0, x1, y1 = (float(v) for v in p.box)
            hf, af = (y1 - y0) / height, (x1 - x0) * (y1 - y0) / area
            records.append(
                {"x0": x0, "y0": y0, "x1": x1, "y1": y1, "score": float(p.score), "detector": p.detector,
                 "height_frac": hf, "area_frac": af, "prominent": prominence(f, p.score, hf, af) >= 1.0,
                 "head_yaw_class": None, "head_confidence": None, "head_yaw": None, "head_pitch": None,
                 "head_roll": None, "keypoints": None}
            )
        order_main_first(records, f)
        face_records = [
            {"x0": float(fc.box[0]), "y0": float(fc.box[1]), "x1": float(fc.box[2]), "y1": float(fc.box[3]),
             "score": float(fc.score), "view": fc.view}
            for fc in faces if fc.score >= m.min_candidate_score
        ]
        return person_update(records, face_records, f, nobody="no person or face detected")


class HeadPoseStage(Stage):
    name = "head_pose"
    reads = ("image", "width", "height", "persons", "faces")
    writes = ("persons", "head_yaw_class", "head_confidence")
    uses_actors = True

    def setup(self) -> None:
        import cv2

        cv2.setNumThreads(self.threads)
        self._cv2 = cv2
        self._eye_cascades = []
        for file in _EYE_CASCADES:
            path = cv2.data.haarcascades + file
            cascade = cv2.CascadeClassifier(path)
            if cascade.empty():
                raise RuntimeError(f"cannot load {path}")
            self._eye_cascades.append((cascade, _last_stage_threshold(path)))

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [self._one(row) for row in rows]

    def _one(self, row: Row) -> Update:
        persons = [dict(p) for p in row["persons"] or []]
        faces = row["faces"] or []
        match = self._match(persons, faces)
        # Non-prominent persons keep null head fields: balancing only looks at prominent ones.
        seen = [faces[match[i]] for i, p in enumerate(persons) if p["prominent"] and i in match]
        gray, scale = self._decode_for(row, seen) if seen else (None, 1.0)
        for i, p in enumerate(persons):
            if not p["prominent"]:
                continue
            if i not in match:
                # No face where this body's head should be: seen from behind, turned away, or too small.
                confidence = self._not_visible_confidence(row, p, faces, match)
                p.update(head_yaw_class="not_visible", head_confidence=confidence)
                continue
            face = faces[match[i]]
            p.update(head_yaw_class=face["view"], head_confidence=float(face["score"]))
            p["head_roll"] = self._roll(gray, scale, face) if gray is not None else None
        main = persons[0] if persons else None
        return {
            "persons": persons,
            "head_yaw_class": main["head_yaw_class"] if main else None,
            "head_confidence": main["head_confidence"] if main else None,
        }

    @staticmethod
    def _head_region(p: dict[str, Any], fc: dict[str, Any]) -> bool:
        """Whether a face's centre lies in the upper half of a person's box and fits in its width."""
        cx, cy = (fc["x0"] + fc["x1"]) / 2, (fc["y0"] + fc["y1"]) / 2
        return (p["x0"] <= cx <= p["x1"] and p["y0"] <= cy <= (p["y0"] + p["y1"]) / 2
                and fc["x1"] - fc["x0"] <= p["x1"] - p["x0"])

    def _match(self, persons: list[dict[str, Any]], faces: list[dict[str, Any]]) -> dict[int, int]:
        """person index -> face index, one face each: greedily by how far a face sits from where the box puts
        the head (centred, about one face side below the top), in face sides. Boxes of people side by side
        overlap, so the nearest-to-expected pairing beats 'any face in the box'."""
        pairs = []
        for i, p in enumerate(persons):
            for j, fc in enumerate(faces):
                if not self._head_region(p, fc):
                    continue
                side = fc["x1"] - fc["x0"]
                dx = (fc["x0"] + fc["x1"]) / 2 - (p["x0"] + p["x1"]) / 2
                dy = (fc["y0"] + fc["y1"]) / 2 - (p["y0"] + 0.9 * side)
                pairs.append((math.hypot(dx, dy) / max(side, 1.0), i, j))
        match: dict[int, int] = {}
        taken: set[int] = set()
        for _, i, j in sorted(pairs):
            if i not in match and j not in taken:
                match[i] = j
                taken.add(j)
        return match

    def _not_visible_confidence(
        self, row: Row, p: dict[str, Any], faces: list[dict[str, Any]], match: dict[int, int]
    ) -> float:
        """How sure 'not visible' is: lowered by an unclaimed weak face in the head region, and by a head too
        small for the face cascades to have seen (under ~20 px in the face search image)."""
        m = self.cfg.models.person
        claimed = set(match.values())
        nearby = [float(fc["score"]) for j, fc in enumerate(faces) if j not in claimed and self._head_region(p, fc)]
        long_side = max(int(row["width"]), int(row["height"]))
        head_px = (p["y1"] - p["y0"]) / m.body_face_heights * min(1.0, m.face_max_side / long_side)
        seeable = min(1.0, max(0.0, (head_px - 20.0) / 20.0))
        return seeable * (1.0 - max(nearby, default=0.0))

    def _decode_for(self, row: Row, faces: list[dict[str, Any]]) -> tuple[np.ndarray, float]:
        """Decode once (grey), at the size that brings the smallest face to about ``eye_face_side`` pixels."""
        m = self.cfg.models.person
        long_side = max(int(row["width"]), int(row["height"]))
        smallest = min(fc["x1"] - fc["x0"] for fc in faces)
        max_side = min(long_side, math.ceil(long_side * m.eye_face_side / max(smallest, 1.0)))
        gray = decode(row["image"]["bytes"], max_side=max_side, mode="L")
        return gray, gray.shape[1] / int(row["width"])

    def _roll(self, gray: np.ndarray, scale: float, face: dict[str, Any]) -> float | None:
        """Head roll in degrees from the line through both eyes; None unless a plausible pair is found."""
        cv2 = self._cv2
        x0, y0, x1, y1 = (face[k] * scale for k in ("x0", "y0", "x1", "y1"))
        side = x1 - x0
        # Pad the crop: a tilted head moves one eye outwards beyond the upright face box.
        pad = 0.15 * side
        cx0, cy0 = max(0, int(x0 - pad)), max(0, int(y0 - pad))
        cx1, cy1 = min(gray.shape[1], int(x1 + pad)), min(gray.shape[0], int(y0 + 0.7 * side))
        if cx1 - cx0 < 8 or cy1 - cy0 < 8:
            return None
        k = self.cfg.models.person.eye_face_side / max(side, 1.0)
        crop = cv2.resize(gray[cy0:cy1, cx0:cx1], None, fx=k, fy=k,
                          interpolation=cv2.INTER_AREA if k < 1 else cv2.INTER_LINEAR)
        fs = side * k
        # Where the face box puts the face centre, in crop pixels.
        mid_x, top = (x0 + x1) / 2 * k - cx0 * k, y0 * k - cy0 * k
        lo, hi = max(8, round(0.1 * fs)), round(0.4 * fs)
        eyes = []  # (centre x, centre y, side, margin over the cascade's last stage)
        for cascade, last in self._eye_cascades:
            # minNeighbors=1: eyes are few windows wide; the pair geometry below rejects the strays.
            rects, _, sums = cascade.detectMultiScale3(
                crop, scaleFactor=1.05, minNeighbors=1, minSize=(lo, lo), maxSize=(hi, hi), outputRejectLevels=True
            )
            for (x, y, w, h), v in zip(np.asarray(rects, dtype=np.float64).reshape(-1, 4), np.ravel(sums)):
                eyes.append((x + w / 2, y + h / 2, w, float(v) - last))
        best, best_margin = None, -math.inf
        for a in eyes:
            for b in eyes:
                dx, dy = b[0] - a[0], b[1] - a[1]
                # A plausible pair: a left and a right eye a quarter to 0.7 of a face apart, alike in size,
                # their midpoint near the face's centre line and in its upper half, and the line through them
                # within 35 degrees of horizontal.
                if not (0.25 * fs <= dx <= 0.7 * fs and abs(dy) <= 0.7 * dx):
                    continue
                if max(a[2], b[2]) > 1.6 * min(a[2], b[2]):
                    continue
                if abs((a[0] + b[0]) / 2 - mid_x) > 0.2 * fs or not 0.15 * fs <= (a[1] + b[1]) / 2 - top <= 0.6 * fs:
                    continue
                if a[3] + b[3] > best_margin:
                    best, best_margin = (dx, dy), a[3] + b[3]
        if best is None:
            return None
        return float(math.degrees(math.atan2(best[1], best[0])))
