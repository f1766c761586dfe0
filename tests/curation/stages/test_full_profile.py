"""Full profile (YOLO person + head pose, OpenCLIP embedding + aesthetic + NSFW + realism + prompt filters) and the model
store, on CPU and offline: the models are built with random weights from their own configs, saved into a temporary
store and loaded back through the store's real loading code. Scores of random models mean nothing; the tests check
shapes, types, thresholds and the wiring into the curate job, and the head-pose geometry on synthetic keypoints."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common import schema
from common.config import ConfigError, load_config
from common.imageio import decode
from curation import models
from curation.config import CurateConfig
from curation.score.chain import stage_runner
from curation.score.ledger import committed_files, read_ledger, reason_code
from curation.score.stage import REJECT
from curation.stages.clip import NSFW_MODEL_NAME, ClipStage
from curation.stages.nsfw import nsfw_detail
from curation.stages.yolo import (
    HEAD_MODEL,
    LEFT_EAR,
    LEFT_EYE,
    NOSE,
    RIGHT_EAR,
    RIGHT_EYE,
    YoloPersonStage,
    estimate_head_pose,
    match_boxes,
    project_head,
    yaw_class,
)
from generators.random_models import TINY_CLIP, random_nsfw_head, store_overrides
from tests.stage_calls import decided

FULL = Path(__file__).resolve().parents[3] / "configs" / "curate" / "full.yaml"
CLIP_DIM = TINY_CLIP["embed_dim"]


# --- fixtures -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    from generators.sample_pool import load_photos

    loaded = load_photos()
    return {n: loaded[n].data for n in ("bus", "zidane", "grace_hopper", "astronaut", "china", "coffee", "page")}


def _rows(photos: dict[str, bytes], names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        data = photos[name]
        img = Image.open(io.BytesIO(data))
        rows.append({"image": {"bytes": data, "path": f"{name}.jpg"}, "width": img.width, "height": img.height})
    return rows


def _full_cfg(store_dir: Path, *overrides: str) -> CurateConfig:
    base = [
        *store_overrides(store_dir, CLIP_DIM),
        "models.yolo.imgsz=320",
        "stages.yolo_person.num_cpus=1",
        "stages.clip.num_cpus=1",
    ]
    return load_config(CurateConfig, FULL, [*base, *overrides])


def _check_types(updates: list[dict], cfg: CurateConfig) -> None:
    """Every written value converts to its column's Arrow type (what StageRunner does when merging)."""
    working = schema.working_schema(cfg.embedding_dim)
    for column in {k for u in updates for k in u if k != REJECT}:
        pa.array([u.get(column) for u in updates], working.field(column).type)


# --- head pose geometry -----------------------------------------------------------------------------------------------


def _frontal_keypoints() -> np.ndarray:
    """Hand-placed keypoints of a face looking into the camera, eyes 60 px apart (the subject's left eye on the
    image's right)."""
    xy = np.zeros((5, 2))
    xy[NOSE] = (300, 238)
    xy[LEFT_EYE], xy[RIGHT_EYE] = (330, 200), (270, 200)
    xy[LEFT_EAR], xy[RIGHT_EAR] = (366, 219), (234, 219)
    return xy


def test_frontal_face_has_zero_yaw_and_roll_and_frontal_class():
    h = estimate_head_pose(_frontal_keypoints()[None], np.ones((1, 5)))
    assert h.valid[0]
    assert abs(h.yaw[0]) < 3 and abs(h.pitch[0]) < 10 and abs(h.roll[0]) < 1
    assert yaw_class(h.yaw[0], 45) == "frontal"
    assert h.confidence[0] > 0.9
    x0, y0, x1, y1 = h.face_box[0]
    assert x0 < 270 and x1 > 330 and y0 < 200 < 238 < y1  # the face box holds eyes and nose


def test_rotated_eye_line_gives_roll():
    xy = _frontal_keypoints()
    centre = xy[[LEFT_EYE, RIGHT_EYE]].mean(0)
    for degrees in (-25.0, 12.0, 30.0):
        a = math.radians(degrees)  # y points down, so a positive angle turns clockwise on screen
        rot = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
        turned = (xy - centre) @ rot.T + centre
        h = estimate_head_pose(turned[None], np.ones((1, 5)))
        assert h.roll[0] == pytest.approx(degrees, abs=1.0)
        assert abs(h.yaw[0]) < 3
        if degrees > 0:  # clockwise: the eye on the image's right side is the lower one
            assert turned[LEFT_EYE, 1] > turned[RIGHT_EYE, 1]


@pytest.mark.parametrize(
    "yaw, pitch, roll",
    [(0, 0, 0), (25, 0, 0), (-40, 10, 5), (60, -15, 20), (-70, 5, -10), (10, 30, -30), (0, -35, 0)],
)
def test_known_poses_are_recovered_from_projected_keypoints(yaw, pitch, roll):
    rng = np.random.default_rng(abs(yaw) * 100 + abs(pitch))
    xy = project_head(yaw, pitch, roll, scale=1.7, offset=(420.0, 310.0))
    exact = estimate_head_pose(xy[None], np.ones((1, 5)))
    assert (exact.yaw[0], exact.pitch[0], exact.roll[0]) == pytest.approx((yaw, pitch, roll), abs=0.2)
    noisy = estimate_head_pose((xy + rng.normal(0, 1.5, xy.shape))[None], np.ones((1, 5)))  # ~1.5 px jitter
    assert (noisy.yaw[0], noisy.pitch[0], noisy.roll[0]) == pytest.approx((yaw, pitch, roll), abs=6.0)
    assert noisy.confidence[0] < exact.confidence[0] or exact.confidence[0] == pytest.approx(1.0)


def test_profiles_are_signed_by_where_the_nose_points():
    for yaw, expected, hidden in (
        (-70, "left_profile", (RIGHT_EYE, RIGHT_EAR)),
        (70, "right_profile", (LEFT_EYE, LEFT_EAR)),
    ):
        xy = project_head(yaw, 0, 0, scale=2.0, offset=(500.0, 300.0))
        eyes_mid = xy[[LEFT_EYE, RIGHT_EYE]].mean(0)
        # the convention in pixels: left_profile means the nose points to the image's left
        assert (xy[NOSE, 0] < eyes_mid[0]) == (expected == "left_profile")
        conf = np.ones(5)
        conf[list(hidden)] = 0.05  # the far eye and ear are hidden behind the head
        h = estimate_head_pose(xy[None], conf[None])
        assert h.valid[0] and yaw_class(h.yaw[0], 45) == expected
        assert h.yaw[0] == pytest.approx(yaw, abs=2.0)
        assert 0 < h.confidence[0] < 1  # fewer landmarks, less sure


def test_face_without_nose_or_eyes_is_not_visible():
    xy = project_head(0, 0, 0, offset=(100.0, 100.0))
    conf = np.array([[0.1, 0.9, 0.9, 0.9, 0.9], [0.9, 0.2, 0.1, 0.9, 0.9], [0.9, 0.9, 0.1, 0.1, 0.1]])
    h = estimate_head_pose(np.repeat(xy[None], 3, 0), conf)
    assert not h.valid.any() and np.isnan(h.yaw).all()
    assert yaw_class(h.yaw[0], 45) == "not_visible"
    # A person the pose model missed has keypoints of confidence 0: not seen even when every confidence counts.
    missed = estimate_head_pose(np.zeros((1, 5, 2)), np.zeros((1, 5)), min_conf=0)
    assert not missed.valid.any() and missed.confidence[0] == 0


def test_head_model_is_left_right_symmetric():
    assert np.allclose(HEAD_MODEL[LEFT_EYE] * [-1, 1, 1], HEAD_MODEL[RIGHT_EYE])
    assert np.allclose(HEAD_MODEL[LEFT_EAR] * [-1, 1, 1], HEAD_MODEL[RIGHT_EAR])


def test_detector_boxes_pair_with_pose_boxes_by_overlap():
    det = np.array([[0, 0, 100, 200], [300, 0, 400, 200], [600, 0, 700, 200]], float)
    pose = np.array([[305, 5, 405, 205], [2, 0, 98, 190]], float)
    assert match_boxes(det, pose, 0.5) == {0: 1, 1: 0}


# --- model store --------------------------------------------------------------------------------------------------


def test_store_resolves_local_paths_and_bare_names_under_roots(tmp_path):
    (tmp_path / "root").mkdir()
    weights = tmp_path / "root" / "head.pth"
    weights.write_bytes(b"x")
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"), roots=(str(tmp_path / "root"),))
    assert store.fetch(str(weights), "models.clip.aesthetic_head") == weights
    assert store.fetch("head.pth", "models.clip.aesthetic_head") == weights
    mirror = tmp_path / "root" / "org" / "repo"
    mirror.mkdir(parents=True)
    (mirror / "w.pt").write_bytes(b"y")
    assert store.fetch("hf-hub:org/repo/w.pt", "models.yolo.pose") == mirror / "w.pt"  # an offline hub mirror
    assert store.fetch("hf-hub:org/repo", "models.clip.checkpoint") == mirror


def test_store_offline_without_weights_says_where_it_looked_and_how_to_provide(tmp_path):
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"), roots=(str(tmp_path / "mirror"),), online=False)
    with pytest.raises(models.ModelNotFoundError) as err:
        store.fetch("hf-hub:Ultralytics/YOLO11/yolo11m-pose.pt", "models.yolo.pose")
    message = str(err.value)
    assert "models.yolo.pose" in message and "yolo11m-pose.pt" in message
    assert str(tmp_path / "mirror" / "Ultralytics" / "YOLO11" / "yolo11m-pose.pt") in message
    assert "models.store.online is false" in message and "models.store.roots" in message
    with pytest.raises(models.ModelNotFoundError, match=r"(?s)models.clip.aesthetic_head.*missing.pth.*local path"):
        store.fetch(str(tmp_path / "missing.pth"), "models.clip.aesthetic_head")


def test_missing_model_fails_stage_setup_naming_the_model(store_dir, tmp_path):
    cfg = _full_cfg(store_dir, f"models.yolo.pose={tmp_path / 'nowhere' / 'pose.safetensors'}")
    with pytest.raises(models.ModelNotFoundError, match=r"models\.yolo\.pose="):
        YoloPersonStage(cfg).setup()


@pytest.fixture()
def s3_models(store_dir):
    """A local S3 endpoint (moto) holding the store's files; yields (uri prefix, boto3 client)."""
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    keys = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    try:
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for path in store_dir.rglob("*"):
            if path.is_file() and "cache" not in path.parts:
                client.put_object(Bucket="models", Key=f"humans/{path.relative_to(store_dir)}", Body=path.read_bytes())
        yield f"s3://models/humans?endpoint_override=http://{host}:{port}&scheme=http&region=us-east-1", client
    finally:
        server.stop()
        for k, v in keys.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_store_copies_an_s3_object_once_per_node_and_refreshes_a_changed_one(s3_models, store_dir, tmp_path):
    prefix, client = s3_models
    base, query = prefix.split("?")
    pose_uri = f"{base}/yolo-pose.safetensors?{query}"
    first = models.ModelStore(cache_dir=str(tmp_path / "cache"))
    got = first.fetch(pose_uri, "models.yolo.pose")
    assert got.read_bytes() == (store_dir / "yolo-pose.safetensors").read_bytes()
    stamp = got.stat().st_mtime_ns
    # another actor on the same node (same cache folder) reuses the copy
    again = models.ModelStore(cache_dir=str(tmp_path / "cache")).fetch(pose_uri, "models.yolo.pose")
    assert again == got and again.stat().st_mtime_ns == stamp
    model = models.load_yolo(again)  # and it loads through the real loader
    assert tuple(model.kpt_shape) == (17, 3)
    # a folder (open_clip hub layout) comes over whole
    folder = first.fetch(f"{base}/clip?{query}", "models.clip.checkpoint")
    assert sorted(p.name for p in folder.iterdir()) == ["open_clip_config.json", "open_clip_model.safetensors"]
    # a bare name under an s3 root
    rooted = models.ModelStore(cache_dir=str(tmp_path / "cache"), roots=(prefix,))
    assert (
        rooted.fetch("aesthetic-mlp.pth", "models.clip.aesthetic_head").read_bytes()
        == (store_dir / "aesthetic-mlp.pth").read_bytes()
    )
    # the object changes under the same name: the node's copy is refreshed
    client.put_object(Bucket="models", Key="humans/yolo-pose.safetensors", Body=b"new weights")
    assert first.fetch(pose_uri, "models.yolo.pose").read_bytes() == b"new weights"
    with pytest.raises(models.ModelNotFoundError, match="no such object"):
        first.fetch(f"{base}/absent.pt?{query}", "models.yolo.detector")


def test_store_copies_file_uris_into_the_cache(store_dir, tmp_path):
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"))
    got = store.fetch((store_dir / "aesthetic-mlp.pth").as_uri(), "models.clip.aesthetic_head")
    assert (
        got.parent.parent == tmp_path / "cache" and got.read_bytes() == (store_dir / "aesthetic-mlp.pth").read_bytes()
    )


def test_ultralytics_pt_loads_without_unpickling_code(tmp_path):
    import torch

    models.import_ultralytics()
    from ultralytics import YOLO

    saved = YOLO("yolo11n-pose.yaml")
    saved.save(tmp_path / "pose.pt")  # ultralytics' own checkpoint format: whole modules, pickled
    loaded = models.load_yolo(tmp_path / "pose.pt")
    for a, b in zip(loaded.state_dict().values(), saved.model.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)  # .pt files store fp16

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"model": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"refusing to load.*getcwd"):
        models.load_yolo(tmp_path / "evil.pt")


def test_importing_ultralytics_through_the_store_keeps_pil_open():
    opener = Image.open
    models.import_ultralytics()
    assert Image.open is opener


# --- YOLO stage -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def yolo_stage(store_dir):
    # Accept every box and keypoint, so all code paths run on every photo (random weights find none on some).
    cfg = _full_cfg(
        store_dir,
        "models.yolo.min_candidate_score=0.00001",
        "models.yolo.keypoint_min_conf=0",
        "filters.person_min_score=0",
        "filters.person_min_height_frac=0",
        "filters.person_min_area_frac=0",
    )
    stage = YoloPersonStage(cfg)
    stage.setup()
    return stage


def test_yolo_stage_writes_lite_shaped_person_columns_for_a_batch(yolo_stage, photos):
    rows = _rows(photos, ["bus", "zidane", "grace_hopper", "astronaut", "china"])
    calls = []
    hook = yolo_stage.pose.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
    try:
        updates = yolo_stage.process_batch(rows)
    finally:
        hook.remove()
    assert calls == [len(rows)]  # one forward pass for the whole batch
    assert len(updates) == len(rows)
    _check_types(updates, yolo_stage.cfg)
    person_fields = {f.name for f in schema.PERSON_TYPE}
    for row, u in zip(rows, updates):
        assert REJECT not in u  # every rule threshold is 0
        persons = u["persons"]
        assert u["person_count"] == len(persons) >= 1 and u["prominent_count"] == sum(p["prominent"] for p in persons)
        assert persons[0]["score"] == pytest.approx(u["main_person_score"])
        assert u["head_yaw_class"] == persons[0]["head_yaw_class"]
        for p in persons:
            assert set(p) == person_fields and p["detector"] == "yolo"
            assert p["keypoints"] is None or len(p["keypoints"]) == 17 * 3  # null where the pose model missed them
            assert 0 <= p["x0"] < p["x1"] <= row["width"] and 0 <= p["y0"] < p["y1"] <= row["height"]
            assert p["head_yaw_class"] in schema.HEAD_YAW_CLASSES and 0 <= p["head_confidence"] <= 1
            if p["head_yaw_class"] != "not_visible":
                assert -90 <= p["head_yaw"] <= 90 and -60 <= p["head_pitch"] <= 60 and -180 <= p["head_roll"] <= 180
                assert yaw_class(p["head_yaw"], 45) == p["head_yaw_class"]
        for face in u["faces"]:
            assert face["view"] in ("frontal", "left_profile", "right_profile")


def test_yolo_stage_rejects_with_the_lite_reason_codes(store_dir, photos):
    strict = _full_cfg(store_dir, "models.yolo.min_candidate_score=0.00001", "filters.person_min_score=0.99")
    stage = YoloPersonStage(strict)
    stage.setup()
    updates = stage.process_batch(_rows(photos, ["bus", "page"]))
    for u in updates:
        assert reason_code(u[REJECT]) == "no_prominent_person" and "score" in u[REJECT]
        assert u["person_count"] >= 1 and u["prominent_count"] == 0
    none_found = YoloPersonStage(_full_cfg(store_dir, "models.yolo.min_candidate_score=0.99"))
    none_found.setup()
    u = none_found.process_batch(_rows(photos, ["coffee"]))[0]
    assert reason_code(u[REJECT]) == "no_person" and u["persons"] == [] and u["person_count"] == 0


def test_max_nms_bounds_the_candidates_that_enter_nms(store_dir, photos):
    """A threshold of 1e-5 lets all of an image's anchors through; ``max_nms`` lets only the highest-scoring few into
    NMS, whose time grows with their square (all 8400 per image outlasted ultralytics' NMS time limit on a GPU)."""
    opened = ("models.yolo.min_candidate_score=0.00001", "models.yolo.max_det=100")
    rows = _rows(photos, ["zidane", "bus"])
    found = {}
    for cap in (30000, 2):
        stage = YoloPersonStage(
            _full_cfg(store_dir, *opened, "models.yolo.detector=null", f"models.yolo.max_nms={cap}")
        )
        stage.setup()
        images = [decode(r["image"]["bytes"], max_side=stage.cfg.models.yolo.imgsz) for r in rows]
        found[cap] = [len(boxes) for boxes, _, _ in stage.infer(images)]
    assert all(n > 2 for n in found[30000]), found  # the uncapped NMS keeps more than two boxes an image ...
    assert all(1 <= n <= 2 for n in found[2]), found  # ... of which a cap of 2 lets two in at most


def test_yolo_pose_model_alone_gives_the_persons(store_dir, photos):
    cfg = _full_cfg(
        store_dir,
        "models.yolo.detector=null",
        "models.yolo.min_candidate_score=0.00001",
        "filters.person_min_score=0",
        "filters.person_min_height_frac=0",
        "filters.person_min_area_frac=0",
    )
    stage = YoloPersonStage(cfg)
    stage.setup()
    assert stage.det is None
    rows = _rows(photos, ["zidane", "astronaut"])
    updates = stage.process_batch(rows)
    _check_types(updates, cfg)
    assert all(u["person_count"] >= 1 for u in updates)
    # Every person carries the pose model's 17 COCO keypoints, in the pixels of the full image like its box. The
    # model runs on the same batch as the stage's: a batch of another size may differ in the last float bits, which
    # can flip a near tie in NMS.
    images = [decode(row["image"]["bytes"], max_side=cfg.models.yolo.imgsz) for row in rows]
    for row, u, image, (_, _, kpts) in zip(rows, updates, images, stage.infer(images)):
        kpts = kpts * np.array([row["width"] / image.shape[1], row["height"] / image.shape[0], 1.0])
        stored = np.array([p["keypoints"] for p in u["persons"]]).reshape(-1, 17, 3)
        assert stored.shape[0] == len(u["persons"]) and (0 <= stored[..., 2]).all() and (stored[..., 2] <= 1).all()
        expected = {tuple(np.round(k.reshape(-1), 1)) for k in kpts}
        assert {tuple(np.round(k.reshape(-1), 1)) for k in stored} <= expected


# --- CLIP stage -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def clip_scores(store_dir, photos):
    """Scores of the tiny CLIP with every filter open, and the rows they came from."""
    cfg = _full_cfg(
        store_dir,
        "filters.min_aesthetic=null",
        "filters.min_realism=null",
        "filters.prompt_filters.not_a_person.max_reject=1",
        "filters.prompt_filters.collage.max_reject=1",
    )
    stage = ClipStage(cfg)
    stage.setup()
    rows = _rows(photos, ["bus", "zidane", "grace_hopper", "astronaut", "china", "coffee"])
    calls = []
    hook = stage.clip.model.visual.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
    try:
        updates = stage.process_batch(rows)
    finally:
        hook.remove()
    return stage, rows, updates, calls


def test_clip_stage_embeds_once_per_batch_and_scores_each_image(clip_scores):
    stage, rows, updates, calls = clip_scores
    assert calls == [len(rows)]  # one image-tower pass for the batch; aesthetic, realism, filters reuse it
    _check_types(updates, stage.cfg)
    emb = np.array([u["embedding"] for u in updates])
    assert emb.shape == (len(rows), CLIP_DIM)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert len({round(float(e), 6) for e in emb[:, 0]}) == len(rows)  # different photos, different embeddings
    for u in updates:
        assert REJECT not in u and 0.0 <= u["realism"] <= 1.0 and math.isfinite(u["aesthetic"])
        assert 0.0 <= u["clip_nsfw_score"] < 0.5  # the random store's head sits far below full.yaml's threshold


def test_aesthetic_head_scores_the_normalised_embedding(store_dir, clip_scores, tmp_path):
    import torch

    _, rows, _updates, _ = clip_scores
    w = torch.linspace(-1, 1, CLIP_DIM)[None]
    torch.save({"weight": w, "bias": torch.tensor([5.0])}, tmp_path / "linear.pth")  # LAION's first, linear head
    stage = ClipStage(
        _full_cfg(
            store_dir,
            f"models.clip.aesthetic_head={tmp_path / 'linear.pth'}",
            "filters.min_aesthetic=null",
            "filters.min_realism=null",
            "filters.prompt_filters={}",
        )
    )
    stage.setup()
    for u in stage.process_batch(rows):
        assert u["aesthetic"] == pytest.approx(float(np.dot(u["embedding"], w[0].numpy())) + 5.0, abs=1e-4)


def _nsfw_stage(store_dir: Path, head: Path, *overrides: str) -> ClipStage:
    """The CLIP stage with LAION's NSFW head from ``head`` (a bare name under a store root) and the other filters
    open."""
    stage = ClipStage(
        _full_cfg(
            store_dir,
            f"models.store.roots=[{head.parent}]",
            f"models.clip.nsfw_head={head.name}",
            "filters.min_aesthetic=null",
            "filters.min_realism=null",
            "filters.prompt_filters={}",
            *overrides,
        )
    )
    stage.setup()
    return stage


@pytest.fixture()
def nsfw_head_file(tmp_path) -> Path:
    """A random head in LAION's layout, saved as safetensors with NeMo Curator's keys; its scores are not saturated."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    path = tmp_path / "heads" / "clip_nsfw.safetensors"
    path.parent.mkdir()
    save_file(random_nsfw_head(CLIP_DIM), str(path))
    return path


def test_nsfw_head_loads_nemo_keys_and_computes_laions_layers(store_dir, clip_scores, nsfw_head_file):
    from safetensors.numpy import load_file

    _, rows, _, _ = clip_scores
    stage = _nsfw_stage(store_dir, nsfw_head_file, "filters.clip_nsfw_max_score=null")
    assert set(stage.nsfw_head.state_dict()) == set(models.NSFW_HEAD_KEYS)
    w = {k: v.astype(np.float64) for k, v in load_file(str(nsfw_head_file)).items()}
    updates = decided(stage, rows)
    x = np.array([u["embedding"] for u in updates], np.float64)
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)  # the head sees the L2-normalised embedding
    x = (x - w["norm.mean"]) / np.sqrt(w["norm.variance"])
    for i in (1, 2, 3):
        x = np.maximum(x @ w[f"linear_{i}.weight"].T + w[f"linear_{i}.bias"], 0)
    want = 1 / (1 + np.exp(-(x @ w["linear_4.weight"].T + w["linear_4.bias"])[:, 0]))
    got = np.array([u["clip_nsfw_score"] for u in updates])
    assert got == pytest.approx(want, abs=1e-5)
    assert 0.01 < got.min() and got.max() < 0.99 and np.ptp(got) > 1e-3  # not saturated, and per image
    _check_types(updates, stage.cfg)
    assert all(REJECT not in u for u in updates)  # scored, no threshold


def test_nsfw_threshold_rejects_above_with_the_open_nsfw_reason_form(store_dir, clip_scores, nsfw_head_file):
    _, rows, _, _ = clip_scores
    open_stage = _nsfw_stage(store_dir, nsfw_head_file, "filters.clip_nsfw_max_score=null")
    scores = [u["clip_nsfw_score"] for u in decided(open_stage, rows)]
    cut = float(np.median(scores))
    updates = decided(_nsfw_stage(store_dir, nsfw_head_file, f"filters.clip_nsfw_max_score={cut}"), rows)
    for score, u in zip(scores, updates, strict=True):
        assert u["clip_nsfw_score"] == pytest.approx(score, abs=1e-6)
        if score > cut:
            assert reason_code(u[REJECT]) == "nsfw"
            assert u[REJECT] == f"nsfw: {nsfw_detail(u['clip_nsfw_score'], cut, NSFW_MODEL_NAME)}"
            assert u[REJECT].startswith("nsfw: score ") and u[REJECT].endswith(" (laion_clip_nsfw)")
        else:
            assert REJECT not in u
    assert 0 < sum(REJECT in u for u in updates) < len(rows)


def test_nsfw_threshold_without_the_head_is_a_setup_error_naming_both(store_dir):
    cfg = _full_cfg(store_dir, "models.clip.nsfw_head=null")
    assert cfg.filters.clip_nsfw_max_score == 0.5  # full.yaml's
    with pytest.raises(ValueError, match=r"filters\.clip_nsfw_max_score is set but models\.clip\.nsfw_head is null"):
        ClipStage(cfg).setup()


def test_nsfw_head_of_another_layout_or_size_fails_at_start(store_dir, tmp_path):
    from safetensors.torch import save_file

    save_file(random_nsfw_head(768), str(tmp_path / "l14.safetensors"))
    with pytest.raises(ValueError, match=r"models\.clip\.nsfw_head .* takes 768-dimensional embeddings .* gives 32"):
        ClipStage(_full_cfg(store_dir, f"models.clip.nsfw_head={tmp_path / 'l14.safetensors'}")).setup()
    aesthetic = store_dir / "aesthetic-mlp.pth"
    with pytest.raises(
        ValueError, match=r"models\.clip\.nsfw_head .*: unknown NSFW head layout .*\(norm\.mean, norm\.var"
    ):
        ClipStage(_full_cfg(store_dir, f"models.clip.nsfw_head={aesthetic}")).setup()


def test_the_card_lists_the_clip_nsfw_head_with_its_threshold_and_rejections(store_dir):
    from curation.phases.write.card import safety_markdown
    from curation.phases.write.shards import _safety

    safety = _safety(_full_cfg(store_dir))
    assert [(e["stage"], e["setting"], e["max_score"]) for e in safety] == [
        ("nsfw", "filters.nsfw_max_score", 0.8),
        ("clip", "filters.clip_nsfw_max_score", 0.5),
    ]
    assert safety[1]["licence"] == "MIT" and safety[1]["weights"].endswith("nsfw-head.safetensors")
    funnel = {
        "score/nsfw/rejected/nsfw": 1,
        "score/clip/rejected/nsfw": 2,
        "score/clip/rejected/low_aesthetic": 3,
        "write/write/kept/kept": 4,
    }
    text = safety_markdown({"curation": {"safety": safety}, "funnel": funnel})
    assert "with LAION's CLIP-based NSFW Detector for ViT-L/14 (licence MIT;" in text
    assert "above 0.5 (`filters.clip_nsfw_max_score`, on this model's scale): 2 of 10 inputs (20.0%)" in text
    assert "above 0.8 (`filters.nsfw_max_score`, on this model's scale): 1 of 10 inputs (10.0%)" in text
    assert text.count("it does not rule it out") == 1
    unset = _safety(_full_cfg(store_dir, "filters.clip_nsfw_max_score=null"))[1]
    assert "without a threshold" in safety_markdown({"curation": {"safety": [unset]}, "funnel": funnel})
    assert [e["stage"] for e in _safety(_full_cfg(store_dir, "models.clip.nsfw_head=null"))] == ["nsfw"]


def test_aesthetic_realism_and_prompt_thresholds_reject_with_reason_codes(store_dir, clip_scores):
    _, rows, open_updates, _ = clip_scores
    aesthetic = np.array([u["aesthetic"] for u in open_updates])
    cut = float(np.median(aesthetic))
    stage = ClipStage(
        _full_cfg(store_dir, f"filters.min_aesthetic={cut}", "filters.min_realism=null", "filters.prompt_filters={}")
    )
    stage.setup()
    updates = decided(stage, rows)
    for score, u in zip(aesthetic, updates):
        assert (REJECT in u) == (score < cut)
        if score < cut:
            assert reason_code(u[REJECT]) == "low_aesthetic" and u["aesthetic"] == pytest.approx(score, abs=1e-4)
    assert 0 < sum(REJECT in u for u in updates) < len(rows)

    realism = np.array([u["realism"] for u in open_updates])
    cut = float(np.median(realism))
    stage = ClipStage(
        _full_cfg(store_dir, "filters.min_aesthetic=null", f"filters.min_realism={cut}", "filters.prompt_filters={}")
    )
    stage.setup()
    for score, u in zip(realism, decided(stage, rows)):
        assert (REJECT in u) == (score < cut)
        if REJECT in u:
            assert reason_code(u[REJECT]) == "low_realism" and "closest prompt" in u[REJECT]

    # a prompt filter: find each image's reject probability with the filter open, then cut at the median
    probe = ClipStage(_full_cfg(store_dir, "filters.min_aesthetic=null", "filters.min_realism=null"))
    probe.setup()
    import torch

    with torch.inference_mode():
        emb = torch.tensor([u["embedding"] for u in open_updates])
        p_reject, _ = probe._set_probability(emb, "figure", "person")
    cut = float(np.median(p_reject))
    for p, u in zip(p_reject, decided(_not_a_person_at(store_dir, cut), rows)):
        assert (REJECT in u) == (p > cut)
        if REJECT in u:
            assert reason_code(u[REJECT]) == "prompt_not_a_person"


def _not_a_person_at(store_dir, max_reject: float) -> ClipStage:
    """The CLIP stage, set up, whose one rejecting rule is the ``not_a_person`` prompt filter at ``max_reject``."""
    stage = ClipStage(
        _full_cfg(
            store_dir,
            "filters.min_aesthetic=null",
            "filters.min_realism=null",
            "filters.prompt_filters.collage.max_reject=1",
            f"filters.prompt_filters.not_a_person.max_reject={max_reject}",
        )
    )
    stage.setup()
    return stage


def test_a_prompt_filters_threshold_is_decided_again_from_the_stored_scores(store_dir, clip_scores):
    """What the stage stores at one ``max_reject`` decides another exactly as the stage run at it does."""
    _, rows, _, _ = clip_scores

    loose = decided(_not_a_person_at(store_dir, 1.0), rows)
    assert not any(REJECT in u for u in loose)
    stored = (
        pa.Table.from_pylist(loose)
        .select(list(ClipStage.writes))
        .cast(pa.schema([schema.working_schema(CLIP_DIM).field(c) for c in ClipStage.writes]))
        .to_pylist()
    )
    p_reject = [next(s["p_reject"] for s in r["prompt_scores"] if s["name"] == "not_a_person") for r in stored]
    strict = _not_a_person_at(store_dir, float(np.median(p_reject)))
    again = [ClipStage.decide({**row, **values}, strict.cfg.filters) for row, values in zip(rows, stored)]
    assert again == [u.get(REJECT) for u in decided(strict, rows)]
    assert any(again) and not all(again)


def test_realism_is_one_half_when_both_prompt_sets_are_the_same(store_dir, clip_scores):
    _, rows, _, _ = clip_scores
    stage = ClipStage(
        _full_cfg(
            store_dir,
            "models.clip.realism.not_photo=photo",
            "filters.min_realism=null",
            "filters.min_aesthetic=null",
            "filters.prompt_filters={}",
        )
    )
    stage.setup()
    assert [u["realism"] for u in decided(stage, rows)] == pytest.approx([0.5] * len(rows))


def test_single_file_checkpoint_with_an_open_clip_arch(store_dir, photos, tmp_path):
    import open_clip

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "humans1b-tiny.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(tmp_path / "configs")
    cfg = _full_cfg(
        store_dir,
        "models.clip.arch=humans1b-tiny",
        f"models.clip.checkpoint={store_dir / 'clip' / 'open_clip_model.safetensors'}",
        "filters.min_aesthetic=null",
        "filters.min_realism=null",
        "filters.prompt_filters={}",
    )
    stage = ClipStage(cfg)
    stage.setup()
    assert len(decided(stage, _rows(photos, ["bus"]))[0]["embedding"]) == CLIP_DIM


def test_mis_sized_embedding_fails_at_actor_start(store_dir):
    cfg = _full_cfg(store_dir, "models.embedding.dim=768")
    with pytest.raises(ValueError, match=r"models\.embedding\.dim is 768 .* gives 32-dimensional"):
        stage_runner("clip", cfg)  # what each Ray actor constructs before its first batch


def test_aesthetic_head_of_another_embedding_size_fails_at_start(store_dir, tmp_path):
    import torch

    torch.save({"weight": torch.zeros(1, 768), "bias": torch.zeros(1)}, tmp_path / "l14.pth")
    with pytest.raises(ValueError, match="takes 768-dimensional embeddings but the CLIP model gives 32"):
        ClipStage(_full_cfg(store_dir, f"models.clip.aesthetic_head={tmp_path / 'l14.pth'}")).setup()


def test_missing_prompt_set_fails_when_the_config_loads(store_dir, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"filters\.prompt_filters\.watermark\.reject names prompt set 'watermarked'"):
        _full_cfg(store_dir, "filters.prompt_filters.watermark={keep: photo, reject: watermarked}")
    from jobs import curate

    args = [
        "--config",
        str(FULL),
        "--input",
        str(tmp_path),
        "--output",
        str(tmp_path / "out"),
        "models.clip.realism.photo=photos",
    ]
    assert curate.main(args) == 2  # before Ray starts or any input is read
    assert "models.clip.realism.photo names prompt set 'photos'" in capsys.readouterr().err


# --- the curate job end to end ----------------------------------------------------------------------------------------

E2E_ITEMS = (
    "people/zidane.jpg",
    "people/zidane_copy.jpg",
    "people/zidane_q40.jpg",
    "people/astronaut.jpg",
    "people/astronaut_resize.jpg",
    "people/bus.jpg",
    "people/grace_hopper.jpg",
    "no_person/china.jpg",
    "text/zidane_caption.jpg",
    "tiny/zidane_thumb.jpg",
    "bad/truncated.jpg",
    "odd/bus_exif6.jpg",
)


@pytest.mark.slow
def test_full_profile_curate_job_end_to_end(store_dir, ray_local, tmp_path):
    from generators.sample_pool import build_pool, write_pool
    from jobs import curate

    pool = tmp_path / "pool"
    items = [it for it in build_pool() if it.name in E2E_ITEMS]
    assert len(items) == len(E2E_ITEMS)
    write_pool(items, pool)
    out = tmp_path / "out"
    overrides = [
        # YOLO weights as bare names under a file:// root: copied into the node cache by the actor
        f"models.store.roots=[{store_dir.as_uri()}]",
        f"models.store.cache_dir={tmp_path / 'cache'}",
        "models.yolo.detector=yolo-det.safetensors",
        "models.yolo.pose=yolo-pose.safetensors",
        "models.yolo.imgsz=320",
        "models.yolo.min_candidate_score=0.00001",
        f"models.clip.checkpoint={store_dir / 'clip'}",
        f"models.clip.aesthetic_head={store_dir / 'aesthetic-mlp.pth'}",
        "models.clip.nsfw_head=nsfw-head.safetensors",
        f"models.embedding.dim={CLIP_DIM}",
        "models.embedding.name=test-tiny-clip",
        # random weights: open every model threshold; decode and the OCR stage still decide for real
        "filters.person_min_score=0",
        "filters.person_min_height_frac=0",
        "filters.person_min_area_frac=0",
        "filters.min_aesthetic=null",
        "filters.min_realism=null",
        "filters.prompt_filters.not_a_person.max_reject=1",
        "filters.prompt_filters.collage.max_reject=1",
        # a 2-CPU machine without GPUs
        "stages.decode={batch_size: 4, num_cpus: 0.25}",
        "stages.yolo_person={batch_size: 4, num_cpus: 0.5, num_gpus: 0, actors: [1, 1]}",
        "stages.clip={batch_size: 4, num_cpus: 0.25, num_gpus: 0, actors: [1, 1]}",
        "stages.text_overlay={batch_size: 4, num_cpus: 0.5, actors: [1, 1]}",
        "stages.phash={batch_size: 8, num_cpus: 0.25}",
        "input.files_per_shard=4",
    ]
    assert curate.main(["--config", str(FULL), "--input", str(pool), "--output", str(out), *overrides]) == 0
    cfg = _full_cfg(store_dir, *overrides)

    ledger = {Path(r["source"]).relative_to(pool).as_posix(): r for r in read_ledger(str(out)).to_pylist()}
    assert set(ledger) == set(E2E_ITEMS)
    assert ledger["tiny/zidane_thumb.jpg"]["reason"].startswith("too_small")
    assert ledger["bad/truncated.jpg"]["stage"] == "decode"
    assert ledger["text/zidane_caption.jpg"]["stage"] == "text_overlay"  # the real OCR detector still rejects
    scored_through = [r for r in ledger.values() if r["stage"] not in ("decode",)]
    for r in scored_through:  # past decode, the YOLO stage scored every image the way lite does
        assert r["person_count"] >= 1 and r["persons"][0]["detector"] == "yolo"
        assert r["head_yaw_class"] in schema.HEAD_YAW_CLASSES
    assert (
        ledger["people/zidane_copy.jpg"]["status"] == schema.DUPLICATE
        or ledger["people/zidane.jpg"]["status"] == schema.DUPLICATE
    )

    files = committed_files(str(out), "scored")
    assert files
    lite_shared = schema.scored_schema(CurateConfig().embedding_dim)
    for f in files:
        table = pq.read_table(out / f)
        assert table.schema.equals(schema.scored_schema(CLIP_DIM))
        assert schema.read_metadata(table.schema)["extra"] == {
            "embedding_model": "test-tiny-clip",
            "embedding_dim": CLIP_DIM,
        }
        for field in lite_shared:  # identical to lite for every shared column
            if field.name != "embedding":
                assert table.schema.field(field.name).equals(field)
        for row in table.to_pylist():
            assert len(row["embedding"]) == CLIP_DIM and row["aesthetic"] is not None and row["realism"] is not None
            assert row["clip_nsfw_score"] is not None
    assert cfg.embedding_dim == CLIP_DIM
    final = list((out / "shards").glob("*.parquet"))
    kept = [r for r in ledger.values() if r["status"] == schema.KEPT]
    assert final and sum(pq.read_metadata(p).num_rows for p in final) == len(kept) > 0
    assert all(r["cluster_ids"] for r in kept)

    # A mis-sized embedding stops the job when the CLIP actors start, before any input shard is committed.
    wrong = tmp_path / "wrong_dim"
    args = ["--config", str(FULL), "--input", str(pool), "--output", str(wrong), *overrides, "models.embedding.dim=64"]
    with pytest.raises(Exception, match=r"models\.embedding\.dim is 64 .* gives 32-dimensional"):
        curate.main(args)
    assert not committed_files(str(wrong), "scored") and not committed_files(str(wrong), "ledger")


def test_the_full_profile_links_copies_by_the_same_rule_and_chance_estimate(clip_scores, photos):
    """full.yaml's link rule on the random-init CLIP's embeddings of six photos and three copies of each: every copy
    is linked to its photo, no two photos to each other, and the chance estimate sizes the rule from them."""
    from curation.phases.dedup import chance
    from curation.phases.dedup.link_rule import crop_distances, pair_distances, pdq_words
    from curation.stages.phash import PhashStage, hashes_of

    stage, rows, updates, _ = clip_scores
    copies, of = [], []
    for k, row in enumerate(rows):
        img = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
        for q, scale in ((40, 1.0), (85, 0.6), (70, 0.8)):  # a re-encode and two resizes
            buf = io.BytesIO()
            img.resize((round(img.width * scale), round(img.height * scale))).save(buf, "JPEG", quality=q)
            copies.append({"image": {"bytes": buf.getvalue(), "path": "copy.jpg"}, "width": 1, "height": 1})
            of.append(k)
    x = np.array([u["embedding"] for u in updates + decided(stage, copies)], np.float32)
    signals = [hashes_of(r["image"]["bytes"], stage.cfg.models.phash.draft_side) for r in rows + copies]
    hashes = np.array([s["phash"] for s in signals], np.uint64)
    pdq, crops = (pdq_words(pa.array([s[c.name] for s in signals], c.type))[0] for c in PhashStage.columns[1:])
    i, j = np.triu_indices(len(x), 1)
    group = np.array(list(range(len(rows))) + of)
    rule = stage.cfg.dedup.rule()
    assert rule.needs_crops
    crop = crop_distances(pdq[i], crops[i], pdq[j], crops[j])
    linked = rule.links(pair_distances(hashes[i], hashes[j]), np.einsum("ij,ij->i", x[i], x[j]), crop)
    assert linked[group[i] == group[j]].all() and not linked[group[i] != group[j]].any()
    sample = chance.PdqSample(pdq, np.ones(len(x), bool), crops.shape[1])
    measured = chance.measure(len(x), hashes, np.ones(len(x), bool), x, group, 1.0, 10**5, seed=0, pdq=sample)
    estimate = chance.decide(measured, rule, stage.cfg.dedup.max_chance_fraction)
    assert estimate.expected <= estimate.bound and len(estimate.summary()["regions"]) == len(rule.regions)
