"""The keep rule: components over the pairs of both signals, one item kept per component by release, resolution,
encoding quality, score and key, and the signal that linked each dropped item; on synthetic graphs and real photos."""

from __future__ import annotations

import io
import pathlib

import faiss
import imagehash
import numpy as np
import pytest
from PIL import Image, ImageEnhance

from common.encoding import encoding_quality
from common.imageio import open_image
from curation.phases.dedup.keep_rule import KeepAttributes, resolve_duplicates
from curation.phases.reference import EmbeddingPairs, HashPairs, embedding_pairs, phash_pairs

faiss.omp_set_num_threads(2)


def test_resolve_keep_rule_and_linking_signal(same_partition):
    # items: 0-1 by pHash, 1-2 by embedding (chain), 3 alone, 4-5 by both signals, 6-7-8 by embedding
    ph = HashPairs(np.array([0, 4]), np.array([1, 5]), np.array([2, 0], np.uint8))
    em = EmbeddingPairs(np.array([1, 4, 6, 7]), np.array([2, 5, 7, 8]), np.ones(4, np.float32), "flat")
    score = np.array([0.5, 0.9, 0.5, 0.1, 0.7, 0.7, np.nan, 0.2, 0.2])
    quality = np.array([80, 80, 40, np.nan, 50, 90, np.nan, np.nan, np.nan])
    width = np.array([10, 10, 10, 10, 20, 10, 99, 10, 10])
    height = np.full(9, 10)
    keys = np.array(["e", "d", "c", "b", "a", "f", "g", "z", "y"])
    keep = KeepAttributes(width=width, height=height, quality=quality, score=score)
    r = resolve_duplicates(9, {"phash": ph, "embedding": em}, keep, keys=keys)
    assert r.signals == ("phash", "embedding")
    # equal size and encoding fall to the score (1 over 0; 2 was re-encoded worse); the larger copy wins over a
    # better-encoded one (4) and over any score (6, whose score is NaN)
    assert r.keep.tolist() == [False, True, False, True, True, False, True, False, False]
    assert r.duplicate_of.tolist() == [1, -1, 1, -1, -1, 4, -1, 6, 6]
    # 0 is linked to 1 by pHash, 2 by embedding; 5 by both -> the first signal; 8 reaches 6 through 7
    assert r.linked_by_name() == ["phash", None, "embedding", None, None, "phash", None, "embedding", "embedding"]
    assert r.n_dropped == 5
    assert same_partition(r.component, np.array([0, 0, 0, 1, 2, 2, 3, 3, 3]))


def test_keep_rule_ranks_release_then_pixels_then_encoding_then_score_then_key():
    released = np.array([True, False, False, False, False, False, False])
    width = np.array([10, 100, 100, 100, 100, 100, 90])
    quality = np.array([10, 50, 90, 90, 90, np.nan, 100])
    score = np.array([0.0, 0.1, 0.0, 0.5, 0.5, 1.0, 1.0])
    keys = np.array(["z", "z", "z", "b", "a", "z", "z"])
    expected = [0, 4, 3, 2, 1, 5, 6]  # best first
    for at, best in enumerate(expected[:-1]):
        left = np.array(expected[at:])  # the items not yet picked, linked in a chain
        pairs = {"phash": HashPairs(left[:-1], left[1:], np.zeros(left.size - 1, np.uint8))}
        keep = KeepAttributes(released=released, width=width, height=width, quality=quality, score=score)
        sub = resolve_duplicates(7, pairs, keep, keys=keys)
        assert np.flatnonzero(sub.keep & np.isin(np.arange(7), left)).tolist() == [best]


def test_resolve_on_random_graph_matches_a_direct_computation(components, same_partition):
    rng = np.random.default_rng(2)
    n = 3000
    pairs = {
        "phash": HashPairs(rng.integers(0, n, 900), rng.integers(0, n, 900), np.zeros(900, np.uint8)),
        "embedding": HashPairs(rng.integers(0, n, 900), rng.integers(0, n, 900), np.zeros(900, np.uint8)),
    }
    score = rng.integers(0, 5, n).astype(float)  # many ties, so the later rules matter
    quality = rng.choice([40.0, 90.0, np.nan], n)
    width, height = rng.integers(1, 4, n), rng.integers(1, 4, n)
    released = rng.random(n) < 0.05
    keep = KeepAttributes(released=released, width=width, height=height, quality=quality, score=score)
    r = resolve_duplicates(n, pairs, keep)
    all_i = np.concatenate([p.i for p in pairs.values()])
    all_j = np.concatenate([p.j for p in pairs.values()])
    assert same_partition(r.component, components(n, all_i, all_j))
    q = np.nan_to_num(quality, nan=-1.0)
    for c in np.unique(r.component):
        members = np.flatnonzero(r.component == c)
        best = min(members, key=lambda m: (not released[m], -width[m] * height[m], -q[m], -score[m], m))
        assert r.keep[members].sum() == 1 and r.keep[best]
        assert np.all(r.duplicate_of[members[members != best]] == best)
    # every dropped item's signal is that of an edge touching it
    touching = {(int(a), s) for s, p in enumerate(pairs.values()) for a in np.concatenate([p.i, p.j])}
    for item in np.flatnonzero(~r.keep):
        assert (int(item), int(r.linked_by[item])) in touching


def test_resolve_without_pairs_keeps_everything():
    r = resolve_duplicates(4, {"phash": HashPairs(np.empty(0, int), np.empty(0, int), np.empty(0, np.uint8))})
    assert r.keep.all() and (r.duplicate_of == -1).all() and (r.linked_by == -1).all()
    assert resolve_duplicates(0, {}).keep.size == 0
    with pytest.raises(ValueError):
        resolve_duplicates(2, {"phash": HashPairs(np.array([0]), np.array([2]), np.zeros(1, np.uint8))})


# ----------------------------------------------------------------------------------------------- on real photos


def _photos() -> dict[str, Image.Image]:
    import matplotlib
    from skimage import data
    from sklearn.datasets import load_sample_image

    from generators.sample_pool import ultralytics_assets

    assets = ultralytics_assets()
    out = {n: Image.fromarray(getattr(data, n)()).convert("RGB") for n in ("astronaut", "camera", "chelsea")}
    out["bus"] = Image.open(assets / "bus.jpg").convert("RGB")
    out["zidane"] = Image.open(assets / "zidane.jpg").convert("RGB")
    out["grace_hopper"] = Image.open(pathlib.Path(matplotlib.get_data_path()) / "sample_data/grace_hopper.jpg")
    out["china"] = Image.fromarray(load_sample_image("china.jpg"))
    out["flower"] = Image.fromarray(load_sample_image("flower.jpg"))
    return {k: v.convert("RGB") for k, v in out.items()}


def _variants(im: Image.Image) -> list[Image.Image]:
    """The photo, then copies at decreasing resolution: brighter 90%, recompressed JPEG 75%, half size."""
    w, h = im.size
    buf = io.BytesIO()
    im.resize((w * 3 // 4, h * 3 // 4)).save(buf, "JPEG", quality=30)
    return [
        im,
        ImageEnhance.Brightness(im.resize((w * 9 // 10, h * 9 // 10))).enhance(1.15),
        Image.open(io.BytesIO(buf.getvalue())).convert("RGB"),
        im.resize((w // 2, h // 2)),
    ]


def _tiny_embedding(im: Image.Image) -> np.ndarray:
    """A crude global descriptor (32x32 grey thumbnail, centred, unit norm): enough to see re-encoded copies."""
    a = np.asarray(im.convert("L").resize((32, 32), Image.BILINEAR), np.float32).ravel()
    a -= a.mean()
    return a / np.linalg.norm(a)


def test_real_photo_copies_grouped_and_the_largest_kept(same_partition):
    items, photo_of = [], []
    for p, im in enumerate(_photos().values()):
        for v in _variants(im):
            items.append(v)
            photo_of.append(p)
    photo_of = np.array(photo_of)
    hashes = np.array([int(str(imagehash.phash(im)), 16) for im in items], dtype=np.uint64)
    emb = np.stack([_tiny_embedding(im) for im in items])
    ph = phash_pairs(hashes, 8)
    em = embedding_pairs(emb, 0.95, k=5)
    assert np.all(photo_of[ph.i] == photo_of[ph.j]) and np.all(photo_of[em.i] == photo_of[em.j])
    width = np.array([im.size[0] for im in items])
    height = np.array([im.size[1] for im in items])
    # each smaller copy scores higher, as a sharper-looking thumbnail may: resolution still decides
    score = np.tile(np.arange(4, dtype=float), len(items) // 4)
    keep = KeepAttributes(width=width, height=height, score=score)
    r = resolve_duplicates(len(items), {"phash": ph, "embedding": em}, keep)
    assert same_partition(r.component, photo_of)  # every photo's copies together, different photos apart
    originals = np.flatnonzero(np.r_[True, photo_of[1:] != photo_of[:-1]])
    assert np.array_equal(np.flatnonzero(r.keep), originals)
    assert set(r.linked_by_name()) == {None, "phash"}  # pHash catches them all and has priority
    assert len(em) > 0


def _jpeg(im: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_real_photo_recompressed_copies_keep_the_best_encoding(same_partition):
    """Copies of one size: the photo saved at quality 95, re-saved at 75 and 40 from it, and a lossless PNG of the
    quality-40 pixels; the scores favour the worst copy. The PNG wins (lossless), then quality 95; a copy at 40
    never wins over one of its own size."""
    items, photo_of, variant = [], [], []
    for p, im in enumerate(_photos().values()):
        best = _jpeg(im, 95)
        q40 = _jpeg(Image.open(io.BytesIO(best)), 40)
        png = io.BytesIO()
        Image.open(io.BytesIO(q40)).save(png, "PNG")
        for v, data in enumerate([best, _jpeg(Image.open(io.BytesIO(best)), 75), q40, png.getvalue()]):
            items.append(data)
            photo_of.append(p)
            variant.append(v)
    photo_of, variant = np.array(photo_of), np.array(variant)
    opened = [open_image(d) for d in items]
    quality = np.array([encoding_quality(im, d) for im, d in zip(opened, items)], float)
    assert np.array_equal(quality, np.tile([95, 75, 40, 100], len(items) // 4))  # the estimate is exact for IJG tables
    hashes = np.array([int(str(imagehash.phash(im.convert("RGB"))), 16) for im in opened], dtype=np.uint64)
    ph = phash_pairs(hashes, 8)
    width = np.array([im.size[0] for im in opened])
    height = np.array([im.size[1] for im in opened])
    score = 1.0 - quality / 100  # the models prefer the blocky copy
    r = resolve_duplicates(
        len(items), {"phash": ph}, KeepAttributes(width=width, height=height, quality=quality, score=score)
    )
    assert same_partition(r.component, photo_of)
    assert np.array_equal(np.flatnonzero(r.keep), np.flatnonzero(variant == 3))  # the lossless copy
    without_png = variant != 3
    keep = KeepAttributes(width=width, height=height, quality=np.where(without_png, quality, np.nan), score=score)
    sub = {"phash": HashPairs(*[x[without_png[ph.i] & without_png[ph.j]] for x in (ph.i, ph.j, ph.distance)])}
    r = resolve_duplicates(len(items), sub, keep)
    assert np.array_equal(np.flatnonzero(r.keep & without_png), np.flatnonzero(variant == 0))  # quality 95
