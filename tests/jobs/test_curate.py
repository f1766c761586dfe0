"""End to end: the curate job on the sample pool (real photos, variants, bad inputs) with a local 2-CPU Ray."""

import hashlib
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from common import schema
from common.layout import LAYOUT
from curation.config import CurateConfig
from curation.score.ledger import committed_files, read_ledger, reason_code
from curation.steps.output import Output
from generators import sample_pool as sp
from jobs import curate, make_sample_pool

LITE = "configs/curate/lite.yaml"
FILTER_STAGES = ("decode", "person", "quality", "text_overlay")  # stages that reject on the sample pool
SURVIVED_SCORING = {schema.KEPT, schema.DUPLICATE, schema.UNSAMPLED}  # fates of images that passed phase 1


@pytest.fixture(scope="session")
def curated(sample_pool, ray_local, repo_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("curated") / "out"
    code = curate.main(["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def ledger(curated) -> dict[str, dict]:
    rows = read_ledger(str(curated)).to_pylist()
    return {r["source"]: r for r in rows}


def test_ledger_has_exactly_one_row_per_input(curated, manifest):
    sources = read_ledger(str(curated), ["source"]).column("source").to_pylist()
    assert len(sources) == len(set(sources))
    assert set(sources) == set(manifest)


def test_kept_plus_rejected_equals_inputs(ledger, curated):
    status = Counter(r["status"] for r in ledger.values())
    assert set(status) <= {schema.KEPT, schema.REJECTED, schema.ERROR, schema.DUPLICATE, schema.UNSAMPLED}
    assert status[schema.DUPLICATE] > 0 and status[schema.UNSAMPLED] > 0
    scored = pads.dataset([str(curated / f) for f in committed_files(str(curated), "scored")], format="parquet")
    survivors = status[schema.KEPT] + status[schema.DUPLICATE] + status[schema.UNSAMPLED]
    assert scored.count_rows() == survivors > 0
    final = pads.dataset(sorted(map(str, (curated / "shards").glob("*.parquet"))), format="parquet")
    assert final.count_rows() == status[schema.KEPT] > 0
    assert sum(status.values()) == len(ledger)


def test_every_filter_stage_keeps_and_rejects_something(ledger):
    rejected_by = Counter(r["stage"] for r in ledger.values() if r["status"] == schema.REJECTED)
    for stage in FILTER_STAGES:
        assert rejected_by[stage] > 0, f"{stage} rejected nothing"
    kept = [r for r in ledger.values() if r["status"] == schema.KEPT]
    # a kept image passed every stage and every global phase, so each of them also kept something
    assert kept and all(r["stage"] == "write" for r in kept)


def test_outcomes_match_what_the_pool_was_built_to_test(ledger, manifest):
    wrong = []
    for source, entry in manifest.items():
        row = ledger[source]
        expect = entry["expect"]
        if expect == "kept" and row["status"] not in SURVIVED_SCORING:
            wrong.append((entry["path"], "expected kept", row["stage"], row["reason"]))
        elif expect == "rejected":
            stages = [entry["stage"]] if "stage" in entry else entry["stage_any"]
            reasons = [entry["reason"]] if "reason" in entry else entry.get("reason_any")
            if (
                row["status"] != schema.REJECTED
                or row["stage"] not in stages
                or (reasons and reason_code(row["reason"]) not in reasons)
            ):
                wrong.append((entry["path"], f"expected rejected by {stages} {reasons}", row["stage"], row["reason"]))
        elif expect == "any" and row["status"] not in SURVIVED_SCORING and row["stage"] not in entry["stage_any"]:
            wrong.append(
                (entry["path"], f"expected kept or rejected by {entry['stage_any']}", row["stage"], row["reason"])
            )
    assert not wrong, "\n".join(map(str, wrong))


def test_bad_inputs_get_precise_reasons(ledger, manifest):
    bad = {s: e for s, e in manifest.items() if e["category"] == "bad"}
    assert len(bad) >= 7
    for source, entry in bad.items():
        row = ledger[source]
        assert row["status"] == schema.REJECTED and row["stage"] == "decode", entry["path"]
        assert ":" in row["reason"] and len(row["reason"]) > len(reason_code(row["reason"])) + 3, row["reason"]


def test_scores_before_rejection_are_kept_in_the_ledger(ledger):
    late = [r for r in ledger.values() if r["status"] == schema.REJECTED and r["stage"] in ("quality", "text_overlay")]
    assert late
    for row in late:
        assert row["key"] and row["width"] >= 384 and row["person_count"] >= 1
    quality_rejects = [r for r in late if r["stage"] == "quality"]
    assert all(r["quality"] is not None and r["text_area_frac"] is None for r in quality_rejects)


def test_scored_shards_read_back_with_declared_schema_and_the_bytes_once_in_the_final_shards(curated, manifest):
    cfg = CurateConfig()
    files = committed_files(str(curated), "scored")
    assert files and all(f.startswith("scored/") for f in files)
    for f in files:
        table = pq.read_table(curated / f)
        assert table.schema.equals(schema.scored_schema(cfg.embedding_dim))
        meta = schema.read_metadata(table.schema)
        assert meta["schema_version"] == schema.SCHEMA_VERSION and meta["table"] == "scored"
        assert meta["config_hash"] == cfg.results_hash()
        for row in table.to_pylist():
            assert row["image"]["bytes"] is None  # dropped once the final shards were written
            assert hashlib.sha256(Path(row["source"]).read_bytes()).hexdigest() == row["key"]
            assert row["phash"] is not None and len(row["embedding"]) == cfg.embedding_dim
            assert row["prominent_count"] >= 1 and row["quality"] >= cfg.filters.min_quality
    listed = json.loads((curated / LAYOUT.manifest).read_text())["shards"]
    kept = pa.concat_tables([pq.read_table(curated / LAYOUT.shards / s["file"]) for s in listed]).to_pylist()
    assert kept and all(Path(r["source"]).read_bytes() == r["image"]["bytes"] for r in kept)  # never re-encoded


def test_rerun_resumes_without_rescoring(curated, sample_pool, repo_root, capsys):
    before = {p: p.stat().st_mtime_ns for p in curated.rglob("*.parquet")}
    code = curate.main(["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(curated)])
    assert code == 0
    assert "0 to score" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in curated.rglob("*.parquet")} == before


def test_wrong_input_and_bad_override_fail_fast(tmp_path, repo_root, capsys):
    args = ["--config", str(repo_root / LITE), "--output", str(tmp_path / "o")]
    assert curate.main([*args, "--input", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert curate.main([*args, "--input", str(tmp_path), "filters.min_short_sid=3"]) == 2
    assert "filters.min_short_sid: unknown key" in capsys.readouterr().err


def test_an_output_scored_with_older_tables_is_refused_with_what_to_do(tmp_path):
    """An output from before ``encoding_quality`` (its run record names no schema version): resuming would mix scored
    files without the column the keep rule reads."""
    from common.layout import LAYOUT
    from curation.records import run_record
    from curation.steps.output import RunMismatch, claim_output

    out, pool = tmp_path / "out", tmp_path / "pool"
    pool.mkdir()
    claim_output(Output.at(str(out)), "h", str(pool), new_run=False)
    claim_output(Output.at(str(out)), "h", str(pool), new_run=False)  # the same version resumes
    old = {k: v for k, v in run_record("h", str(pool)).items() if k != "schema_version"}
    (out / LAYOUT.run_record).write_text(json.dumps(old))
    with pytest.raises(RunMismatch, match=r"older version of the pipeline .*schema version 2 or older.*--new-run"):
        claim_output(Output.at(str(out)), "h", str(pool), new_run=False)
    claim_output(Output.at(str(out)), "h", str(pool), new_run=True)
    assert json.loads((out / LAYOUT.run_record).read_text())["schema_version"] == schema.SCHEMA_VERSION


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_parquet_and_webdataset_pools_give_the_same_decode_fates(fmt, ray_local, repo_root, tmp_path, ledger, manifest):
    pool = tmp_path / fmt
    assert make_sample_pool.main(["--out", str(pool), "--seed", "0", "--format", fmt]) == 0
    out = tmp_path / "out"
    only_cheap = [
        f"stages.{s}.enabled=false" for s in ("person", "head_pose", "quality", "text_overlay", "nsfw", "embedding")
    ]
    args = [
        "--config",
        str(repo_root / LITE),
        "--input",
        str(pool),
        "--output",
        str(out),
        "--phases",
        "score",
        *only_cheap,
    ]
    assert curate.main(args) == 0
    by_name = {e["name"]: e for e in map(json.loads, (pool / "_manifest.jsonl").read_text().splitlines())}
    folder_rows = {manifest[s]["name"]: r for s, r in ledger.items()}
    rows = read_ledger(str(out)).to_pylist()
    assert len(rows) == len(by_name)
    for row in rows:
        name = next(n for n, e in by_name.items() if str(pool / e["path"]) == row["source"])
        folder = folder_rows[name]
        if folder["stage"] == "decode":  # the same decode verdict, whatever the container
            assert (row["status"], reason_code(row["reason"])) == (folder["status"], reason_code(folder["reason"])), (
                name
            )
        else:
            assert row["status"] == schema.KEPT and row["key"] == folder["key"], name
            assert folder["phash"] is None or row["phash"] == folder["phash"], name


def test_near_duplicate_variants_collapse_to_the_best_copy_as_the_pool_expects(ledger, manifest):
    """Recompressed, resized, cropped, converted and byte-identical copies of a photo end in one group, whose copy
    with the most pixels, then the best encoding, is kept; the run ends as the pool's summary says."""
    expected = sp.expected_curation(list(manifest.values()))
    assert len(expected.kept_copy) == 5
    kept_rows = {r["key"]: r for r in ledger.values() if r["status"] in (schema.KEPT, schema.UNSAMPLED)}
    for photo, names in expected.kept_copy.items():
        copies = [
            ledger[s]
            for s, e in manifest.items()
            if e["dup_group"] == photo and e["variant"] not in sp.UNLINKED_VARIANTS
        ]
        assert all(r["status"] in SURVIVED_SCORING for r in copies), photo
        winners = {r["key"] if r["status"] != schema.DUPLICATE else r["duplicate_of"] for r in copies}
        assert len(winners) == 1, (photo, [(r["source"], r["status"], r["duplicate_of"]) for r in copies])
        best = kept_rows[winners.pop()]
        assert manifest[best["source"]]["name"] in names, (photo, best["source"])
        for dup in (r for r in copies if r["status"] == schema.DUPLICATE):
            assert dup["stage"] == "dedup" and dup["duplicate_signal"] in ("phash", "embedding")
            assert best["key"] in dup["reason"]
            # keep rule: more pixels, then a better encoding
            pixels = lambda r: (r["width"] * r["height"], r["encoding_quality"])  # noqa: E731
            assert pixels(best) >= pixels(dup), (dup["source"], best["source"])
    fates = Counter(r["status"] for r in ledger.values())
    assert fates[schema.DUPLICATE] == expected.duplicates
    assert fates[schema.KEPT] + fates[schema.UNSAMPLED] == expected.after_dedup
    assert fates[schema.KEPT] == expected.kept
    assert fates[schema.REJECTED] == sum(expected.rejected.values())


def test_the_dedup_record_and_the_card_say_how_dedup_decided(curated):
    record = json.loads((curated / LAYOUT.done("dedup")).read_text())
    chance = record["chance"]
    assert chance["survivors"] == record["inputs"] and chance["expected_chance_links"] <= chance["bound"]
    card = (curated / LAYOUT.card).read_text()
    assert "## Deduplication" in card and f"At N = {chance['survivors']} survivors" in card
    for region in chance["regions"]:
        used = region["radius"] if region["radius"] >= 0 else "off"
        assert f"| {region['region']} | {region['configured_radius']} | {used} |" in card


def test_a_rule_over_the_chance_bound_stops_dedup_with_the_setting_to_change(
    curated, sample_pool, repo_root, tmp_path, capsys
):
    out = tmp_path / "out"
    shutil.copytree(curated, out)
    args = ["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(out), "--phases",
            "dedup,sample,write", "dedup.fit_radii=false", "dedup.links=[{radius: 32}]"]  # fmt: skip
    assert curate.main(args) == 2
    err = capsys.readouterr().err
    assert "error: dedup: the link rule is expected to link" in err and "dedup.links[0].radius" in err
    assert "Traceback" not in err and not (out / LAYOUT.done("dedup")).exists()


def test_unsampled_rows_name_their_clusters(ledger):
    unsampled = [r for r in ledger.values() if r["status"] == schema.UNSAMPLED]
    kept = [r for r in ledger.values() if r["status"] == schema.KEPT]
    assert unsampled and all(r["cluster_ids"] and r["stage"] == "sample" for r in unsampled)
    assert all(r["cluster_ids"] for r in kept)
    assert len(kept) == math.floor(0.8 * (len(unsampled) + len(kept)) + 0.5)  # sample.target_fraction of lite.yaml


def test_manifest_describes_the_final_shards(curated, ledger):
    manifest = json.loads((curated / "shards" / "manifest.json").read_text())
    assert manifest["schema_version"] == schema.SCHEMA_VERSION
    assert manifest["totals"]["rows"] == sum(r["status"] == schema.KEPT for r in ledger.values())
    assert sum(manifest["funnel"].values()) == len(ledger)
    for shard in manifest["shards"]:
        data = (curated / "shards" / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]
        table = pq.read_table(curated / "shards" / shard["file"])
        assert table.num_rows == shard["rows"]
        assert table.schema.equals(schema.curated_schema(None))
        for row in table.to_pylist():
            assert hashlib.sha256(row["image"]["bytes"]).hexdigest() == row["key"]
            assert ledger[row["source"]]["status"] == schema.KEPT and row["cluster_ids"]


def test_rewriting_gives_byte_identical_shards_and_manifest(curated, sample_pool, repo_root):
    before = {p.name: p.read_bytes() for p in (curated / "shards").iterdir()}
    (curated / "_state" / "write.done.json").unlink()
    args = [
        "--config",
        str(repo_root / LITE),
        "--input",
        str(sample_pool),
        "--output",
        str(curated),
        "--phases",
        "write",
    ]
    assert curate.main(args) == 0
    assert {p.name: p.read_bytes() for p in (curated / "shards").iterdir()} == before


def test_an_output_scored_before_a_stage_column_existed_reruns_its_global_phases(
    curated, sample_pool, repo_root, tmp_path
):
    """The global phases' settings may change without rescoring (results_hash leaves them out), so an output whose
    scored and ledger parts predate a stage's column (``pdq_crops``, ``nsfw_score``, ``pdq``) must still dedup,
    sample and write: the column reads as nulls, and the crop distance then links nothing those rows."""
    out = tmp_path / "out"
    shutil.copytree(curated, out)
    for path in [*(out / LAYOUT.scored).rglob("*.parquet"), *(out / LAYOUT.ledger).rglob("*.parquet")]:
        table = pq.read_table(path)
        older = [c for c in ("pdq_crops", "nsfw_score", "pdq") if c in table.column_names]
        pq.write_table(table.drop_columns(older), path)
    # other dedup settings: the global phases run again, from the scored files
    args = ["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(out), "--phases",
            "dedup,sample,write", "dedup.max_chance_fraction=0.001"]  # fmt: skip
    assert curate.main(args) == 0
    shards = pa.concat_tables(pq.read_table(p) for p in sorted((out / "shards").glob("*.parquet")))
    assert shards.num_rows > 0 and shards.column("pdq").null_count == shards.num_rows
    assert shards.column("phash").null_count == 0
    assert "pdq_crops" not in shards.column_names  # a working column: the scored parts hold it, not the dataset
    final_ledger = pq.read_table(out / LAYOUT.final_ledger, columns=["nsfw_score"])
    assert final_ledger.column("nsfw_score").null_count == final_ledger.num_rows > 0


def test_global_phases_refuse_to_run_out_of_order(tmp_path, sample_pool, repo_root, capsys):
    out = tmp_path / "fresh"
    args = ["--config", str(repo_root / LITE), "--input", str(sample_pool), "--output", str(out), "--phases", "sample"]
    assert curate.main(args) == 2
    assert "needs phase dedup" in capsys.readouterr().err


def test_the_funnel_reaches_rays_prometheus_export(curated, ledger, ray_local):
    """Each scoring stage counts its images by outcome and reason code as Ray metrics: what the Ray dashboard,
    Prometheus and Grafana read. Counters add up over the test session, so each is at least this run's count."""
    import time
    import urllib.request

    node = ray_local.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    expected = Counter(
        (r["stage"], r["status"], reason_code(r["reason"]))
        for r in ledger.values()
        if r["stage"] in FILTER_STAGES and r["status"] in (schema.REJECTED, schema.ERROR)
    )
    assert expected
    deadline, exported, busy = time.monotonic() + 90, {}, set()
    while time.monotonic() < deadline:  # the metrics agent publishes every few seconds
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        exported = {}
        for line in text.splitlines():
            if line.startswith("ray_humans1b_curation_images"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
                key = tuple(labels[k].strip('"') for k in ("stage", "outcome", "reason"))
                exported[key] = exported.get(key, 0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith("ray_humans1b_curation_stage_seconds"):
                busy.add(line.split('stage="', 1)[1].split('"', 1)[0])
        if all(exported.get(k, 0) >= n for k, n in expected.items()) and set(FILTER_STAGES) <= busy:
            break
        time.sleep(3)
    assert {k: exported.get(k, 0) for k in expected} == {k: max(n, exported.get(k, 0)) for k, n in expected.items()}
    assert set(FILTER_STAGES) <= busy
    passed = {k[0] for k in exported if k[1] == "passed"}
    assert {"decode", "person"} <= passed
