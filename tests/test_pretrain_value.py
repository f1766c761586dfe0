"""The pretrained-vs-random benchmark (benchmarks/pretrain_value.py): its verdicts and learning-rate choice on
results made up here, its presets, pretraining in the caller's process instead of the job (exports and held-out MAE
from the objective it returns), and (slow) the quick chain's whole code path at a microscopic size."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a single-process checkpoint read, as meant
def test_an_objective_trained_in_this_process_exports_what_its_checkpoint_would(tmp_path):
    from common.config import load_config
    from pretrain.export import export_backbone
    from pretrain.train import build_optimizer
    from training import checkpoint as ckpt
    from training.checkpoint import read_safetensors

    cfg = load_config(pv.PretrainConfig, REPO / "configs/pretrain/tiny.yaml", ["steps=2"])
    model = pv.initial_objective(cfg)
    optimizer = build_optimizer(model, cfg.optim)
    images = torch.randint(
        0, 256, (2, 3, *cfg.image_size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    for step in range(2):  # the EMA teacher moves away from the student
        model(images, step, torch.Generator().manual_seed(step))["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_teacher(step)
    uri = ckpt.step_uri(str(tmp_path / "run"), 2)
    ckpt.save(uri, model, optimizer, {"step": 2, "config": cfg.model_dump(mode="json")})
    for which in ("student", "teacher"):
        job, here = tmp_path / f"job-{which}.safetensors", tmp_path / f"here-{which}.safetensors"
        assert export_backbone(uri, str(job), which) == pv.export_objective(model, cfg.model, 2, str(here), which)
        (a, meta_a), (b, meta_b) = read_safetensors(str(job)), read_safetensors(str(here))
        assert meta_a == meta_b and meta_b["which"] == which and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), which


def test_a_pretrainer_stands_in_for_the_pretraining_job(tmp_path):
    budget = pv.Budget(
        pool=20, pretrain_steps=3, pretrain_epochs=None, labels=(8,), seeds=(0,), steps=4, lrs=(6.4e-2,), val=8,
        test=8, heldout=2, exports=("student", "teacher"), workers=1,
        pretrain_overrides=("ray.workers=1", "data.batch_size=2"),
    )  # fmt: skip
    calls = []

    def pretrainer(cfg, shards):
        calls.append((cfg.steps, cfg.samples_per_step(), shards))
        return pv.initial_objective(cfg)  # untrained: its held-out MAE must be the initial one to the digit

    def chain() -> pv.Chain:
        return pv.Chain(tmp_path / "work", budget, lambda line: None, data=tmp_path / "data", pretrainer=pretrainer)

    first = chain()
    steps, files, run = first.pretrain(tmp_path / "shards", kept=10)
    assert steps == 3 and calls == [(3, 2, tmp_path / "shards")]
    for which, f in files.items():
        meta = pv.read_safetensors(str(f))[1]
        assert f.parent == run and meta["which"] == which and meta["step"] == "3" and meta["size"] == "tiny"
    mae = first.heldout_mae(run, steps)
    assert mae["step"] == 3 and mae["images"] == 2 and mae["pretrained"] == mae["initial"]
    assert (tmp_path / "data" / "heldout").is_dir() and not (tmp_path / "work" / "heldout").exists()
    # a rerun finds the exports and the held-out MAE: the pretrainer is not called again
    again = chain()
    assert again.pretrain(tmp_path / "shards", kept=10)[0] == 3 and len(calls) == 1
    assert again.heldout_mae(run, steps) == mae
    with pytest.raises(SystemExit, match="colours"):
        pv.run_chain(tmp_path / "other", dataclasses.replace(budget, colours=("sepia",)))
