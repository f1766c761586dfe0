"""Lite person detection (OpenPose-style keypoints) and head pose (BlazeFace + face mesh + PnP) on real photos that
ship in installed packages, and variants of them."""

from __future__ import annotations

import importlib.util
import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from common import schema
from curation.config import CurateConfig
from curation.score.stage import REJECT
from curation.stages.head_pose import HeadPoseStage
from curation.stages.openpose import group_skeletons
from curation.stages.person import PersonStage
from curation.stages.person_rules import yaw_class
from generators.labelled_photos import person_check, precision_recall, upscaled_rgb

PEOPLE = ("bus", "zidane", "grace_hopper", "astronaut", "camera")
NO_PERSON = ("china", "flower", "coffee", "rocket", "chelsea", "text", "page")
VARIANTS = ("original", "mirrored", "jpeg_q30", "resized_0.6")
MIN_SIDE = 384  # decode's default minimum short side: every row a stage sees has at least this


def _photo(name: str) -> np.ndarray:
    """RGB array of a shipped photo, upscaled so its short side is at least MIN_SIDE."""
    if name in ("bus", "zidane"):
        # Located without importing ultralytics: its import patches PIL.Image.open.
        spec = importlib.util.find_spec("ultralytics")
        assert spec is not None and spec.submodule_search_locations
        img = Image.open(Path(next(iter(spec.submodule_search_locations))) / "assets" / f"{name}.jpg")
    elif name == "grace_hopper":
        from matplotlib import cbook

        img = Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    elif name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        img = Image.fromarray(load_sample_image(f"{name}.jpg"))
    else:
        import skimage.data

        img = Image.fromarray(getattr(skimage.data, name)())
    return upscaled_rgb(img, MIN_SIDE)


def _jpeg(rgb: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _variant(rgb: np.ndarray, kind: str) -> np.ndarray:
    if kind == "original":
        return rgb
    if kind == "mirrored":
        return np.ascontiguousarray(rgb[:, ::-1])
    if kind == "jpeg_q30":
        return np.asarray(Image.open(io.BytesIO(_jpeg(rgb, 30))).convert("RGB"))
    if kind == "resized_0.6":
        h, w = rgb.shape[:2]
        s = max(0.6, MIN_SIDE / min(h, w))  # keep the short side >= MIN_SIDE
        return np.asarray(Image.fromarray(rgb).resize((round(w * s), round(h * s)), Image.Resampling.BILINEAR))
    raise ValueError(kind)


def _rotated(rgb: np.ndarray, degrees: float) -> np.ndarray:
    """Rotated counter-clockwise as displayed (PIL's convention), same size."""
    return np.asarray(Image.fromarray(rgb).rotate(degrees, resample=Image.Resampling.BICUBIC))


def _row(rgb: np.ndarray, name: str) -> dict:
    return {"image": {"bytes": _jpeg(rgb), "path": f"{name}.jpg"}, "width": rgb.shape[1], "height": rgb.shape[0]}


def _stage(cls: type, cfg: CurateConfig | None = None):
    st = cls(cfg or CurateConfig())
    st.setup()
    return st


@pytest.fixture(scope="module")
def person_stage() -> PersonStage:
    return _stage(PersonStage)


@pytest.fixture(scope="module")
def head_stage() -> HeadPoseStage:
    return _stage(HeadPoseStage)


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    return {name: _photo(name) for name in PEOPLE + NO_PERSON}


@pytest.fixture(scope="module")
def results(person_stage, photos) -> dict[tuple[str, str], tuple[dict, dict]]:
    """(photo, variant) -> (row, person update): every variant of the person photos, originals of the rest."""
    cases = [(n, v) for n in PEOPLE for v in VARIANTS] + [(n, "original") for n in NO_PERSON]
    rows = [_row(_variant(photos[n], v), f"{n}_{v}") for n, v in cases]
    updates = person_stage.process_batch(rows)
    assert len(updates) == len(rows)
    return {case: (row, update) for case, row, update in zip(cases, rows, updates)}


@pytest.fixture(scope="module")
def head_results(head_stage, results) -> dict[tuple[str, str], dict]:
    kept = [(case, row, u) for case, (row, u) in results.items() if REJECT not in u]
    updates = head_stage.process_batch([{**row, **u} for _, row, u in kept])
    return {case: update for (case, _, _), update in zip(kept, updates)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", PEOPLE)
def test_person_photos_and_their_variants_are_kept(results, name, variant):
    cfg = CurateConfig()
    _, u = results[(name, variant)]
    assert REJECT not in u, u.get(REJECT)
    assert u["prominent_count"] >= 1
    main = u["persons"][0]
    assert main["prominent"]
    assert main["score"] >= cfg.filters.person_min_score
    assert (
        main["height_frac"] >= cfg.filters.person_min_height_frac
        or main["area_frac"] >= cfg.filters.person_min_area_frac
    )
    assert (u["main_person_score"], u["main_person_height_frac"], u["main_person_area_frac"]) == pytest.approx(
        (main["score"], main["height_frac"], main["area_frac"])
    )


@pytest.mark.parametrize("name", NO_PERSON)
def test_photos_without_people_are_rejected(results, name):
    _, u = results[(name, "original")]
    assert REJECT in u
    code = u[REJECT].split(":")[0]
    assert code in ("no_person", "no_prominent_person")
    assert u["prominent_count"] == 0
    if code == "no_person":
        assert u["persons"] == [] and u["person_count"] == 0
    else:
        assert u["person_count"] >= 1 and not any(p["prominent"] for p in u["persons"])


def test_no_prominent_person_detail_names_the_best_candidate_against_the_thresholds(photos):
    # Thresholds no box can meet: bus still has candidates, so the reason is no_prominent_person.
    cfg = CurateConfig()
    cfg = cfg.model_copy(
        update={
            "filters": cfg.filters.model_copy(update={"person_min_height_frac": 0.99, "person_min_area_frac": 0.99})
        }
    )
    u = _stage(PersonStage, cfg).process_batch([_row(photos["bus"], "bus")])[0]
    assert u[REJECT].startswith("no_prominent_person: ")
    main = u["persons"][0]
    detail = u[REJECT]
    assert f"score {main['score']:.2f} (min {cfg.filters.person_min_score})" in detail
    assert f"height {main['height_frac']:.2f} of the image (min 0.99)" in detail
    assert f"area {main['area_frac']:.3f} (min 0.99)" in detail
    assert u["main_person_height_frac"] == pytest.approx(main["height_frac"])


def test_boxes_lie_within_the_image_and_fractions_match_them(results):
    checked = 0
    for (name, variant), (row, u) in results.items():
        w, h = row["width"], row["height"]
        assert u["person_count"] == len(u["persons"])
        assert u["prominent_count"] == sum(p["prominent"] for p in u["persons"])
        for box in [*u["persons"], *u["faces"]]:
            assert 0 <= box["x0"] < box["x1"] <= w and 0 <= box["y0"] < box["y1"] <= h, (name, variant, box)
            assert 0.0 <= box["score"] <= 1.0
            checked += 1
        for p in u["persons"]:
            assert p["height_frac"] == pytest.approx((p["y1"] - p["y0"]) / h)
            assert p["area_frac"] == pytest.approx((p["x1"] - p["x0"]) * (p["y1"] - p["y0"]) / (w * h))
            assert p["detector"] == "openpose"
            kp = np.asarray(p["keypoints"]).reshape(17, 3)
            seen = kp[:, 2] > 0
            assert seen.sum() >= 2 and (kp[:, 2] <= 1).all()
            # Keypoints lie inside the person's box (the box is grown from them by body proportions).
            assert (kp[seen, 0] >= p["x0"] - 1e-3).all() and (kp[seen, 0] <= p["x1"] + 1e-3).all()
            assert (kp[seen, 1] >= p["y0"] - 1e-3).all() and (kp[seen, 1] <= p["y1"] + 1e-3).all()
    assert checked > 20


def test_updates_match_the_working_schema(results, head_results):
    table = schema.working_schema(8)
    updates = [u for _, u in results.values()] + list(head_results.values())
    for column in {k for u in updates for k in u if k != REJECT}:
        pa.array([u.get(column) for u in updates], type=table.field(column).type)  # raises on a mismatch


def test_zidane_shows_two_people_side_by_side(results):
    row, u = results[("zidane", "original")]
    assert u["person_count"] >= 2
    centres = sorted((p["x0"] + p["x1"]) / 2 for p in u["persons"] if p["prominent"])
    # Two distinct prominent people, not two boxes on one: their centres lie far apart.
    assert len(centres) >= 2 and centres[-1] - centres[0] > 0.2 * row["width"]


def test_keypoints_are_in_coco_order(results):
    # COCO order: nose, the subject's left and right eye, ears, shoulders, ... A person facing the camera has their
    # left eye and shoulder on the image's right, in the photo and in its mirror image alike (the mirror image
    # shows a person facing the camera too).
    for variant in ("original", "mirrored"):
        kp = np.asarray(results[("zidane", variant)][1]["persons"][0]["keypoints"]).reshape(17, 3)
        nose, left_eye, right_eye, left_shoulder, right_shoulder = kp[0], kp[1], kp[2], kp[5], kp[6]
        assert min(nose[2], left_eye[2], right_eye[2], left_shoulder[2], right_shoulder[2]) > 0
        assert left_eye[0] > nose[0] > right_eye[0], variant
        assert left_shoulder[0] > right_shoulder[0], variant
        assert left_eye[1] < nose[1] < left_shoulder[1]  # eyes above the nose, the nose above the shoulders


def test_the_person_filter_on_a_labelled_check_of_shipped_photos(person_stage):
    """People (as shipped, mirrored, recompressed, shrunk, greyscale, painted) against animals, scenes, paintings of
    scenes, textures, print, and crowds of small people: "at least one prominent person"."""
    photos = list(person_check(MIN_SIDE))
    updates = person_stage.process_batch([_row(p.rgb, p.name) for p in photos])
    said = [REJECT not in u for u in updates]
    precision, recall = precision_recall([p.person for p in photos], said)
    wrong = [p.name for p, s in zip(photos, said) if s != p.person]
    assert precision >= 0.9 and recall >= 0.9, (precision, recall, wrong)
    kinds = {p.kind for p in photos}
    assert {"people", "painted_people", "animals", "scenes", "textures", "crowds"} <= kinds
    # Crowds of small people are seen (person_count) but none is prominent.
    for p, u in zip(photos, updates):
        if p.kind == "crowds":
            assert u["person_count"] >= 4 and u[REJECT].startswith("no_prominent_person"), p.name


def test_grouping_joins_parts_along_their_affinity_fields():
    """Two synthetic skeletons side by side (neck, shoulders, nose) with fields along their limbs: two skeletons,
    each with its own parts; with fields that point across, the parts do not join."""
    h, w = 60, 80
    heat = np.zeros((h, w, 18), np.float32)
    fields = np.zeros((h, w, 38), np.float32)
    parts = {1: (0, 20), 2: (-8, 20), 5: (8, 20), 0: (0, 10), 8: (-5, 40), 11: (5, 40)}  # dx from centre, y
    limbs = {(1, 2): (12, 13), (1, 5): (20, 21), (1, 0): (28, 29), (1, 8): (0, 1), (1, 11): (6, 7)}
    for cx in (20, 60):
        for part, (dx, y) in parts.items():
            heat[y, cx + dx, part] = 1.0
        for (a, b), (chx, chy) in limbs.items():
            (ax, ay), (bx, by) = parts[a], parts[b]
            v = np.array([bx - ax, by - ay], np.float32)
            v /= np.linalg.norm(v)
            for t in np.linspace(0, 1, 30):
                x, y = round(cx + ax + t * (bx - ax)), round(ay + t * (by - ay))
                fields[y, x, chx], fields[y, x, chy] = v
    skeletons = group_skeletons(heat, fields, sigma=0.0)
    assert len(skeletons) == 2
    for kp, score in skeletons:
        seen = np.flatnonzero(kp[:, 2] > 0)
        assert sorted(seen) == sorted(parts)
        assert np.ptp(kp[seen, 0]) <= 16  # all parts from one side
        assert score > 0.3
    assert group_skeletons(heat, np.zeros_like(fields), sigma=0.0) == []


@pytest.mark.parametrize("name", ["grace_hopper", "astronaut"])
def test_portraits_face_the_camera(results, head_results, name):
    for variant in VARIANTS:
        _, _u = results[(name, variant)]
        hu = head_results[(name, variant)]
        assert any(f["view"] == "frontal" and f["score"] >= 0.5 for f in hu["faces"]), variant
        main = hu["persons"][0]
        assert main["head_yaw_class"] == "frontal", variant
        assert abs(main["head_yaw"]) < 20 and abs(main["head_roll"]) < 10, variant
        assert hu["head_yaw_class"] == "frontal"


def test_profile_view_swaps_sides_on_the_mirror_image(head_results):
    # The cameraman looks into a camera on the image's right: his nose points right.
    for variant in ("original", "jpeg_q30", "resized_0.6"):
        main = head_results[("camera", variant)]["persons"][0]
        assert main["head_yaw"] > 30, variant
    assert head_results[("camera", "original")]["head_yaw_class"] == "right_profile"
    assert head_results[("camera", "mirrored")]["head_yaw_class"] == "left_profile"


@pytest.mark.parametrize("name", PEOPLE)
def test_a_mirrored_face_flips_the_sign_of_yaw(head_results, name):
    a = head_results[(name, "original")]["persons"][0]
    b = head_results[(name, "mirrored")]["persons"][0]
    assert a["head_yaw_class"] != "not_visible" and b["head_yaw_class"] != "not_visible"
    assert a["head_yaw"] + b["head_yaw"] == pytest.approx(0, abs=10)  # the same face, turned the other way
    assert a["head_roll"] + b["head_roll"] == pytest.approx(0, abs=8)
    assert a["head_pitch"] == pytest.approx(b["head_pitch"], abs=8)
    if abs(a["head_yaw"]) > 5:
        assert np.sign(a["head_yaw"]) == -np.sign(b["head_yaw"])
    mirrored = {"frontal": "frontal", "left_profile": "right_profile", "right_profile": "left_profile"}
    cfg = CurateConfig().models.head_pose
    if abs(abs(a["head_yaw"]) - cfg.frontal_max_yaw) > 5:  # away from the class boundary
        assert b["head_yaw_class"] == mirrored[a["head_yaw_class"]]


def test_yaw_class_names_the_side_the_nose_points_to():
    assert yaw_class(-60.0, 45.0) == "left_profile"
    assert yaw_class(60.0, 45.0) == "right_profile"
    assert yaw_class(10.0, 45.0) == "frontal"
    assert yaw_class(float("nan"), 45.0) == "not_visible"


def test_head_pose_annotates_every_prominent_person_and_rejects_nothing(results, head_results):
    assert len(head_results) == len(PEOPLE) * len(VARIANTS)
    for case, hu in head_results.items():
        assert REJECT not in hu
        before = results[case][1]["persons"]
        assert [(p["x0"], p["score"]) for p in hu["persons"]] == [(p["x0"], p["score"]) for p in before]
        for p in hu["persons"]:
            if not p["prominent"]:
                assert p["head_yaw_class"] is None and p["head_yaw"] is None
                continue
            assert p["head_yaw_class"] in schema.HEAD_YAW_CLASSES
            assert 0.0 <= p["head_confidence"] <= 1.0
            if p["head_yaw_class"] == "not_visible":
                assert p["head_yaw"] is None and p["head_pitch"] is None and p["head_roll"] is None
            else:
                assert p["head_yaw_class"] == yaw_class(p["head_yaw"], 45.0)
                assert -90 <= p["head_yaw"] <= 90 and -90 <= p["head_pitch"] <= 90 and -90 <= p["head_roll"] <= 90
        for fc in hu["faces"]:
            assert fc["view"] in ("frontal", "left_profile", "right_profile") and 0 <= fc["score"] <= 1
        assert (hu["head_yaw_class"], hu["head_confidence"]) == (
            hu["persons"][0]["head_yaw_class"],
            hu["persons"][0]["head_confidence"],
        )


def test_a_body_without_a_face_is_not_visible(head_stage, results):
    row, u = results[("bus", "original")]
    persons = []
    for p in u["persons"]:
        kp = np.asarray(p["keypoints"]).reshape(17, 3)
        kp[:5] = 0  # no nose, eyes or ears: seen from behind
        persons.append({**p, "keypoints": kp.reshape(-1).tolist()})
    hu = head_stage.process_batch([{**row, **u, "persons": persons}])[0]
    prominent = [p for p in hu["persons"] if p["prominent"]]
    assert prominent and all(p["head_yaw_class"] == "not_visible" for p in prominent)
    assert all(0.0 < p["head_confidence"] <= 1.0 and p["head_roll"] is None for p in prominent)
    assert hu["faces"] == []


def test_a_head_crop_without_a_face_is_not_visible(head_stage, photos):
    # A person whose head keypoints sit on a textureless patch: the face detector finds nothing there.
    rgb = np.full((480, 640, 3), 200, np.uint8)
    kp = np.zeros((17, 3))
    kp[:7] = [
        [320, 100, 0.9],
        [330, 90, 0.9],
        [310, 90, 0.9],
        [340, 95, 0.8],
        [300, 95, 0.8],
        [360, 160, 0.9],
        [280, 160, 0.9],
    ]
    person = {
        "x0": 250.0,
        "y0": 50.0,
        "x1": 390.0,
        "y1": 470.0,
        "score": 0.9,
        "detector": "openpose",
        "height_frac": 0.875,
        "area_frac": 0.19,
        "prominent": True,
        "head_yaw_class": None,
        "head_confidence": None,
        "head_yaw": None,
        "head_pitch": None,
        "head_roll": None,
        "keypoints": kp.reshape(-1).tolist(),
    }
    hu = head_stage.process_batch([{**_row(rgb, "blank"), "persons": [person]}])[0]
    assert hu["head_yaw_class"] == "not_visible" and hu["persons"][0]["head_yaw"] is None


@pytest.mark.parametrize("name", ["astronaut", "grace_hopper"])
def test_head_roll_follows_a_rotation_of_the_photo(person_stage, head_stage, photos, name):
    rolls = {}
    for degrees in (15, -15):
        row = _row(_rotated(photos[name], degrees), f"{name}_rot{degrees}")
        u = person_stage.process_batch([row])[0]
        assert REJECT not in u, u.get(REJECT)
        main = head_stage.process_batch([{**row, **u}])[0]["persons"][0]
        assert main["head_yaw_class"] == "frontal"
        assert main["head_roll"] is not None
        rolls[degrees] = main["head_roll"]
    # Counter-clockwise rotation raises the eye on the image's right: negative roll; clockwise: positive.
    assert rolls[15] < 0 < rolls[-15]
    assert rolls[-15] - rolls[15] == pytest.approx(30, abs=10)


def _person_on(runtime: str) -> CurateConfig:
    cfg = CurateConfig()
    return cfg.model_copy(
        update={
            "models": cfg.models.model_copy(
                update={"person": cfg.models.person.model_copy(update={"runtime": runtime})}
            )
        }
    )


@pytest.mark.slow
def test_both_runtimes_of_the_person_graph_give_the_same_people(photos):
    """OpenVINO (the default where it imports) and cv2.dnn run the same graph in fp32: on every photo of the labelled
    check and the module's photos, the same verdicts and the same persons, boxes and keypoints within 1e-4 of the
    image size."""
    stages = {runtime: _stage(PersonStage, _person_on(runtime)) for runtime in ("openvino", "opencv")}
    assert {r: s.network.runtime for r, s in stages.items()} == {"openvino": "openvino", "opencv": "opencv"}
    checked = [(p.name, p.rgb) for p in person_check(MIN_SIDE)] + list(photos.items())
    rows = [_row(rgb, name) for name, rgb in checked]
    got = {r: s.process_batch(rows) for r, s in stages.items()}
    for (name, rgb), a, b in zip(checked, got["openvino"], got["opencv"]):
        assert a.get(REJECT, "").split(":")[0] == b.get(REJECT, "").split(":")[0], name
        assert a["person_count"] == b["person_count"], name
        side = max(rgb.shape[:2])
        for pa_, pb_ in zip(a["persons"] or [], b["persons"] or []):
            box_a = np.array([pa_[k] for k in ("x0", "y0", "x1", "y1")])
            box_b = np.array([pb_[k] for k in ("x0", "y0", "x1", "y1")])
            assert np.abs(box_a - box_b).max() <= 1e-4 * side, (name, box_a, box_b)
            assert np.abs(np.subtract(pa_["keypoints"], pb_["keypoints"])).max() <= 1e-4 * side, name


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning is only seen with two CPUs or more")
def test_openvino_leaves_its_threads_free_to_run_on_any_of_the_process_cpus():
    """Each process pins OpenVINO's inference threads from the first core up, not knowing of the other actors on the
    node: two single-thread actors then share one core. While the person graph runs, no thread of this process may be
    narrowed to fewer CPUs than the process may use."""
    stage = _stage(PersonStage, _person_on("openvino"))
    assert stage.network.runtime == "openvino"
    allowed = os.sched_getaffinity(0)
    rgb = np.zeros((276, 368, 3), np.uint8)
    done = threading.Event()

    def infer() -> None:
        while not done.is_set():
            stage.network(rgb)

    worker = threading.Thread(target=infer, daemon=True)
    worker.start()
    narrowed = set()
    try:
        for _ in range(150):
            for tid in map(int, os.listdir("/proc/self/task")):
                try:
                    cpus = os.sched_getaffinity(tid)
                except OSError:  # the thread has ended
                    continue
                if cpus != allowed:
                    narrowed.add((tid, tuple(sorted(cpus))))
            time.sleep(0.005)
    finally:
        done.set()
        worker.join()
    assert not narrowed, f"threads pinned to fewer CPUs than {sorted(allowed)}: {sorted(narrowed)}"
