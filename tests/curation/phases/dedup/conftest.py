"""Inputs of the embedding pair search (a Gaussian mixture with planted near-copies, written as survivor partitions)
and the check that two labellings group items alike. Handed to tests as fixtures (a function each)."""

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from common.storage import join, resolve, write_parquet_atomic
from curation.phases.survivors import make_uid, partition_path, survivors_schema


def _mixture(n: int, dim: int, seed: int, copies: float = 0.05, centre_norm: float = 1.0) -> np.ndarray:
    """A long-tailed Gaussian mixture, L2-normalised, with planted near-copies at cosine ~0.96-0.99.

    Centres of norm 1 (against noise of norm 0.35 √D) give diffuse concepts; a large ``centre_norm`` a tight one,
    dense with natural pairs at the threshold."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((32, dim)).astype(np.float32)
    centres *= centre_norm / np.linalg.norm(centres, axis=1, keepdims=True)
    weights = rng.zipf(1.5, 32).astype(np.float64)
    x = centres[rng.choice(32, n, p=weights / weights.sum())] + 0.35 * rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    m = int(n * copies)
    src, dst = np.split(rng.choice(n, 2 * m, replace=False), 2)
    cos = rng.uniform(0.96, 0.99, m)
    noise = np.sqrt((1 / cos**2 - 1) / dim)[:, None] * rng.standard_normal((m, dim))
    x[dst] = x[src] + noise.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _binary(words: np.ndarray) -> pa.Array:
    """Rows of uint64 words as one binary value each, as the phash stage stores hashes."""
    rows = np.ascontiguousarray(words, np.uint64).reshape(len(words), -1)
    return pa.array([r.tobytes() for r in rows], pa.binary(rows.shape[1] * 8))


def _write_survivors(
    out,
    x: np.ndarray,
    rows_per_file: int,
    phash: np.ndarray | None = None,
    pdq: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[str], np.ndarray]:
    """Survivor partitions of ``x`` (and ``phash``, uint64 per row, ``pdq``, the PDQs and sub-crop PDQs as (rows, 4)
    and (rows, K, 4) uint64 words; None: none) in the survivors schema under ``out``; returns their paths and the
    uid of each row of ``x``."""
    fs, root = resolve(str(out))
    n, dim = x.shape
    files, uids = [], []
    for i, start in enumerate(range(0, n, rows_per_file)):
        e = x[start : start + rows_per_file]
        m = len(e)
        uid = make_uid(np.full(m, i, np.int64), np.arange(m, dtype=np.int64))
        table = pa.table(
            {
                "uid": uid,
                "shard_id": [f"shard-{i}"] * m,
                "source": [f"s://{i}/{j}" for j in range(m)],
                "key": [f"{i}-{j}" for j in range(m)],
                "phash": pa.nulls(m, pa.uint64()) if phash is None else pa.array(phash[start : start + m], pa.uint64()),
                "pdq": pa.nulls(m, pa.binary(32)) if pdq is None else _binary(pdq[0][start : start + m]),
                "pdq_crops": pa.nulls(m, pa.binary()) if pdq is None else _binary(pdq[1][start : start + m]),
                "score": np.full(m, np.nan),
                "width": np.full(m, 64, np.int32),
                "height": np.full(m, 64, np.int32),
                "encoding_quality": pa.nulls(m, pa.int8()),
                "released": np.zeros(m, bool),
                "balance": pa.nulls(m, pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(e.ravel()), dim),
            },
            schema=survivors_schema(dim),
        )
        files.append(partition_path(i))
        write_parquet_atomic(fs, join(root, files[-1]), table, row_group_size=1000)
        uids.append(uid)
    return files, np.concatenate(uids)


@pytest.fixture(scope="session")
def embedding_mixture() -> Callable[..., np.ndarray]:
    """``embedding_mixture(n, dim, seed, copies=0.05, centre_norm=1.0)``: see ``_mixture``."""
    return _mixture


@pytest.fixture(scope="session")
def write_survivors() -> Callable[..., tuple[list[str], np.ndarray]]:
    """``write_survivors(out, x, rows_per_file, phash=None)``: see ``_write_survivors``."""
    return _write_survivors


def _components(n: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The connected component of each of ``n`` items linked by the pairs (i, j)."""
    g = csr_matrix((np.ones(i.size), (i, j)), shape=(n, n))
    return connected_components(g, directed=False)[1]


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Two labelings describe the same grouping (labels themselves may differ)."""
    pairs = np.unique(np.stack([a, b], axis=1), axis=0)
    return len(pairs) == len(np.unique(a)) == len(np.unique(b))


@pytest.fixture(scope="session")
def components() -> Callable[[int, np.ndarray, np.ndarray], np.ndarray]:
    """``components(n, i, j)``: see ``_components``."""
    return _components


@pytest.fixture(scope="session")
def same_partition() -> Callable[[np.ndarray, np.ndarray], bool]:
    """``same_partition(a, b)``: see ``_same_partition``."""
    return _same_partition
