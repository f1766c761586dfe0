"""The Ray-distributed pair searches of the dedup phase agree with the single-process ones."""

import numpy as np

from curation import dedup as dd
from curation.phases import embedding_pairs_on_ray, phash_pairs_on_ray


def _planted_hashes(n: int, rng: np.random.Generator) -> np.ndarray:
    hashes = rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    for src in rng.choice(n, size=n // 10, replace=False):
        dst = rng.integers(n)
        bits = rng.choice(64, size=rng.integers(0, 11), replace=False)
        hashes[dst] = hashes[src] ^ np.uint64(sum(1 << int(b) for b in bits))
    return hashes


def test_phash_pairs_on_ray_equal_the_single_process_search(ray_local):
    hashes = _planted_hashes(4000, np.random.default_rng(1))
    local = dd.phash_pairs(hashes, 8)
    on_ray = phash_pairs_on_ray(hashes, 8, splits_per_band=3)
    assert len(local) > 200
    assert np.array_equal(local.i, on_ray.i) and np.array_equal(local.j, on_ray.j)
    brute = dd.brute_force_hash_pairs(hashes, 8)
    assert set(zip(brute.i.tolist(), brute.j.tolist())) >= set(zip(on_ray.i.tolist(), on_ray.j.tolist()))


def test_embedding_pairs_on_ray_recall_against_exact(ray_local):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6000, 32)).astype(np.float32)
    copies = rng.choice(6000, size=600, replace=False)
    x[copies[:300]] = x[copies[300:]] + 0.05 * rng.standard_normal((300, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    exact = dd.embedding_pairs(x, 0.95, 8, flat_max=10**9)
    on_ray = embedding_pairs_on_ray(x, 0.95, 8, lists_per_task=16)
    want = set(zip(exact.i.tolist(), exact.j.tolist()))
    got = set(zip(on_ray.i.tolist(), on_ray.j.tolist()))
    assert len(want) >= 290
    assert len(want & got) / len(want) >= 0.95 and got <= want | got
    assert np.all(on_ray.similarity >= 0.95)
