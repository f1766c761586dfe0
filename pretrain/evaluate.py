"""A pretraining checkpoint evaluated without training it: the objective's MAE term on held-out images.

The MAE loss on images the run never saw says whether the student + decoder learnt to complete figures or only
memorised its pool; read against the same term of the run's initial weights (``initial_objective``: what
``pretrain.train.build_model`` builds from the run's seed, before any step) on the same views and masks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pretrain.backbone import build
from pretrain.config import PretrainConfig
from pretrain.export import read_model_state
from pretrain.objective import JointObjective
from training.checkpoint import read_commit


def initial_objective(cfg: PretrainConfig) -> JointObjective:
    """The objective a run with ``cfg`` starts from (the same seed, so the same weights as its step 0)."""
    torch.manual_seed(cfg.seed)
    return JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)


def load_objective(ckpt_uri: str) -> tuple[JointObjective, PretrainConfig, int]:
    """The whole objective (student, decoder, head, teacher) of a committed checkpoint, on the CPU in eval mode, its
    run's config and its step; read in this process (no process group, no optimiser state)."""
    commit = read_commit(ckpt_uri)
    cfg = PretrainConfig.model_validate(commit["config"])
    objective = initial_objective(cfg)
    objective.load_state_dict(read_model_state(ckpt_uri, objective.state_dict()), strict=True)
    return objective.eval(), cfg, int(commit["step"])


@torch.no_grad()
def heldout_mae(
    objective: JointObjective, images: Tensor, *, step: int = 0, seed: int = 0, batch_size: int = 16
) -> float:
    """The objective's MAE term (``JointObjective.forward``'s ``mae``: the views and masks training draws) over
    uint8 images [N, 3, H, W], averaged per image. A seeded generator draws the views and masks, so two objectives
    evaluated with one seed see the same crops and the same hidden patches."""
    objective.eval()
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for i in range(0, len(images), batch_size):
        batch = images[i : i + batch_size]
        total += float(objective(batch, step, generator)["mae"]) * len(batch)
    return total / len(images)
