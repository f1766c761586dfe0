"""Phase 1 as one step of the step runner: its units are the input shards, its receipts the commit records; outputs
scored before it ran on the runner (commit records in ``_state/score/``) are read, and resume without rescoring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.config import load_config
from common.layout import LAYOUT
from curation.audit.verify import audit
from curation.config import CurateConfig
from curation.records import read_commits
from curation.score.phase import ScorePhase
from curation.score.pool import Pool
from curation.steps.output import Output
from curation.steps.runner import StepRunner
from jobs import curate

REPO = Path(__file__).resolve().parents[3]
LITE = REPO / "configs/curate/lite.yaml"


def _args(pool: Path, out: Path) -> list[str]:
    return ["--config", str(LITE), "--input", str(pool), "--output", str(out), "write.rows_per_shard=4"]


def test_the_score_phase_is_one_step_whose_units_are_the_input_shards(curated_run, sample_pool):
    cfg = load_config(CurateConfig, LITE, ["write.rows_per_shard=4"])
    out = Output.at(str(curated_run))
    step = ScorePhase(cfg, out, Pool.at(str(sample_pool)))
    assert LAYOUT.step_units("score", step.name) == LAYOUT.score_commits
    fingerprint = StepRunner(out, "score", cfg.results_hash(), window=1).fingerprint(step)
    units = sorted((curated_run / LAYOUT.score_commits).glob("*.json"))
    records = [json.loads(p.read_text()) for p in units]
    assert {r["fingerprint"] for r in records} == {fingerprint}
    assert [r["receipt"]["shard_id"] for r in records] == [p.stem for p in units]
    done = json.loads((curated_run / LAYOUT.step_done("score", step.name)).read_text())
    assert done["fingerprint"] == fingerprint and done["units"] == len(units) > 1
    rows = sum(r["receipt"]["rows"] for r in records)
    assert done["stats"] == {"shards": len(units), "inputs": rows, "kept": sum(r["receipt"]["kept"] for r in records)}
    assert rows == len((sample_pool / "_manifest.jsonl").read_text().splitlines())  # every input, once


def _to_previous_layout(out: Path) -> dict[str, dict]:
    """Rewrite ``out``'s commit records as an output scored before the score phase was a step keeps them."""
    receipts = {}
    for unit in sorted((out / LAYOUT.score_commits).glob("*.json")):
        receipt = json.loads(unit.read_text())["receipt"]
        (out / LAYOUT.previous_score_commits).mkdir(parents=True, exist_ok=True)
        (out / LAYOUT.previous_score_commits / unit.name).write_text(json.dumps(receipt))
        receipts[receipt["shard_id"]] = receipt
    shutil.rmtree(out / LAYOUT.phase_steps("score"))
    return receipts


def test_an_output_of_the_previous_layout_is_read_and_resumed_without_rescoring(
    curated_run, sample_pool, tmp_path, capsys
):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    receipts = _to_previous_layout(out)
    resolved = Output.at(str(out))
    assert read_commits(resolved.fs, resolved.root) == receipts
    assert audit(str(out), decode=False).ok
    scored = {p: p.stat().st_mtime_ns for p in (out / LAYOUT.scored).rglob("*.parquet")}
    capsys.readouterr()
    assert curate.main(_args(sample_pool, out)) == 0
    console = capsys.readouterr().out
    n = len(receipts)
    assert f"[score] {n} commit records of an earlier version's layout moved to {LAYOUT.score_commits}/" in console
    assert f"[score] {n} input shards, {n} already committed, 0 to score" in console
    assert {p: p.stat().st_mtime_ns for p in (out / LAYOUT.scored).rglob("*.parquet")} == scored
    assert not (out / LAYOUT.previous_score_commits).exists()
    assert read_commits(resolved.fs, resolved.root) == receipts
    assert (out / LAYOUT.manifest).read_bytes() == (curated_run / LAYOUT.manifest).read_bytes()
