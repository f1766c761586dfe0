"""Quality, pHash and embedding stages on real photos that ship in installed packages and degraded copies of them.

Timings are printed (run with ``-s`` to see them), never asserted.
"""

from __future__ import annotations

import io
import itertools
import time

import cv2
import imagehash
import numpy as np
import pyarrow as pa
import pytest
from package_photos import jpeg, package_photo_files, upscale_to_min_short
from PIL import Image

from common import schema
from common.imageio import decode
from curation.config import CurateConfig
from curation.phases.dedup.link_rule import crop_distances, pdq_words
from curation.score.stage import REJECT
from curation.stages.embedding import LITE_NAME, EmbeddingStage
from curation.stages.phash import CROP_COUNT, PhashStage, crop_boxes, hamming, hash_to_int
from curation.stages.quality import PARTS, QualityStage
from tests.stage_calls import decided

_jpeg, _upscale_to_min_short = jpeg, upscale_to_min_short


def _resize_long(img: np.ndarray, long_side: int) -> np.ndarray:
    h, w = img.shape[:2]
    s = long_side / max(h, w)
    return cv2.resize(img, (round(w * s), round(h * s)), interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_CUBIC)


@pytest.fixture(scope="module")
def photo_files() -> dict[str, bytes]:
    """Encoded photos: the JPEG files as shipped where there are files, else arrays encoded at quality 95."""
    return package_photo_files()


@pytest.fixture(scope="module")
def photos(photo_files: dict[str, bytes]) -> dict[str, np.ndarray]:
    return {name: decode(data) for name, data in photo_files.items()}


def _rows(encoded: list[bytes]) -> list[dict]:
    return [{"image": {"bytes": data, "path": f"img{i}.jpg"}} for i, data in enumerate(encoded)]


def _timed_batch(stage, encoded: list[bytes]) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    updates = decided(stage, _rows(encoded))
    return updates, (time.perf_counter() - t0) / len(encoded) * 1000


def _stage(cls, **overrides):
    cfg = CurateConfig.model_validate(overrides)
    stage = cls(cfg)
    stage.setup()
    return stage


# ---------------------------------------------------------------------------------------------------- quality

# text() is a 172-px crop of a sign that has to be upscaled 2.2x to reach 384 px: genuinely soft, and a text
# image the text-overlay stage decides on. Every other package photo must be kept.
KEEP = (
    "bus",
    "zidane",
    "grace_hopper",
    "astronaut",
    "camera",
    "chelsea",
    "coffee",
    "rocket",
    "china",
    "flower",
    "page",
)


def _degrade(img: np.ndarray, kind: str, seed: int) -> np.ndarray:
    """The degraded copies quality must reject, made at 1000 px on the long side."""
    base = _resize_long(img, 1000).astype(np.float32)
    rng = np.random.default_rng(seed)
    if kind == "blur":
        out = cv2.GaussianBlur(base, (0, 0), 6.0)
    elif kind == "dark":
        out = base * 0.15
    elif kind == "blown":
        out = base * 3.0
    elif kind == "noise":
        out = base + rng.normal(0.0, 40.0, base.shape)
    elif kind == "flat":
        # The photo's mean colour, a gentle +-8 level ramp and a little sensor noise.
        h, w = base.shape[:2]
        ramp = np.linspace(-8.0, 8.0, w, dtype=np.float32)[None, :].repeat(h, axis=0)
        ramp = ramp[..., None] if base.ndim == 3 else ramp
        out = base.mean(axis=(0, 1)) + ramp + rng.normal(0.0, 2.0, base.shape)
    else:
        raise ValueError(kind)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def _check_update_types(update: dict) -> None:
    """Values must convert to the working schema's column types."""
    pa.array([update["quality"]], pa.float32())
    pa.array([update["quality_parts"]], schema.QUALITY_PARTS_TYPE)
    assert set(update["quality_parts"]) == set(PARTS)


def test_quality_keeps_every_original_photo(photo_files):
    stage = _stage(QualityStage)
    updates, ms = _timed_batch(stage, [photo_files[n] for n in KEEP])
    print(f"\nquality: {ms:.1f} ms/image (decode at {stage.cfg.models.quality.max_side} px included)")
    for name, update in zip(KEEP, updates):
        parts = " ".join(f"{k}={v:.2f}" for k, v in update["quality_parts"].items())
        print(f"  {name:13s} quality={update['quality']:.3f}  {parts}")
    for name, update in zip(KEEP, updates):
        _check_update_types(update)
        assert REJECT not in update, f"{name}: {update[REJECT]}"
        assert stage.cfg.filters.min_quality <= update["quality"] <= 1.0
        assert all(0.0 <= v <= 1.0 for v in update["quality_parts"].values())


# Which part each degradation must show up in (the rejection detail names the weakest parts).
DEGRADATIONS = {"blur": "sharpness", "dark": "exposure", "blown": "exposure", "noise": "noise", "flat": "contrast"}


@pytest.mark.parametrize("kind", list(DEGRADATIONS))
def test_quality_rejects_degraded_copies(photos, kind):
    stage = _stage(QualityStage)
    names = list(photos)
    encoded = [_jpeg(_degrade(photos[n], kind, seed=i), 90) for i, n in enumerate(names)]
    updates, ms = _timed_batch(stage, encoded)
    print(f"\n{kind}: {ms:.1f} ms/image; " + ", ".join(f"{n}={u['quality']:.2f}" for n, u in zip(names, updates)))
    for name, update in zip(names, updates):
        _check_update_types(update)
        assert REJECT in update, f"{kind} copy of {name} kept with quality {update['quality']:.3f}"
        code, _, detail = update[REJECT].partition(": ")
        assert code == "low_quality"
        assert DEGRADATIONS[kind] in detail.split("weakest: ")[1], f"{kind} copy of {name}: {detail}"
    # The rejection comes from the configured threshold, not from the stage itself.
    lenient = _stage(QualityStage, filters={"min_quality": 0.0})
    assert not any(REJECT in u for u in decided(lenient, _rows(encoded)))


def test_quality_parts_fall_monotonically_with_blur_and_noise(photos):
    """Finer steps than the rejection test: the part a degradation hits must not rise as it gets worse."""
    stage = _stage(QualityStage)
    for i, name in enumerate(("bus", "grace_hopper", "coffee", "camera")):
        base = _resize_long(photos[name], 1000)
        blurred = [base] + [cv2.GaussianBlur(base, (0, 0), s) for s in (1.0, 2.0, 3.0, 6.0)]
        noise = np.random.default_rng(i).normal(0.0, 1.0, base.shape)
        noisy = [np.clip(base + s * noise, 0, 255).astype(np.uint8) for s in (0.0, 10.0, 20.0, 30.0, 40.0)]
        sharp = [u["quality_parts"]["sharpness"] for u in stage.process_batch(_rows([_jpeg(b, 90) for b in blurred]))]
        clean = [u["quality_parts"]["noise"] for u in stage.process_batch(_rows([_jpeg(b, 90) for b in noisy]))]
        by_blur, by_noise = (" ".join(f"{v:.2f}" for v in vs) for vs in (sharp, clean))
        print(f"\n{name}: sharpness part by blur {by_blur}; noise part by noise sigma {by_noise}")
        assert all(b <= a + 0.02 for a, b in itertools.pairwise(sharp)), sharp
        assert all(b <= a + 0.02 for a, b in itertools.pairwise(clean)), clean
        assert sharp[0] - sharp[-1] > 0.5 and clean[0] - clean[-1] > 0.5


def test_quality_grayscale_photo_not_rejected_for_lacking_colour(photos):
    stage = _stage(QualityStage)
    names = ("bus", "china", "flower")
    gray = [cv2.cvtColor(photos[n], cv2.COLOR_RGB2GRAY) for n in names]
    colour = decided(stage, _rows([_jpeg(photos[n]) for n in names]))
    mono = decided(stage, _rows([_jpeg(g) for g in gray]))
    for name, c, m in zip(names, colour, mono):
        assert m["quality_parts"]["colourfulness"] == 0.0
        assert c["quality_parts"]["colourfulness"] > 0.5
        assert REJECT not in m, f"grayscale {name}: {m[REJECT]}"
        assert m["quality"] < c["quality"]


# ------------------------------------------------------------------------------------------------------ phash


def test_phash_draft_decode_matches_full_image_hash(photo_files, photos):
    stage = _stage(PhashStage)
    # Plus one at a typical web-photo size, where draft decoding saves the most.
    files = {**photo_files, "bus_2400px": _jpeg(_resize_long(photos["bus"], 2400), 92)}
    names = list(files)
    t0 = time.perf_counter()
    full = [imagehash.phash(Image.open(io.BytesIO(files[n]))) for n in names]
    full_ms = (time.perf_counter() - t0) / len(names) * 1000
    updates, draft_ms = _timed_batch(stage, [files[n] for n in names])
    print(
        f"\nphash: full decode {full_ms:.2f} ms/image, draft decode (stage) {draft_ms:.2f} ms/image, "
        f"ratio {full_ms / draft_ms:.1f}x"
    )
    pa.array([u["phash"] for u in updates], pa.uint64())
    for name, reference, update in zip(names, full, updates):
        value = update["phash"]
        assert 0 <= value < 2**64
        restored = imagehash.hex_to_hash(f"{value:016x}")
        assert hash_to_int(restored.hash) == value
        print(f"  {name:13s} {value:016x}  {restored - reference} bits from the full-decode hash")
        assert restored - reference <= 2, name


def test_phash_near_duplicates_close_and_different_photos_far(photos):
    stage = _stage(PhashStage)
    names = list(photos)
    originals = [u["phash"] for u in stage.process_batch(_rows([_jpeg(photos[n]) for n in names]))]
    dup_dist = {}
    for kind in ("recompressed", "resized", "cropped"):
        copies = []
        for n in names:
            img = photos[n]
            h, w = img.shape[:2]
            c = int(0.02 * min(h, w))  # a slight crop: 2 % off every side
            if kind == "recompressed":
                copy = _jpeg(img, 50)
            elif kind == "resized":
                copy = _jpeg(cv2.resize(img, (w * 2 // 3, h * 2 // 3), interpolation=cv2.INTER_AREA), 90)
            else:
                copy = _jpeg(np.ascontiguousarray(img[c : h - c, c : w - c]), 90)
            copies.append(copy)
        hashes = [u["phash"] for u in stage.process_batch(_rows(copies))]
        dup_dist[kind] = [hamming(a, b) for a, b in zip(originals, hashes)]
    unrelated = [hamming(a, b) for i, a in enumerate(originals) for b in originals[i + 1 :]]
    print(f"\nphash distances: near-duplicates {dup_dist}; different photos min {min(unrelated)} max {max(unrelated)}")
    assert max(max(d) for d in dup_dist.values()) <= 10
    assert min(unrelated) >= 16


def test_sub_crop_hashes_bring_a_light_crop_close_to_its_original(photos):
    """A crop keeping 90-95% of each side, off-centre, moves the whole-image PDQ far; one of the original's sub-crop
    windows frames it alike, so its crop distance stays small. Unrelated photos stay far on the crop distance."""
    stage = _stage(PhashStage)
    assert stage.columns[2].type == pa.binary(32 * CROP_COUNT)
    assert len(crop_boxes(192, 144)) == CROP_COUNT and crop_boxes(192, 144)[-1][2:] == (192, 144)
    names = list(photos)
    rng = np.random.default_rng(3)
    copies = []
    for n in names:
        img = photos[n]
        h, w = img.shape[:2]
        f = rng.uniform(0.90, 0.95)
        ch, cw = round(h * f), round(w * f)
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        copies.append(_jpeg(np.ascontiguousarray(img[y : y + ch, x : x + cw]), 90))
    orig = stage.process_batch(_rows([_jpeg(photos[n]) for n in names]))
    crop = stage.process_batch(_rows(copies))

    def signals(updates):  # as the stored columns hold them, read back as the dedup search does
        return tuple(pdq_words(pa.array([u[c.name] for u in updates], c.type))[0] for c in stage.columns[1:])

    (h0, c0), (h1, c1) = signals(orig), signals(crop)
    whole = crop_distances(h0, c0[:, :0], h1, c1[:, :0]).tolist()
    cropped = crop_distances(h0, c0, h1, c1).tolist()
    i, j = np.triu_indices(len(names), 1)
    unrelated = crop_distances(h0[i], c0[i], h0[j], c0[j])
    print(f"\nlight crops: whole-image PDQ distance {whole}, crop distance {cropped}; unrelated min {unrelated.min()}")
    assert np.median(cropped) < np.median(whole) / 2 and max(cropped) <= 64
    assert all(c <= w for c, w in zip(cropped, whole)) and unrelated.min() >= 80


# -------------------------------------------------------------------------------------------------- embedding


def test_embedding_unit_norm_exact_dim_deterministic(photo_files):
    stage = _stage(EmbeddingStage)
    assert stage.cfg.models.embedding.name == LITE_NAME
    encoded = list(photo_files.values())
    first, ms = _timed_batch(stage, encoded)
    print(f"\nembedding: {ms:.1f} ms/image (decode included)")
    again = _stage(EmbeddingStage).process_batch(_rows(encoded))
    pa.array([u["embedding"] for u in first], schema.embedding_type(stage.cfg.embedding_dim))
    for a, b in zip(first, again):
        vec = np.asarray(a["embedding"], dtype=np.float32)
        assert vec.shape == (384,) and np.isfinite(vec).all()
        assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
        assert a["embedding"] == b["embedding"]


@pytest.mark.parametrize("dim", [128, 768])
def test_embedding_other_dims_keep_unit_norm_and_geometry(photo_files, dim):
    encoded = list(photo_files.values())
    native = np.array([u["embedding"] for u in _stage(EmbeddingStage).process_batch(_rows(encoded))])
    stage = _stage(EmbeddingStage, models={"embedding": {"dim": dim}})
    other = np.array([u["embedding"] for u in stage.process_batch(_rows(encoded))])
    assert other.shape == (len(encoded), dim)
    assert np.allclose(np.linalg.norm(other, axis=1), 1.0, atol=1e-5)
    change = np.abs(other @ other.T - native @ native.T)[np.triu_indices(len(encoded), k=1)]
    print(f"\ndim {dim}: cosine similarities moved by {change.mean():.3f} on average, {change.max():.3f} at most")
    if dim > 384:  # an isometric embedding
        assert change.max() < 1e-5
    else:  # a random projection: roughly (Johnson-Lindenstrauss)
        assert change.mean() < 0.08 and change.max() < 0.3


def test_embedding_near_duplicates_closer_than_different_photos(photos):
    stage = _stage(EmbeddingStage)
    names = list(photos)

    def embed_all(images: list[np.ndarray], quality: int = 90) -> np.ndarray:
        return np.array([u["embedding"] for u in stage.process_batch(_rows([_jpeg(i, quality) for i in images]))])

    originals = embed_all([photos[n] for n in names], 95)
    crops = []
    for n in names:
        h, w = photos[n].shape[:2]
        c = int(0.05 * min(h, w))
        crops.append(np.ascontiguousarray(photos[n][c : h - c, c : w - c]))
    smaller = [cv2.resize(photos[n], None, fx=0.6, fy=0.6, interpolation=cv2.INTER_AREA) for n in names]
    copies = {
        "recompressed": embed_all([photos[n] for n in names], 50),
        "resized": embed_all(smaller),
        "cropped": embed_all(crops),
    }
    # Mirrored copies are not near-duplicates for this descriptor (layout is kept left to right): reported only.
    flipped = embed_all([np.ascontiguousarray(photos[n][:, ::-1]) for n in names])
    dup = {k: np.sum(originals * v, axis=1) for k, v in copies.items()}
    sims = originals @ originals.T
    unrelated = sims[np.triu_indices(len(names), k=1)]
    print(
        "\nembedding cosine: "
        + ", ".join(f"{k} min {v.min():.3f}" for k, v in dup.items())
        + f"; different photos max {unrelated.max():.3f} mean {unrelated.mean():.3f}"
        + f"; mirrored (not asserted) min {np.sum(originals * flipped, axis=1).min():.3f}"
    )
    worst_dup = min(v.min() for v in dup.values())
    assert worst_dup > 0.95
    assert worst_dup - unrelated.max() > 0.1


def test_embedding_stage_refuses_other_models():
    stage = EmbeddingStage(CurateConfig.model_validate({"models": {"embedding": {"name": "ViT-B-16"}}}))
    with pytest.raises(ValueError, match=LITE_NAME):
        stage.setup()
