"""The pretraining-value benchmark (benchmarks/pretrain_value.py): its verdicts and recipe choice on results made up
here, its presets, pretraining in the caller's process instead of the job (exports and held-out MAE from the
objective it returns), and (slow) the whole chain at a microscopic size: both pretraining sets, the positive control,
the recipe grid."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pretrain_value", REPO / "benchmarks" / "pretrain_value.py")
assert spec is not None and spec.loader is not None
pv = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = pv  # its dataclasses look their module up there
spec.loader.exec_module(pv)


def made_up_results(seeds: tuple[int, ...]) -> dict:
    k = len(seeds)
    mae = {"images": 4, "initial": 1.3, "pretrained": 1.1, "step": 20}
    curve = [{"step": 5, "mae": 1.2, "cl": 3.0}]
    return {
        "budget": {"pool": 100, "junk": 0.3, "steps": 10, "lrs": [0.1, 0.2], "layer_decays": [0.85],
                   "probe_steps": [0], "val": 8, "test": 8, "seeds": list(seeds), "labels": [16], "control": 50,
                   "control_steps": 20, "image_size": [128, 96]},
        "pretraining": {"curated": {"images": 40, "epochs": 4.0, "heldout_mae": mae, "curve": curve},
                        "raw": {"images": 100, "epochs": 1.6, "heldout_mae": mae, "curve": curve}},
        "pretrain_steps": 20,
        "inits": ["random", "random-ls1", "supervised", "curated", "raw"],
        "measures": {
            # the control far ahead; curated ahead by more than the spread on the probe, raw by less
            "probe mIoU (tokens, best layer), 16 labels, colour": {
                "random": [0.10, 0.12, 0.11][:k], "random-ls1": [0.10, 0.12, 0.11][:k],
                "supervised": [0.50, 0.51, 0.52][:k], "curated": [0.30, 0.31, 0.29][:k],
                "raw": [0.09, 0.13, 0.14][:k],
            },
            "left/right bal. acc, 16 labels, colour": {  # nothing to score for some
                "random": [None] * k, "random-ls1": [None] * k, "supervised": [0.9] * k, "curated": [0.9] * k,
                "raw": [None] * k,
            },
            "fine-tune mIoU, 16 labels (recipe on val)": {
                "random": [0.2] * k, "random-ls1": [0.2] * k, "supervised": [0.6] * k, "curated": [0.1] * k,
                "raw": [0.3] * k,
            },
        },
        "finetune_recipe": {"16": dict.fromkeys(["random", "random-ls1", "supervised", "curated", "raw"],
                                                "lr0.1-ld0.85-lp0")},
        "finetune_curves": {"16": {i: [[[5, 0.1], [10, 0.2]]] * k
                                   for i in ["random", "random-ls1", "supervised", "curated", "raw"]}},
        "machine": "here",
        "elapsed_s": 1.0,
    }  # fmt: skip


def test_gains_count_only_beyond_the_seed_spread_and_the_verdicts_name_each_question():
    lines = pv.report(made_up_results((0, 1, 2)))
    cells = [line.removeprefix("| ").removesuffix(" |").split(" | ") for line in lines if line.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["measure"][:5] == ["random", "random-ls1", "> spread", "supervised", "> spread"]
    probe = rows["probe mIoU (tokens, best layer), 16 labels, colour"]
    assert probe[5:9] == ["0.3000 ± 0.0100", "yes", "0.1200 ± 0.0265", "no"]  # curated, raw
    lr = rows["left/right bal. acc, 16 labels, colour"]
    assert lr[0] == "n/a" and lr[4] == "n/a"  # no random score: no verdict
    # raw's fine-tuning gain holds on every seed with no spread at all: beyond the spread
    assert rows["fine-tune mIoU, 16 labels (recipe on val)"][7:9] == ["0.3000 ± 0.0000", "yes"]
    verdicts = [line.removeprefix("verdict: ") for line in lines if line.startswith("verdict: ")]
    assert verdicts[0] == (
        "control: supervised ahead of random on 1/1, beyond the seed spread on 1 (fine-tune mIoU, 16 labels "
        "(recipe on val)) on fine-tuning"
    )
    assert verdicts[1].startswith("curated ahead of random on 1/2, beyond the seed spread on 1 (probe mIoU")
    assert verdicts[2].startswith("raw ahead of random on 2/2, beyond the seed spread on 1 (fine-tune")
    assert verdicts[3].startswith(
        "curated ahead of raw on 1/3, beyond the seed spread on 1 (probe mIoU"
    )  # every measure
    assert any(line.startswith("fine-tuning validation mIoU by step, 16 labels") for line in lines)
    assert "pretraining on curated by step: 5: mae 1.200 cl 3.00" in lines
    assert lines[-1] == (
        "summary: fine-tune mIoU at 16 labels: random 0.2000, random-ls1 0.2000, supervised 0.6000, curated 0.1000, "
        "raw 0.3000"
    )
    one_seed = pv.report(made_up_results((0,)))
    assert "(one seed: no spread to beat)" in next(line for line in one_seed if line.startswith("verdict: control"))
    assert all(line.endswith("n/a |") for line in one_seed if line.startswith("| probe"))


def test_the_recipe_is_chosen_on_validation_alone():
    grid = {"a": {"val": 0.5, "test": 0.1}, "b": {"val": 0.3, "test": 0.9}}
    assert pv.choose(grid) == "a"
    budget = pv.parse_args(["--lrs", "1e-2,2e-2", "--layer-decays", "0.75,1", "--probe-steps", "0,20"])[1]
    recipes = budget.recipes()
    assert len(recipes) == 8 and len({pv.recipe_name(r) for r in recipes}) == 8
    assert {"lr": 2e-2, "layer_decay": 0.75, "probe_steps": 20} in recipes


def test_presets_budget_flags_and_matched_resolution():
    work, cpu, data = pv.parse_args([])
    assert work.name == "pretrain_value" and cpu.seeds == (0, 1, 2) and cpu.labels == (16, 64)
    assert cpu.tuned() == (16,) and pv.parse_args(["--finetune-labels", "16,64"])[1].tuned() == (16, 64)
    assert len(cpu.lrs) >= 3 and cpu.pool >= 1000 and cpu.control >= 1000 and cpu.sources == ("curated", "raw")
    assert cpu.val >= 64 and cpu.test >= 128 and 0 < cpu.junk < 1
    quick_work, quick, _ = pv.parse_args(["--quick"])
    assert (
        quick_work.name == "pretrain_value_quick"
        and quick.pool < cpu.pool
        and quick.pretrain_steps < cpu.pretrain_steps
    )
    _, both, shared = pv.parse_args(
        ["--quick", "--both-exports", "--pretrain-steps", "3", "--size", "tiny", "--sources", "raw", "--data", "d"]
    )
    assert both.exports == ("student", "teacher") and both.pretrain_steps == 3 and both.sources == ("raw",)
    assert data is None and shared == Path("d").resolve()  # the renders and sets of another chain
    assert both.model_overrides() == ["model.size=tiny"]
    with pytest.raises(SystemExit):
        pv.parse_args(["--sources", "web"])
    # pretraining sees the labelled renders' size: the read-outs' token grid
    cfg = pv.Chain(work, cpu).pretrain_config()
    assert tuple(cfg.objective.views.global_size) == cpu.image_size == tuple(cfg.image_size)


@pytest.mark.slow
def test_the_chain_runs_end_to_end_at_a_microscopic_size(tmp_path, ray_local, capsys):
    budget = pv.Budget(
        pool=60, pretrain_steps=4, labels=(8,), seeds=(0, 1), steps=4, lrs=(6.4e-2, 1e-1), val=8, test=8,
        heldout=4, control=16, control_steps=4, sources=("raw",), exports=("student", "teacher"), probe_iters=5,
    )  # fmt: skip
    results = pv.run_chain(tmp_path, budget)
    (raw,) = results["pretraining"].values()  # both sets: tests/benchmarks/test_gpu_check.py's value part
    assert raw["images"] == 60  # every image of the pool decodes, junk included
    assert results["inits"] == ["random", "random-ls1", "supervised", "raw", "raw-teacher"]
    mae = raw["heldout_mae"]
    assert mae["images"] == 4 and mae["step"] == 4 and math.isfinite(mae["pretrained"]) and mae["initial"] > 0
    assert [r["step"] for r in raw["curve"]] == [4]  # the run's logged steps
    assert len(results["measures"]) == 3 + 1  # (probe, k-NN, left/right) in colour, and fine-tuning
    for name, row in results["measures"].items():
        assert set(row) == set(results["inits"]) and all(len(v) == 2 for v in row.values()), name
    # the recipe: chosen on seed 0's validation among the two rates, then run with seed 1
    chosen = results["finetune_recipe"]["8"]
    assert set(chosen) == set(results["inits"]) and all(name.startswith("lr") for name in chosen.values())
    runs = tmp_path / "runs"
    assert len(list(runs.glob("ft-random-8-s0-*"))) == 2 and len(list(runs.glob("ft-random-8-s1-*"))) == 1
    control = json.loads((runs / "control-n16-s4" / "metrics.json").read_text())
    assert control["config"]["steps"] == 4 and control["data"]["train"].endswith("control/train")
    probed = json.loads((tmp_path / "probes" / "supervised-n16-s4-colour-s0.json").read_text())["config"]
    assert probed["backbone"].endswith("control-n16-s4/finetuned.safetensors")
    assert len(list(runs.glob("ft-supervised-n16-s4-8-s0-*"))) == 2
    assert json.loads((tmp_path / "results.json").read_text())["measures"] == results["measures"]
    lines = pv.report(results)
    assert lines[-1].startswith("summary: fine-tune mIoU at 8 labels: random")
    # a rerun reuses everything: no job runs again
    capsys.readouterr()
    assert pv.run_chain(tmp_path, budget)["measures"] == results["measures"]
    assert "===" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="another pool"):  # the sets were made from another pool
        pv.run_chain(tmp_path, dataclasses.replace(budget, pool=70))


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
        pool=20, pretrain_steps=3, labels=(8,), seeds=(0,), steps=4, lrs=(6.4e-2,), val=8, test=8, heldout=2,
        exports=("student", "teacher"), workers=1, pretrain_overrides=("ray.workers=1", "data.batch_size=2"),
    )  # fmt: skip
    calls = []

    def pretrainer(cfg, shards):
        calls.append((cfg.steps, cfg.samples_per_step(), cfg.image_size, shards))
        return pv.initial_objective(cfg)  # untrained: its held-out MAE must be the initial one to the digit

    def chain() -> pv.Chain:
        return pv.Chain(tmp_path / "work", budget, lambda line: None, data=tmp_path / "data", pretrainer=pretrainer)

    first = chain()
    files, run = first.pretrain("raw", tmp_path / "shards", kept=10)
    assert calls == [(3, 2, budget.image_size, tmp_path / "shards")]  # at the read-outs' resolution
    for which, f in files.items():
        meta = pv.read_safetensors(str(f))[1]
        assert f.parent == run and meta["which"] == which and meta["step"] == "3" and meta["size"] == "tiny"
    assert run.name == "pretrain-raw"
    mae = first.heldout_mae("raw", run)
    assert mae["step"] == 3 and mae["images"] == 2 and mae["pretrained"] == mae["initial"]
    assert pv.pretraining_curve(run) == []  # trained in this process: no metrics log
    assert (tmp_path / "data" / "heldout").is_dir() and not (tmp_path / "work" / "heldout").exists()
    # a rerun finds the exports and the held-out MAE: the pretrainer is not called again
    again = chain()
    assert again.pretrain("raw", tmp_path / "shards", kept=10)[1] == run and len(calls) == 1
    assert again.heldout_mae("raw", run) == mae
    with pytest.raises(SystemExit, match="colours"):
        pv.run_chain(tmp_path / "other", dataclasses.replace(budget, colours=("sepia",)))
