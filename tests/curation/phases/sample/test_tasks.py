"""The sample phase's tasks (curation/phases/sample/tasks.py) one at a time: file facts, assign's buckets and
per-leaf counts, the budget, select's receipts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from common.storage import resolve
from curation.phases.sample import kmeans
from curation.phases.sample.selection import hierarchy_table
from curation.phases.sample.tasks import (
    BUDGET_FILE,
    HIERARCHY_FILE,
    assign_task,
    budget_task,
    counts_path,
    file_facts,
    select_task,
)
from curation.settings import SampleSettings

DIM = 8


def _survivors(path, uid: np.ndarray, x: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM)
    balance = np.array(["a", "b", "c"])[uid % 3].tolist()
    pq.write_table(pa.table({"uid": uid, "embedding": embedding, "balance": balance}), path, row_group_size=30)


def test_file_facts(tmp_path):
    fs, root = resolve(str(tmp_path))
    assert file_facts(fs, f"{root}/absent.parquet", "uid") is None
    _survivors(tmp_path / "s.parquet", np.arange(10, 70), np.zeros((60, DIM), np.float32))
    facts = file_facts(fs, f"{root}/s.parquet", "uid")
    assert facts is not None and (facts.rows, facts.uid_min, facts.uid_max) == (60, 10, 69)


def test_assign_budget_and_select(ray_local, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, DIM)).astype(np.float32)
    files = ["dedup/survivors/part-000000.parquet", "dedup/survivors/part-000001.parquet"]
    for i, f in enumerate(files):
        _survivors(tmp_path / f, np.arange(100 * i, 100 * (i + 1)), x[100 * i : 100 * (i + 1)])
    h = kmeans.hierarchical_kmeans(x, [6, 2], seed=0)
    (tmp_path / "sample").mkdir()
    pq.write_table(hierarchy_table(h), tmp_path / HIERARCHY_FILE)
    out = str(tmp_path)

    assigned = ray.get(
        [
            assign_task.remote(out, i, f, "dedup/decisions/none.parquet", (h.centroids, h.parents), 3, True, 150)
            for i, f in enumerate(files)
        ]
    )
    assert assigned == [{"rows": 100}, {"rows": 100}]
    counts = pa.concat_tables([pq.read_table(tmp_path / counts_path(i)) for i in range(2)])
    leaf = h.assignments[:, 0]
    want = np.bincount(leaf, minlength=6)
    got = np.bincount(counts.column("leaf").to_numpy(), weights=counts.column("items").to_numpy(), minlength=6)
    assert np.array_equal(got, want) and pa.compute.sum(counts.column("chosen")).as_py() == 50

    settings = SampleSettings(target_count=40, balance_key="head_yaw_class")
    assert ray.get(budget_task.remote(out, 2, settings)) == {"chosen": 50, "new": 40}
    assert pq.read_table(tmp_path / BUDGET_FILE).column("budget").to_numpy().sum() == 40

    routes = np.array([0, 100]), np.array([0, 1])
    selected = ray.get([select_task.remote(out, b, 2, *routes, "closest", True, 0, 150) for b in range(3)])
    assert sum(r["rows"] for r in selected) == 200 and sum(r["selected"] for r in selected) == 90
