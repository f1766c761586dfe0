"""The random-init model store (generators.random_models), loaded through the full profile's real loading code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from common.config import load_config
from common.imageio import decode
from curation.config import CurateConfig
from curation.stages.yolo import YoloPersonStage
from generators.random_models import CANDIDATES_PER_PHOTO, build_random_store
from generators.sample_pool import load_photos

FULL = Path(__file__).resolve().parents[2] / "configs" / "curate" / "full.yaml"
PEOPLE = ("bus", "zidane", "grace_hopper", "astronaut")


@pytest.mark.slow  # builds and calibrates the store, then runs both models at 640 px: ~40 s (11n) on two CPU cores
@pytest.mark.parametrize("yolo", ["yolo11n", "yolo11m"])  # the lite-sized store and the GPU check's
def test_random_detectors_hand_nms_a_photos_worth_of_candidates(tmp_path, monkeypatch, yolo):
    """At the stage's own threshold each random model passes some boxes on every photo of people and tens on the
    median package photo: neither none nor all 8400 anchors (which ended every batch at ultralytics' NMS time limit
    on a GPU). Their spread follows the photo's texture, so a busy photo passes up to a few hundred."""
    cfg = load_config(CurateConfig, FULL, [*build_random_store(tmp_path, yolo), "stages.yolo_person.num_cpus=1"])
    stage = YoloPersonStage(cfg)
    stage.setup()
    counts: list[np.ndarray] = []  # per NMS call (pose model, then detector): candidates of each image
    non_max_suppression = stage._nms.non_max_suppression

    def counting_nms(preds, conf, *args, classes=None, nc=0, **kwargs):
        scores = preds[:, 4 : 4 + (nc or preds.shape[1] - 4)]
        scores = scores if classes is None else scores[:, classes]
        counts.append((scores > conf).any(1).sum(1).cpu().numpy())
        return non_max_suppression(preds, conf, *args, classes=classes, nc=nc, **kwargs)

    monkeypatch.setattr(stage, "_nms", SimpleNamespace(non_max_suppression=counting_nms))
    photos = load_photos()
    found = stage.infer([decode(p.data, max_side=cfg.models.yolo.imgsz) for p in photos.values()])
    assert len(counts) == 2
    for model, per_image in zip(("pose", "detector"), counts):
        by_photo = dict(zip(photos, per_image.tolist()))
        print(yolo, model, by_photo)  # the figures benchmarks/RESULTS.md records
        assert all(1 <= by_photo[name] <= 200 for name in PEOPLE), (model, by_photo)
        assert max(by_photo.values()) < 1000, (model, by_photo)  # never thousands, even on the busiest photo
        lower_median = sorted(by_photo.values())[(len(by_photo) - 1) // 2]  # the photo the bias was set on
        assert CANDIDATES_PER_PHOTO / 2 <= lower_median <= 2 * CANDIDATES_PER_PHOTO, (model, by_photo)
    people = [list(photos).index(name) for name in PEOPLE]
    assert all(len(found[i][0]) >= 1 for i in people)  # persons come out of NMS on every photo of people
