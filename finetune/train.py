"""Fine-tuning on Ray Train (V2): backbone + task head, FSDP2, layer-wise LR decay, periodic evaluation.

The training runtime pretraining uses too (``training/``): a ``TorchTrainer`` worker group (gloo on CPU, NCCL on
GPU), FSDP2 on every transformer block, the head and the root (bf16 compute with fp32 reduction on GPU), the linear
warm-up + cosine schedule, gradient clipping on the global norm, JSON-lines metrics under ``<run>/metrics/``, DCP
checkpoints with a commit record (``training/worker.py``): a rerun of the same command, or Ray Train restarting the
worker group, continues from the newest committed checkpoint with the same data order.

- Backbone: an exported pretrained backbone (``backbone.safetensors`` of ``jobs.pretrain``, safetensors only) or a
  random initialisation from the run's seed. Built on the meta device and sharded; each rank then reads only its
  shards' rows of the file, or draws the seeded weights one module at a time (``build_model``).
- Optimiser: AdamW at the peak rate ``optim.lr x global batch / 256`` (``training.schedules.peak_lr``); layer-wise LR
  decay: the head and the final norm get the full rate, block ``i`` of the ``n`` blocks (a 4K backbone's windowed
  blocks first, then the global ones) ``decay ** (n - i)``, the patch embedding and learned tokens
  ``decay ** (n + 1)``; no weight decay on 1-D parameters (norms, biases, layer scales) or the learned tokens.
  ``optim.freeze_backbone`` trains the head alone on features computed without gradients (dense probing).
- LP-FT (Kumar et al., ICLR 2022): for the first ``optim.probe_steps`` steps the backbone's groups get rate 0 and no
  weight decay, so the head alone trains and first fits the pretrained features: a random head's gradients would
  otherwise distort them. Then the whole model fine-tunes. The head's schedule runs on the step, the backbone's on
  ``step - probe_steps`` over ``steps - probe_steps``, so its warm-up starts when it unfreezes.
- Stochastic depth (``model.drop_path``, the last block's rate; MAE's recipe: 0.1 for ViT-B): the given rate
  overrides the pretrained backbone's; ``finetuned.safetensors`` records 0, as it is a training setting.
- Output size: the input's, or half of it for a 4K backbone (``output_size``: its decoder gives 2K from 4K
  input); the labels are then resized to it (``tasks.resize_targets``) for the loss and the metrics.
- Evaluation every ``eval.every`` steps and at the end, on every worker's share of the validation set; the
  metric states are gathered on rank 0.
- At the end: ``<run>/metrics.json`` (final metrics, the evaluation curve, the config), PNGs under
  ``<run>/pictures/`` (input | target | prediction), and ``<run>/finetuned.safetensors`` (backbone + head, with
  what ``load_finetuned`` needs to rebuild it in its metadata).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from common import storage
from common.config import ConfigError, hash_json
from common.progress import Progress
from finetune import data, losses, tasks
from finetune.augment import Augmenter
from finetune.config import FinetuneConfig
from pretrain.backbone import BackboneConfig, Sapiens2Backbone, build, init_streamed
from pretrain.data import DataIndex
from pretrain.export import load_backbone, load_backbone_shards, read_backbone_config
from pretrain.views import IMAGENET_MEAN, IMAGENET_STD
from training import failures
from training.checkpoint import read_safetensors
from training.runner import launch, run_uri_for
from training.schedules import lr_at, peak_lr, wd_at
from training.sharding import copy_module, optimizer_step, shard, write_full
from training.worker import Worker, log_line

METRICS_FILE = "metrics.json"
PICTURES = "pictures"
FINETUNED_FILE = "finetuned.safetensors"


# --- model --------------------------------------------------------------------------------------------------------


class FinetuneModel(nn.Module):
    """Backbone -> patch-token feature map -> head. Takes uint8 images [B, 3, H, W] (normalised inside)."""

    mean: Tensor  # buffers, registered in __init__
    std: Tensor

    def __init__(self, backbone: Sapiens2Backbone, head: nn.Module, frozen: bool = False) -> None:
        super().__init__()
        self.backbone, self.head, self.frozen = backbone, head, frozen
        self.register_buffer("mean", torch.empty(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.empty(1, 3, 1, 1), persistent=False)
        self.init_buffers()
        if frozen:
            backbone.requires_grad_(False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The normalisation constants (written again once a meta-device build is materialised)."""
        self.mean.copy_(torch.tensor(IMAGENET_MEAN, device="cpu").view(1, 3, 1, 1))
        self.std.copy_(torch.tensor(IMAGENET_STD, device="cpu").view(1, 3, 1, 1))

    def forward(self, images: Tensor) -> Tensor:
        x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        x = (x - self.mean) / self.std
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            feat = self.backbone(x).featmap()
        return self.head(feat, output_size(self.backbone.cfg, *images.shape[-2:]))

    def no_weight_decay(self) -> set[str]:
        exempt = {f"backbone.{n}" for n in self.backbone.no_weight_decay()}
        return exempt | {f"head.{n}" for n, p in self.head.named_parameters() if p.ndim <= 1}


def output_stride(cfg: BackboneConfig) -> int:
    """Input pixels per output pixel: a 4K backbone's decoder outputs 2K (half the input per side), a base one
    the input's resolution."""
    return 2 if cfg.window else 1


def output_size(cfg: BackboneConfig, height: int, width: int) -> tuple[int, int]:
    """(H, W) of the head's output (and of the labels it is trained on) for a height x width input."""
    stride = output_stride(cfg)
    return height // stride, width // stride


def feature_stride(cfg: BackboneConfig) -> int:
    """Output pixels per feature-map cell, what the head upsamples by."""
    return cfg.patch_size * (cfg.window or 1) // output_stride(cfg)


def layer_id(name: str, depth: int, local_depth: int = 0) -> int:
    """0: patch embedding and learned tokens; i + 1: windowed block i; local_depth + i + 1: global block i;
    local_depth + depth + 1: final norm and the head."""
    top = local_depth + depth + 1
    if not name.startswith("backbone."):
        return top
    rest = name.removeprefix("backbone.")
    if rest.startswith("local_blocks."):
        return int(rest.split(".")[1]) + 1
    if rest.startswith("blocks."):
        return local_depth + int(rest.split(".")[1]) + 1
    if rest.startswith(("patch_embed", "cls_token", "registers", "window_query")):
        return 0
    return top


HEAD_GROUP = "-head"  # the name suffix of the groups that LP-FT's probe steps train (finetune.config probe_steps)


def param_groups(model: FinetuneModel, decay: float, weight_decay: float, split_head: bool = False) -> list[dict]:
    """AdamW groups per (layer, decay or not): ``lr_scale`` = decay ** (blocks + 1 - layer). ``split_head`` (LP-FT)
    also splits the top layer's head from the final norm, which the probe steps hold with the backbone; without it
    the groups are those of a run saved before LP-FT existed, so its checkpoints still resume."""
    cfg = model.backbone.cfg
    exempt = model.no_weight_decay()
    groups: dict[tuple[int, bool, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lid, no_wd = layer_id(name, cfg.depth, cfg.local_depth), name in exempt
        head = split_head and not name.startswith("backbone.")
        g = groups.setdefault(
            (lid, no_wd, head),
            {"params": [], "lr_scale": decay ** (cfg.total_depth + 1 - lid), "decays": not no_wd,
             "weight_decay": 0.0 if no_wd else weight_decay,
             "name": f"layer{lid}{'-no_decay' if no_wd else ''}{HEAD_GROUP if head else ''}"},
        )  # fmt: skip
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def check_architecture(found: BackboneConfig, cfg: FinetuneConfig, where: str) -> None:
    """Refuse a pretrained backbone whose architecture is not the config's (how it initialised LayerScale,
    recomputed activations or dropped paths is not its architecture)."""
    mine, wanted = (
        dataclasses.replace(c, activation_checkpointing="off", layer_scale_init=0.0, drop_path=0.0)
        for c in (found, cfg.model.backbone())
    )
    if mine == wanted:
        return
    local = f" + {found.local_depth} windowed blocks ({found.window}x{found.window} windows)" if found.window else ""
    differ = [f"model.{k}={getattr(found, k)}" for k in ("patch_size",) if getattr(mine, k) != getattr(wanted, k)]
    raise ConfigError(
        f"the backbone in {where} (width {found.width}, depth {found.depth}{local}, patch {found.patch_size}) does not "
        f"have the architecture of model.size={cfg.model.size!r} with model.patch_size={cfg.model.patch_size}; set "
        f"{' '.join(differ) or 'model.size and model.patch_size'} as it was pretrained"
    )


def build_backbone(cfg: FinetuneConfig, backbone_uri: str | None) -> Sapiens2Backbone:
    if backbone_uri is None:
        torch.manual_seed(cfg.seed)
        return build(cfg.model.backbone())
    backbone = load_backbone(
        backbone_uri, activation_checkpointing=cfg.model.activation_checkpointing, drop_path=cfg.model.drop_path
    )
    check_architecture(backbone.cfg, cfg, backbone_uri)
    return backbone


def backbone_settings(cfg: FinetuneConfig, backbone_uri: str | None) -> BackboneConfig:
    """The backbone ``build_backbone`` builds: the pretrained file's architecture (checked against the config, read
    from its header) with the config's training settings, or the config's."""
    if backbone_uri is None:
        return cfg.model.backbone()
    found = read_backbone_config(
        backbone_uri, activation_checkpointing=cfg.model.activation_checkpointing, drop_path=cfg.model.drop_path
    )
    check_architecture(found, cfg, backbone_uri)
    return found


def build_model(
    cfg: FinetuneConfig, task: tasks.Task, backbone_uri: str | None, device: torch.device | None = None
) -> FinetuneModel:
    """Backbone (pretrained or seeded random) + the task's head (seeded), FSDP2-sharded when a process group runs.

    Sharded, it is built on the meta device and each rank materialises only its shards on ``device``: their rows
    read from the pretrained file (``load_backbone_shards``), or the seeded weights drawn one module at a time
    (``init_streamed``); the same weights as the plain build, which never holds more than one backbone."""
    if device is None or not dist.is_initialized():
        backbone = build_backbone(cfg, backbone_uri)
        torch.manual_seed(cfg.seed + 1)
        model = FinetuneModel(backbone, _head(task, backbone.cfg), frozen=cfg.optim.freeze_backbone)
        _compile(cfg, model)
        return model.to(device or "cpu")
    bb_cfg = backbone_settings(cfg, backbone_uri)
    with torch.device("meta"):
        model = FinetuneModel(Sapiens2Backbone(bb_cfg), _head(task, bb_cfg), frozen=cfg.optim.freeze_backbone)
    _compile(cfg, model)
    shard(model, fsdp_chains(model), device, cfg.precision, cfg.fsdp)
    model.to_empty(device=device)
    if backbone_uri is None:
        torch.manual_seed(cfg.seed)
        init_streamed(bb_cfg, lambda name, full: write_full(model.backbone.get_parameter(name), full))
    else:
        load_backbone_shards(backbone_uri, model.backbone)
    torch.manual_seed(cfg.seed + 1)
    copy_module(model.head, _head(task, bb_cfg))  # small: drawn whole on the CPU, as the plain build draws it
    model.init_buffers()
    return model


def _head(task: tasks.Task, backbone: BackboneConfig) -> nn.Module:
    return task.build_head(backbone.width, feature_stride(backbone))


def _compile(cfg: FinetuneConfig, model: FinetuneModel) -> None:
    if cfg.model.compile:
        for block in model.backbone.all_blocks:
            block.compile()


def fsdp_chains(model: FinetuneModel) -> list[list[nn.Module]]:
    """The FSDP2 units in forward order (``training.sharding``): the backbone's blocks, then the head."""
    return [[*model.backbone.all_blocks, model.head]]


def build_optimizer(model: FinetuneModel, cfg: FinetuneConfig) -> torch.optim.AdamW:
    o = cfg.optim
    groups = param_groups(model, cfg.layer_decay(), o.weight_decay, split_head=o.probe_steps > 0)
    if not groups:
        raise ValueError("nothing to train: every parameter is frozen")
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def set_schedule(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig, step: int, world: int) -> tuple[float, float]:
    """Per-group learning rates (the schedule times each group's layer scale) and weight decay at ``step`` of a
    run on ``world`` workers (the peak rate scales with the global batch); returns the head's (the plain step's).

    LP-FT: the backbone's schedule runs on ``step - optim.probe_steps`` over the steps after the probe, and before
    it its groups get rate 0 and no weight decay (AdamW's decoupled decay is scaled by the rate, so rate 0 alone
    already leaves them bit-identical). Their gradients still feed AdamW's moments during the probe."""
    o = cfg.optim
    batch = cfg.samples_per_step(world)
    lr, wd = lr_at(step, o, cfg.steps, batch), wd_at(step, o, cfg.steps)
    after = step - o.probe_steps  # the backbone's step; with no probe, the step
    backbone_lr, backbone_wd = (
        (lr_at(after, o, cfg.steps - o.probe_steps, batch), wd_at(after, o, cfg.steps - o.probe_steps))
        if after >= 0
        else (0.0, 0.0)
    )
    for group in optimizer.param_groups:
        rate, decay = (lr, wd) if group["name"].endswith(HEAD_GROUP) else (backbone_lr, backbone_wd)
        group["lr"] = rate * group["lr_scale"]
        group["weight_decay"] = decay if group["decays"] else 0.0
    return lr, wd


def _to(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def make_task(name: str, cfg: FinetuneConfig, info: data.LabelInfo, backbone: BackboneConfig) -> tasks.Task:
    """The task at the model's output size: its labels, and pose's heatmap geometry, live there."""
    return tasks.make(name, cfg, dataclasses.replace(info, image_size=output_size(backbone, *info.image_size)))


def _image_at(images: Tensor, hw: tuple[int, int]) -> Tensor:
    """uint8 images area-resized to ``hw`` (pictures beside a prediction made at another size)."""
    if tuple(images.shape[-2:]) == tuple(hw):
        return images
    resized = torch.nn.functional.interpolate(images.float(), size=hw, mode="area")
    return resized.round().clamp(0, 255).to(torch.uint8)


# --- the worker loop ----------------------------------------------------------------------------------------------


def train_loop(loop_config: dict) -> None:
    """``TorchTrainer``'s ``train_loop_per_worker``: the config (JSON data), the run spec and the run URI."""
    import ray.train

    cfg = FinetuneConfig.model_validate(loop_config["config"])
    with failures.classified(loop_config["run_uri"], ray.train.get_context().get_world_rank()):
        FinetuneWorker(cfg, loop_config["spec"], loop_config["run_uri"]).run()


class FinetuneWorker(Worker[FinetuneConfig]):
    job = "finetune"
    hash_covers = "task, model size, head or label set"
    model: FinetuneModel

    def __init__(self, cfg: FinetuneConfig, spec: dict, run_uri: str) -> None:
        super().__init__(cfg, run_uri)
        self.spec = spec
        self.train_index = DataIndex.scan(spec["train"])
        self.val_index = DataIndex.scan(spec["val"])
        self.info = data.read_info(self.train_index, spec["train"])
        if data.read_info(self.val_index, spec["val"]) != self.info:
            raise data.DataError(
                f"{storage.redact(spec['val'])} labels differ from {storage.redact(spec['train'])} (classes, keypoints "
                "or size)"
            )
        self.task = make_task(spec["task"], cfg, self.info, cfg.model.backbone())
        self.output_hw = self.task.image_hw
        self.model = build_model(cfg, self.task, spec.get("backbone"), self.device)
        self.optimizer = build_optimizer(self.model, cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.curve: list[dict] = []  # the evaluations so far
        self.resume()

    # --- checkpoints ---

    def model_hash(self) -> str:
        c = self.cfg
        return hash_json(
            {"task": self.spec["task"], "size": c.model.size, "head": c.head.model_dump(mode="json"),
             "frozen": c.optim.freeze_backbone, "classes": self.info.num_classes, "keypoints": self.info.num_keypoints}
        )  # fmt: skip

    def named_spec(self) -> dict:
        """The run spec as the run's records name it: its URIs without query or credentials."""
        return {k: v and storage.redact(v) for k, v in self.spec.items()}

    def train_state(self) -> dict:
        return {"curve": self.curve, "spec": self.named_spec()}

    def restore_state(self, commit: dict) -> dict:
        self.curve = commit["curve"]
        return {}

    # --- training ---

    def labels(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The batch with its labels at the model's output size (a 4K backbone's is half the input's)."""
        if tuple(batch["image"].shape[-2:]) == self.output_hw:
            return batch
        return tasks.resize_targets(batch, self.spec["task"], self.output_hw)

    def augmenter(self) -> Augmenter | None:
        if self.cfg.data.augment is None:
            return None
        augmenter = Augmenter(self.cfg.data.augment, self.spec["task"], self.info.parts, self.info.keypoint_names)
        return augmenter if augmenter.active else None

    def run(self) -> None:
        c = self.cfg
        if self.log:
            per_step = c.samples_per_step(self.world)
            log_line(
                f"[finetune] {self.spec['task']} size={c.model.size} "
                f"backbone={'pretrained' if self.spec.get('backbone') else 'random'} frozen={c.optim.freeze_backbone} "
                f"steps {self.step}->{c.steps} workers={self.world} batch={per_step} "
                f"lr={peak_lr(c.optim, per_step):.3g} (optim.lr {c.optim.lr:g} x {per_step} / 256) "
                f"layer_decay={c.layer_decay()} probe_steps={c.optim.probe_steps} drop_path={c.model.drop_path} "
                f"output={self.output_hw[0]}x{self.output_hw[1]} "
                f"train={self.train_index.num_samples} val={self.val_index.num_samples}"
            )
        batches = data.train_batches(
            self.train_index, self.spec["task"], self.info.image_size, seed=c.seed, batch_size=c.data.batch_size,
            start_step=self.step, steps=c.steps, world=self.world, rank=self.rank, shuffle=c.data.shuffle,
            prefetch=c.data.prefetch, augment=self.augmenter(),
        )  # fmt: skip
        window: list[Tensor] = []
        started, wait = time.perf_counter(), 0.0
        while self.step < c.steps:
            t = time.perf_counter()
            batch = _to(next(batches), self.device)
            wait += time.perf_counter() - t
            lr, wd = set_schedule(self.optimizer, c, self.step, self.world)
            out = self.model(batch["image"])
            loss, terms = self.task.loss(self.model.head, out, self.labels(batch))
            loss.backward()
            grad_norm = optimizer_step(self.optimizer, self.params, c.optim.grad_clip)
            self.take_host_peak()
            self.step += 1
            window.append(torch.stack([loss.detach().float(), grad_norm.float(), *terms.values()]))
            if self.step % c.log.every == 0 or self.step == c.steps:
                self._log(window, list(terms), lr, wd, time.perf_counter() - started, wait)
                window, started, wait = [], time.perf_counter(), 0.0
            self.poll_save()  # after the step's metrics: a commit rolls the metrics log to the next step
            if c.eval.every and self.step % c.eval.every == 0 and self.step < c.steps:
                self.evaluate()
            if c.checkpoint.every and self.step % c.checkpoint.every == 0 and self.step < c.steps:
                self.save()
        done = self.curve and self.curve[-1]["step"] == self.step and self.saved_step == self.step  # a rerun
        final = self.curve[-1] if done else self.evaluate(pictures=c.eval.visualise)
        self.finish_save()
        if self.saved_step != self.step:
            self.save()
        self.finish_save()
        self._finish(final)

    def _log(self, window: list[Tensor], names: list[str], lr: float, wd: float, seconds: float, wait: float) -> None:
        stats = torch.stack(window).mean(0).to(self.device)
        dist.all_reduce(stats)
        stats = (stats / self.world).tolist()
        record = {"kind": "train", "step": self.step, "loss": stats[0], "grad_norm": stats[1],
                  **dict(zip(names, stats[2:])), "lr": lr, "wd": wd, "step_s": seconds / len(window),
                  "data_wait_s": wait / len(window), "data_wait_frac": wait / seconds,
                  "images_per_s": len(window) * self.cfg.data.batch_size * self.world / seconds,
                  **self.host_peak_field()}  # fmt: skip
        if self.log:
            self.log.write(record)
            terms = " ".join(f"{k} {v:.4f}" for k, v in zip(names, stats[2:]))
            log_line(
                f"[finetune] step {self.step}/{self.cfg.steps} loss {stats[0]:.4f} ({terms}) lr {lr:.2e} "
                f"gnorm {stats[1]:.3f} | {record['images_per_s']:.1f} img/s step {record['step_s']:.3f}s"
            )

    # --- evaluation ---

    @torch.no_grad()
    def evaluate(self, pictures: int = 0) -> dict:
        self.model.eval()
        acc = self.task.metric()
        shown: list[np.ndarray] = []  # pictures, rank 0's
        c = self.cfg
        samples = min(c.eval.max_samples or self.val_index.num_samples, self.val_index.num_samples)
        per_worker = math.ceil(math.ceil(samples / self.world) / c.data.eval_batch_size)  # the same on every worker
        meter = Progress(f"[finetune] eval step {self.step}:", per_worker, log_line, "batches") if self.log else None
        for batch, valid in data.eval_batches(
            self.val_index, self.spec["task"], self.info.image_size, batch_size=c.data.eval_batch_size,
            world=self.world, rank=self.rank, limit=c.eval.max_samples,
        ):  # fmt: skip
            batch, valid = _to(batch, self.device), valid.to(self.device)
            out = self.model(batch["image"])
            labels = self.labels(batch)
            self.task.update(acc, self.model.head, out, labels, valid)
            if self.rank == 0 and len(shown) < pictures:
                labels = {**labels, "image": _image_at(batch["image"], self.output_hw)}  # drawn at the output size
                for i in valid.nonzero().flatten().tolist()[: pictures - len(shown)]:
                    target, pred = self.task.picture(self.model.head, out, labels, i)
                    image = labels["image"][i].permute(1, 2, 0).cpu().numpy()
                    shown.append(np.concatenate([image, target, pred], axis=1))
            if meter:
                meter.update()
        self.model.train()
        states: list[dict[str, list[np.ndarray]]] = [{} for _ in range(self.world)]  # filled by all_gather_object
        dist.all_gather_object(states, acc.state())
        result: list[dict] = [{}]  # rank 0's record, broadcast to every rank
        if self.rank == 0:
            merged = self.task.metric()
            merged.merge(states)
            result[0] = {"step": self.step, **merged.compute()}
        dist.broadcast_object_list(result, src=0)
        self.curve.append(result[0])
        if self.log:
            self.log.write({"kind": "eval", **result[0]})
            summary = " ".join(f"{k} {v:.4f}" for k, v in result[0].items() if isinstance(v, float))
            log_line(f"[finetune] eval step {self.step}: {summary}")
            fs, root = storage.resolve(self.run_uri)
            for k, picture in enumerate(shown):
                path = storage.join(root, PICTURES, f"{self.spec['task']}-{k:02d}.png")
                storage.write_bytes_atomic(fs, path, data.png_bytes(picture))
        return result[0]

    # --- the end of the run ---

    def _finish(self, final: dict) -> None:
        # a model's state dict holds tensors only (torch types it as any state dict value)
        state = cast(
            dict[str, Tensor],
            get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        )
        if self.rank != 0:
            return
        from safetensors.torch import save as st_save

        fs, root = storage.resolve(self.run_uri)
        meta = {
            "format": "pt",
            "task": self.spec["task"],
            "backbone_config": json.dumps(
                dataclasses.asdict(
                    dataclasses.replace(self.model.backbone.cfg, activation_checkpointing="off", drop_path=0.0)
                )
            ),
            "config": self.cfg.model_dump_json(),
            "labels": json.dumps(dataclasses.asdict(self.info)),
            "step": str(self.step),
        }
        tensors = {k: v.contiguous() for k, v in state.items()}
        storage.write_bytes_atomic(fs, storage.join(root, FINETUNED_FILE), st_save(tensors, metadata=meta))
        report = {
            "task": self.spec["task"],
            "step": self.step,
            "metrics": final,
            "curve": self.curve,
            "backbone": self.named_spec().get("backbone"),
            "data": {"train": self.named_spec()["train"], "val": self.named_spec()["val"]},
            "config": self.cfg.model_dump(mode="json"),
        }
        storage.write_json_atomic(fs, storage.join(root, METRICS_FILE), _finite(report))
        assert self.log is not None  # rank 0 opened it in resume
        self.log.close()


def _finite(obj):
    """NaN / inf -> None, so the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# --- loading a fine-tuned model ------------------------------------------------------------------------------------


def load_finetuned(uri: str) -> tuple[FinetuneModel, tasks.Task]:
    """The model (eval mode, CPU) and its task from ``finetuned.safetensors``; safetensors only, no pickle. The
    task works at the model's output size (``output_size``: half the input's for a 4K backbone)."""
    tensors, meta = read_safetensors(uri)
    if "task" not in meta:
        raise ValueError(f"{uri} is not a fine-tuned model (no task in its metadata); it may be a bare backbone")
    cfg = FinetuneConfig.model_validate_json(meta["config"])
    fields = json.loads(meta["backbone_config"])
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    bb_cfg = BackboneConfig(**values)
    labels = json.loads(meta["labels"])
    info = data.LabelInfo(**{k: tuple(v) for k, v in labels.items()})
    task = make_task(meta["task"], cfg, info, bb_cfg)
    model = FinetuneModel(Sapiens2Backbone(bb_cfg), task.build_head(bb_cfg.width, feature_stride(bb_cfg)))
    model.load_state_dict(tensors, strict=True)
    return model.eval(), task


@torch.no_grad()
def evaluate_finetuned(uri: str, data_uri: str, batch_size: int = 16, limit: int | None = None) -> dict:
    """The task's metrics of ``finetuned.safetensors`` on the first ``limit`` samples of labelled shards, in this
    process: a split the run never evaluated on (a test set, when its validation set chose the learning rate)."""
    model, task = load_finetuned(uri)
    index = DataIndex.scan(data_uri)
    info = data.read_info(index, data_uri)
    acc = task.metric()
    batches = data.eval_batches(index, task.name, info.image_size, batch_size=batch_size, world=1, rank=0, limit=limit)
    for batch, valid in batches:
        labels = batch  # at the model's output size, as the worker's evaluation scores them
        if tuple(batch["image"].shape[-2:]) != task.image_hw:
            labels = tasks.resize_targets(batch, task.name, task.image_hw)
        task.update(acc, model.head, model(batch["image"]), labels, valid)
    return acc.compute()


# --- the driver side ----------------------------------------------------------------------------------------------


def resolve_class_weights(cfg: FinetuneConfig, spec: dict) -> FinetuneConfig:
    """``head.class_weights: auto`` -> the weights of the training set's class frequencies (seg only)."""
    if cfg.head.class_weights != "auto":
        return cfg
    if spec["task"] != "seg":
        return cfg.model_copy(update={"head": cfg.head.model_copy(update={"class_weights": None})})
    index = DataIndex.scan(spec["train"])
    counts = data.class_pixel_counts(index, data.read_info(index, spec["train"]))
    weights = losses.balanced_class_weights(counts)
    return cfg.model_copy(update={"head": cfg.head.model_copy(update={"class_weights": weights})})


def fit(cfg: FinetuneConfig, spec: dict, storage_path: str, name: str):
    """Run (or resume) the fine-tuning run ``name`` under ``storage_path`` on the connected Ray cluster."""
    cfg = resolve_class_weights(cfg, spec)
    config = {"config": cfg.model_dump(mode="json"), "spec": spec, "run_uri": run_uri_for(storage_path, name)}
    return launch(train_loop, config, cfg.ray, storage_path, name)
