"""The pretrained-vs-random benchmark (benchmarks/pretrain_value.py): its verdicts and learning-rate choice on
results made up here, its presets, and (slow) the quick chain's whole code path at a microscopic size."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pretrain_value", REPO / "benchmarks" / "pretrain_value.py")
assert spec is not None and spec.loader is not None
pv = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = pv  # its dataclasses look their module up there
spec.loader.exec_module(pv)


def made_up_results(seeds: tuple[int, ...]) -> dict:
    k = len(seeds)
    return {
        "budget": {"pool": 100, "steps": 10, "lrs": [0.1], "val": 8, "test": 8, "seeds": list(seeds), "labels": [16]},
        "curated": 40,
        "pretrain_steps": 20,
        "pretrain_epochs": 2.0,
        "heldout_mae": {"images": 4, "initial": 1.3, "pretrained": 1.1},
        "inits": ["random", "student", "teacher"],
        "measures": {
            # the student far ahead, the teacher ahead by less than the spread
            "probe": {
                "random": [0.10, 0.12, 0.11][:k],
                "student": [0.30, 0.31, 0.29][:k],
                "teacher": [0.09, 0.13, 0.14][:k],
            },
            "left/right": {"random": [None] * k, "student": [0.9] * k, "teacher": [None] * k},  # nothing to score
            "fine-tune mIoU, 16 labels (LR on val)": {"random": [0.2] * k, "student": [0.1] * k, "teacher": [0.3] * k},
        },
        "machine": "here",
        "elapsed_s": 1.0,
    }


def test_gains_count_only_beyond_the_seed_spread():
    lines = pv.report(made_up_results((0, 1, 2)))
    cells = [line.removeprefix("| ").removesuffix(" |").split(" | ") for line in lines if line.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["measure"][:3] == ["random", "student", "gain > seed spread"]
    assert rows["probe"][1:5] == ["0.3000 ± 0.0100", "yes", "0.1200 ± 0.0265", "no"]
    assert rows["left/right"][0] == "n/a" and rows["left/right"][2] == "n/a"  # no random score: no verdict
    # the teacher's fine-tuning gain holds on every seed with no spread at all: beyond the spread
    assert rows["fine-tune mIoU, 16 labels (LR on val)"][3:5] == ["0.3000 ± 0.0000", "yes"]
    summary = lines[-1]
    assert summary.startswith("summary: student ahead of random on 1/3 measures, beyond the seed spread on 1 (probe)")
    assert "teacher ahead of random on 2/3 measures" in summary
    assert summary.endswith("fine-tune mIoU at 16 labels: student 0.1000, teacher 0.3000 vs random 0.2000")
    one_seed = pv.report(made_up_results((0,)))
    assert "no seed spread to beat with one seed" in one_seed[-1]
    assert all(line.endswith("n/a |") for line in one_seed if line.startswith("| probe"))


def test_the_learning_rate_is_chosen_on_validation_alone():
    grid = {0.1: [{"val": 0.5, "test": 0.1}, {"val": 0.4, "test": 0.1}], 0.2: [{"val": 0.3, "test": 0.9}] * 2}
    assert pv.choose_lr(grid) == 0.1


def test_presets_and_budget_flags():
    work, quick = pv.parse_args(["--quick"])
    assert work.name == "pretrain_value_quick" and quick.seeds == (0,) and quick.labels == (16, 64)
    assert len(quick.lrs) >= 2 and quick.pretrain_steps and quick.exports == ("student",)
    _, full = pv.parse_args([])
    assert full.pool >= 2000 and full.pretrain_steps is None and full.pretrain_epochs and full.seeds == (0, 1, 2)
    assert len(full.lrs) == 3 and full.labels == (16, 64)
    _, both = pv.parse_args(["--quick", "--both-exports", "--pretrain-epochs", "3", "--size", "tiny"])
    assert both.exports == ("student", "teacher") and both.pretrain_epochs == 3 and both.pretrain_steps is None
    assert both.model_overrides() == ["model.size=tiny"]
    with pytest.raises(SystemExit):
        pv.parse_args(["--pretrain-steps", "4", "--pretrain-epochs", "2"])


@pytest.mark.slow
def test_the_quick_chain_runs_end_to_end_at_a_microscopic_size(tmp_path, ray_local, capsys):
    budget = pv.Budget(
        pool=20, pretrain_steps=4, pretrain_epochs=None, labels=(8,), seeds=(0,), steps=4, lrs=(6.4e-2,),
        val=8, test=8, heldout=4, exports=("student", "teacher"), probe_iters=5,
    )  # fmt: skip
    results = pv.run_chain(tmp_path, budget)
    assert results["pretrain_steps"] == 4 and results["curated"] >= 4
    assert results["inits"] == ["random", "student", "teacher"]
    mae = results["heldout_mae"]
    assert mae["images"] == 4 and mae["step"] == 4 and math.isfinite(mae["pretrained"]) and mae["initial"] > 0
    assert len(results["measures"]) == 3 * 2 + 1  # (probe, k-NN, left/right) x colours, and fine-tuning
    for name, row in results["measures"].items():
        assert set(row) == set(results["inits"]) and all(len(v) == 1 for v in row.values()), name
    assert results["finetune_lr"] == {"8": dict.fromkeys(results["inits"], 6.4e-2)}
    assert json.loads((tmp_path / "results.json").read_text())["measures"] == results["measures"]
    teacher = json.loads((tmp_path / "probes" / "teacher-grayscale-s0.json").read_text())["config"]
    assert teacher["which"] == "teacher" and teacher["grayscale"] and teacher["labels"] == [8]
    lines = pv.report(results)
    assert lines[-1].startswith("summary: student ahead of random on")
    # a rerun reuses everything: no job runs again
    capsys.readouterr()
    assert pv.run_chain(tmp_path, budget)["measures"] == results["measures"]
    assert "===" not in capsys.readouterr().out
