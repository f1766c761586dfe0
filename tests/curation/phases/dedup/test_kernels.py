"""Global dedup: exact pHash pairs, embedding pairs (exact and IVF), components and the keep rule."""

from __future__ import annotations

import io
import pathlib

import faiss
import imagehash
import numpy as np
import pytest
from PIL import Image, ImageEnhance
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from common.encoding import encoding_quality
from common.imageio import open_image
from curation.phases import reference
from curation.phases.dedup import kernels as dedup
from curation.phases.dedup.kernels import (
    KeepAttributes,
    band_pairs,
    build_band_table,
    collapse_exact,
    plan_bands,
    resolve_duplicates,
)
from curation.phases.reference import (
    EmbeddingPairs,
    HashPairs,
    brute_force_hash_pairs,
    embedding_pairs,
    pairs_from_unique,
    phash_pairs,
)

faiss.omp_set_num_threads(2)


def flip_bits(h: np.uint64, n_bits: int, rng: np.random.Generator) -> np.uint64:
    bits = rng.choice(64, n_bits, replace=False)
    return np.uint64(h ^ np.uint64(sum(1 << int(b) for b in bits)))


@pytest.fixture(scope="module")
def planted_hashes() -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """3000 random hashes with 40 planted copies at every distance 0..12 (some chained through earlier copies)."""
    rng = np.random.default_rng(7)
    h = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True)
    planted = []
    for dist in range(13):
        for _ in range(40):
            a, b = rng.choice(h.size, 2, replace=False)
            h[b] = flip_bits(h[a], dist, rng)
            planted.append((int(a), int(b), dist))
    return h, planted


def as_sets(p: HashPairs) -> set[tuple[int, int, int]]:
    return set(zip(p.i.tolist(), p.j.tolist(), p.distance.tolist()))


def components(n: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    g = csr_matrix((np.ones(i.size), (i, j)), shape=(n, n))
    return connected_components(g, directed=False)[1]


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Two labelings describe the same grouping (labels themselves may differ)."""
    pairs = np.unique(np.stack([a, b], axis=1), axis=0)
    return len(pairs) == len(np.unique(a)) == len(np.unique(b))


# --------------------------------------------------------------------------------------------------- pHash pairs


@pytest.mark.parametrize("n_bands", [None, 3, 4, 5, 9])
@pytest.mark.parametrize("radius", [4, 8])
def test_phash_pairs_equal_brute_force(planted_hashes, n_bands, radius):
    h, planted = planted_hashes
    ref = brute_force_hash_pairs(h, radius)
    got = phash_pairs(h, radius, spanning=False, n_bands=n_bands)
    assert as_sets(got) == as_sets(ref)
    assert len(got) == len(ref)  # no pair listed twice
    assert np.all(got.i < got.j)
    # the planted copies that survived later overwrites: inside the radius found, outside it absent
    found = set(zip(got.i.tolist(), got.j.tolist()))
    for a, b, _ in planted:
        distance = bin(int(h[a]) ^ int(h[b])).count("1")
        assert ((min(a, b), max(a, b)) in found) == (distance <= radius)


def test_phash_threads_and_tasks_are_disjoint_and_complete(planted_hashes):
    h, _ = planted_hashes
    ref = as_sets(brute_force_hash_pairs(h, 8))
    assert as_sets(phash_pairs(h, 8, spanning=False, threads=2, n_bands=3)) == ref
    # the distributed path: every task on its own, results concatenated
    groups = collapse_exact(h)
    plan = plan_bands(groups.unique.size, 8, n_bands=3)
    parts = [band_pairs(groups.unique, plan, t.band_index, (t.mask_start, t.mask_stop)) for t in plan.tasks(4)]
    u, v, d = (np.concatenate(p) for p in zip(*parts))
    keys = u * groups.unique.size + v
    assert np.unique(keys).size == keys.size  # every pair reported by exactly one task
    assert as_sets(pairs_from_unique(groups, u, v, d, spanning=False)) == ref


def test_band_plan_is_exact_by_pigeonhole_and_adapts_to_size():
    for n in (1_000, 1_000_000):
        plan = plan_bands(n, 8)
        assert sum(b.width for b in plan.bands) == 64
        assert plan.max_flips == 8 // len(plan.bands)
        assert max(b.width for b in plan.bands) <= dedup.MAX_BAND_WIDTH
    assert len(plan_bands(1_000_000, 8).bands) < len(plan_bands(1_000, 8).bands)  # wide bands pay off at scale
    masks = plan_bands(10, 8, n_bands=3).masks(0)
    assert masks[0] == 0 and len(masks) == len(set(masks.tolist())) == 1 + 22 + 22 * 21 // 2


def test_exact_duplicate_clique_becomes_a_star():
    rng = np.random.default_rng(3)
    h = rng.integers(0, 2**64 - 1, 2000, dtype=np.uint64, endpoint=True)
    h[100:600] = h[100]  # one image uploaded 500 times
    h[700] = flip_bits(h[100], 3, rng)  # and a near copy of it
    ref = brute_force_hash_pairs(h, 8)
    full = phash_pairs(h, 8, spanning=False)
    assert as_sets(full) == as_sets(ref)
    assert len(full) >= 500 * 499 // 2  # the clique
    star = phash_pairs(h, 8)
    # spanning set: 499 star edges, and each near pair of distinct hashes once, from the group's first item
    assert len(star) == 499 + len(brute_force_hash_pairs(np.unique(h), 8))
    assert {(100, j, 0) for j in range(101, 600)} <= as_sets(star)
    assert (100, 700, 3) in as_sets(star)
    assert same_partition(components(h.size, star.i, star.j), components(h.size, ref.i, ref.j))


def test_huge_bucket_is_scanned_in_bounded_steps(monkeypatch):
    """Hashes that share their high bits pile into one bucket: the scan cuts it into pieces, still exact."""
    rng = np.random.default_rng(5)
    low = rng.integers(0, 2**20, 1500, dtype=np.uint64)
    h = np.concatenate([np.uint64(0xABCDE) << np.uint64(40) | low, rng.integers(0, 2**63, 500, dtype=np.uint64)])
    monkeypatch.setattr(dedup, "MAX_CANDIDATES_PER_STEP", 1000)
    plan = plan_bands(h.size, 8, n_bands=3)
    table = build_band_table(np.unique(h), plan.bands[2])
    assert table.counts.max() * (table.counts.max() - 1) > 1000  # the crowded bucket needs several steps
    assert as_sets(phash_pairs(h, 8, spanning=False, n_bands=3)) == as_sets(brute_force_hash_pairs(h, 8))


def test_phash_inputs_and_edge_cases():
    h = np.array([5, 5, 7, 1 << 40], dtype=np.uint64)
    assert as_sets(phash_pairs(h.view(np.int64), 2, spanning=False)) == {(0, 1, 0), (0, 2, 1), (1, 2, 1)}
    assert as_sets(phash_pairs(h, 0)) == {(0, 1, 0)}
    assert len(phash_pairs(np.empty(0, np.uint64), 8)) == 0
    with pytest.raises(TypeError):
        phash_pairs(h.astype(np.float64), 8)


# ---------------------------------------------------------------------------------------------- embedding pairs


@pytest.fixture(scope="module")
def planted_embeddings() -> np.ndarray:
    """A clustered cloud (like image embeddings) with 1500 planted near copies, some close to the threshold."""
    rng = np.random.default_rng(11)
    n, d, copies = 12_000, 48, 1500
    centres = rng.standard_normal((200, d)).astype(np.float32)
    x = centres[rng.integers(0, 200, n)] + 0.6 * rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    src = rng.choice(n - copies, copies, replace=False)
    noise = rng.standard_normal((copies, d)).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    y = x[src] + rng.uniform(0.05, 0.4, (copies, 1)).astype(np.float32) * noise  # cosine ~0.92..0.999
    x[n - copies :] = y / np.linalg.norm(y, axis=1, keepdims=True)
    return x


def reference_pairs(x: np.ndarray, threshold: float, k: int) -> set[tuple[int, int]]:
    """k nearest neighbours of every item by a full numpy similarity matrix, thresholded."""
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    nn = np.argsort(-sims, axis=1)[:, :k]
    q = np.repeat(np.arange(x.shape[0]), k)
    j = nn.ravel()
    ok = sims[q, j] >= threshold
    return set(zip(np.minimum(q, j)[ok].tolist(), np.maximum(q, j)[ok].tolist()))


def test_flat_embedding_pairs_are_exact(planted_embeddings):
    x = planted_embeddings[:3000]
    got = embedding_pairs(x, 0.9, k=5)
    assert got.method == "flat"
    assert set(zip(got.i.tolist(), got.j.tolist())) == reference_pairs(x, 0.9, 5)
    assert np.all(got.i < got.j)
    np.testing.assert_allclose(got.similarity, np.sum(x[got.i] * x[got.j], axis=1), atol=1e-5)


def test_ivf_embedding_pairs_recall(planted_embeddings):
    x = planted_embeddings
    exact = embedding_pairs(x, 0.95, k=10)
    approx = embedding_pairs(x, 0.95, k=10, flat_max=1000)
    single = embedding_pairs(x, 0.95, k=10, flat_max=1000, lists_per_item=1)
    assert exact.method == "flat" and approx.method == "ivf"
    assert len(exact) > 500  # the planted copies above the threshold
    exact_keys = exact.i * x.shape[0] + exact.j
    approx_keys = approx.i * x.shape[0] + approx.j
    recall = np.isin(exact_keys, approx_keys).mean()
    assert recall >= 0.95
    # joining two lists per item is what buys the recall: pairs split by a list boundary are found again
    assert recall > np.isin(exact_keys, single.i * x.shape[0] + single.j).mean()
    # what IVF returns is right: the similarities are exact and above the threshold
    assert np.all(approx.similarity >= 0.95)
    np.testing.assert_allclose(approx.similarity, np.sum(x[approx.i] * x[approx.j], axis=1), atol=1e-5)
    assert np.unique(approx_keys).size == approx_keys.size


def test_ivf_huge_list_is_searched_in_pieces(planted_embeddings):
    """Many identical embeddings make one list huge; pieces merged by ResultHeap give the same neighbours."""
    x = planted_embeddings[:4000].copy()
    x[:1500] = x[0]
    part = reference.build_ivf_partition(x, nlist=20)
    lists = range(part.nlist)
    whole = reference.ivf_block_pairs(x, part, lists, 5, 0.9)
    pieces = reference.ivf_block_pairs(x, part, lists, 5, 0.9, max_candidates=300)
    key = lambda p: set(zip(p[0].tolist(), p[1].tolist()))  # noqa: E731
    # ties among identical vectors may pick different equal neighbours: compare the non-tied part and sizes
    assert len(whole[0]) == len(pieces[0])
    assert {k for k in key(whole) if k[0] >= 1500} == {k for k in key(pieces) if k[0] >= 1500}


# ------------------------------------------------------------------------------------------- components and keep


def test_resolve_keep_rule_and_linking_signal():
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


def test_resolve_on_random_graph_matches_a_direct_computation():
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


def test_real_photo_copies_grouped_and_the_largest_kept():
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


def test_real_photo_recompressed_copies_keep_the_best_encoding():
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
