"""Embedding near-duplicate pairs as steps over survivor partitions (curation.phases.dedup.embedding_pairs) against
the exact single-process search (curation.phases.reference), and their resume on the step runner."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from common.layout import LAYOUT
from curation.phases import reference
from curation.phases.dedup import embedding_pairs as ep
from curation.phases.dedup import embedding_tasks as tasks
from curation.phases.dedup.embedding_clusters import SATURATED_WARNING
from curation.phases.dedup.link_rule import NO_HASH, Region, crop_distances, pair_distances
from curation.steps.output import Output
from curation.steps.runner import StepRunner

THRESHOLD, K = 0.95, 8


def _run(out, files: list[str], threshold: float = THRESHOLD, **settings) -> dict:
    runner = StepRunner(Output.at(str(out)), "dedup", "settings", window=2)
    return ep.run_embedding_pairs(runner, files, threshold, K, **settings)


def _read_pairs(out) -> tuple[list, set]:
    tables = [pq.read_table(p) for p in sorted((out / tasks.PAIRS_DIR).glob("part-*.parquet"))]
    pairs = {(a, b) for t in tables for a, b in zip(t.column("a").to_pylist(), t.column("b").to_pylist())}
    return tables, pairs


def _exact(x: np.ndarray, uid: np.ndarray) -> set:
    exact = reference.embedding_pairs(x, THRESHOLD, K, flat_max=10**9)
    return set(zip(uid[exact.i].tolist(), uid[exact.j].tolist()))


def test_recall_against_the_exact_search_each_pair_once(ray_local, tmp_path, embedding_mixture, write_survivors):
    x = embedding_mixture(8000, 128, seed=0)
    files, uid = write_survivors(tmp_path, x, 1500)
    summary = _run(tmp_path, files, buckets=3)
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
    assert np.load(tmp_path / tasks.CENTROIDS_FILE).shape == (summary["clusters"], 128)
    assert not (tmp_path / tasks.BUCKETS_DIR).exists()  # intermediates removed


def test_clusters_too_fine_for_the_threshold_are_reported_and_coarser_ones_recover(
    ray_local, tmp_path, embedding_mixture, write_survivors
):
    x = embedding_mixture(6000, 128, seed=5, centre_norm=12.5)  # one blob at cosine ~0.9 holds most: natural pairs
    files, uid = write_survivors(tmp_path, x, 1500)
    want = _exact(x, uid)
    fine = _run(tmp_path, files)
    recall_fine = len(want & _read_pairs(tmp_path)[1]) / len(want)
    coarse = _run(tmp_path, files, cluster_size=1500)
    recall_coarse = len(want & _read_pairs(tmp_path)[1]) / len(want)
    assert len(want) > 400
    assert fine["saturated"] > SATURATED_WARNING and recall_fine < 0.97
    assert coarse["saturated"] < SATURATED_WARNING and recall_coarse >= 0.99


def test_one_cluster_is_the_exact_search(ray_local, tmp_path, embedding_mixture, write_survivors):
    x = embedding_mixture(600, 32, seed=1)
    files, uid = write_survivors(tmp_path, x, 250)
    summary = _run(tmp_path, files, cluster_size=10_000)
    assert summary["clusters"] == 1
    assert _read_pairs(tmp_path)[1] == _exact(x, uid)


@ray.remote(num_cpus=0.25)
def _killed() -> dict:
    raise RuntimeError("the run was killed here")


def test_a_killed_search_resumes_from_its_receipts_and_a_new_threshold_clears_it(
    ray_local, tmp_path, monkeypatch, embedding_mixture, write_survivors
):
    x = embedding_mixture(3000, 32, seed=2)
    out, clean = tmp_path / "killed", tmp_path / "clean"
    files, _ = write_survivors(out, x, 1000)
    write_survivors(clean, x, 1000)
    first = _run(clean, files, buckets=4)
    want = {p.name: p.read_bytes() for p in (clean / tasks.PAIRS_DIR).glob("part-*.parquet")}

    # a kill at the third bucket: the buckets before it may finish, it and those after it never do
    search = ep.EmbeddingSearch.run_unit
    ran: list[str] = []

    def kill_from_the_third(step, unit):
        ran.append(unit)
        return _killed.remote() if unit >= "part-00002" else search(step, unit)

    monkeypatch.setattr(ep.EmbeddingSearch, "run_unit", kill_from_the_third)
    with pytest.raises(ray.exceptions.RayTaskError, match="killed"):
        _run(out, files, buckets=4)
    receipts = out / LAYOUT.step_units("dedup", "embedding-search")
    kept = sorted(p.stem for p in receipts.glob("*.json"))
    assert "part-00000" in kept and "part-00002" not in kept
    assert (out / LAYOUT.step_done("dedup", "embedding-assign")).exists()
    assert not (out / LAYOUT.step_done("dedup", "embedding-search")).exists()
    before = {u: (out / tasks.pairs_path(int(u[5:]))).stat().st_mtime_ns for u in kept}

    # the rerun searches only the buckets without a receipt, and ends with the bytes of an uninterrupted run
    ran.clear()
    monkeypatch.setattr(ep.EmbeddingSearch, "run_unit", lambda step, unit: ran.append(unit) or search(step, unit))
    resumed = _run(out, files, buckets=4)
    assert ran == [u for u in ("part-00000", "part-00001", "part-00002", "part-00003") if u not in kept]
    assert resumed["pairs"] == first["pairs"] and resumed["buckets"] == 4
    assert {p.name: p.read_bytes() for p in (out / tasks.PAIRS_DIR).glob("part-*.parquet")} == want
    assert {u: (out / tasks.pairs_path(int(u[5:]))).stat().st_mtime_ns for u in kept} == before
    assert not (out / tasks.BUCKETS_DIR).exists()

    # done with these settings: the recorded summary, nothing run
    ran.clear()
    assert _run(out, files, buckets=4) == resumed and ran == []

    # a new threshold: the plan, its buckets and the pairs are cleared and made anew
    other = _run(out, files, 0.98, buckets=2)
    assert other["buckets_searched"] == other["buckets"] == 2 and ran == ["part-00000", "part-00001"]
    assert len(list((out / tasks.PAIRS_DIR).glob("part-*.parquet"))) == 2
    assert sorted(p.stem for p in receipts.glob("*.json")) == ["part-00000", "part-00001"]


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_survivors_give_an_empty_pair_file(ray_local, tmp_path, n, embedding_mixture, write_survivors):
    files = write_survivors(tmp_path, embedding_mixture(2, 16, seed=4)[:n], 10)[0] if n else []
    summary = _run(tmp_path, files)
    assert summary == {"survivors": n, "clusters": 0, "buckets": 1, "pairs": 0}
    assert pq.read_table(tmp_path / tasks.pairs_path(0)).num_rows == 0


def test_the_phash_confirms_each_pair_of_a_joint_region(ray_local, tmp_path, embedding_mixture, write_survivors):
    x = embedding_mixture(3000, 32, seed=5)
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 2**63, len(x), dtype=np.int64).astype(np.uint64)
    near = rng.random(len(x)) < 0.5  # half the rows share their pHash with row 0's, a few bits off
    hashes[near] = hashes[0] ^ rng.integers(0, 16, int(near.sum()), dtype=np.int64).astype(np.uint64)
    files, uid = write_survivors(tmp_path / "all", x, 1000, hashes)
    write_survivors(tmp_path / "confirmed", x, 1000, hashes)
    everything = _run(tmp_path / "all", files)
    confirmed = _run(tmp_path / "confirmed", files, confirm=(Region(4, THRESHOLD),))
    _, all_pairs = _read_pairs(tmp_path / "all")
    tables, kept = _read_pairs(tmp_path / "confirmed")
    of = {u: h for u, h in zip(uid.tolist(), hashes.tolist())}
    distance = {(a, b): int(pair_distances(np.uint64(of[a]), np.uint64(of[b]))) for a, b in all_pairs}
    assert kept == {p for p, d in distance.items() if d <= 4} and 0 < confirmed["pairs"] < everything["pairs"]
    assert all(distance[(a, b)] == d for t in tables for a, b, d in zip(*(t.column(c).to_pylist() for c in "ab"),
               t.column("distance").to_pylist()))  # fmt: skip
    # without pHashes nothing is confirmed, and the distance column says so
    files, _ = write_survivors(tmp_path / "unhashed", x, 1000)
    assert _run(tmp_path / "unhashed", files, confirm=(Region(64, THRESHOLD),))["pairs"] == 0
    _run(tmp_path / "unhashed-all", write_survivors(tmp_path / "unhashed-all", x, 1000)[0])
    assert set(_read_pairs(tmp_path / "unhashed-all")[0][0].column("distance").to_pylist()) <= {NO_HASH}


def test_a_crop_region_links_the_pairs_within_its_crop_distance(
    ray_local, tmp_path, embedding_mixture, write_survivors
):
    x = embedding_mixture(3000, 32, seed=6)
    rng = np.random.default_rng(6)
    hashes = rng.integers(0, 2**63, len(x), dtype=np.int64).astype(np.uint64)
    pdq = rng.integers(0, 2**63, (len(x), 4), dtype=np.int64).astype(np.uint64)
    crops = rng.integers(0, 2**63, (len(x), 16, 4), dtype=np.int64).astype(np.uint64)
    files, uid = write_survivors(tmp_path / "all", x, 1000, hashes, (pdq, crops))
    _run(tmp_path / "all", files)
    _, all_pairs = _read_pairs(tmp_path / "all")
    row = {u: r for r, u in enumerate(uid.tolist())}
    # half the embedding pairs become crops: b's PDQ a few bits off one of a's sub-crop PDQs
    for a, b in sorted(all_pairs)[::2]:
        crops[row[a], rng.integers(0, 16)] = pdq[row[b]] ^ np.array([int(rng.integers(0, 64)), 0, 1, 0], np.uint64)
    files, _ = write_survivors(tmp_path / "crops", x, 1000, hashes, (pdq, crops))
    result = _run(tmp_path / "crops", files, confirm=(Region(4, 0.0), Region(6, THRESHOLD, crops=True)))
    tables, kept = _read_pairs(tmp_path / "crops")
    a, b = (np.array([row[u] for u, _ in sorted(all_pairs)]), np.array([row[v] for _, v in sorted(all_pairs)]))
    crop = dict(zip(sorted(all_pairs), crop_distances(pdq[a], crops[a], pdq[b], crops[b]).tolist()))
    plain = dict(zip(sorted(all_pairs), pair_distances(hashes[a], hashes[b]).tolist()))
    assert kept == {p for p in all_pairs if crop[p] <= 6 or plain[p] <= 4} and len(kept) >= len(all_pairs) // 3
    assert result["pairs"] == len(kept)
    got = {
        (u, v): c for t in tables for u, v, c in zip(*(t.column(n).to_pylist() for n in ("a", "b", "crop_distance")))
    }
    assert all(got[p] == crop[p] for p in kept)
