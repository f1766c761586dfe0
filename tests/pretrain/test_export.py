"""A pretraining checkpoint's other read-outs (pretrain/export.py, pretrain/evaluate.py): the EMA teacher exported
beside the student, and the objective's MAE term on held-out images, both read without a process group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.config import load_config
from jobs import pretrain as pretrain_job
from jobs import probe
from pretrain.backbone import SIZES, build
from pretrain.config import PretrainConfig
from pretrain.evaluate import heldout_mae, initial_objective, load_objective
from pretrain.export import EXPORT_FILES, export_backbone, load_backbone
from pretrain.objective import JointObjective
from pretrain.train import build_optimizer
from training import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SMALL = ["objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]", f"steps={STEPS}"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process checkpoints, as meant


def images(n: int, seed: int) -> torch.Tensor:
    """Smooth random colour fields (something an MAE can learn to complete), uint8 [n, 3, 128, 96]."""
    low = torch.rand(n, 3, 8, 6, generator=torch.Generator().manual_seed(seed))
    return (torch.nn.functional.interpolate(low, size=(128, 96), mode="bilinear") * 255).to(torch.uint8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only contend with whatever else runs
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, JointObjective, PretrainConfig]:
    """A few optimiser steps of the tiny objective in this process, checkpointed as the training worker does."""
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", SMALL)
    model = initial_objective(cfg)
    optimizer = build_optimizer(model, cfg.optim)
    data = images(4, 0)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(data, step, torch.Generator().manual_seed(step))["loss"].backward()
        optimizer.step()
        model.update_teacher(step)
    uri = ckpt.step_uri(str(tmp_path_factory.mktemp("run")), STEPS)
    ckpt.save(uri, model, optimizer, {"step": STEPS, "config": cfg.model_dump(mode="json")})
    return uri, model, cfg


def test_the_exported_teacher_is_the_checkpoints_teacher_and_not_the_student(trained, tmp_path):
    uri, model, _ = trained
    files = {which: str(tmp_path / EXPORT_FILES[which]) for which in ("student", "teacher")}
    metas = {which: export_backbone(uri, out, which) for which, out in files.items()}
    assert {w: m["which"] for w, m in metas.items()} == {"student": "student", "teacher": "teacher"}
    assert metas["teacher"]["step"] == str(STEPS)
    loaded = {which: load_backbone(out).state_dict() for which, out in files.items()}  # strict: the backbone's keys
    for which, expected in (("student", model.student), ("teacher", model.teacher["backbone"])):
        assert loaded[which].keys() == expected.state_dict().keys()
        assert all(torch.equal(loaded[which][k], v) for k, v in expected.state_dict().items()), which
    moved = [k for k, v in loaded["teacher"].items() if not torch.equal(v, loaded["student"][k])]
    assert len(moved) > len(loaded["teacher"]) // 2  # the EMA trails the student on (nearly) every tensor
    with pytest.raises(ValueError, match="which must be one of"):
        export_backbone(uri, str(tmp_path / "x.safetensors"), "decoder")


def test_the_pretrain_job_exports_what_it_is_asked_for():
    args = ["--config", "c.yaml", "--data", "d", "--storage", "s", "--name", "n"]
    assert pretrain_job.parse_args(args).export == ["student"]
    assert pretrain_job.parse_args([*args, "--export", "teacher"]).export == ["teacher"]
    assert pretrain_job.parse_args([*args, "--export", "student,teacher"]).export == ["student", "teacher"]
    with pytest.raises(SystemExit):
        pretrain_job.parse_args([*args, "--export", "decoder"])


def test_the_probe_job_reads_an_exported_teacher(trained, tmp_path):
    uri, *_ = trained
    teacher = tmp_path / EXPORT_FILES["teacher"]
    export_backbone(uri, str(teacher), "teacher")
    from jobs import make_synthetic

    data = tmp_path / "labelled"
    assert make_synthetic.main(["--out", str(data), "--n", "8", "--val", "4", "--keypoints", "17"]) == 0
    out = tmp_path / "probe.json"
    assert probe.main(["--data", str(data), "--backbone", str(teacher), "--out", str(out), "--iters", "5"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["which"] == "teacher" and config["pretrain_step"] == STEPS and config["size"] == "tiny"


def test_heldout_mae_of_a_checkpoint_is_the_trained_objectives_and_below_its_start(trained):
    uri, model, cfg = trained
    loaded, loaded_cfg, step = load_objective(uri)
    assert step == STEPS and loaded_cfg == cfg
    heldout = images(8, 1)
    trained_mae = heldout_mae(loaded, heldout, step=step, seed=3)
    assert trained_mae == pytest.approx(heldout_mae(model, heldout, step=step, seed=3), rel=1e-5)
    # the start is the run's step 0 (the same seed builds the same weights), and training moved away from it
    start = initial_objective(cfg)
    torch.manual_seed(cfg.seed)
    fresh = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in start.state_dict().items())
    assert trained_mae < heldout_mae(start, heldout, step=step, seed=3)
    # one seed, one draw of views and masks: the figure is reproducible
    assert heldout_mae(loaded, heldout, step=step, seed=3) == trained_mae


@pytest.mark.parametrize(("flag", "mode"), [(True, "full"), (False, "off")])
def test_a_backbone_exported_with_the_checkpointing_flag_loads_with_the_mode_it_stood_for(tmp_path, flag, mode):
    model = build(SIZES["tiny"])
    fields = {**dataclasses.asdict(model.cfg), "activation_checkpointing": flag}  # as exports wrote it before modes
    path = str(tmp_path / "old.safetensors")
    save_file(model.state_dict(), path, metadata={"format": "pt", "backbone_config": json.dumps(fields)})
    assert load_backbone(path).cfg.activation_checkpointing == mode
    assert load_backbone(path, activation_checkpointing="selective").activation_checkpointing == "selective"
