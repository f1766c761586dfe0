"""Meta-device builds under a process group (``pretrain.train.build_model``, ``finetune.train.build_model``): each
rank's shards hold the weights of the plain seeded build, the teacher the student's, and a pretrained backbone read
per shard is the one ``load_backbone`` gives; on one process and on two gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from common.config import load_config
from finetune.config import FinetuneConfig
from finetune.data import LabelInfo
from finetune.train import build_model as build_finetune_model
from finetune.train import make_task
from pretrain.backbone import build
from pretrain.config import PretrainConfig
from pretrain.export import export_objective
from pretrain.objective import JointObjective
from pretrain.train import build_model
from training.checkpoint import read_safetensors

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/pretrain/tiny.yaml"
FINETUNE = REPO / "configs/finetune/tiny.yaml"
CPU = torch.device("cpu")
LABELS = LabelInfo(parts=("background", "skin", "clothes"), keypoint_names=("a", "b", "c"),
                   keypoint_sigmas=(0.05, 0.05, 0.05), image_size=(128, 96))  # fmt: skip
# odd sizes: rows that two ranks split unevenly, and a prototype matrix of more rows than the ranks
PRETRAIN = ["objective.cl.prototypes=63", "objective.cl.hidden=40", "objective.mae.width=20", "objective.mae.heads=2"]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def whole(model: nn.Module) -> dict[str, Tensor]:
    """The model's state with every sharded tensor gathered (a collective: every rank calls it)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def configs() -> tuple[PretrainConfig, FinetuneConfig]:
    finetune = load_config(FinetuneConfig, FINETUNE, ["head.class_weights=null"])
    return load_config(PretrainConfig, TINY, PRETRAIN), finetune


def meta_builds(backbone_file: str, device: torch.device = CPU) -> dict[str, dict[str, Tensor]]:
    """The sharded builds' states: pretraining's objective, fine-tuning's model seeded and from ``backbone_file``."""
    pretrain, finetune = configs()
    task = make_task("seg", finetune, LABELS, finetune.model.backbone())
    return {
        "objective": whole(build_model(pretrain, device)),
        "seeded": whole(build_finetune_model(finetune, task, None, device)),
        "loaded": whole(build_finetune_model(finetune, task, backbone_file, device)),
    }


def plain_builds(backbone_file: str) -> dict[str, dict[str, Tensor]]:
    """``meta_builds``' states as the plain (unsharded, CPU) construction makes them."""
    pretrain, finetune = configs()
    task = make_task("seg", finetune, LABELS, finetune.model.backbone())
    torch.manual_seed(pretrain.seed)
    objective = JointObjective(build(pretrain.model.backbone()), pretrain.objective, total_steps=pretrain.steps)
    return {
        "objective": objective.state_dict(),
        "seeded": build_finetune_model(finetune, task, None).state_dict(),
        "loaded": build_finetune_model(finetune, task, backbone_file).state_dict(),
    }


def a_backbone_file(folder: Path) -> str:
    """A pretrained backbone whose weights are not the fine-tuning seed's."""
    pretrain, _ = configs()
    torch.manual_seed(pretrain.seed + 7)
    objective = JointObjective(build(pretrain.model.backbone()), pretrain.objective, total_steps=1)
    export_objective(objective, pretrain.model, 1, str(folder / "backbone.safetensors"))
    return str(folder / "backbone.safetensors")


def check(got: dict[str, dict[str, Tensor]], want: dict[str, dict[str, Tensor]]) -> None:
    for name, state in want.items():
        assert got[name].keys() == state.keys(), name
        assert [k for k, v in state.items() if not torch.equal(got[name][k], v)] == [], name
    objective = got["objective"]
    twins = {"student.": "teacher.backbone.", "head.": "teacher.head."}
    for key, value in objective.items():  # the EMA teacher starts as the student
        for side, teacher in twins.items():
            if key.startswith(side):
                assert torch.equal(objective[teacher + key.removeprefix(side)], value), key


def test_meta_builds_hold_the_seeded_and_loaded_weights(world_of_one, tmp_path):
    backbone = a_backbone_file(tmp_path)
    got = meta_builds(backbone)
    check(got, plain_builds(backbone))
    # a fine-tuned model's file: its backbone.* tensors are read, its head.* left
    tensors, meta = read_safetensors(backbone)
    finetuned = tmp_path / "finetuned.safetensors"
    save_file({**{f"backbone.{k}": v for k, v in tensors.items()}, "head.w": torch.ones(3)}, str(finetuned),
              metadata={**meta, "task": "seg"})  # fmt: skip
    _, finetune = configs()
    model = build_finetune_model(finetune, make_task("seg", finetune, LABELS, finetune.model.backbone()),
                                 str(finetuned), CPU)  # fmt: skip
    assert all(torch.equal(v, got["loaded"][k]) for k, v in whole(model).items())


RANK = """
import sys, torch, torch.distributed as dist
from tests.training.test_meta_init import meta_builds
store, rank, backbone, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
torch.save(meta_builds(backbone), out)
dist.barrier()  # neither rank tears its connections down while the other still uses them
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes importing torch and Ray's stack: about a minute on 2 busy cores
def test_meta_builds_hold_the_seeded_and_loaded_weights_on_two_ranks(tmp_path):
    backbone = a_backbone_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    command = [sys.executable, "-c", RANK, str(tmp_path / "store")]
    ranks = [subprocess.Popen([*command, str(r), backbone, str(out)], cwd=REPO, env=env) for r, out in enumerate(outs)]
    try:
        assert [p.wait(timeout=180) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            p.kill()
    want = plain_builds(backbone)
    for out in outs:
        check(torch.load(out), want)
