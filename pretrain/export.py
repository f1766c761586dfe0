"""The pretrained backbone as a plain file: the student of a pretraining checkpoint, exported to safetensors.

``jobs.pretrain`` writes ``<run>/backbone.safetensors`` at the end of a run; fine-tuning starts from it
(``load_backbone``). No pickle on either side: the backbone config travels in the file's metadata.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common import storage
from pretrain.backbone import BackboneConfig, Sapiens2Backbone
from pretrain.config import ModelSettings
from training.checkpoint import SafeLoadPlanner, read_commit, read_safetensors, storage_reader

BACKBONE_FILE = "backbone.safetensors"


def export_backbone(ckpt_uri: str, out_uri: str) -> dict:
    """Write the student backbone of a checkpoint as a plain safetensors state dict (keys of Sapiens2Backbone).

    Reads only the backbone's tensors (no optimiser, no teacher), without a process group. The backbone config
    travels in the file's metadata, so ``load_backbone`` needs nothing else.
    """
    from safetensors.torch import save as st_save

    commit = read_commit(ckpt_uri)
    cfg = ModelSettings.model_validate(commit["config"]["model"]).backbone()  # the run's, overrides included
    shapes = build_meta(cfg).state_dict()
    state = {"model": {f"student.{k}": torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}}
    with warnings.catch_warnings():  # no_dist is what this single-process read means to do; torch warns anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        planner = SafeLoadPlanner(allow_partial_load=True)
        dcp.load(state, storage_reader=storage_reader(ckpt_uri), planner=planner, no_dist=True)
    tensors = {k.removeprefix("student."): v.contiguous() for k, v in state["model"].items()}
    meta = {
        "format": "pt",
        "backbone_config": json.dumps(dataclasses.asdict(dataclasses.replace(cfg, activation_checkpointing=False))),
        "size": commit["config"]["model"]["size"],
        "step": str(commit["step"]),
    }
    fs, path = storage.resolve(out_uri)
    storage.write_bytes_atomic(fs, path, st_save(tensors, metadata=meta))
    return meta


def build_meta(cfg: BackboneConfig) -> Sapiens2Backbone:
    with torch.device("meta"):
        return Sapiens2Backbone(cfg)


def load_backbone(uri: str, **overrides) -> Sapiens2Backbone:
    """A Sapiens2Backbone with the exported weights (``overrides`` change non-shape fields, e.g.
    ``activation_checkpointing=True``)."""
    tensors, meta = read_safetensors(uri)
    fields = json.loads(meta["backbone_config"])
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    cfg = BackboneConfig(**values)
    model = Sapiens2Backbone(dataclasses.replace(cfg, **overrides))
    model.load_state_dict(tensors, strict=True)
    return model
