"""Decisions re-taken from stored scores equal a run's with the new thresholds, to the bit; a what-if says so without
writing anything, and says which inputs need model work."""

from __future__ import annotations

import io
import json
import math
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from common import schema
from common.config import load_config
from curation.config import CurateConfig
from curation.score.chain import score_in_process
from curation.score.originals import SourceReader
from curation.score.pool import Pool, list_shards
from curation.score.redecide import NEEDS, Decider, NeedsNewRun
from curation.score.rerun import rerun_rows

REPO = Path(__file__).resolve().parents[3]


def _ledger(table: pa.Table) -> pa.Table:
    """Phase 1's ledger rows of an in-process run, by source."""
    ledger = schema.ledger_schema()
    return table.select(ledger.names).cast(ledger).sort_by("source")


def _cfg(**filters) -> CurateConfig:
    return CurateConfig.model_validate({"filters": filters})


@pytest.fixture(scope="module")
def scored(sample_pool):
    """The sample pool scored in this process at the lite profile's thresholds and at tighter ones."""
    runs = {}
    for name, cfg in {"default": _cfg(), "tight": _cfg(min_quality=0.7, min_short_side=512)}.items():
        shards = list_shards(Pool.at(str(sample_pool)), cfg.input)
        runs[name] = (cfg, _ledger(score_in_process(cfg, shards, str(sample_pool))))
    return runs


def _same_rows(a: pa.Table, b: pa.Table) -> None:
    assert a.column("source").to_pylist() == b.column("source").to_pylist()
    for name in a.column_names:
        assert a.column(name).equals(b.column(name)), name


def test_tightened_thresholds_re_decided_equal_a_run_with_them(scored):
    (cfg_a, ledger_a), (cfg_b, ledger_b) = scored["default"], scored["tight"]
    redecided, walks = Decider(cfg_a, cfg_b).ledger(ledger_a)
    assert not [w for w in walks if w.status == NEEDS]  # tightening needs no model
    _same_rows(redecided, ledger_b)
    kept = lambda t: pc.sum(pc.equal(t.column("status"), schema.KEPT)).as_py()  # noqa: E731
    assert 0 < kept(ledger_b) < kept(ledger_a)  # the test can fail: the thresholds moved images
    codes = {r.split(":")[0] for r in redecided.column("reason").to_pylist() if r}
    assert {"too_small", "low_quality"} <= codes


def test_relaxed_thresholds_need_the_stages_the_cascade_skipped(scored):
    (cfg_a, ledger_a), (cfg_b, ledger_b) = scored["default"], scored["tight"]
    redecided, walks = Decider(cfg_b, cfg_a).ledger(ledger_b)
    needs = [i for i, w in enumerate(walks) if w.status == NEEDS]
    # exactly the inputs a run at the default thresholds takes further than the tight run did need model work, from
    # the stage after the one that stopped them
    order = {name: i for i, name in enumerate(cfg_a.enabled_stages)}
    stops = zip(ledger_a.column("stage").to_pylist(), ledger_b.column("stage").to_pylist())
    assert needs == [i for i, (a, b) in enumerate(stops) if order[a] > order[b]] != []
    after = {r: cfg_a.enabled_stages[order[r] + 1] for r in order if order[r] + 1 < len(order)}
    assert [walks[i].stage for i in needs] == [after[s] for s in ledger_b.take(needs).column("stage").to_pylist()]
    others = [i for i in range(ledger_a.num_rows) if i not in set(needs)]
    _same_rows(redecided.take(others), ledger_a.take(others))


def _run_again(before: tuple[CurateConfig, pa.Table], after: CurateConfig, pool: Path) -> tuple[pa.Table, list]:
    """``before``'s ledger re-decided to ``after``: its re-decided rows, the rows that needed stages run again as
    the stages end them, their indices."""
    decider = Decider(before[0], after)
    redecided, walks = decider.ledger(before[1])
    needs = [i for i, w in enumerate(walks) if w.status == NEEDS]
    reader = SourceReader(after.input, after.filters.max_file_bytes, pool=str(pool))
    starts = [decider.order[walks[i].stage] for i in needs]
    again, _ = rerun_rows(before[1].take(pa.array(needs, pa.int64())), starts, decider.stages, after, reader)
    return redecided, again, needs


def test_the_inputs_that_need_stages_run_again_end_as_a_run_with_the_new_thresholds_ends_them(scored, sample_pool):
    """Relaxed past what was scored: each input the cascade stopped runs through the stages from the next one, its
    earlier stages' stored columns as they were, and ends as the run at the relaxed thresholds ends it."""
    (cfg_a, ledger_a), tight = scored["default"], scored["tight"]
    _, again, needs = _run_again(tight, cfg_a, sample_pool)
    assert needs
    _same_rows(_ledger(again), ledger_a.take(needs))


def _close(a, b) -> bool:
    """Equal values, floats to float32 rounding of a batched forward pass, recursively."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_close, a, b))
    return a == b


def test_a_prompt_filter_is_re_decided_both_ways_on_the_full_profile(store_dir, sample_pool):
    """The full profile (random-init models): a prompt filter tightened is decided from the stored prompt scores;
    relaxed, the inputs it rejected run through CLIP again (the embedding a kept input needs is not in the ledger) and
    the stages after it. Both end as a run at the new value ends them. The full profile's models score a batch in one
    forward pass, whose float results depend on the batch's size (as two fresh runs batched otherwise differ): fates
    are equal, scores equal to float32 rounding."""
    from generators.random_models import TINY_CLIP, store_overrides

    base = [
        *store_overrides(store_dir, TINY_CLIP["embed_dim"]),
        "models.yolo.imgsz=320",
        "filters.min_aesthetic=null",
        "filters.min_realism=null",
        "filters.prompt_filters.collage.max_reject=1",
        *(f"stages.{s}.{k}" for s in ("yolo_person", "clip") for k in ("num_cpus=1", "num_gpus=0")),
    ]
    runs = {}
    for name, max_reject in (("strict", 0.68), ("loose", 1.0)):
        at = f"filters.prompt_filters.not_a_person.max_reject={max_reject}"
        cfg = load_config(CurateConfig, REPO / "configs/curate/full.yaml", [*base, at])
        table = score_in_process(cfg, list_shards(Pool.at(str(sample_pool)), cfg.input), str(sample_pool))
        runs[name] = (cfg, table.sort_by("source"))
    strict, loose = runs["strict"], runs["loose"]
    prompt = [r for r in strict[1].column("reason").to_pylist() if r and r.startswith("prompt_not_a_person")]
    assert prompt and strict[1].filter(pc.equal(strict[1]["status"], schema.KEPT)).num_rows  # the value splits them
    redecided, _, needs = _run_again((loose[0], _ledger(loose[1])), strict[0], sample_pool)
    assert not needs
    _same_rows(redecided, _ledger(strict[1]))
    _, again, needs = _run_again((strict[0], _ledger(strict[1])), loose[0], sample_pool)
    assert len(needs) == len(prompt)
    columns = [
        "status",
        "stage",
        "reason",
        *(c for c in schema.scored_schema(TINY_CLIP["embed_dim"]).names if c != "image"),
    ]
    expected = loose[1].take(needs).select(columns).to_pylist()
    assert schema.KEPT in {r["status"] for r in expected}
    for got, want in zip(again.select(columns).to_pylist(), expected):
        assert {c for c in columns if not _close(got[c], want[c])} == set(), got["source"]


def test_a_change_beyond_thresholds_needs_a_new_run():
    with pytest.raises(NeedsNewRun, match="--new-run"):
        Decider(_cfg(), CurateConfig.model_validate({"models": {"quality": {"max_side": 256}}}))
    # a threshold that changes what a stage computes is rerun, not refused: every input that reached it
    decider = Decider(_cfg(), _cfg(person_min_height_frac=0.5))
    assert decider.stages[decider.recompute_from].name == "person"


def _curate(*args: str) -> tuple[int, str]:
    from jobs import curate

    out = io.StringIO()
    with redirect_stdout(out):
        code = curate.main(list(args))
    return code, out.getvalue()


def _tree(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_what_if_prints_the_funnel_before_and_after_and_writes_nothing(curated_run, sample_pool, capsys):
    before = _tree(curated_run)
    config = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool)]
    args = [*config, "--output", str(curated_run), "write.rows_per_shard=4"]
    code, text = _curate(*args, "--what-if", "filters.min_short_side=512", "--what-if", "filters.min_quality=0.7")
    assert code == 0, capsys.readouterr().err
    assert _tree(curated_run) == before
    lines = [line for line in text.splitlines() if line.startswith("[what-if]")]
    assert "filters.min_short_side 384 -> 512" in lines[0] and "filters.min_quality 0.5 -> 0.7" in lines[0]
    ledger = pa.concat_tables(pq.read_table(p) for p in (curated_run / "ledger").rglob("*.parquet")).to_pylist()
    kept = [r for r in ledger if r["status"] == schema.KEPT]
    still = [r for r in kept if min(r["width"], r["height"]) >= 512 and r["quality"] >= 0.7]
    assert 0 < len(still) < len(kept)
    assert f"kept after scoring: {len(kept)} of {len(ledger)} inputs -> {len(still)}" in lines[1]
    assert lines[-1].endswith("none (every input is re-decided from stored scores)")
    # relaxing: the inputs the quality threshold stopped need the stages after it
    low = sum(r["reason"] is not None and r["reason"].startswith("low_quality") for r in ledger)
    code, text = _curate(*args, "--what-if", "filters.min_quality=0.0")
    assert code == 0 and f"need model work: {low} inputs ({low} from stage text_overlay)" in text
    # a setting that is not a threshold: one line, exit 2
    code, _ = _curate(*args, "--what-if", "models.quality.max_side=256")
    assert code == 2 and "--new-run" in capsys.readouterr().err
    assert _tree(curated_run) == before


@pytest.mark.slow
def test_a_large_ledger_is_walked_in_ray_tasks_to_the_same_funnel(curated_run, ray_local, monkeypatch):
    from curation.score import redecide

    cfg = load_config(CurateConfig, REPO / "configs/curate/lite.yaml", ["write.rows_per_shard=4"])
    new = cfg.model_copy(update={"filters": cfg.filters.model_copy(update={"min_quality": 0.7, "min_short_side": 160})})
    here = redecide.output_what_if(str(curated_run), cfg, new)
    monkeypatch.setattr(redecide, "FILES_PER_TASK", 2)  # several tasks, and more of them than the window
    in_tasks = redecide.output_what_if(str(curated_run), cfg, new, tasks_from_files=0)
    assert in_tasks == here
    assert "need model work: none" not in here[-1]  # the relaxed side counts inputs too


def _final(out: Path) -> dict:
    """What a curated output publishes: each final shard's and final-ledger file's table (by content), the manifest's
    funnel and counts."""
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    shards = pa.concat_tables(pq.read_table(out / "shards" / s["file"]) for s in manifest["shards"])
    ledger = pa.concat_tables(pq.read_table(out / "final_ledger" / e["file"]) for e in manifest["final_ledger"])
    return {
        "shards": shards.sort_by("source"),
        "ledger": ledger.sort_by("source"),
        "shard_bytes": sorted(s["sha256"] for s in manifest["shards"]),
        "funnel": manifest["funnel"],
        "config_hash": manifest["config_hash"],
    }


def _assert_same_output(a: Path, b: Path) -> None:
    fa, fb = _final(a), _final(b)
    for name in ("funnel", "config_hash", "shard_bytes"):
        assert fa[name] == fb[name], name
    _same_rows(fa["shards"], fb["shards"])
    _same_rows(fa["ledger"], fb["ledger"])


@pytest.mark.slow
def test_changed_thresholds_are_applied_in_place_and_equal_a_fresh_run(curated_run, sample_pool, tmp_path, capsys):
    redecided, fresh = tmp_path / "redecided", tmp_path / "fresh"
    shutil.copytree(curated_run, redecided)
    config = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool)]
    tight = ["write.rows_per_shard=4", "filters.min_quality=0.7", "filters.min_short_side=512"]
    code, text = _curate(*config, "--output", str(redecided), *tight)
    assert code == 0, capsys.readouterr().err
    assert "[re-decide] need model work: none" in text and "0 inputs scored this run" in text  # no model call
    assert _curate(*config, "--output", str(fresh), *tight)[0] == 0
    assert _final(fresh)["funnel"] != _final(curated_run)["funnel"]  # the thresholds moved images
    _assert_same_output(redecided, fresh)
    from jobs import audit

    assert audit.main([str(redecided)]) == 0, capsys.readouterr().out
    # and back: the first thresholds, from the scores kept, equal the first run
    code, text = _curate(*config, "--output", str(redecided), "write.rows_per_shard=4")
    assert code == 0 and "0 inputs scored this run" in text
    _assert_same_output(redecided, curated_run)
    # past what was scored: the inputs the quality threshold stopped are read from the pool and run through the stages
    # after it, and only they
    ledger = pa.concat_tables(pq.read_table(p) for p in (curated_run / "ledger").rglob("*.parquet")).to_pylist()
    low = sum(r["reason"] is not None and r["reason"].startswith("low_quality") and r["quality"] >= 0.1 for r in ledger)
    loose = ["write.rows_per_shard=4", "filters.min_quality=0.1"]
    code, text = _curate(*config, "--output", str(redecided), *loose)
    assert code == 0, capsys.readouterr().err
    assert f"[re-decide] need model work: {low} inputs ({low} from stage text_overlay)" in text
    assert (
        f"stages run again: text_overlay on {low} inputs, nsfw on {low}" in text and "0 inputs scored this run" in text
    )
    assert _curate(*config, "--output", str(fresh), *loose)[0] == 0
    _assert_same_output(redecided, fresh)
    assert not list((redecided / "scored_images").rglob("*.parquet"))  # the bytes it read are in the shards only


@pytest.mark.slow
def test_a_person_threshold_reruns_the_stages_it_changes_and_equals_a_fresh_run(
    curated_run, sample_pool, tmp_path, capsys, monkeypatch
):
    """``person_min_height_frac`` (and ``_area_frac``) decide which persons are prominent, which head pose is computed
    for: the inputs that reached the person stage run from it again, the others are re-decided. Tightened, then
    back; the first in Ray tasks, as a re-decide with much model work runs."""
    from curation.score import redecide

    redecided, fresh = tmp_path / "redecided", tmp_path / "fresh"
    shutil.copytree(curated_run, redecided)
    config = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool)]
    ledger = pa.concat_tables(pq.read_table(p) for p in (curated_run / "ledger").rglob("*.parquet")).to_pylist()
    reached = sum(r["stage"] not in ("decode", "download") for r in ledger)
    # prominent: tall enough or large enough; these make it a main person 3/4 of the image high or 2/5 of its area
    tall = ["write.rows_per_shard=4", "filters.person_min_height_frac=0.75", "filters.person_min_area_frac=0.4"]
    monkeypatch.setattr(redecide, "RERUN_TASKS_FROM_INPUTS", 1)
    code, text = _curate(*config, "--output", str(redecided), *tall)
    monkeypatch.undo()
    assert code == 0, capsys.readouterr().err
    assert f"[re-decide] need model work: {reached} inputs ({reached} from stage person)" in text
    assert f"stages run again: person on {reached} inputs, head_pose on" in text
    assert _curate(*config, "--output", str(fresh), *tall)[0] == 0
    assert _final(fresh)["funnel"] != _final(curated_run)["funnel"]  # the threshold moved images
    _assert_same_output(redecided, fresh)
    code, text = _curate(*config, "--output", str(redecided), "write.rows_per_shard=4")
    assert code == 0 and f"stages run again: person on {reached} inputs" in text
    _assert_same_output(redecided, curated_run)


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_re_decide_killed_half_way_goes_on_to_the_same_output(sample_pool, ray_local, tmp_path, monkeypatch, capsys):
    """Killed as a shard that needed model work had written its files but not its commit record: the rerun keeps the
    two shards committed before and equals a fresh run."""
    from curation.score import redecide

    out, fresh = tmp_path / "out", tmp_path / "fresh"
    config = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool)]
    loose = ["input.files_per_shard=8", "filters.min_quality=0.1", "filters.min_short_side=300"]
    assert _curate(*config, "--output", str(out), "input.files_per_shard=8")[0] == 0
    commit, rerun, commits, ran = redecide.write_json_atomic, redecide.rerun_rows, [], []

    def rerun_noted(*args, **kwargs):
        ran.append(True)
        return rerun(*args, **kwargs)

    def killed_at_the_third(*args, **kwargs):
        if len(commits) == 2 and ran:
            raise Killed  # as a kill lands: the shard's ledger, scores and scored files written, its record not
        commits.append(args[1])
        return commit(*args, **kwargs)

    monkeypatch.setattr(redecide, "rerun_rows", rerun_noted)
    monkeypatch.setattr(redecide, "write_json_atomic", killed_at_the_third)
    with pytest.raises(Killed):
        _curate(*config, "--output", str(out), *loose)
    monkeypatch.setattr(redecide, "write_json_atomic", commit)
    code, text = _curate(*config, "--output", str(out), *loose)
    assert code == 0, capsys.readouterr().err
    shards = len(list((out / "_state" / "steps" / "score" / "shards").glob("*.json")))
    assert f"[re-decide] done: {shards - 2} input shards" in text  # the two committed before the kill are kept
    assert _curate(*config, "--output", str(fresh), *loose)[0] == 0
    _assert_same_output(out, fresh)
    referenced = {f for p in (out / "_state" / "steps" / "score" / "shards").glob("*.json")
                  for k in ("ledger_files", "scores_files") for f in json.loads(p.read_text())["receipt"][k]}  # fmt: skip
    left = {str(p.relative_to(out)) for p in (out / "ledger").rglob("*.parquet")} - referenced
    assert all("-scores-" in f or len(f.rsplit("-", 1)[-1]) == len("0123456789abcdef.parquet") for f in left)
