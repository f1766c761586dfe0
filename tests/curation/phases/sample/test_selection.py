"""The sample phase's arithmetic (curation/phases/sample/selection.py): cluster counts, per-uid hashes, the hierarchy
table, leaf budgets and the selection inside leaves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from curation.phases.sample import kmeans
from curation.phases.sample.selection import (
    cluster_counts,
    hierarchy_from_table,
    hierarchy_table,
    leaf_budgets,
    leaf_cluster_ids,
    leaf_counts,
    member,
    select_in_leaves,
    uid_uniform,
    value_ranks,
)
from curation.settings import SampleSettings


def test_cluster_counts():
    assert cluster_counts(5, None) == [1]
    assert cluster_counts(10_000, None) == [100, 10]
    assert cluster_counts(30, [50, 4]) == [30, 4]


def test_uid_uniform_is_fixed_per_uid_and_uniform():
    uid = np.arange(100_000, dtype=np.int64) << 20
    u = uid_uniform(uid, seed=3, stream=1)
    assert np.all((u >= 0) & (u < 1)) and abs(u.mean() - 0.5) < 0.01
    assert np.array_equal(u[::7], uid_uniform(uid[::7], seed=3, stream=1))  # independent of what else is hashed
    assert not np.array_equal(u, uid_uniform(uid, seed=3, stream=2))
    assert not np.array_equal(u, uid_uniform(uid, seed=4, stream=1))


def test_member_is_isin_on_a_sorted_set():
    values = np.array([5, 1, 9, 3, 12])
    assert np.array_equal(member(values, np.array([1, 3, 12])), np.isin(values, [1, 3, 12]))
    assert not member(values, np.zeros(0, np.int64)).any()


def test_hierarchy_table_round_trip():
    rng = np.random.default_rng(0)
    h = kmeans.hierarchical_kmeans(rng.standard_normal((300, 8)).astype(np.float32), [12, 3], seed=0)
    centroids, parents = hierarchy_from_table(hierarchy_table(h))
    assert all(np.array_equal(a, b) for a, b in zip(centroids, h.centroids))
    assert np.array_equal(parents[0], h.parents[0]) and len(parents) == 1
    ids = leaf_cluster_ids(parents, 12)
    assert np.array_equal(ids[:, 0], np.arange(12)) and np.array_equal(ids[:, 1], h.parents[0])


def test_select_in_leaves_takes_each_budget_lowest_priority_first():
    leaf = np.array([0, 0, 0, 1, 1, 2])
    priority = np.array([0.3, 0.1, 0.2, 0.9, 0.5, 0.4])
    mask = select_in_leaves(leaf, priority, np.array([2, 1, 5]), None, seed=0)
    assert mask.tolist() == [False, True, True, False, True, True]  # leaf 2's budget capped at its one item


def test_select_in_leaves_spreads_over_the_balance_values():
    leaf = np.zeros(12, np.int64)
    balance = np.array([0] * 9 + [1] * 3)
    mask = select_in_leaves(leaf, np.arange(12.0), np.array([6]), balance, seed=0)
    assert np.bincount(balance[mask]).tolist() == [3, 3]  # not the 6 of lowest priority, all of value 0


def test_leaf_budgets_meet_the_target_and_leave_room_for_the_chosen():
    rng = np.random.default_rng(1)
    h = kmeans.hierarchical_kmeans(rng.standard_normal((400, 8)).astype(np.float32), [10, 2], seed=0)
    counts = np.full(10, 40, np.int64)
    budget = leaf_budgets(h.centroids, h.parents, counts, np.zeros(10, np.int64), SampleSettings(target_count=100))
    assert budget.sum() == 100 and np.all(budget <= counts)
    chosen = np.zeros(10, np.int64)
    chosen[0] = 30
    budget = leaf_budgets(h.centroids, h.parents, counts, chosen, SampleSettings(target_count=100))
    assert budget.sum() == 100 and budget[0] < budget[1:].min()


def test_leaf_counts_and_value_ranks():
    t = leaf_counts(np.array([1, 2, 3, 4, 5]), np.array([7, 2, 7, 7, 2]), chosen_from=4)
    assert t.to_pydict() == {"leaf": [2, 7], "items": [2, 3], "chosen": [1, 1]}
    assert leaf_counts(np.array([1]), np.array([3]), None).column("chosen").to_pylist() == [0]
    ranks = value_ranks(pa.chunked_array([["left", None], ["frontal", "left"]]))
    assert ranks.tolist() == [2, 0, 1, 2]  # "None" < "frontal" < "left"
