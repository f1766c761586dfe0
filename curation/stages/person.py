"""The lite profile's person stage: person boxes, COCO keypoints and the prominent-person verdict from the
OpenPose-style keypoint network (``curation.stages.openpose``). Boxes follow from the keypoints (``body_box``)."""

from __future__ import annotations

import numpy as np

from common.imageio import decode
from curation.score.stage import Row, Stage, StageSettings, Update
from curation.stages.openpose import LIMBS, PARTS, TO_COCO, PersonNetwork, group_skeletons
from curation.stages.person_rules import (
    COCO_L_ANKLE,
    COCO_L_HIP,
    COCO_L_KNEE,
    COCO_R_ANKLE,
    COCO_R_HIP,
    COCO_R_KNEE,
    HEAD_KEYPOINTS,
    PERSON_FIELDS,
    head_height,
    order_main_first,
    person_update,
    prominence,
    sigmoid,
)


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
    head_seen = seen[list(HEAD_KEYPOINTS)]
    top = (xy[list(HEAD_KEYPOINTS)][head_seen, 1].min() - 0.6 * head) if head_seen.any() else y0 - 0.3 * head
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


class PersonStage(Stage):
    """Person boxes, COCO keypoints and the prominent-person verdict from the OpenPose-style keypoint network."""

    name = "person"
    reads = ("image", "width", "height")
    columns = PERSON_FIELDS
    model_section = "person"
    thresholds = ("person_min_score", "person_min_height_frac", "person_min_area_frac")
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
            score = float(sigmoid((kp[:, 2].sum() - m.score_mid) / m.score_scale))
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
