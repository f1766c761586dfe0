"""The single-process embedding pair search the phases are checked against: exact (flat) below ``flat_max``, an
inverted file searched list by list above it, with the recall its second list per item buys."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from curation.phases import reference
from curation.phases.reference import embedding_pairs

faiss.omp_set_num_threads(2)


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
