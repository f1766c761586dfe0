"""Fine-tuning: the synthetic renderer's labels, the label codec, heads, losses, metrics, the optimiser, training.

Metrics are checked against cases worked out by hand; the end-to-end run trains a segmentation head with Ray Train
(2 CPU workers, FSDP2) on shards written by ``jobs.make_synthetic``.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tensorboard_scalars
from PIL import Image
from safetensors.torch import load_file, save_file

from common.config import load_config
from finetune import augment, data, heads, losses, metrics, tasks
from finetune.config import FinetuneConfig
from finetune.labels import COCO_KEYPOINTS, GROUPS, KEYPOINT_NAMES, KEYPOINTS, MAX_KEYPOINTS, PARTS, keypoints
from finetune.train import build_model, build_optimizer, layer_id, load_finetuned, resolve_class_weights, set_schedule
from generators.humanoids import RenderConfig, render
from jobs import finetune as job
from jobs import make_synthetic
from pretrain.backbone import build
from pretrain.data import DataIndex
from pretrain.export import load_backbone
from training import checkpoint as ckpt
from training.schedules import lr_at
from training.sharding import optimizer_step

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/finetune/tiny.yaml")
CFG = RenderConfig(height=128, width=96)


@pytest.fixture(scope="module")
def renders():
    return [render(CFG, np.random.default_rng([7, i])) for i in range(6)]


# --- renderer -------------------------------------------------------------------------------------------------------


def test_normals_are_unit_and_face_the_camera(renders):
    for r in renders:
        n, m = r.normals[r.mask], r.mask
        assert m.sum() > 200
        np.testing.assert_allclose(np.linalg.norm(n, axis=-1), 1.0, atol=1e-5)
        # the ray to a pixel is its 3D point; a visible surface is entered from the camera's side
        assert ((n * r.points[m]).sum(-1) < 1e-6).all()
        assert not r.normals[~m].any()


def test_pointmap_depth_is_positive_and_projects_onto_its_own_pixel(renders):
    for r in renders:
        c, m = r.camera, r.mask
        p = r.points[m].astype(np.float64)
        assert (p[:, 2] > 0).all()
        rows, cols = np.nonzero(m)
        np.testing.assert_allclose(c["fx"] * p[:, 0] / p[:, 2] + c["cx"], cols, atol=1e-3)
        np.testing.assert_allclose(c["fy"] * p[:, 1] / p[:, 2] + c["cy"], rows, atol=1e-3)
        assert not r.points[~m].any() and not r.albedo[~m].any()


def test_part_labels_cover_the_figure(renders):
    seen = set()
    for r in renders:
        labels = np.unique(r.parts)
        assert labels[0] == 0 and labels.max() < len(PARTS)
        assert len(labels) >= 8  # background and most body parts in every render
        seen |= set(labels.tolist())
        # every foreground pixel has a surface (point, normal, albedo) and vice versa
        assert (np.linalg.norm(r.normals, axis=-1) > 0.5).tolist() == r.mask.tolist()
        assert 0 <= r.albedo.min() and r.albedo.max() <= 1


def test_every_part_class_and_keypoint_group_appears_in_renders():
    """Sapiens2's 29 classes (eyeglasses, teeth and socks included) and its three keypoint groups, 25 / 40 / 243."""
    assert len(PARTS) == 29 and PARTS[0] == "background" and PARTS[-1] == "eyeglasses"
    assert [sum(k.group == g for k in KEYPOINTS) for g in GROUPS] == [25, 40, 243]
    pixels, visible = np.zeros(len(PARTS), np.int64), dict.fromkeys(GROUPS, 0)
    for seed in range(40):
        r = render(CFG, np.random.default_rng([11, seed]))
        pixels += np.bincount(r.parts.ravel(), minlength=len(PARTS))
        for k, v in zip(KEYPOINTS, r.visibility):
            visible[k.group] += int(v == 2)
    assert (pixels > 0).all(), [PARTS[i] for i in np.flatnonzero(pixels == 0)]
    assert pixels[PARTS.index("upper_clothing")] > 50 * pixels[PARTS.index("tongue")]  # why seg weighs its classes
    assert all(n > 100 for n in visible.values()), visible


def test_keypoints_project_inside_the_image_when_labelled(renders):
    for r in renders:
        c = r.camera
        k3 = r.keypoints_3d.astype(np.float64)
        np.testing.assert_allclose(r.keypoints[:, 0], c["fx"] * k3[:, 0] / k3[:, 2] + c["cx"], atol=1e-3)
        x, y = r.keypoints[:, 0], r.keypoints[:, 1]
        inside = (x >= -0.5) & (x < CFG.width - 0.5) & (y >= -0.5) & (y < CFG.height - 0.5)
        assert ((r.visibility > 0) == inside).all()
        assert (r.visibility == 2).sum() > 30 and (r.visibility == 1).sum() > 30  # self-occlusion happens
        # A visible surface landmark is where the pointmap puts the surface (at its pixel or a neighbour: the
        # pixel centre may fall just off a silhouette); an occluded one lies behind what its pixel shows.
        surface = np.array([k.anchor[0] == "surface" for k in KEYPOINTS])
        padded = np.pad(r.points[..., 2], 1)
        for v in (2, 1):
            sel = (r.visibility == v) & surface
            px = np.round(r.keypoints[sel]).astype(int) + 1
            around = np.stack([padded[px[:, 1] + dy, px[:, 0] + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)], 1)
            if v == 2:
                assert (np.abs(around - k3[sel, 2:3]) < 0.03 * k3[sel, 2:3]).any(1).mean() > 0.97
            else:
                assert (around[:, 4] < k3[sel, 2]).mean() > 0.85


def test_renders_are_deterministic_and_keypoint_sets_nest():
    a, b = render(CFG, 3), render(CFG, 3)
    assert (a.image == b.image).all() and (a.keypoints == b.keypoints).all()
    assert not (render(CFG, 4).image == a.image).all()
    assert keypoints(40) == keypoints(MAX_KEYPOINTS)[:40]
    assert KEYPOINT_NAMES[:3] == ("nose", "left_eye", "right_eye") and KEYPOINT_NAMES[25] == "left_thumb_third_joint"
    assert len(render(RenderConfig(height=64, width=48, num_keypoints=17), 0).keypoints) == 17
    with pytest.raises(ValueError, match="num_keypoints"):
        RenderConfig(num_keypoints=309)


def test_max_yaw_keeps_the_face_towards_the_camera():
    nose = COCO_KEYPOINTS.index("nose")
    frontal = [
        render(RenderConfig(height=64, width=48, num_keypoints=17, yaw=0.0), s).visibility[nose] for s in range(16)
    ]
    anyway = [render(RenderConfig(height=64, width=48, num_keypoints=17), s).visibility[nose] for s in range(16)]
    assert sum(v == 2 for v in frontal) >= 14  # only an arm raised in front of the face hides it
    assert sum(v < 2 for v in anyway) >= 5  # back views hide the nose


def test_every_option_of_make_synthetic_says_what_it_does():
    options = [a for a in make_synthetic.build_parser()._actions if a.option_strings and a.dest != "help"]
    assert options and [a.dest for a in options if not a.help] == []


def test_unlabelled_pool_is_jpeg_webdataset_shards_of_renders_no_labelled_split_holds(tmp_path):
    args = ["--n", "6", "--unlabelled", "--height", "64", "--width", "48", "--rows-per-shard", "4", "--max-yaw", "1.2"]
    assert make_synthetic.main(["--out", str(tmp_path / "a"), *args]) == 0
    assert make_synthetic.main(["--out", str(tmp_path / "b"), *args]) == 0
    shards = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert shards == ["pool-00000.tar", "pool-00001.tar"]
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with tarfile.open(tmp_path / "a" / "pool-00001.tar") as tar:
        members = tar.getnames()
        data_bytes = tar.extractfile(members[1]).read()
    assert members == ["render-0-00000004.jpg", "render-0-00000005.jpg"]
    cfg = RenderConfig(height=64, width=48, num_keypoints=17, yaw=1.2)
    expected = render(cfg, np.random.default_rng([0, make_synthetic.SPLITS["pool"], 5])).image.astype(float)
    got = np.asarray(Image.open(io.BytesIO(data_bytes)).convert("RGB"), float)
    loss = np.abs(got - expected).mean()  # the render, up to JPEG loss on a noisy 64x48 picture
    train_figure = render(cfg, np.random.default_rng([0, make_synthetic.SPLITS["train"], 5])).image.astype(float)
    assert loss < 10 and np.abs(got - train_figure).mean() > 3 * loss


def test_a_junk_pool_holds_each_kind_of_web_junk_beside_the_clean_renders_of_the_pool_without(tmp_path):
    cfg = RenderConfig(height=64, width=48, num_keypoints=17)
    kinds: dict[str | None, list[int]] = {}
    for i in range(40):
        image, quality, kind = make_synthetic.pool_image(cfg, 0, i, junk=0.5)
        kinds.setdefault(kind, []).append(i)
        clean, _, none = make_synthetic.pool_image(cfg, 0, i, junk=0.0)
        assert none is None and image.dtype == np.uint8
        if kind is None:  # the junk draw has its own stream: the clean samples are the clean pool's
            assert np.array_equal(image, clean) and quality == make_synthetic.POOL_JPEG_QUALITY
        elif kind == "tiny":  # under curation's 384-px rule at any pool size of 1536 px or less
            assert image.shape == (16, 12, 3)
        elif kind == "text":  # the same figure under a text overlay
            assert image.shape == clean.shape and 0.05 < (image != clean).any(-1).mean() < 0.95
        elif kind == "no_person":
            figure = render(cfg, np.random.default_rng([0, make_synthetic.SPLITS["pool"], i])).mask
            assert figure.any() and image.shape == clean.shape and not np.array_equal(image, clean)
        else:  # a re-encoded earlier sample of the pool
            assert kind == "duplicate" and quality < make_synthetic.POOL_JPEG_QUALITY
            assert any(np.array_equal(image, make_synthetic.pool_image(cfg, 0, j, 0.0)[0]) for j in range(i))
    assert set(kinds) == {None, *make_synthetic.JUNK_KINDS} and 10 < len(kinds[None]) < 30
    out = ["--out", str(tmp_path), "--n", "2"]
    assert make_synthetic.main([*out, "--unlabelled", "--junk", "1.5"]) == 2  # a fraction ...
    assert make_synthetic.main([*out, "--junk", "0.5"]) == 2  # ... of an unlabelled pool
    assert not any(tmp_path.iterdir())


# --- shards -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synthetic")
    args = ["--out", str(out), "--n", "24", "--val", "8", "--height", "64", "--width", "48", "--rows-per-shard", "16"]
    assert make_synthetic.main([*args, "--row-group-size", "8"]) == 0
    return out


def test_make_synthetic_writes_labelled_shards_that_decode_to_the_render(shards):
    manifest = json.loads((shards / "train/manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [16, 8] and manifest["parts"] == list(PARTS)
    table = pq.read_table(shards / "train/part-00000.parquet")
    assert table.schema.metadata[b"humans1b.table"] == b"labelled"
    row = table.slice(3, 1).to_pylist()[0]
    r = render(RenderConfig(height=64, width=48), np.random.default_rng([0, 0, 3]))
    assert row["source"] == "synthetic:0:train:3"
    assert (data.decode_image(row["image"]["bytes"]) == r.image).all()
    seg = data.decode_sample(row, "seg", (64, 48))
    assert (seg["parts"] == r.parts).all() and seg["image"].shape == (3, 64, 48)
    normal = data.decode_sample(row, "normal", (64, 48))
    assert (normal["mask"] == r.mask).all()
    np.testing.assert_allclose(normal["target"], r.normals, atol=2e-3)  # float16 storage
    pose = data.decode_sample(row, "pose", (64, 48))
    assert (pose["keypoints"] == r.keypoints).all() and (pose["visibility"] == r.visibility).all()
    with pytest.raises(data.DataError, match="image_size"):
        data.decode_sample(row, "seg", (128, 96))


def test_make_synthetic_is_reproducible(shards, tmp_path):
    again = tmp_path / "again"
    args = ["--out", str(again), "--n", "24", "--val", "8", "--height", "64", "--width", "48", "--rows-per-shard", "16"]
    assert make_synthetic.main([*args, "--row-group-size", "8"]) == 0
    for name in ("train/part-00000.parquet", "val/part-00000.parquet", "train/manifest.json"):
        assert (again / name).read_bytes() == (shards / name).read_bytes()


def test_training_batches_follow_the_plan_and_resume(shards):
    index = DataIndex.scan(str(shards / "train"))
    kwargs = dict(seed=0, batch_size=4, steps=6, world=2)

    def fingerprints(rank: int, start: int) -> list[list[int]]:  # pixel sums identify the samples
        batches = data.train_batches(index, "seg", (64, 48), start_step=start, rank=rank, **kwargs)
        return [b["image"].flatten(1).sum(1).tolist() for b in batches]

    full = [fingerprints(r, 0) for r in (0, 1)]
    assert all(len(f) == 6 for f in full)
    for epoch in (0, 1):  # 24 samples = 3 global batches of 2 x 4: every sample once per epoch
        assert len({x for s in range(3 * epoch, 3 * epoch + 3) for r in (0, 1) for x in full[r][s]}) == 24
    assert fingerprints(1, 4) == full[1][4:]  # a resumed worker continues with the same samples
    val = DataIndex.scan(str(shards / "val"))
    evals = [list(data.eval_batches(val, "seg", (64, 48), batch_size=3, world=2, rank=r)) for r in (0, 1)]
    assert [len(e) for e in evals] == [2, 2]  # 8 samples: 4 per rank in batches of 3, padded
    assert sum(int(v.sum()) for e in evals for _, v in e) == 8


def _as_sample(r, task: str) -> dict[str, np.ndarray]:
    sample = {"image": r.image.transpose(2, 0, 1).copy()}
    if task == "seg":
        sample["parts"] = r.parts.astype(np.int64)
    else:
        sample.update(keypoints=r.keypoints.copy(), visibility=r.visibility.copy(), area=np.float32(r.mask.sum()))
    return sample


def test_mirror_swaps_left_and_right_and_refuses_unpaired_names():
    for names in (PARTS, KEYPOINT_NAMES):
        order = augment.mirror_order(names)
        swapped = [n.replace("left", "\0").replace("right", "left").replace("\0", "right") for n in names]
        assert [names[i] for i in order] == swapped and (order[order] == np.arange(len(names))).all()
    assert augment.mirror_order(("nose", "left_eye")) is None  # a left point without its right one
    cfg = augment.AugmentSettings()
    # Every one of the 308 keypoints has a mirror image (midline points are their own): pose may flip.
    pose = augment.Augmenter(cfg, "pose", PARTS, KEYPOINT_NAMES)
    assert pose.flip == cfg.flip and pose.geometric and pose.colour
    assert augment.Augmenter(cfg, "pose", PARTS, ("nose", "left_eye")).flip == 0
    albedo = augment.Augmenter(cfg, "albedo", PARTS, ())
    assert not albedo.active  # its target is the surface colour; a warp would break the camera of the label maps


def _home(name: str) -> set[str]:
    """Body-part labels a visible keypoint may land on (its skin, or what covers it)."""
    side = name.split("_")[0]
    if name.endswith("wrist"):
        return {f"{side}_lower_arm", f"{side}_hand", "upper_clothing"}
    if name.endswith("knee"):
        return {f"{side}_upper_leg", f"{side}_lower_leg", "lower_clothing"}
    if name.endswith(("toe", "heel")):
        return {f"{side}_foot", f"{side}_shoe", f"{side}_sock"}
    return {f"{side}_hand"}


def test_augmented_labels_stay_on_their_body_parts(renders):
    """Seg and pose augmenters seeded alike draw the same warp: each visible wrist, knee, foot and hand keypoint
    must land on a part label it may have (left and right swapped in a mirror image)."""
    checks = [
        i for i, k in enumerate(KEYPOINTS) if k.group == "hands" or k.name.endswith(("wrist", "knee", "toe", "heel"))
    ]
    cfg = augment.AugmentSettings(flip=0.5, scale=0.25, shift=0.1, colour=0.0)
    seg, pose = (augment.Augmenter(cfg, t, PARTS, KEYPOINT_NAMES) for t in ("seg", "pose"))
    checked = 0
    for i, r in enumerate(renders):
        for draw in range(4):
            a = seg(_as_sample(r, "seg"), np.random.default_rng([i, draw]))
            b = pose(_as_sample(r, "pose"), np.random.default_rng([i, draw]))
            for k in checks:
                if b["visibility"][k] != 2:
                    continue
                x, y = np.round(b["keypoints"][k]).astype(int)
                window = a["parts"][max(y - 1, 0) : y + 2, max(x - 1, 0) : x + 2]
                assert {PARTS[v] for v in window.ravel()} & _home(KEYPOINT_NAMES[k]), (i, draw, KEYPOINT_NAMES[k])
                checked += 1
    assert checked >= 200
    # The warp moved things: images differ from the render, and some keypoint left the frame or moved.
    original = _as_sample(renders[0], "pose")
    moved = pose(_as_sample(renders[0], "pose"), np.random.default_rng([0, 0]))
    assert np.abs(moved["keypoints"] - original["keypoints"]).max() > 1
    assert (moved["image"] != original["image"]).any()


def test_a_mirror_alone_is_exact_and_its_own_inverse(renders):
    r = renders[1]
    cfg = augment.AugmentSettings(flip=1.0, scale=0.0, shift=0.0, colour=0.0)
    seg = augment.Augmenter(cfg, "seg", PARTS, KEYPOINT_NAMES)
    pose = augment.Augmenter(cfg, "pose", PARTS, KEYPOINT_NAMES)
    a = seg(_as_sample(r, "seg"), np.random.default_rng(0))
    assert (a["image"] == r.image.transpose(2, 0, 1)[:, :, ::-1]).all()
    assert (a["parts"] == augment.mirror_order(PARTS)[r.parts[:, ::-1]]).all()
    unlabelled = _as_sample(r, "seg")
    unlabelled["parts"][:4, :] = 255  # the ignore index: no class of its own, kept through the mirror
    assert (seg(unlabelled, np.random.default_rng(0))["parts"][:4, :] == 255).all()
    b = pose(_as_sample(r, "pose"), np.random.default_rng(0))
    order = augment.mirror_order(KEYPOINT_NAMES)
    np.testing.assert_allclose(b["keypoints"][:, 0], (CFG.width - 1) - r.keypoints[order, 0], atol=1e-4)
    back = pose(b, np.random.default_rng(0))
    np.testing.assert_allclose(back["keypoints"], r.keypoints, atol=1e-4)
    assert (back["visibility"] == r.visibility).all() and back["area"] == r.mask.sum()


def test_augmented_batches_are_the_same_for_a_seed_and_after_a_resume(shards):
    index = DataIndex.scan(str(shards / "train"))
    info = data.read_info(index, str(shards / "train"))
    aug = augment.Augmenter(augment.AugmentSettings(), "seg", info.parts, info.keypoint_names)
    kwargs = dict(seed=3, batch_size=4, steps=5, world=1, rank=0)

    def run(start: int, augmenter) -> list[torch.Tensor]:
        return [b["image"] for b in data.train_batches(index, "seg", (64, 48), start_step=start, augment=augmenter,
                                                       **kwargs)]  # fmt: skip

    plain, first, again, resumed = run(0, None), run(0, aug), run(0, aug), run(3, aug)
    assert all((x == y).all() for x, y in zip(first, again))
    assert all((x == y).all() for x, y in zip(first[3:], resumed))
    assert all((x != y).any() for x, y in zip(first, plain))


# --- heads and losses -----------------------------------------------------------------------------------------------


def test_udp_heatmaps_decode_back_to_the_keypoints():
    kp = torch.tensor([[[10.3, 20.7], [50.0, 100.2], [0.0, 0.0], [47.77, 63.1], [200.0, 5.0]]])
    vis = torch.tensor([[2, 1, 2, 2, 2]])
    target, weight = heads.udp_heatmaps(kp, vis, (128, 96), 4, 2.0)
    assert target.shape == (1, 5, 32, 24) and weight.tolist() == [[1, 1, 1, 1, 0]]  # the last is off the map
    decoded, scores = heads.decode_heatmaps(target, (128, 96), blur=0)
    assert (decoded[0, :4] - kp[0, :4]).abs().max() < 1e-3  # exact, the corner (0, 0) included
    assert (scores[0, :4] > 0.9).all() and scores[0, 4] == 0
    blurred, _ = heads.decode_heatmaps(target, (128, 96), blur=1.0)  # away from the edges blurring keeps the peak
    assert (blurred[0, [1, 3]] - kp[0, [1, 3]]).abs().max() < 1e-3


def test_each_loss_is_zero_on_a_perfect_prediction():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 12, 10, generator=g) > 0.3
    normal = torch.nn.functional.normalize(torch.randn(2, 12, 10, 3, generator=g), dim=-1)
    albedo = torch.rand(2, 12, 10, 3, generator=g)
    points = torch.randn(2, 12, 10, 3, generator=g) * 0.2 + torch.tensor([0.0, 0.0, 3.0])
    noisy = lambda x: x + 0.05 * torch.randn(x.shape, generator=g)  # noqa: E731
    for fn, target in ((losses.normal_loss, normal), (losses.albedo_loss, albedo), (losses.pointmap_loss, points)):
        zero, terms = fn(target, target, mask)
        assert zero.item() == pytest.approx(0, abs=1e-6)
        assert all(v.item() == pytest.approx(0, abs=1e-6) for v in terms.values())
        assert fn(noisy(target), target, mask)[0] > 1e-3
    # pointmap: a scaled prediction is right in shape (aligned term 0) but wrong in scale (absolute term > 0)
    _, terms = losses.pointmap_loss(points * 2, points, mask)
    assert terms["aligned"].item() == pytest.approx(0, abs=1e-6) and terms["absolute"] > 0.1

    labels = torch.randint(0, 5, (2, 12, 10), generator=g)
    labels[0, 0, :] = 255
    perfect = 40.0 * torch.nn.functional.one_hot(labels.clamp(max=4), 5).permute(0, 3, 1, 2).float()
    total, terms = losses.seg_loss(perfect, labels, class_weights=torch.tensor([1.0, 2, 1, 1, 3]))
    assert total.item() == pytest.approx(0, abs=1e-5) and terms["ce"] < 1e-6
    perfect[0, :, 0, :] = torch.randn(5, 10, generator=g)  # ignored pixels do not count
    assert losses.seg_loss(perfect, labels)[0].item() == pytest.approx(0, abs=1e-5)
    assert losses.seg_loss(noisy(perfect / 40), labels)[0] > 0.5

    kp = torch.tensor([[[20.0, 30.0], [40.0, 60.0]]])
    target, weight = heads.udp_heatmaps(kp, torch.tensor([[2, 2]]), (64, 48), 4, 1.5)
    assert losses.heatmap_loss(target, target, weight).item() == 0
    assert losses.heatmap_loss(noisy(target), target, weight) > 0


# --- metrics (hand-computed cases) ---------------------------------------------------------------------------------


def _one_keypoint_at_oks(value: float, sigma: float, area: float) -> float:
    """The distance at which a single keypoint has similarity ``value``: exp(-d^2 / (2 area (2 sigma)^2))."""
    return math.sqrt(-math.log(value) * 2 * area * (2 * sigma) ** 2)


def test_oks_and_keypoint_ap_match_hand_computed_values():
    sigmas, area = np.array([0.05, 0.05]), 400.0
    gt, vis = np.array([[10.0, 10.0], [30.0, 30.0]]), np.array([2, 0])  # the second is unlabelled
    d = _one_keypoint_at_oks(0.62, 0.05, area)
    off = gt + np.array([[d, 0.0], [99.0, 99.0]])
    assert metrics.oks(off, gt, vis, area, sigmas) == pytest.approx(0.62)
    assert metrics.oks(gt, gt, vis, area, sigmas) == 1.0
    gts = [[(gt, vis, area)], [(gt, vis, area)]]
    # Higher score on the exact detection: thresholds 0.50-0.60 find both (AP 1); 0.65-0.95 find one of two, at
    # precision 1 up to recall 0.5: 51 of the 101 recall points.
    ap = metrics.keypoint_ap(gts, [[(gt, 0.9)], [(off, 0.8)]], sigmas)
    assert ap["AP"] == pytest.approx((3 + 7 * 51 / 101) / 10)
    assert ap["AP50"] == 1 and ap["AP75"] == pytest.approx(51 / 101)
    # Higher score on the poor detection: precision 1/2 at recall 1/2 for the strict thresholds.
    ap = metrics.keypoint_ap(gts, [[(gt, 0.8)], [(off, 0.9)]], sigmas)
    assert ap["AP"] == pytest.approx((3 + 7 * 25.5 / 101) / 10)
    # A ground truth with no labelled keypoint is ignored; a detection matched to nothing is a false positive.
    ignored = [(gt, np.array([0, 0]), area)]
    assert metrics.keypoint_ap([gts[0], ignored], [[(gt, 0.9)], [(gt, 0.95)]], sigmas)["AP"] == pytest.approx(1.0)
    assert metrics.keypoint_ap([gts[0], []], [[(gt, 0.9)], [(gt, 0.95)]], sigmas)["AP"] == pytest.approx(0.5)


def test_pose_metrics_per_keypoint_group():
    """Body exact, face far off: AP 1 for the body group, 0 for the face, the whole set in between."""
    names, groups = ("left_wrist", "right_wrist", "chin", "nose_tip"), ("body", "body", "face", "face")
    acc = metrics.PoseMetric(np.full(4, 0.05), groups)
    gt = torch.tensor([[[10.0, 10.0], [30.0, 12.0], [20.0, 5.0], [20.0, 8.0]]] * 3)
    pred = gt + torch.tensor([0.0, 0.0, 40.0, 40.0]).view(1, 4, 1)
    acc.update(pred, torch.ones(3, 4), gt, torch.full((3, 4), 2), torch.full((3,), 400.0))
    out = acc.compute()
    assert out["AP_body"] == 1 and out["OKS_body"] == 1
    assert out["AP_face"] == 0 and out["OKS_face"] == pytest.approx(0, abs=1e-6)
    assert out["OKS"] == pytest.approx(0.5) and len(names) == len(groups)
    assert "AP_hands" not in out  # no hand keypoints in this label set


def test_auto_class_weights_lift_rare_classes(shards):
    weights = losses.balanced_class_weights(np.array([1000, 0, 10, 100, 1_000_000]))
    assert weights[1] == 1.0  # absent: no say
    assert weights[2] > weights[3] > weights[0] > weights[4] and weights[2] <= 10 and weights[4] >= 0.1
    cfg = load_config(FinetuneConfig, str(REPO / "configs/finetune/tiny-seg.yaml"))
    spec = {"task": "seg", "train": str(shards / "train")}
    resolved = resolve_class_weights(cfg, spec).head.class_weights
    index = DataIndex.scan(spec["train"])
    counts = data.class_pixel_counts(index, data.read_info(index, spec["train"]))
    assert len(resolved) == len(PARTS) and counts.sum() == 24 * 64 * 48
    rare = np.where(counts > 0, counts, counts.max() + 1).argmin()
    assert resolved[rare] > 1 > resolved[counts.argmax()]
    assert resolve_class_weights(cfg, {**spec, "task": "normal"}).head.class_weights is None
    with pytest.raises(ValueError, match="resolved from the data"):
        tasks.make("seg", cfg, _info()).loss(
            None, torch.zeros(1, len(PARTS), 4, 4), {"parts": torch.zeros(1, 4, 4).long()}
        )


def test_segmentation_miou_and_macc_match_hand_computed_values():
    labels = np.array([[0, 0, 1], [1, 1, 2], [255, 255, 255]])
    pred = np.array([[0, 1, 1], [1, 2, 2], [3, 3, 3]])
    acc = metrics.SegMetric(num_classes=4)
    acc.update(torch.from_numpy(pred[:1]), torch.from_numpy(labels[:1]))  # two updates, one confusion matrix
    acc.update(torch.from_numpy(pred[1:]), torch.from_numpy(labels[1:]))
    r = acc.compute()
    # class 0: tp 1, union 2; class 1: tp 2, union 4; class 2: tp 1, union 2; class 3: absent (ignored pixels only)
    assert r["IoU"] == [0.5, 0.5, 0.5, None]
    assert r["mIoU"] == pytest.approx(0.5)
    assert r["mAcc"] == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    assert r["aAcc"] == pytest.approx(4 / 6)


def test_normal_pointmap_and_albedo_metrics_match_hand_computed_values():
    deg = np.radians([0.0, 90.0, 10.0, 20.0])
    target = torch.tensor([[[[0.0, 0.0, -1.0]] * 4]])  # [1, 1, 4, 3]
    pred = torch.tensor([[[[math.sin(a), 0.0, -math.cos(a)] for a in deg]]], dtype=torch.float32)
    n = metrics.NormalMetric()
    n.update(pred, target, torch.ones(1, 1, 4, dtype=torch.bool))
    r = n.compute()
    assert r["mean"] == pytest.approx(30, abs=1e-3) and r["median"] == pytest.approx(15, abs=1e-3)
    assert r["within_11.25"] == pytest.approx(50) and r["within_30"] == pytest.approx(75)

    # targets at depth 1 and 2, both predicted at depth 1: scale s = (1 + 2) / 2 = 1.5, errors 0.5 / 1 and 0.5 / 2
    p = metrics.PointmapMetric()
    mask = torch.tensor([[[True, True, False]]])
    pred = torch.tensor([[[[0, 0, 1.0], [0, 0, 1.0], [5, 5, 5.0]]]])
    p.update(pred, torch.tensor([[[[0, 0, 1.0], [0, 0, 2.0], [0, 0, 9.0]]]]), mask)  # the third is unlabelled
    assert p.compute() == pytest.approx({"rel_point": 0.375, "abs_rel_depth": 0.375})

    a = metrics.AlbedoMetric()
    t = torch.full((2, 4, 4, 3), 0.5)
    a.update(t + 0.1, t, torch.ones(2, 4, 4, dtype=torch.bool))
    assert a.compute() == pytest.approx({"mae": 0.1, "psnr": 20.0})


def test_metric_states_merge_like_one_accumulator():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(4, 5, 5, 3, generator=g), torch.randn(4, 5, 5, 3, generator=g)
    mask = torch.rand(4, 5, 5, generator=g) > 0.4
    whole, parts = metrics.NormalMetric(), [metrics.NormalMetric(), metrics.NormalMetric()]
    whole.update(pred, target, mask)
    parts[0].update(pred[:2], target[:2], mask[:2])
    parts[1].update(pred[2:], target[2:], mask[2:])
    merged = metrics.NormalMetric()
    merged.merge([p.state() for p in parts])
    assert merged.compute() == pytest.approx(whole.compute())


# --- optimiser ------------------------------------------------------------------------------------------------------


def _info(h: int = 64, w: int = 48, k: int = 40) -> data.LabelInfo:
    points = keypoints(k)
    return data.LabelInfo(PARTS, *zip(*((p.name, p.sigma) for p in points)), (h, w), tuple(p.group for p in points))


def test_layer_wise_lr_decay_and_no_decay_on_1d_params():
    cfg = load_config(FinetuneConfig, TINY, ["optim.layer_decay=0.5", "optim.warmup_steps=0"])
    model = build_model(cfg, tasks.make("seg", cfg, _info()), None)
    opt = build_optimizer(model, cfg)
    set_schedule(opt, cfg, 0, 1)
    rate = {}
    for group in opt.param_groups:
        for p in group["params"]:
            rate[id(p)] = (group["lr"], group["weight_decay"])
    named = dict(model.named_parameters())
    lr = cfg.optim.lr * cfg.data.batch_size / 256  # the peak on one worker (optim.lr is the rate of 256 images)
    assert rate[id(named["head.out.weight"])] == (lr, 0.1)
    assert rate[id(named["head.out.bias"])] == (lr, 0.0)
    assert rate[id(named["backbone.blocks.3.attn.qkv.weight"])] == (lr * 0.5, 0.1)
    assert rate[id(named["backbone.blocks.0.ffn.w12.weight"])] == (lr * 0.5**4, 0.1)
    assert rate[id(named["backbone.blocks.0.norm1.weight"])] == (lr * 0.5**4, 0.0)
    assert rate[id(named["backbone.patch_embed.weight"])] == (lr * 0.5**5, 0.1)
    assert rate[id(named["backbone.cls_token"])] == (lr * 0.5**5, 0.0)
    assert len(rate) == len(named)
    assert layer_id("backbone.norm.weight", 4) == 5
    # per-size defaults of the public configs
    for size, decay in (("tiny", 0.85), ("0.4b", 0.8), ("1b", 0.9), ("5b", 0.94), ("0.8b-4k", 0.85)):
        assert load_config(FinetuneConfig, TINY, [f"model.size={size}"]).layer_decay() == decay
    frozen = load_config(FinetuneConfig, TINY, ["optim.freeze_backbone=true"])
    model = build_model(frozen, tasks.make("seg", frozen, _info()), None)
    trained = {id(p) for g in build_optimizer(model, frozen).param_groups for p in g["params"]}
    assert trained == {id(p) for p in model.head.parameters()}


def test_probe_steps_train_the_head_alone_then_the_backbone_warms_up_lp_ft():
    k = 3
    cfg = load_config(FinetuneConfig, TINY, [f"optim.probe_steps={k}", "steps=8", "optim.warmup_steps=2"])
    model = build_model(cfg, tasks.make("seg", cfg, _info()), None)
    opt = build_optimizer(model, cfg)
    named = dict(model.named_parameters())
    start = {n: p.detach().clone() for n, p in named.items()}
    backbone = [n for n in named if n.startswith("backbone.")]
    images = torch.randint(0, 256, (2, 3, 64, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def step(i: int) -> None:
        set_schedule(opt, cfg, i, 1)
        model(images).square().mean().backward()
        optimizer_step(opt, [p for p in model.parameters() if p.requires_grad], cfg.optim.grad_clip)

    for i in range(k):
        step(i)
        assert all(g["lr"] == g["weight_decay"] == 0 for g in opt.param_groups if not g["name"].endswith("-head"))
    assert all(torch.equal(named[n], start[n]) for n in backbone)  # the final norm included
    assert not torch.equal(named["head.out.weight"], start["head.out.weight"])
    # the backbone's warm-up starts at its first step, the head's schedule goes on
    batch = cfg.samples_per_step(1)
    lr, _ = set_schedule(opt, cfg, k, 1)
    assert lr == lr_at(k, cfg.optim, cfg.steps, batch)
    rates = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert rates[id(named["backbone.norm.weight"])] == lr_at(0, cfg.optim, cfg.steps - k, batch) < lr
    assert rates[id(named["head.out.bias"])] == lr
    for i in range(k, k + 2):
        step(i)
    assert all(
        not torch.equal(named[n], start[n]) for n in ("backbone.blocks.0.attn.qkv.weight", "backbone.norm.weight")
    )
    with pytest.raises(ValueError, match=r"optim\.probe_steps"):
        load_config(FinetuneConfig, TINY, ["optim.probe_steps=8", "steps=8"])
    # without a probe the groups are those of a run saved before LP-FT existed: its checkpoints still resume
    plain = load_config(FinetuneConfig, TINY, ["steps=8"])
    names = [
        g["name"]
        for g in build_optimizer(build_model(plain, tasks.make("seg", plain, _info()), None), plain).param_groups
    ]
    assert not any(n.endswith("-head") for n in names) and len(names) == len(set(names)) < len(opt.param_groups)


# --- every head trains ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_batch() -> dict[str, dict[str, torch.Tensor]]:
    cfg = RenderConfig(height=64, width=48, num_keypoints=40)
    rows = []
    for i in range(4):
        r = render(cfg, np.random.default_rng([5, i]))
        rows.append(data.encode_row(r.image, source="t", mask=r.mask, parts=r.parts, pointmap=r.points,
                                    normal=r.normals, albedo=r.albedo, keypoints=r.keypoints,
                                    visibility=r.visibility, area=float(r.mask.sum()), camera=r.camera))  # fmt: skip
    return {t: data.collate([data.decode_sample(row, t, (64, 48)) for row in rows]) for t in data.TASKS}


@pytest.mark.parametrize("task_name", data.TASKS)
def test_every_head_trains_a_few_steps_and_its_loss_falls(task_name, small_batch):
    torch.set_num_threads(2)
    cfg = load_config(
        FinetuneConfig, TINY, ["optim.warmup_steps=0", "steps=12", "optim.lr=9.6e-2", "optim.min_lr=3e-3"]
    )
    task = tasks.make(task_name, cfg, _info())
    model = build_model(cfg, task, None)
    opt = build_optimizer(model, cfg)
    batch = small_batch[task_name]
    losses_seen = []
    for step in range(12):
        set_schedule(opt, cfg, step, 1)  # peak 9.6e-2 x 8 / 256 = 3e-3
        out = model(batch["image"])
        loss, _ = task.loss(model.head, out, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses_seen.append(loss.item())
    assert np.mean(losses_seen[-3:]) < 0.9 * losses_seen[0], losses_seen
    with torch.no_grad():  # output contracts of the heads
        out = model(batch["image"])
    if task_name == "normal":
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(out.shape[:-1]))
    if task_name == "albedo":
        assert out.min() >= 0 and out.max() <= 1
    if task_name == "pointmap":
        assert (out[..., 2] > 0).all()
    if task_name == "pose":
        assert out.shape == (4, 40, 16, 12)


@pytest.mark.parametrize("task_name", data.TASKS)
def test_a_perfect_prediction_scores_perfectly_through_the_task(task_name, small_batch):
    cfg = load_config(FinetuneConfig, TINY)
    task = tasks.make(task_name, cfg, _info())
    head = task.build_head(64, 16)
    batch = small_batch[task_name]
    if task_name == "pose":
        perfect = head.targets(batch["keypoints"], batch["visibility"], (64, 48))[0]
    elif task_name == "seg":
        perfect = 30.0 * torch.nn.functional.one_hot(batch["parts"], len(PARTS)).permute(0, 3, 1, 2).float()
    else:
        perfect = batch["target"]
    acc = task.metric()
    valid = torch.tensor([True, True, True, False])
    task.update(acc, head, perfect, batch, valid)
    result = acc.compute()
    expected = {"pose": ("AP", 1.0), "seg": ("mIoU", 1.0), "normal": ("mean", 0.0), "albedo": ("mae", 0.0),
                "pointmap": ("rel_point", 0.0)}[task_name]  # fmt: skip
    assert result[expected[0]] == pytest.approx(expected[1], abs=0.02)
    target, prediction = task.picture(head, perfect, batch, 0)
    assert target.shape == prediction.shape == (64, 48, 3) and target.dtype == np.uint8
    if task_name != "pose":  # pose draws the keypoints in two colours
        assert (target == prediction).all()


def test_pretrained_backbone_is_loaded_and_a_wrong_size_refused(tmp_path):
    import dataclasses

    torch.manual_seed(5)
    cfg = load_config(FinetuneConfig, TINY)
    backbone = build(
        dataclasses.replace(cfg.model.backbone(), layer_scale_init=0.1)
    )  # how it was initialised is no matter
    meta = {"format": "pt", "size": "tiny", "step": "1",
            "backbone_config": json.dumps(dataclasses.asdict(backbone.cfg))}  # fmt: skip
    path = tmp_path / "backbone.safetensors"
    save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(path), metadata=meta)
    model = build_model(cfg, tasks.make("normal", cfg, _info()), str(path))
    torch.testing.assert_close(model.backbone.blocks[2].ffn.w3.weight, backbone.blocks[2].ffn.w3.weight)
    wrong = load_config(FinetuneConfig, TINY, ["model.size=tiny-gqa"])
    with pytest.raises(ValueError, match=r"model.size"):
        build_model(wrong, tasks.make("normal", wrong, _info()), str(path))
    coarse = load_config(FinetuneConfig, TINY, ["model.patch_size=16"])
    with pytest.raises(ValueError, match="patch 8"):
        build_model(coarse, tasks.make("normal", coarse, _info()), str(path))


def test_a_pretrained_backbone_takes_the_fine_tuning_drop_path(tmp_path):
    import dataclasses

    for pretrained_rate, tuned_rate in ((0.0, 0.3), (0.2, 0.0)):  # how the pretraining dropped paths is no matter
        backbone = build(
            dataclasses.replace(load_config(FinetuneConfig, TINY).model.backbone(), drop_path=pretrained_rate)
        )
        meta = {"format": "pt", "size": "tiny", "step": "1",
                "backbone_config": json.dumps(dataclasses.asdict(backbone.cfg))}  # fmt: skip
        path = tmp_path / f"backbone-{pretrained_rate}.safetensors"
        save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(path), metadata=meta)
        tuned = load_config(FinetuneConfig, TINY, [f"model.drop_path={tuned_rate}"])
        model = build_model(tuned, tasks.make("normal", tuned, _info()), str(path))
        assert model.backbone.cfg.drop_path == tuned_rate
        rates = [blk.drop_path_rate for blk in model.backbone.all_blocks]
        assert rates == pytest.approx([0.0, tuned_rate / 3, 2 * tuned_rate / 3, tuned_rate])
        assert torch.equal(model.backbone.blocks[3].ffn.w3.weight, backbone.blocks[3].ffn.w3.weight)


# --- the job ----------------------------------------------------------------------------------------------------------


def test_job_refuses_bad_inputs_with_a_clear_message(shards, tmp_path, capsys):
    base = ["--config", TINY, "--storage", str(tmp_path), "--name", "x"]
    assert job.main(["--task", "seg", "--data", str(shards / "train"), *base]) == 2
    assert "no train/ or val/ folder" in capsys.readouterr().err
    assert job.main(["--task", "seg", "--data", str(shards), *base, "optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert job.main(["--task", "seg", "--data", str(shards), *base, "--backbone", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_finetune_job_trains_evaluates_and_resumes(shards, tmp_path, ray_local, capsys):
    args = ["--task", "seg", "--config", TINY, "--data", str(shards), "--storage", str(tmp_path), "--name", "seg"]
    fast = ["steps=6", "log.every=2", "eval.every=3", "eval.visualise=2", "data.batch_size=2", "ray.workers=2",
            "ray.cpus_per_worker=1", "ray.torch_threads=1"]  # fmt: skip
    assert job.main([*args, *fast]) == 0
    run = tmp_path / "seg"
    report = json.loads((run / "metrics.json").read_text())
    assert report["task"] == "seg" and report["step"] == 6
    assert [c["step"] for c in report["curve"]] == [3, 6]
    assert 0 <= report["metrics"]["mIoU"] <= 1 and len(report["metrics"]["IoU"]) == len(PARTS)
    pictures = sorted((run / "pictures").glob("*.png"))
    assert len(pictures) == 2 and data.decode_image(pictures[0].read_bytes()).shape == (64, 3 * 48, 3)
    train = [json.loads(line) for f in (run / "metrics").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == [2, 4, 6]
    assert ["host_memory_peak_bytes" in r for r in train if r["kind"] == "train"] == [True, False, False]
    board = tensorboard_scalars(run)  # TensorBoard: the training scalars and the evaluation curve
    assert board["loss/loss"] == pytest.approx({r["step"]: r["loss"] for r in train if r["kind"] == "train"}, rel=1e-6)
    assert set(board["optim/lr"]) == set(board["perf/data_wait_frac"]) == {2, 4, 6}
    assert board["eval/mIoU"] == pytest.approx({c["step"]: c["mIoU"] for c in report["curve"]}, rel=1e-6)
    model, task = load_finetuned(str(run / "finetuned.safetensors"))
    assert task.name == "seg"
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 64, 48, dtype=torch.uint8)).shape == (1, len(PARTS), 64, 48)
    # The same command again finds the finished run's checkpoint: no training step is repeated.
    assert job.main([*args, *fast]) == 0
    train = [json.loads(line) for f in (run / "metrics").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == [2, 4, 6]
    assert job.main([*args, *fast, "model.size=tiny-gqa"]) == 2  # a different run under the same name
    assert job.main([*args, *fast, "loss.dice=0"]) == 2  # a changed setting, not allowed
    # its only checkpoint torn: set aside, and with none left the run stops in one line (exit 2)
    (only,) = (run / "checkpoints").glob("step_*")
    shard = next(only.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert job.main([*args, *fast]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: no readable checkpoint left in")
    assert [p.name.split("-")[1] for p in (run / "checkpoints").iterdir()] == [only.name]  # kept, set aside
    # the fine-tuned model's backbone (not its head) starts another run through --backbone
    finetuned = str(run / "finetuned.safetensors")
    job.check_backbone(finetuned, load_config(FinetuneConfig, TINY))
    backbone = load_backbone(finetuned)
    assert backbone.state_dict().keys() == model.backbone.state_dict().keys()
    assert all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in backbone.state_dict().items())
    cfg = load_config(FinetuneConfig, TINY)
    other = build_model(cfg, tasks.make("normal", cfg, _info()), finetuned)
    assert torch.equal(other.backbone.blocks[3].attn.qkv.weight, model.backbone.blocks[3].attn.qkv.weight)


# Each task's headline metrics, as metrics.json reports them.
TASK_METRICS = {
    "pose": ("AP", "OKS", "AP_body", "AP_hands", "AP_face"),
    "pointmap": ("rel_point", "abs_rel_depth"),
    "normal": ("mean", "median", "within_11.25"),
    "albedo": ("mae", "psnr"),
}


def _check_run(run: Path, task_name: str, steps: int) -> None:
    """metrics.json holds the task's metrics, a picture shows input | target | prediction, the model loads."""
    report = json.loads((run / "metrics.json").read_text())
    assert report["task"] == task_name and report["step"] == steps
    assert all(math.isfinite(report["metrics"][k]) for k in TASK_METRICS[task_name]), report["metrics"]
    picture = sorted((run / "pictures").glob("*.png"))[0]
    assert data.decode_image(picture.read_bytes()).shape == (64, 3 * 48, 3)
    model, task = load_finetuned(str(run / "finetuned.safetensors"))
    with torch.no_grad():
        out = model(torch.zeros(1, 3, 64, 48, dtype=torch.uint8))
    assert task.name == task_name and out.shape[0] == 1


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["pointmap", "normal", "albedo"])  # seg and pose: the tests around these
def test_every_task_runs_end_to_end_through_the_job(task_name, shards, tmp_path, ray_local):
    config = str(REPO / f"configs/finetune/tiny-{task_name}.yaml")
    args = ["--task", task_name, "--config", config, "--data", str(shards), "--storage", str(tmp_path), "--name", "t"]
    assert job.main([*args, "steps=3", "log.every=3", "eval.visualise=1", "data.batch_size=4"]) == 0
    _check_run(tmp_path / "t", task_name, 3)


def _finetuned_tensors(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "finetuned.safetensors")


@pytest.mark.slow
def test_killed_finetuning_job_resumes_to_the_uninterrupted_weights(shards, tmp_path, ray_local):
    """SIGKILL the driver after its first checkpoint, submit the same command again: the final weights are those
    of a run that was never interrupted (same seed, same batches, same augmentation draws)."""
    address = ray_local.get_runtime_context().gcs_address
    config = str(REPO / "configs/finetune/tiny-pose.yaml")
    common = ["--task", "pose", "--config", config, "--data", str(shards), "--storage", str(tmp_path)]
    settings = ["steps=24", "checkpoint.every=4", "log.every=4", "eval.max_samples=4", "data.batch_size=4"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "jobs.finetune", *common, "--name", "killed", *settings, f"ray.address={address}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while (
            time.monotonic() < deadline
            and driver.poll() is None
            and not ckpt.latest_committed(str(tmp_path / "killed"))
        ):
            time.sleep(0.05)
        assert driver.poll() is None, "the driver finished before it could be killed"
        killed_at = ckpt.step_of(ckpt.latest_committed(str(tmp_path / "killed")))
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert 4 <= killed_at < 24 and not (tmp_path / "killed/finetuned.safetensors").exists()
    assert job.main([*common, "--name", "killed", *settings]) == 0
    assert job.main([*common, "--name", "straight", *settings]) == 0
    resumed, straight = _finetuned_tensors(tmp_path / "killed"), _finetuned_tensors(tmp_path / "straight")
    assert resumed.keys() == straight.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0, msg=name)
    first = json.loads((tmp_path / "killed/metrics.json").read_text())["metrics"]
    assert first == json.loads((tmp_path / "straight/metrics.json").read_text())["metrics"]
    _check_run(tmp_path / "killed", "pose", 24)
