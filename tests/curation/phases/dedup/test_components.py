"""Distributed components and keep rule (curation.phases.dedup.components) against the single-process kernel
(dedup.resolve_duplicates) on small synthetic survivors and pair files."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.layout import LAYOUT
from curation.phases.dedup import components as components_module
from curation.phases.dedup import keep_rule
from curation.phases.dedup.component_files import WORK_DIR, ComponentsError
from curation.phases.dedup.component_tasks import keep_attributes
from curation.phases.survivors import make_uid, survivors_schema
from curation.steps.output import Output
from curation.steps.runner import StepRunner

DIM = 4


class Survivors(NamedTuple):
    files: list[str]
    table: pa.Table  # every survivor, in uid order (the global index of the reference run)


class Links(NamedTuple):
    i: np.ndarray
    j: np.ndarray


def write_survivors(root: Path, n_files: int, shards_per_file: int, rows_per_shard: int, seed: int) -> Survivors:
    """Survivors in the shared schema, with ties on score, resolution and encoding quality, repeated keys (exact
    copies) and some released images."""
    rng = np.random.default_rng(seed)
    files, tables = [], []
    for f in range(n_files):
        shard = np.repeat(np.arange(f * shards_per_file, (f + 1) * shards_per_file), rows_per_shard)
        rank = np.tile(np.arange(rows_per_shard), shards_per_file)
        n = shard.size
        score = rng.integers(0, 4, n) / 4.0
        score[rng.random(n) < 0.2] = np.nan
        side = rng.choice([384, 512], n).astype(np.int32)
        key = np.asarray([f"{k:04x}" for k in rng.integers(0, 600, n)])
        key[rng.random(n) < 0.02] = None
        t = pa.table(
            {
                "uid": make_uid(shard.astype(np.int64), rank.astype(np.int64)),
                "shard_id": [f"shard-{s:05d}" for s in shard],
                "source": [f"pool/{s:05d}/{r:04d}.jpg" for s, r in zip(shard, rank)],
                "key": pa.array(key.tolist(), pa.string()),
                "phash": pa.array(rng.integers(0, 2**63, n).astype(np.uint64)),
                "pdq": pa.nulls(n, pa.binary(32)),
                "pdq_crops": pa.nulls(n, pa.binary()),
                "score": score,
                "width": side,
                "height": rng.choice([384, 512], n).astype(np.int32),
                "encoding_quality": pa.array(rng.choice([40, 90, 100], n), pa.int8(), mask=rng.random(n) < 0.2),
                "released": rng.random(n) < 0.05,
                "balance": pa.nulls(n, pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(np.zeros(n * DIM, np.float32), DIM),
            },
            schema=survivors_schema(DIM),
        )
        rel = f"dedup/survivors/part-{f:06d}.parquet"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, root / rel, row_group_size=100)
        files.append(rel)
        tables.append(t)
    return Survivors(files, pa.concat_tables(tables))


def random_graph(n: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Stars, chains, cliques and random links in two signals, with shared pairs, reversed pairs and self-loops."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    at = 0

    def take(k: int) -> np.ndarray:
        nonlocal at
        at += k
        return order[at - k : at]

    links: dict[str, list] = {"phash": [], "embedding": []}
    for _ in range(25):
        g = take(int(rng.integers(2, 12)))
        links[str(rng.choice(list(links)))].append((np.full(g.size - 1, g[0]), g[1:]))  # star
    for _ in range(15):
        g = take(int(rng.integers(2, 40)))
        signal = rng.integers(0, 2, g.size - 1)
        for code, name in enumerate(links):
            links[name].append((g[:-1][signal == code], g[1:][signal == code]))  # chain, mixed signals
    for _ in range(10):
        g = take(int(rng.integers(3, 8)))
        a, b = np.triu_indices(g.size, 1)
        links["embedding"].append((g[a], g[b]))  # clique
        links["phash"].append((g[b[:2]], g[a[:2]]))  # the same pairs again, reversed, in the other signal
    pool = take(n // 4)
    a, b = rng.choice(pool, 150), rng.choice(pool, 150)  # random links: some merge groups, some are loops
    links["phash"].append((a[:75], b[:75]))
    links["embedding"].append((a[75:], b[75:]))
    return {
        name: (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        for name, parts in links.items()
    }


def write_pairs(root: Path, survivors: Survivors, graph: dict, files_per_signal: int) -> dict[str, list[str]]:
    uid = survivors.table.column("uid").to_numpy()
    out = {}
    for name, (i, j) in graph.items():
        out[name] = []
        for k, rows in enumerate(np.array_split(np.arange(i.size), files_per_signal)):
            rel = f"dedup/pairs/{name}/part-{k:06d}.parquet"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.table({"a": uid[i[rows]], "b": uid[j[rows]], "distance": np.zeros(rows.size, np.float32)}),
                root / rel,
            )
            out[name].append(rel)
    return out


def reference(survivors: Survivors, graph: dict) -> dict[int, tuple[str, str]]:
    """uid -> (duplicate_of key, signal) for every dropped survivor, from the single-process kernel."""
    t = survivors.table
    keys = np.asarray(
        [f"{k}\x00{s}" for k, s in zip(t.column("key").to_pylist(), t.column("source").to_pylist())], object
    )
    result = keep_rule.resolve_duplicates(
        t.num_rows, {name: Links(i, j) for name, (i, j) in graph.items()}, keep_attributes(t), keys=keys
    )
    uid, key = t.column("uid").to_numpy(), t.column("key").to_pylist()
    signal = result.linked_by_name()
    return {int(uid[d]): (key[result.duplicate_of[d]], signal[d]) for d in np.flatnonzero(~result.keep)}


def decisions(root: Path, survivors: Survivors) -> dict[int, tuple[str, str]]:
    out = {}
    for i, f in enumerate(survivors.files):
        held = set(pq.read_table(root / f, columns=["uid"]).column("uid").to_pylist())
        t = pq.read_table(root / LAYOUT.dedup_decision(i))
        rows = t.to_pylist()
        assert t.column("uid").to_pylist() == sorted(t.column("uid").to_pylist())
        assert all(r["uid"] in held for r in rows), "a decision sits in another survivor file's partition"
        out.update({r["uid"]: (r["duplicate_of"], r["duplicate_signal"]) for r in rows})
    return out


def copy_inputs(root: Path, out: Path, survivors: Survivors, pairs: dict[str, list[str]]) -> Path:
    for rel in [*survivors.files, *(p for files in pairs.values() for p in files)]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes((root / rel).read_bytes())
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("components")
    survivors = write_survivors(root, n_files=4, shards_per_file=3, rows_per_shard=250, seed=1)
    graph = random_graph(survivors.table.num_rows, seed=2)
    return root, survivors, graph, write_pairs(root, survivors, graph, files_per_signal=3)


def run_components(out, *args, **kwargs) -> dict:
    runner = StepRunner(Output.at(str(out)), "dedup", "settings", window=4)
    return components_module.run_components(runner, *args, **kwargs)


@pytest.mark.parametrize(
    "partitions,local_edges,files_per_task", [(3, 0, 4), (5, 0, 1), (2, None, 3)], ids=["rounds-3", "rounds-5", "local"]
)
def test_decisions_match_single_process(ray_local, case, tmp_path, partitions, local_edges, files_per_task):
    root, survivors, graph, pairs = case
    out = copy_inputs(root, tmp_path / "out", survivors, pairs)
    summary = run_components(
        out,
        pairs,
        survivors.files,
        partitions,
        local_edges=local_edges,
        files_per_task=files_per_task,
    )
    want = reference(survivors, graph)
    got = decisions(out, survivors)
    assert got == want  # kept items, duplicate_of and linked_by all identical
    assert summary["dropped"] == len(want)
    assert summary["by_signal"] == {s: sum(v[1] == s for v in want.values()) for s in graph}
    assert summary["pairs"] == {s: int(graph[s][0].size) for s in graph}
    assert (summary["rounds"] > 0) == (local_edges == 0)
    assert not (out / WORK_DIR).exists()


def test_long_chain_converges_and_max_rounds_stops(ray_local, tmp_path):
    survivors = write_survivors(tmp_path, n_files=3, shards_per_file=2, rows_per_shard=500, seed=3)
    n = survivors.table.num_rows
    order = np.random.default_rng(4).permutation(n)
    graph = {"phash": (order[:-1], order[1:]), "embedding": (np.empty(0, np.int64), np.empty(0, np.int64))}
    pairs = write_pairs(tmp_path, survivors, graph, files_per_signal=2)
    with pytest.raises(ComponentsError, match="max_rounds=2"):
        run_components(tmp_path, pairs, survivors.files, partitions=2, max_rounds=2, local_edges=0)
    summary = run_components(tmp_path, pairs, survivors.files, partitions=2, local_edges=0)
    assert 2 < summary["rounds"] <= 25 and summary["components"] == 1 and summary["dropped"] == n - 1
    assert decisions(tmp_path, survivors) == reference(survivors, graph)


def test_rerun_skips_finished_work_and_is_byte_identical(ray_local, case, tmp_path):
    root, survivors, _graph, pairs = case
    out = copy_inputs(root, tmp_path / "out", survivors, pairs)
    args = dict(partitions=3, local_edges=0, keep_work=True)
    first = run_components(out, pairs, survivors.files, **args)
    written = {p: p.read_bytes() for p in sorted((out / "dedup/decisions").glob("*.parquet"))}
    work = {p: p.stat().st_mtime_ns for p in (out / WORK_DIR).rglob("*.parquet")}

    assert run_components(out, pairs, survivors.files, **args) == first  # done: nothing runs
    assert all(p.stat().st_mtime_ns == t for p, t in work.items())

    # an interrupted run: the last two steps not done, one decisions file and one keep task's output neither
    # written nor receipted
    for step in ("components/keep", "components/write"):
        (out / LAYOUT.step_done("dedup", step)).unlink()
    next(iter(written)).unlink()
    (out / LAYOUT.step_unit("dedup", "components/write", "part-000000")).unlink()
    removed = [p for p in work if "keep/dropped" in str(p) and "part-000001" in p.name]
    for p in removed:
        p.unlink()
    (out / LAYOUT.step_unit("dedup", "components/keep", "part-000001")).unlink()
    assert run_components(out, pairs, survivors.files, **args) == first
    assert {p: p.read_bytes() for p in written} == written
    assert all(p.stat().st_mtime_ns == t for p, t in work.items() if p not in removed), "finished tasks were redone"

    # other partitioning: same decisions, earlier work thrown away
    again = run_components(out, pairs, survivors.files, **{**args, "partitions": 4})
    assert {p: p.read_bytes() for p in written} == written
    assert {k: again[k] for k in ("dropped", "by_signal", "components")} == {
        k: first[k] for k in ("dropped", "by_signal", "components")
    }


def test_no_pairs_keeps_everyone_and_unknown_uids_are_refused(ray_local, tmp_path):
    survivors = write_survivors(tmp_path, n_files=2, shards_per_file=1, rows_per_shard=50, seed=5)
    empty = np.empty(0, np.int64)
    pairs = write_pairs(tmp_path, survivors, {"phash": (empty, empty)}, files_per_signal=1)
    summary = run_components(tmp_path, pairs, survivors.files)
    assert summary["dropped"] == 0 and summary["components"] == 0 and summary["rounds"] == 0
    assert all(pq.read_table(tmp_path / LAYOUT.dedup_decision(i)).num_rows == 0 for i in range(2))

    bad = tmp_path / "dedup/pairs/bad.parquet"
    pq.write_table(pa.table({"a": [int(survivors.table.column("uid")[0].as_py())], "b": [make_uid(99, 0)]}), bad)
    with pytest.raises(ComponentsError, match="no survivor file"):
        run_components(tmp_path, {"phash": ["dedup/pairs/bad.parquet"]}, survivors.files)


def test_counts_per_signal_read_as_words():
    assert components_module.by_signal_words({"phash": 11, "embedding": 10}) == "phash 11, embedding 10"
    assert components_module.by_signal_words({}) == "no signal"
    assert components_module.by_signal_words({}, "no links") == "no links"
