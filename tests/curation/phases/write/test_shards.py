"""The write phase as the runner's steps: the manifest of a run, and a kill between units resumed from the receipts."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO, CountedTask

from common.config import load_config
from common.layout import LAYOUT
from curation.config import CurateConfig
from curation.phases.pipeline import GlobalPhases
from curation.phases.write import shards as ws
from curation.steps.output import Output
from curation.steps.runner import StepRunner

LITE = str(REPO / "configs/curate/lite.yaml")
CURATED_WITH = ["write.rows_per_shard=4"]  # the settings of conftest's curated_run


def _write(out, overrides: list[str]) -> dict:
    """The write phase's manifest, through a runner of two tasks in flight."""
    cfg = load_config(CurateConfig, LITE, overrides)
    phases = GlobalPhases(cfg, Output.at(str(out)))
    partition_of = {r["shard_id"]: i for i, shards in enumerate(phases.partitions) for _, r in shards}
    runner = StepRunner(phases.output, "write", phases.phase_hash("write"), window=2)
    assert runner.phase_fingerprint == phases.phase_hash("write")
    return ws.write_phase(runner, cfg, phases.records, partition_of, len(phases.partitions))


def test_write_phase_resumes_a_kill_between_units_from_their_receipts(curated_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    published = json.loads((out / LAYOUT.manifest).read_text())

    # done with these settings: the manifest comes from the steps' records, and no task runs
    monkeypatch.setattr(ws._Ledger, "task", CountedTask(ws._write_ledger_group, kill_at=0))
    assert _write(out, CURATED_WITH) == published

    # other settings, one final-ledger task per input shard: killed at the fifth launch, three or four done
    rewrite = [*CURATED_WITH, "write.ledger_rows_per_task=1"]
    monkeypatch.setattr(ws._Ledger, "task", CountedTask(ws._write_ledger_group, kill_at=4))
    with pytest.raises(KeyboardInterrupt):
        _write(out, rewrite)
    kept = {p.name: p.read_bytes() for p in (out / LAYOUT.step_units("write", "ledger")).glob("*.json")}
    assert len(kept) in (3, 4)

    # the same command again runs only the units without a receipt, and writes the same files
    resumed = CountedTask(ws._write_ledger_group)
    monkeypatch.setattr(ws._Ledger, "task", resumed)
    manifest = _write(out, rewrite)
    assert resumed.launched == len(published["final_ledger"]) - len(kept)
    assert {
        p.name: p.read_bytes() for p in (out / LAYOUT.step_units("write", "ledger")).glob("*.json")
    }.items() >= kept.items()
    assert manifest["settings_hash"] != published["settings_hash"]
    assert manifest == {**published, "settings_hash": manifest["settings_hash"]}
