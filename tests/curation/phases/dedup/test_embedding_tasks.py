"""The Ray tasks of the embedding pair search (curation.phases.dedup.embedding_tasks), run one by one: what each
writes, and a retried task that finds its output written."""

import numpy as np
import pyarrow.parquet as pq
import ray

from common.storage import resolve
from curation.phases.dedup import embedding_tasks as tasks
from curation.phases.dedup.embedding_clusters import Layout, ProbeRule, SearchSettings

THRESHOLD, K = 0.95, 8


def test_plan_assign_and_search_by_hand(ray_local, tmp_path, embedding_mixture, write_survivors):
    files, uid = write_survivors(tmp_path, embedding_mixture(2000, 32, seed=7), 800)
    out = str(tmp_path)
    fs, root = resolve(out)
    counts = np.array([pq.read_metadata(tmp_path / f).num_rows for f in files])
    layout = Layout(cluster_size=60, max_cluster=240, sample_size=10**6, buckets=2, bucket_rows=0, seed=0)
    probes = ProbeRule(7, 1.0, THRESHOLD)

    stats = ray.get(tasks.make_plan.remote(out, files, counts, layout, probes))
    centroids, bucket_of = tasks.read_plan(fs, root)
    assert centroids.shape == (stats["clusters"], 32) and bucket_of.max() + 1 == stats["buckets"] == 2

    shared = (probes.centroids(centroids), bucket_of)
    assigned = ray.get([tasks.assign_file.remote(out, f, i, shared, probes) for i, f in enumerate(files)])
    assert sum(r["rows"] for r in assigned) >= len(uid)  # each survivor once at home, some in probed clusters too
    assert all((tmp_path / tasks.bucket_path(b, i)).exists() for b in range(2) for i in range(len(files)))
    assert ray.get(tasks.assign_file.remote(out, files[0], 0, shared, probes))["rows"] == 0  # a retry: written

    settings = SearchSettings(K, THRESHOLD, probes, layout)
    searched = ray.get([tasks.search_bucket.remote(out, b, len(files), settings) for b in range(2)])
    assert not any(r["skipped"] for r in searched) and sum(r["rows"] for r in searched) == sum(
        r["rows"] for r in assigned
    )
    assert not any((tmp_path / tasks.bucket_path(b, 0)).exists() for b in range(2))  # rows deleted once searched
    tables = [pq.read_table(tmp_path / tasks.pairs_path(b)) for b in range(2)]
    assert [t.num_rows for t in tables] == [r["pairs"] for r in searched] and sum(r["pairs"] for r in searched) > 0
    retried = ray.get(tasks.search_bucket.remote(out, 1, len(files), settings))
    assert retried == {"pairs": searched[1]["pairs"], "skipped": True}


def test_no_pairs_is_one_empty_file(ray_local, tmp_path):
    receipt = ray.get(tasks.write_no_pairs.remote(str(tmp_path)))
    table = pq.read_table(tmp_path / tasks.pairs_path(0))
    assert receipt["pairs"] == table.num_rows == 0 and table.schema == tasks.PAIRS_SCHEMA
