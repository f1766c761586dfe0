"""The maths of the embedding pair search (curation.phases.dedup.embedding_clusters): the search inside one cluster,
its split when oversized, pair ownership across probes, and the plan."""

import logging

import numpy as np

from curation.phases.dedup import embedding_clusters as ec

THRESHOLD, K = 0.95, 8


def _settings(max_probes: int = 7, max_cluster: int = 100) -> ec.SearchSettings:
    layout = ec.Layout(cluster_size=40, max_cluster=max_cluster, sample_size=0, buckets=None, bucket_rows=0, seed=0)
    return ec.SearchSettings(K, THRESHOLD, ec.ProbeRule(max_probes, 1.0, THRESHOLD), layout)


def test_an_oversized_cluster_is_split_in_its_task_with_little_loss(embedding_mixture):
    x = embedding_mixture(3000, 64, seed=3, copies=0.1)
    uid = np.arange(len(x), dtype=np.int64) * 7
    home = np.ones(len(x), bool)
    ranked = np.zeros((len(x), 2), np.int32)
    ranked[:, 1] = 1
    whole = ec.cluster_pairs(x, uid, home, ranked, _settings(max_cluster=10**9))
    split = ec.cluster_pairs(x, uid, home, ranked, _settings())
    want, got = set(zip(*map(np.ndarray.tolist, whole[:2]))), set(zip(*map(np.ndarray.tolist, split[:2])))
    assert len(want) >= 290
    assert len(want & got) / len(want) >= 0.9
    assert np.all(split[0] < split[1]) and len(got) == split[0].size and np.all(split[2] >= THRESHOLD)


def test_a_cluster_kmeans_cannot_split_is_searched_whole():
    x = np.tile(np.eye(1, 16, dtype=np.float32), (300, 1))  # 300 identical embeddings
    uid = np.arange(300, dtype=np.int64)
    a, _b, sim = ec.cluster_pairs(x, uid, np.ones(300, bool), np.zeros((300, 1), np.int32), _settings(max_probes=0))
    assert a.size >= 300 * K // 2 and np.allclose(sim, 1.0)


def test_a_pair_across_reciprocal_probes_is_owned_by_the_home_of_the_smaller_uid():
    s = _settings(max_probes=1)
    e = np.eye(1, 8, dtype=np.float32)
    x = np.concatenate([e, e])  # one item homed here (uid 5) and one probing here (uid 3)
    # cluster 0: uid 5 is home (probes cluster 1); uid 3 is a probe row homed in cluster 1
    reciprocal = ec.cluster_pairs(x, np.array([5, 3]), np.array([True, False]), np.array([[0, 1], [1, 0]], np.int32), s)
    assert reciprocal[0].size == 0  # cluster 1, the home of uid 3, owns it
    # cluster 1: uid 3 is home (probes cluster 0), uid 5 a probe row homed in cluster 0: this cluster keeps it
    owner = ec.cluster_pairs(x, np.array([3, 5]), np.array([True, False]), np.array([[1, 0], [0, 1]], np.int32), s)
    assert (owner[0].tolist(), owner[1].tolist()) == ([3], [5])
    # not reciprocal (uid 5 probes cluster 2): only this cluster can find it, so it keeps it
    one_way = ec.cluster_pairs(x, np.array([5, 3]), np.array([True, False]), np.array([[0, 2], [1, 0]], np.int32), s)
    assert (one_way[0].tolist(), one_way[1].tolist()) == ([3], [5])


def test_sample_quotas_are_proportional_and_bounded():
    quotas = ec.sample_quotas(np.array([10, 0, 30, 60]), 50)
    assert quotas.sum() == 50 and quotas[1] == 0 and np.all(quotas <= [10, 0, 30, 60])
    assert ec.sample_quotas(np.array([3, 4]), 100).tolist() == [3, 4]


def test_buckets_are_balanced_by_predicted_rows():
    rows = np.array([20, 100, 40, 60, 30, 50, 5])
    bucket_of = ec.balance_buckets(rows, 3)
    load = np.bincount(bucket_of, weights=rows)
    assert load.size == 3 and load.max() - load.min() <= rows.max() / 2  # largest first: within the last added
    assert np.array_equal(bucket_of, ec.balance_buckets(rows, 3))


def test_the_plan_splits_what_it_predicts_oversized_and_packs_every_cluster(embedding_mixture):
    sample = embedding_mixture(2000, 32, seed=6)
    layout = ec.Layout(cluster_size=100, max_cluster=150, sample_size=10**6, buckets=3, bucket_rows=0, seed=0)
    probes = ec.ProbeRule(7, 1.0, THRESHOLD)
    assert ec.sample_rows(20_000, layout) == 64 * 200 * 5 // 4  # 200 centroids' training rows, a fifth held out
    centroids, bucket_of, stats = ec.plan_clusters(sample, 20_000, 2, layout, probes)
    assert centroids.shape == (stats["clusters"], 32) and bucket_of.shape == (stats["clusters"],)
    assert stats["split_by_plan"] > 0 and stats["clusters"] > 200 - stats["split_by_plan"]
    assert stats["buckets"] == 3 and set(bucket_of.tolist()) == {0, 1, 2}
    assert stats["sample"] == 2000 and stats["rows_per_survivor"] >= 1
    assert stats["log"][0][0] == logging.INFO
    again = ec.plan_clusters(sample, 20_000, 2, layout, probes)
    assert np.array_equal(again[0], centroids) and np.array_equal(again[1], bucket_of)
