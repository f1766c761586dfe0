"""The pretrained backbone as a plain file: the student (or EMA teacher) of a pretraining checkpoint, in safetensors.

``jobs.pretrain`` writes ``<run>/backbone.safetensors`` at the end of a run (``--export teacher``:
``<run>/teacher_backbone.safetensors``); fine-tuning starts from it
(``load_backbone``). No pickle on either side: the backbone config travels in the file's metadata. An objective
trained in a process of its own, outside Ray Train, is written to the same file by ``export_objective``.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common import storage
from pretrain.backbone import BackboneConfig, Sapiens2Backbone
from pretrain.config import ModelSettings
from training.checkpoint import SafeLoadPlanner, SafetensorsFile, read_commit, read_safetensors, storage_reader
from training.sharding import local_region, write_local

BACKBONE_FILE = "backbone.safetensors"


# The backbones a checkpoint holds, by their key prefix in the model state (``JointObjective``): the student, and its
# EMA teacher (DINO evaluates the teacher, which is often the better of the two).
EXPORTS = {"student": "student.", "teacher": "teacher.backbone."}
EXPORT_FILES = {"student": BACKBONE_FILE, "teacher": "teacher_backbone.safetensors"}
FINETUNED_PREFIX = "backbone."  # the backbone's keys in a fine-tuned model's state (finetune.train.FinetuneModel)


def read_model_state(ckpt_uri: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors named in ``like`` (shapes and dtypes; keys of the objective's state dict) from a checkpoint's model
    state, read in this process without a process group; nothing else (no optimiser) is read."""
    state = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in like.items()}}
    with warnings.catch_warnings():  # no_dist is what this single-process read means to do; torch warns anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        planner = SafeLoadPlanner(allow_partial_load=True)
        dcp.load(state, storage_reader=storage_reader(ckpt_uri), planner=planner, no_dist=True)
    return state["model"]


def export_backbone(ckpt_uri: str, out_uri: str, which: str = "student") -> dict:
    """Write the student backbone of a checkpoint (or, ``which="teacher"``, its EMA teacher's) as a plain safetensors
    state dict (keys of Sapiens2Backbone).

    Reads only that backbone's tensors (no optimiser), without a process group. The backbone config travels in the
    file's metadata, so ``load_backbone`` needs nothing else.
    """
    prefix = _prefix(which)
    commit = read_commit(ckpt_uri)
    model = ModelSettings.model_validate(commit["config"]["model"])  # the run's, overrides included
    shapes = build_meta(model.backbone()).state_dict()
    state = read_model_state(ckpt_uri, {f"{prefix}{k}": v for k, v in shapes.items()})
    tensors = {k.removeprefix(prefix): v for k, v in state.items()}
    return _write_backbone(out_uri, tensors, model, int(commit["step"]), which)


def export_objective(
    objective: torch.nn.Module, model: ModelSettings, step: int, out_uri: str, which: str = "student"
) -> dict:
    """``export_backbone`` for an objective trained in this process (a plain ``JointObjective``, not sharded, on any
    device): the same file, from its state dict; ``model`` is its run's model settings, ``step`` the steps it made."""
    prefix = _prefix(which)
    state = objective.state_dict()
    tensors = {k: state[prefix + k].detach().cpu() for k in build_meta(model.backbone()).state_dict()}
    return _write_backbone(out_uri, tensors, model, step, which)


def _prefix(which: str) -> str:
    if which not in EXPORTS:
        raise ValueError(f"which must be one of {sorted(EXPORTS)}, got {which!r}")
    return EXPORTS[which]


def _write_backbone(
    out_uri: str, tensors: dict[str, torch.Tensor], model: ModelSettings, step: int, which: str
) -> dict:
    from safetensors.torch import save as st_save

    cfg = model.backbone()
    meta = {
        "format": "pt",
        # training-time settings are not the architecture: a fine-tuning run sets its own
        "backbone_config": json.dumps(
            dataclasses.asdict(dataclasses.replace(cfg, activation_checkpointing="off", drop_path=0.0))
        ),
        "size": model.size,
        "step": str(step),
        "which": which,
    }
    fs, path = storage.resolve(out_uri)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    storage.write_bytes_atomic(fs, path, st_save(tensors, metadata=meta))
    return meta


def build_meta(cfg: BackboneConfig) -> Sapiens2Backbone:
    with torch.device("meta"):
        return Sapiens2Backbone(cfg)


def backbone_config(meta: dict[str, str], ffn_layer_scale: bool = False) -> BackboneConfig:
    """The architecture an exported backbone's (or a fine-tuned model's) metadata records; ``ffn_layer_scale``: the
    value for a file written before the flag was recorded."""
    fields = json.loads(meta["backbone_config"])
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    values.setdefault("ffn_layer_scale", ffn_layer_scale)
    return BackboneConfig(**values)


def load_backbone(uri: str, **overrides) -> Sapiens2Backbone:
    """A Sapiens2Backbone with the exported weights (``overrides`` change non-shape fields, e.g.
    ``activation_checkpointing="full"``). ``uri`` is an exported backbone or a fine-tuned model
    (``finetuned.safetensors`` of ``jobs.finetune``, whose backbone is taken and its head left): a backbone trained
    on one task starts another, and a supervised backbone is the positive control of ``benchmarks/pretrain_value.py``.
    """
    tensors, meta = read_safetensors(uri)
    cfg, prefix = _file_backbone(meta, tensors)
    tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    model = Sapiens2Backbone(dataclasses.replace(cfg, **overrides))
    model.load_state_dict(tensors, strict=True)
    return model


def read_backbone_config(uri: str, **overrides) -> BackboneConfig:
    """The architecture of ``load_backbone``'s backbone (``overrides`` as there), from the file's header alone."""
    with SafetensorsFile(uri) as f:
        return dataclasses.replace(_file_backbone(f.meta, f.entries)[0], **overrides)


@torch.no_grad()
def load_backbone_shards(uri: str, backbone: torch.nn.Module) -> None:
    """``load_backbone``'s weights into ``backbone`` (materialised, sharded or not): each parameter's part this rank
    holds (``local_region``) is read from the file, rows of the first dimension as one byte range each, so a rank
    reads its shards, not the file."""
    with SafetensorsFile(uri) as f:
        _, prefix = _file_backbone(f.meta, f.entries)
        params = dict(backbone.named_parameters())
        found = {k.removeprefix(prefix) for k in f.entries if k.startswith(prefix)}
        wrong = sorted(n for n in params.keys() & found if f.shape(prefix + n) != tuple(params[n].shape))
        if found != params.keys() or wrong:
            missing, unexpected = sorted(params.keys() - found), sorted(found - params.keys())
            raise ValueError(
                f"{storage.redact(uri)} does not hold this backbone's weights: missing {missing}, unexpected "
                f"{unexpected}, other shapes {wrong}"
            )
        for name, p in params.items():
            region = local_region(p)
            rows_only = all(r == slice(0, n) for r, n in zip(region[1:], p.shape[1:]))  # FSDP2's Shard(0)
            part = f.read(prefix + name, region[0]) if region and rows_only else f.read(prefix + name)[region]
            write_local(p, part)


def _file_backbone(meta: dict[str, str], names: Iterable[str]) -> tuple[BackboneConfig, str]:
    """The architecture a file's metadata records and the prefix of its backbone's tensor names (a fine-tuned
    model's backbone.* beside its head.*)."""
    prefix = FINETUNED_PREFIX if "task" in meta else ""
    keys = [k for k in names if k.startswith(prefix)]
    # Files written before the setting existed carry no flag; their tensors tell whether blocks scale the FFN branch.
    return backbone_config(meta, ffn_layer_scale=any(k.endswith(".ls2") for k in keys)), prefix
