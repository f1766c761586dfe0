"""Embedding near-duplicate pairs as Ray tasks over survivor partitions (curation.phases.dedup.embedding_pairs) against the exact
single-process search (curation.phases.dedup.kernels)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.storage import join, resolve, write_parquet_atomic
from curation.phases import reference
from curation.phases.dedup import embedding_pairs as ep
from curation.phases.survivors import make_uid, partition_path, survivors_schema

THRESHOLD, K = 0.95, 8


def _embeddings(n: int, dim: int, seed: int, copies: float = 0.05, centre_norm: float = 1.0) -> np.ndarray:
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


def _write_survivors(out, x: np.ndarray, rows_per_file: int) -> tuple[list[str], np.ndarray]:
    """Survivor partitions of ``x`` in the survivors schema; returns their paths and the uid of each row of ``x``."""
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
                "phash": pa.nulls(m, pa.uint64()),
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


def _read_pairs(out) -> tuple[list[pa.Table], set]:
    paths = sorted((out / ep.PAIRS_DIR).glob("part-*.parquet"))
    tables = [pq.read_table(p) for p in paths]
    both = pa.concat_tables(tables)
    return tables, set(zip(both.column("a").to_pylist(), both.column("b").to_pylist()))


def _exact(x: np.ndarray, uid: np.ndarray) -> set:
    exact = reference.embedding_pairs(x, THRESHOLD, K, flat_max=10**9)
    return set(zip(uid[exact.i].tolist(), uid[exact.j].tolist()))


def test_recall_against_the_exact_search_each_pair_once(ray_local, tmp_path):
    x = _embeddings(8000, 128, seed=0)
    files, uid = _write_survivors(tmp_path, x, 1500)
    summary = ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K, buckets=3)
    tables, got = _read_pairs(tmp_path)
    want = _exact(x, uid)

    assert summary["buckets"] == len(tables) == 3 and summary["clusters"] > 20
    assert len(want) >= 380
    assert len(want & got) / len(want) >= 0.98
    assert sum(t.num_rows for t in tables) == len(got) == summary["pairs"]  # each pair in one file, once
    row_of = {u: i for i, u in enumerate(uid.tolist())}
    for t in tables:
        a, b, sim = (t.column(c).to_numpy() for c in ("a", "b", "similarity"))
        assert np.all(a < b) and np.all(np.diff(a) >= 0) and np.all(sim >= THRESHOLD)
        exact_sim = np.einsum("ij,ij->i", x[[row_of[v] for v in a]], x[[row_of[v] for v in b]])
        assert np.allclose(sim, exact_sim, atol=1e-5)
    assert np.load(tmp_path / ep.CENTROIDS_FILE).shape == (summary["clusters"], 128)
    assert not (tmp_path / ep.BUCKETS_DIR).exists()  # intermediates removed


def test_clusters_too_fine_for_the_threshold_are_reported_and_coarser_ones_recover(ray_local, tmp_path):
    x = _embeddings(6000, 128, seed=5, centre_norm=12.5)  # one blob at cosine ~0.9 holds most: natural pairs
    files, uid = _write_survivors(tmp_path, x, 1500)
    want = _exact(x, uid)
    fine = ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K)
    recall_fine = len(want & _read_pairs(tmp_path)[1]) / len(want)
    coarse = ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K, cluster_size=1500)
    recall_coarse = len(want & _read_pairs(tmp_path)[1]) / len(want)
    assert len(want) > 400
    assert fine["saturated"] > ep.SATURATED_WARNING and recall_fine < 0.97
    assert coarse["saturated"] < ep.SATURATED_WARNING and recall_coarse >= 0.99


def test_one_cluster_is_the_exact_search(ray_local, tmp_path):
    x = _embeddings(600, 32, seed=1)
    files, uid = _write_survivors(tmp_path, x, 250)
    summary = ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K, cluster_size=10_000)
    assert summary["clusters"] == 1
    assert _read_pairs(tmp_path)[1] == _exact(x, uid)


def test_rerun_skips_what_exists_and_rewrites_the_same_bytes(ray_local, tmp_path):
    x = _embeddings(3000, 32, seed=2)
    files, _ = _write_survivors(tmp_path, x, 1000)

    def run() -> dict:
        return ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K, buckets=3)

    first = run()
    paths = sorted((tmp_path / ep.PAIRS_DIR).glob("part-*.parquet"))
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}

    assert run()["buckets_searched"] == 0
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths} == before

    paths[1].unlink()  # as if the run had stopped before this bucket's search
    again = run()
    assert again["buckets_searched"] == 1 and again["pairs"] == first["pairs"]
    assert {p: p.read_bytes() for p in paths} == {p: b for p, (b, _) in before.items()}
    assert paths[0].stat().st_mtime_ns == before[paths[0]][1]

    other = ep.run_embedding_pairs(str(tmp_path), files, 0.98, K, buckets=2)
    assert other["buckets_searched"] == other["buckets"] == 2  # other settings: planned and searched anew
    assert len(list((tmp_path / ep.PAIRS_DIR).glob("part-*.parquet"))) == 2


def _settings(max_probes: int = 7, max_cluster: int = 100) -> ep.SearchSettings:
    layout = ep.Layout(cluster_size=40, max_cluster=max_cluster, sample_size=0, buckets=None, bucket_rows=0, seed=0)
    return ep.SearchSettings(K, THRESHOLD, ep.ProbeRule(max_probes, 1.0, THRESHOLD), layout)


def test_an_oversized_cluster_is_split_in_its_task_with_little_loss():
    x = _embeddings(3000, 64, seed=3, copies=0.1)
    uid = np.arange(len(x), dtype=np.int64) * 7
    home = np.ones(len(x), bool)
    ranked = np.zeros((len(x), 2), np.int32)
    ranked[:, 1] = 1
    whole = ep.cluster_pairs(x, uid, home, ranked, _settings(max_cluster=10**9))
    split = ep.cluster_pairs(x, uid, home, ranked, _settings())
    want, got = set(zip(*map(np.ndarray.tolist, whole[:2]))), set(zip(*map(np.ndarray.tolist, split[:2])))
    assert len(want) >= 290
    assert len(want & got) / len(want) >= 0.9
    assert np.all(split[0] < split[1]) and len(got) == split[0].size and np.all(split[2] >= THRESHOLD)


def test_a_cluster_kmeans_cannot_split_is_searched_whole():
    x = np.tile(np.eye(1, 16, dtype=np.float32), (300, 1))  # 300 identical embeddings
    uid = np.arange(300, dtype=np.int64)
    a, _b, sim = ep.cluster_pairs(x, uid, np.ones(300, bool), np.zeros((300, 1), np.int32), _settings(max_probes=0))
    assert a.size >= 300 * K // 2 and np.allclose(sim, 1.0)


def test_a_pair_across_reciprocal_probes_is_owned_by_the_home_of_the_smaller_uid():
    s = _settings(max_probes=1)
    e = np.eye(1, 8, dtype=np.float32)
    x = np.concatenate([e, e])  # one item homed here (uid 5) and one probing here (uid 3)
    # cluster 0: uid 5 is home (probes cluster 1); uid 3 is a probe row homed in cluster 1
    reciprocal = ep.cluster_pairs(x, np.array([5, 3]), np.array([True, False]), np.array([[0, 1], [1, 0]], np.int32), s)
    assert reciprocal[0].size == 0  # cluster 1, the home of uid 3, owns it
    # cluster 1: uid 3 is home (probes cluster 0), uid 5 a probe row homed in cluster 0: this cluster keeps it
    owner = ep.cluster_pairs(x, np.array([3, 5]), np.array([True, False]), np.array([[1, 0], [0, 1]], np.int32), s)
    assert (owner[0].tolist(), owner[1].tolist()) == ([3], [5])
    # not reciprocal (uid 5 probes cluster 2): only this cluster can find it, so it keeps it
    one_way = ep.cluster_pairs(x, np.array([5, 3]), np.array([True, False]), np.array([[0, 2], [1, 0]], np.int32), s)
    assert (one_way[0].tolist(), one_way[1].tolist()) == ([3], [5])


def test_sample_quotas_are_proportional_and_bounded():
    quotas = ep.sample_quotas(np.array([10, 0, 30, 60]), 50)
    assert quotas.sum() == 50 and quotas[1] == 0 and np.all(quotas <= [10, 0, 30, 60])
    assert ep.sample_quotas(np.array([3, 4]), 100).tolist() == [3, 4]


def test_buckets_are_balanced_by_predicted_rows():
    rows = np.array([20, 100, 40, 60, 30, 50, 5])
    bucket_of = ep.balance_buckets(rows, 3)
    load = np.bincount(bucket_of, weights=rows)
    assert load.size == 3 and load.max() - load.min() <= rows.max() / 2  # largest first: within the last added
    assert np.array_equal(bucket_of, ep.balance_buckets(rows, 3))


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_survivors_give_an_empty_pair_file(ray_local, tmp_path, n):
    files, _ = (
        _write_survivors(tmp_path, _embeddings(max(n, 2), 16, seed=4)[:n].reshape(n, 16), 10) if n else ([], None)
    )
    summary = ep.run_embedding_pairs(str(tmp_path), files, THRESHOLD, K)
    assert summary["pairs"] == 0 and pq.read_table(tmp_path / ep.pairs_path(0)).num_rows == 0
