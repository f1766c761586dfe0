"""curation.audit.report_data: what the report shows, folded a file at a time into state bounded by what it shows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from curation.audit.explorer import CANDIDATES, candidates
from curation.audit.report_data import Picks, ReportOptions, ScoreValues, _clusters, _duplicates


def test_picks_keep_every_row_up_to_k_and_k_of_more():
    rng = np.random.default_rng(0)
    few = Picks(3, rng)
    for source in ("c", "a", "b"):
        few.offer({"source": source})
    assert [r["source"] for r in few.rows()] == ["a", "b", "c"] and few.n == 3

    def pick(seed: int) -> list[str]:
        many = Picks(5, np.random.default_rng(seed))
        for i in range(10_000):
            many.offer({"source": f"{i:05d}"})
        assert many.n == 10_000
        return [r["source"] for r in many.rows()]

    assert len(pick(0)) == 5 and pick(0) == pick(0) != pick(1)  # a seed's picks, the same every time


def test_score_values_are_exact_up_to_the_cap_and_a_bounded_sample_past_it():
    exact = ScoreValues(100, np.random.default_rng(0))
    for v in range(50):
        exact.add(float(v), v < 10)
    values, rejected = exact.arrays()
    assert values.tolist() == list(range(50)) and rejected.sum() == 10
    sampled = ScoreValues(100, np.random.default_rng(0))
    for v in range(100_000):
        sampled.add(float(v), False)
    values, _ = sampled.arrays()
    assert sampled.n == 100_000 and len(values) == 100 and len(set(values.tolist())) == 100
    assert values.mean() > 20_000  # drawn from the whole stream, not its start


def _dataset(tmp_path, name: str, table: pa.Table) -> ds.Dataset:
    (tmp_path / name).mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), tmp_path / name / "part-000000.parquet")
    pq.write_table(table.slice(half), tmp_path / name / "part-000001.parquet")
    return ds.dataset(tmp_path / name, format="parquet")


def test_duplicate_groups_largest_first_with_their_members(tmp_path):
    keys = ["k2", "k1", "k1", "k3", "k2", "k1"]
    table = pa.table(
        {
            "source": [f"s{i}" for i in range(6)],
            "duplicate_of": keys,
            "duplicate_signal": ["phash", "embedding", "phash", "phash", "phash", "phash"],
        }
    )
    dups = _duplicates(_dataset(tmp_path, "d", table), shown=2)
    assert (dups.dropped, dups.groups, dups.by_signal) == (6, 3, {"phash": 5, "embedding": 1})
    assert [(key, [d["source"] for d in members]) for key, members in dups.shown] == [
        ("k1", ["s1", "s2", "s5"]),
        ("k2", ["s0", "s4"]),
    ]


def test_cluster_sizes_and_grids_selected_first(tmp_path):
    table = pa.table(
        {
            "source": [f"s{i}" for i in range(7)],
            "cluster_ids": pa.array([[0, 9], [1, 9], [0, 9], [0, 9], [1, 9], [2, 8], []], pa.list_(pa.int32())),
            "selected": [False, True, True, False, False, True, True],
        }
    )
    clusters = _clusters(_dataset(tmp_path, "s", table), ReportOptions(clusters=2, per_cluster=2))
    assert (clusters.images, clusters.count, clusters.levels) == (7, 4, 2)
    assert clusters.sizes[:2] == [(0, 3, 1), (1, 2, 1)]
    assert {leaf: [d["source"] for d in grid] for leaf, grid in clusters.shown.items()} == {
        0: ["s2", "s0"],
        1: ["s1", "s4"],
    }


def test_explorer_candidates_are_the_configured_value_and_rounded_quantiles():
    rng = np.random.default_rng(0)
    got = candidates(rng.random(1000), 0.5, integer=False)
    assert 0.5 in got and got == sorted(got) and len(set(got)) == len(got) == CANDIDATES
    assert all(v == float(f"{v:.2g}") for v in got)
    # quantiles crowded near one value get a third digit rather than collapsing
    crowded = candidates(0.975 + 0.025 * rng.random(1000), 0.5, integer=False)
    assert len(crowded) == CANDIDATES
    sides = candidates(rng.integers(100, 2000, 1000).astype(float), 384, integer=True)
    assert 384 in sides and all(isinstance(v, int) and v >= 1 for v in sides)
    assert candidates(np.full(10, 4 / 3), 3.0, integer=False) == [1.3, 3.0]
    assert candidates(np.empty(0), None, integer=False) == [None]  # an unset threshold: off, first
