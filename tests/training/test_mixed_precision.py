"""bf16 under FSDP2, as on a GPU, run on the CPU: ``training.sharding.mixed_precision`` gives the GPU's policy here
(bf16 parameters and compute, fp32 gradient reduction). FSDP2 casts the floating inputs of the root module only, and
the models take uint8 images that they normalise inside, so every step from there must meet the parameters' dtype;
a model that mixes them fails at its first layer on a GPU (``Input type (float) and bias type (BFloat16)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.config import load_config
from finetune.config import FinetuneConfig
from finetune.data import LabelInfo
from finetune.train import build_model as build_finetune_model
from finetune.train import make_task
from pretrain.config import PretrainConfig
from pretrain.train import Trainer
from pretrain.train import build_model as build_pretrain_model
from training import sharding

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def bf16_fsdp(monkeypatch):
    """A process group of one with the GPU's mixed-precision policy (the one sharding chooses for a CUDA device)."""
    gpu_policy = sharding.mixed_precision(torch.device("cuda"), "bf16")
    assert gpu_policy.param_dtype == torch.bfloat16 and gpu_policy.reduce_dtype == torch.float32
    monkeypatch.setattr(sharding, "mixed_precision", lambda device, precision: gpu_policy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compute_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes the patch embedding and every linear layer see, recorded by hooks during the next forward."""
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].dtype))
    return seen


def test_pretraining_steps_in_bf16_with_fp32_master_weights(bf16_fsdp):
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml",
                      ["ray.workers=1", "objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]",
                       "data.batch_size=4"])  # fmt: skip
    model = build_pretrain_model(cfg, CPU)
    seen = compute_dtypes(model)
    trainer = Trainer(model, cfg, CPU)
    images = torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8)
    before = [p.detach().full_tensor().clone() for p in model.student.parameters()]
    for step in range(2):
        terms, _ = trainer.train_step(step, [images] * cfg.optim.grad_accum)
        assert torch.isfinite(terms).all(), terms
    assert seen == {torch.bfloat16}  # every layer computed in bf16 ...
    after = list(model.student.parameters())
    assert {p.dtype for p in after} == {torch.float32}  # ... on fp32 weights, which the steps moved
    assert any(not torch.equal(a.detach().full_tensor(), b) for a, b in zip(after, before))


@pytest.mark.parametrize("task_name", ["pose", "seg", "pointmap", "normal", "albedo"])
def test_every_finetuning_head_trains_in_bf16(bf16_fsdp, task_name):
    g = torch.Generator().manual_seed(0)
    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/tiny.yaml",
                      ["head.class_weights=null", "optim.warmup_steps=0"])  # fmt: skip
    labels = LabelInfo(parts=("background", "skin", "clothes"), keypoint_names=("a", "b", "c"),
                       keypoint_sigmas=(0.05, 0.05, 0.05), image_size=(128, 96))  # fmt: skip
    task = make_task(task_name, cfg, labels, cfg.model.backbone())
    model = build_finetune_model(cfg, task, None, CPU)
    seen = compute_dtypes(model)
    images = torch.randint(0, 256, (2, 3, 128, 96), dtype=torch.uint8, generator=g)
    batch = {"image": images, "keypoints": torch.rand(2, 3, 2, generator=g) * torch.tensor([95.0, 127.0]),
             "visibility": torch.full((2, 3), 2, dtype=torch.uint8), "area": torch.full((2,), 5000.0),
             "parts": torch.randint(0, 3, (2, 128, 96), generator=g), "mask": torch.rand(2, 128, 96, generator=g) > 0.3,
             "target": torch.rand(2, 128, 96, 3, generator=g) + 0.1}  # fmt: skip
    loss, _ = task.loss(model.head, model(images), batch)
    loss.backward()
    assert torch.isfinite(loss) and seen == {torch.bfloat16}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g.full_tensor()).all() for g in grads)
