"""The partitioned sample phase (curation/phases/sample/cluster_sampling.py) against the single-process reference
(curation/phases/reference.py, kmeans.hierarchical_kmeans): the same selection on the same training keys, exact
sizes, balance no worse, whole small clusters, independence from partitioning, deterministic bytes, fit tasks
bounded by the fan-out as the pool grows; its steps on the runner: a killed step resumes, changed settings or
inputs clear."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.layout import LAYOUT
from curation.phases import reference
from curation.phases.sample import cluster_sampling as cs
from curation.phases.sample import kmeans
from curation.phases.sample.selection import TRAIN_STREAM, uid_uniform
from curation.phases.sample.tasks import DECISIONS_SCHEMA, HIERARCHY_FILE
from curation.phases.survivors import make_uid, survivors_schema
from curation.settings import SampleSettings
from curation.steps.output import Output
from curation.steps.runner import StepRunner

faiss.omp_set_num_threads(2)

DIM = 32
VALUES = np.array(["frontal", "left", "right", "back"], object)
VALUE_WEIGHTS = [0.75, 0.15, 0.07, 0.03]  # skewed: most heads face the camera


def mixture(n_per_component: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """L2-normalised Gaussian mixture (embeddings, component labels) in a shuffled order, and a skewed balance key
    whose values partly follow the component (so leaves differ in their value mix)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_per_component.size, DIM))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.permutation(np.repeat(np.arange(n_per_component.size), n_per_component))
    x = (centres[labels] + 0.12 * rng.standard_normal((labels.size, DIM))).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    tilt = rng.dirichlet(np.ones(VALUES.size), n_per_component.size)
    p = 0.7 * np.asarray(VALUE_WEIGHTS) + 0.3 * tilt[labels]
    balance = VALUES[(rng.random((labels.size, 1)) > np.cumsum(p, axis=1)).sum(axis=1)]
    return x, labels, balance


def write_survivors(
    root: Path, x: np.ndarray, balance: np.ndarray, dropped: np.ndarray, n_files: int
) -> tuple[list[str], list[str]]:
    """Survivors files (in uid order, 400 items per input shard) and dedup decision files listing ``dropped``
    (item indices); a file with nothing dropped has no decisions file."""
    n = x.shape[0]
    uid = make_uid(np.arange(n) // 400, np.arange(n) % 400).astype(np.int64)
    schema = survivors_schema(DIM)
    survivor_files, decision_files = [], []
    for i, rows in enumerate(np.array_split(np.arange(n), n_files)):
        table = pa.table(
            {
                "uid": uid[rows],
                "shard_id": [f"files-{u >> 32:06d}" for u in uid[rows]],
                "source": [f"pool/{j:07d}.jpg" for j in rows],
                "key": [f"k{j}" for j in rows],
                "phash": pa.nulls(rows.size, pa.uint64()),
                "pdq": pa.nulls(rows.size, pa.binary(32)),
                "pdq_crops": pa.nulls(rows.size, pa.binary()),
                "score": np.full(rows.size, np.nan),
                "width": np.full(rows.size, 512, np.int32),
                "height": np.full(rows.size, 512, np.int32),
                "encoding_quality": pa.nulls(rows.size, pa.int8()),
                "released": np.zeros(rows.size, bool),
                "balance": balance[rows].tolist(),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x[rows].ravel()), DIM),
            },
            schema=schema,
        )
        survivor_files.append(f"dedup/survivors/part-{i:06d}.parquet")
        decision_files.append(f"dedup/decisions/part-{i:06d}.parquet")
        (root / "dedup/survivors").mkdir(parents=True, exist_ok=True)
        pq.write_table(table, root / survivor_files[-1], row_group_size=300)
        gone = rows[np.isin(rows, dropped)]
        if gone.size:
            (root / "dedup/decisions").mkdir(parents=True, exist_ok=True)
            decisions = pa.table({"uid": uid[gone], "duplicate_of": [f"k{j}" for j in gone]})
            pq.write_table(decisions, root / decision_files[-1])
    return survivor_files, decision_files


def run(root: Path, files: tuple[list[str], list[str]], settings: SampleSettings, **kwargs) -> dict:
    """``run_sample`` on a runner of the sample phase, as ``curation.phases.pipeline`` hands it one."""
    return cs.run_sample(StepRunner(Output.at(str(root)), "sample", "phase", window=2), *files, settings, **kwargs)


def read_decisions(root: Path, n_files: int) -> pa.Table:
    return pa.concat_tables([pq.read_table(root / LAYOUT.sample_decision(i)) for i in range(n_files)])


def entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.fixture(scope="module")
def data():
    x, labels, balance = mixture(np.geomspace(8, 2500, 16).astype(int))
    dropped = np.random.default_rng(3).choice(x.shape[0], x.shape[0] // 20, replace=False)
    return x, labels, balance, dropped


def alive_keys(dropped: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The alive items (indices, in uid order) and their training keys, as the phase hashes them."""
    alive = np.setdiff1d(np.arange(n), dropped)
    return alive, uid_uniform(make_uid(alive // 400, alive % 400).astype(np.int64), seed, TRAIN_STREAM)


def test_it_selects_what_the_single_process_reference_selects(ray_local, tmp_path, data):
    """On the same training keys, with a fan-out that adds a level, every fit split over tasks: the same bytes of
    selection and cluster ids as the reference in one process."""
    x, _, balance, dropped = data
    files = write_survivors(tmp_path, x, balance, dropped, n_files=3)
    settings = SampleSettings(
        target_count=1500, clusters=[60, 8], mode="closest", balance_key=None, seed=4, max_fanout=6
    )
    summary = run(tmp_path, files, settings, buckets=4)

    alive, key = alive_keys(dropped, x.shape[0], seed=4)
    single = reference.balanced_sample(
        x[alive], size=1500, n_clusters=[60, 8], mode="closest", seed=4, train_key=key, max_fanout=6
    )
    got = read_decisions(tmp_path, 3)
    assert summary["largest_fit"]["centroids"] <= 6
    del summary["largest_fit"]
    assert summary == {
        "inputs": alive.size,
        "selected": 1500,
        "unsampled": alive.size - 1500,
        "levels": 4,
        "clusters_per_level": [int(c.shape[0]) for c in single.hierarchy.centroids],
    }
    # a level on top and one between; no parent has more than 6 children, so at most the 60 leaves asked for
    assert summary["clusters_per_level"][1:] == [20, 8, 3] and 40 <= summary["clusters_per_level"][0] <= 60
    assert got.column("source").to_pylist() == [f"pool/{j:07d}.jpg" for j in alive]
    assert np.array_equal(np.flatnonzero(got.column("selected").to_numpy()), single.indices)
    assert np.array_equal(np.asarray(got.column("cluster_ids").to_pylist()), single.cluster_ids)


def test_exact_size_and_balance_no_worse_than_single_process(ray_local, tmp_path, data):
    """Trained on a third of the items (the distributed path proper). k-means outcomes vary from seed to seed for
    both (the single-process one subsamples too), so the spreads are compared as means over seeds."""
    x, labels, balance, dropped = data
    files = write_survivors(tmp_path, x, balance, dropped, n_files=4)
    alive = np.setdiff1d(np.arange(x.shape[0]), dropped)
    codes = np.unique(balance[alive], return_inverse=True)[1]

    def spread(indices):
        concepts = np.bincount(labels[alive][indices], minlength=labels.max() + 1)
        return entropy(concepts), concepts.max(), entropy(np.bincount(codes[indices]))

    ours, theirs = [], []
    for seed in range(4):
        settings = SampleSettings(target_fraction=0.1, clusters=[100, 16], balance_key="head_yaw_class", seed=seed)
        summary = run(tmp_path, files, settings, buckets=3)
        chosen = np.flatnonzero(read_decisions(tmp_path, 4).column("selected").to_numpy())
        single = reference.balanced_sample(
            x[alive], fraction=0.1, n_clusters=[100, 16], mode="closest", balance_key=codes, seed=seed
        )
        assert chosen.size == single.indices.size == summary["selected"] == round(0.1 * alive.size)
        ours.append(spread(chosen))
        theirs.append(spread(single.indices))
    (c_ent, c_max, v_ent), (s_c_ent, s_c_max, s_v_ent) = np.mean(ours, axis=0), np.mean(theirs, axis=0)
    assert c_ent >= s_c_ent - 0.05 and c_max <= 1.15 * s_c_max and v_ent >= s_v_ent - 0.03
    uniform = spread(np.random.default_rng(0).choice(alive.size, chosen.size, replace=False))
    assert c_ent > uniform[0] + 0.4 and c_max < 0.6 * uniform[1] and v_ent > uniform[2] + 0.15


def test_clusters_below_their_share_are_taken_whole_and_closest_first(ray_local, tmp_path, data):
    x, _, balance, dropped = data
    files = write_survivors(tmp_path, x, balance, dropped, n_files=2)
    settings = SampleSettings(target_count=3000, clusters=[40], mode="closest", balance_key="head_yaw_class")
    run(tmp_path, files, settings, buckets=2)
    got = read_decisions(tmp_path, 2)
    leaf = np.asarray(got.column("cluster_ids").to_pylist())[:, 0]
    selected = got.column("selected").to_numpy()
    size, taken = np.bincount(leaf, minlength=40), np.bincount(leaf[selected], minlength=40)
    partial = taken < size
    level = taken[partial].min()
    assert taken.sum() == 3000 and np.all(taken[partial] <= level + 1)
    assert (~partial).sum() >= 3 and np.all(size[~partial] <= level + 1)  # small leaves whole

    # inside a (leaf, value) group, every pick is closer to the leaf centroid than every item left out
    centroids = pq.read_table(tmp_path / HIERARCHY_FILE).filter(pa.compute.equal(pa.compute.field("level"), 0))
    c = np.stack(centroids.column("centroid").to_numpy(zero_copy_only=False))
    alive = np.setdiff1d(np.arange(x.shape[0]), dropped)
    dist = ((x[alive] - c[leaf]) ** 2).sum(axis=1)
    value = balance[alive]
    for g in {(a, b) for a, b in zip(leaf[partial[leaf]], value[partial[leaf]])}:
        members = (leaf == g[0]) & (value == g[1])
        if selected[members].any() and (~selected[members]).any():
            assert dist[members & selected].max() <= dist[members & ~selected].min() + 1e-5


def test_independent_of_partitioning_and_deterministic(ray_local, tmp_path, data):
    x, _, balance, dropped = data
    settings = SampleSettings(target_fraction=0.2, clusters=[50, 6], mode="random", seed=7)
    runs = []
    for name, n_files, buckets in (("a", 2, 1), ("b", 5, 4), ("c", 5, 4)):
        root = tmp_path / name
        files = write_survivors(root, x, balance, dropped, n_files=n_files)
        run(root, files, settings, buckets=buckets)
        runs.append(read_decisions(root, n_files))
    assert runs[0].equals(runs[1])

    # each level is trained on the alive items of lowest hash, as the reference trains on them
    alive, key = alive_keys(dropped, x.shape[0], seed=7)
    want = kmeans.hierarchical_kmeans(x[alive], [50, 6], seed=7, train_key=key)
    got = pq.read_table(tmp_path / "a" / HIERARCHY_FILE).to_pydict()
    for level in (0, 1):
        rows = [i for i, lv in enumerate(got["level"]) if lv == level]
        assert np.array_equal(np.asarray([got["centroid"][i] for i in rows], np.float32), want.centroids[level])
    for i in range(5):
        b, c = (tmp_path / name / LAYOUT.sample_decision(i) for name in "bc")
        assert b.read_bytes() == c.read_bytes()


def test_no_fit_task_grows_with_the_pool(ray_local, tmp_path, data):
    """Default clusters (about sqrt(N) leaves) under a fan-out of 4: as N grows 4x, a level is added, and the
    largest fit task still has at most 4 centroids on at most 4 x 256 points."""
    x, _, balance, dropped = data
    levels = []
    for n in (x.shape[0] // 4, x.shape[0]):
        files = write_survivors(tmp_path / str(n), x[:n], balance[:n], dropped[dropped < n], n_files=2)
        summary = run(tmp_path / str(n), files, SampleSettings(target_fraction=0.3, max_fanout=4))
        assert summary["largest_fit"]["centroids"] <= 4 and summary["largest_fit"]["points"] <= 4 * 256
        levels.append(summary["clusters_per_level"])
    assert levels[1][0] > 1.8 * levels[0][0] and len(levels[1]) == len(levels[0]) + 1 and levels[1][-1] <= 4


def test_a_killed_step_resumes_and_changed_settings_or_inputs_clear(ray_local, tmp_path, data, caplog):
    x, _, balance, dropped = data
    files = write_survivors(tmp_path, x[:3000], balance[:3000], dropped[dropped < 3000], n_files=3)
    settings = SampleSettings(target_count=500, clusters=[30, 5])
    caplog.set_level(logging.INFO, logger="curation")
    first = run(tmp_path, files, settings, buckets=2)
    outputs = {i: tmp_path / LAYOUT.sample_decision(i) for i in range(3)}
    hierarchy, buckets = tmp_path / HIERARCHY_FILE, tmp_path / "sample/work/buckets/part-000000.parquet"
    before = {i: (p.read_bytes(), p.stat().st_mtime_ns) for i, p in outputs.items()}
    untouched = {p: p.stat().st_mtime_ns for p in (hierarchy, buckets)}

    # everything done: nothing runs, nothing is rewritten
    caplog.clear()
    assert run(tmp_path, files, settings, buckets=2) == first
    assert not any("done before" in line for line in caplog.messages)
    assert all(p.stat().st_mtime_ns == before[i][1] for i, p in outputs.items())

    # a kill in the select step, after bucket 0 was receipted and before assemble started: bucket 1 and assemble
    # run again, the steps before are not touched, the bytes are the same
    state = tmp_path / "_state/steps/sample"
    for path in (state / "select.done.json", state / "select/bucket-00001.json", state / "assemble.started.json"):
        path.unlink()
    for path in (state / "assemble.done.json", *(state / "assemble").iterdir()):
        path.unlink()
    (tmp_path / "sample/work/selected/bucket-00001.parquet").unlink()
    outputs[1].unlink()
    caplog.clear()
    assert run(tmp_path, files, settings, buckets=2) == first
    assert "[sample] select: 1 of 2 buckets done before" in caplog.messages
    assert not any(" done before" in line for line in caplog.messages if "assemble" in line or "assign" in line)
    assert all(p.read_bytes() == before[i][0] for i, p in outputs.items())
    assert all(p.stat().st_mtime_ns == t for p, t in untouched.items())

    # other settings: every step's outputs are cleared as it comes to it, not mixed in
    stray = tmp_path / "sample/work/selected/bucket-00009.parquet"
    stray.write_bytes(b"from another run")
    caplog.clear()
    other = run(tmp_path, files, settings.model_copy(update={"seed": 9}), buckets=2)
    assert other["selected"] == 500 and not stray.exists()
    assert any("gather: settings or inputs changed" in line for line in caplog.messages)
    assert hierarchy.stat().st_mtime_ns != untouched[hierarchy]

    # other inputs (a survivors file rewritten: its modification time changed): the same
    survivors = tmp_path / files[0][0]
    os.utime(survivors, ns=(survivors.stat().st_atime_ns, survivors.stat().st_mtime_ns + 10**9))
    caplog.clear()
    assert run(tmp_path, files, settings, buckets=2) == first
    assert any("gather: settings or inputs changed" in line for line in caplog.messages)
    assert all(p.read_bytes() == before[i][0] for i, p in outputs.items())


def test_tiny_and_empty_inputs(ray_local, tmp_path, data):
    x, _, balance, _ = data
    tiny = {
        "inputs": 5,
        "selected": 3,
        "unsampled": 2,
        "levels": 1,
        "clusters_per_level": [1],
        "largest_fit": {"centroids": 1, "points": 5},
    }
    files = write_survivors(tmp_path / "tiny", x[:6], balance[:6], np.array([2]), n_files=2)
    assert run(tmp_path / "tiny", files, SampleSettings(target_count=3)) == tiny

    files = write_survivors(tmp_path / "gone", x[:6], balance[:6], np.arange(6), n_files=2)
    summary = run(tmp_path / "gone", files, SampleSettings(target_count=3))
    assert summary["inputs"] == 0 and read_decisions(tmp_path / "gone", 2).num_rows == 0
    assert read_decisions(tmp_path / "gone", 2).schema.equals(DECISIONS_SCHEMA)

    # the same output with survivors alive again, then none: each run's decisions, never the other's
    shutil.rmtree(tmp_path / "gone/dedup/decisions")
    write_survivors(tmp_path / "gone", x[:6], balance[:6], np.array([2]), n_files=2)
    assert run(tmp_path / "gone", files, SampleSettings(target_count=3)) == tiny
    assert read_decisions(tmp_path / "gone", 2).num_rows == 5
    write_survivors(tmp_path / "gone", x[:6], balance[:6], np.arange(6), n_files=2)
    assert run(tmp_path / "gone", files, SampleSettings(target_count=3))["inputs"] == 0
    assert read_decisions(tmp_path / "gone", 2).num_rows == 0


def test_the_console_line_says_in_words_what_was_selected_and_how():
    line = cs.summary_line(12, 10, [3, 2], {"centroids": 3, "points": 12}, 1)
    assert line == (
        "[sample] 10 of the 12 images left after dedup selected, 2 unsampled; 2 cluster levels of 3 and 2 clusters "
        "(finest first); the largest fit: 3 centroids on 12 points; 1 select bucket"
    )
    one = cs.summary_line(1, 1, [1], {"centroids": 1, "points": 1}, 2)
    assert "1 of the 1 image left" in one and "1 cluster level of 1 cluster;" in one and "1 centroid on 1 point" in one
    assert "{" not in line + one and "[3" not in line
