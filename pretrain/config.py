"""The pretraining config: model size, objective, data ingest, gradient accumulation, checkpoints, fault drill.

The settings every training run has (optimiser, metrics, cluster) are ``training/config.py``'s. Shipped configs
live in ``configs/pretrain/*.yaml``; every field has a default here so a config only states what it changes.
Overrides use the same ``key=value`` style as curation (``optim.lr=3e-4``, ``ray.workers=8``).
"""

from __future__ import annotations

import dataclasses

from pydantic import Field, field_validator, model_validator

from common.config import ConfigError, Strict, hash_json
from pretrain.backbone import SIZES, BackboneConfig, Checkpointing, checkpointing_mode
from pretrain.objective import ObjectiveConfig
from training.config import CheckpointSettings, LogSettings, OptimSettings, TrainingConfig


class ModelSettings(Strict):
    size: str = Field(
        "0.4b", description="The backbone's size: a key of pretrain.backbone.SIZES (e.g. tiny, 0.4b, 1b, 5b)."
    )
    activation_checkpointing: Checkpointing = Field(
        "off",
        description='What each block recomputes in the backward pass: nothing ("off"), everything from its input '
        '("full"), or all but its matmul and attention outputs ("selective"; pretrain/backbone.py). true and false '
        'read as "full" and "off".',
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    layer_scale_init: float | None = Field(
        None,
        gt=0,
        description="LayerScale's initial value (None: the size's, 1e-4). At 1e-4 a fresh shallow model's [CLS] "
        "barely depends on the image, so the teacher's targets start uniform; small models start better from 0.1.",
    )
    ffn_layer_scale: bool = Field(
        False,
        description="LayerScale on the FFN branch too (DINOv2's blocks); false: on the attention branch only, as "
        "Sapiens2's blocks.",
    )
    patch_size: int | None = Field(
        None,
        ge=1,
        description="Patch side in pixels (None: the size's, 16). At 128x96 a 16-px patch leaves an 8x6 token grid, "
        "coarser than the 64x48 the Sapiens2 sizes see at 1024x768; 8 px gives the tiny model 16x12 tokens.",
    )
    drop_path: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Stochastic depth, a fine-tuning setting (MAE fine-tunes ViT-B / L / H with 0.1 / 0.2 / 0.3): "
        "each block's attention and FFN branches are dropped per sample in training, at a rate rising linearly from "
        "0 at the first block to this at the last. 0: none, pretraining's default.",
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _flag(cls, v: object) -> object:
        # configs and runs recorded when the setting was a flag: true is "full", false "off"
        return checkpointing_mode(v) if isinstance(v, bool) else v

    @field_validator("size")
    @classmethod
    def _known_size(cls, v: str) -> str:
        if v not in SIZES:
            raise ValueError(f"unknown size; choose from {sorted(SIZES)}")
        return v

    def backbone(self) -> BackboneConfig:
        backbone = dataclasses.replace(
            SIZES[self.size],
            activation_checkpointing=self.activation_checkpointing,
            ffn_layer_scale=self.ffn_layer_scale,
            drop_path=self.drop_path,
        )
        if self.layer_scale_init is not None:
            backbone = dataclasses.replace(backbone, layer_scale_init=self.layer_scale_init)
        if self.patch_size is not None:
            backbone = dataclasses.replace(backbone, patch_size=self.patch_size)
        return backbone


class DataSettings(Strict):
    image_size: tuple[int, int] | None = Field(
        None,
        description="(H, W) of the decoded image: a person-centred crop of the model's aspect resized to this size. "
        "None: the objective's global view size. The views are then cut from it on the device.",
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        description="Images per optimiser step over all workers: the recipe (batch, peak LR, schedules), whatever "
        "the cluster's size. Set, the worker count is operational (a resume on fewer or more workers keeps it), "
        "batch_size is the largest micro-batch a worker may hold and optim.grad_accum is derived "
        "(PretrainConfig.split). None: the global batch is batch_size x optim.grad_accum x ray.workers.",
    )
    batch_size: int = Field(
        32, ge=1, description="Images per worker per micro-batch (with global_batch: at most this many)."
    )
    shuffle: bool = Field(
        True,
        description="Shuffle the data each epoch, seeded by the run's seed and the epoch: row groups in a random order, rows "
        "shuffled inside each. false: no shuffling.",
    )
    person_crop: bool = Field(
        True, description="Centre the crop on the prominent persons' boxes; false: on the image centre."
    )
    read_segments: int = Field(
        8, ge=1, description="Plan segments (runs of rows of one row group) per Ray Data read task."
    )
    read_cpus: float = Field(1.0, gt=0, description="CPUs per Ray Data read-and-decode task.")
    prefetch_batches: int = Field(
        2, ge=0, description="Batches Ray Data prepares ahead of the one in use, per worker (0: none)."
    )
    plan_steps: int = Field(
        1000,
        ge=1,
        description="Optimiser steps per Ray Data dataset; the next dataset starts when they are reached.",
    )
    verify_sha256: bool = Field(
        False,
        description="Check every shard's sha256 against the manifest's at each start (reads all the data once).",
    )
    takedown_check_minutes: float = Field(
        10.0,
        ge=0,
        description="Minutes between reads of the data's takedown records (jobs.takedown): a removed image is "
        "skipped from at most this long (and the next metrics step, log.every) after its takedown on. 0: at every "
        "metrics step.",
    )


class PretrainOptim(OptimSettings):
    grad_accum: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimiser step: the global batch is data.batch_size x grad_accum x workers. "
        "Derived when data.global_batch is set (then leave it at 1).",
    )


class PretrainCheckpoint(CheckpointSettings):
    every: int = Field(500, ge=1, description="Optimiser steps between checkpoints (and one at the end).")
    on_preemption: bool = Field(True, description="Save at once when Ray reports that a node is about to be reclaimed.")
    preemption_check_every: int = Field(
        10, ge=1, description="Optimiser steps between preemption queries (a barrier each)."
    )


class PretrainLog(LogSettings):
    record_keys: bool = Field(False, description="Write the sample keys of every step (all ranks) to the metrics log.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Per-GPU peak TFLOPS for MFU; None: looked up from the GPU name."
    )
    collapse_patience: int = Field(
        10,
        ge=1,
        description="Steps a self-distillation collapse (objective.collapse_state), or its end, must last before "
        "it is logged.",
    )


class PretrainProbe(Strict):
    """The frozen probe of ``jobs.probe`` on the EMA teacher during training: every rank runs the sharded teacher
    over the probe's images, rank 0 fits and scores the probes; the scores are ``eval`` records of the metrics log
    and TensorBoard. A failed evaluation is logged and training goes on."""

    every: int = Field(
        0,
        ge=0,
        description="Optimiser steps between probes of the EMA teacher (and one at the last step). 0: none.",
    )
    data: str | None = Field(
        None,
        description="Labelled shards with train/ and val/, as jobs.make_synthetic writes them; required when every "
        "is set.",
    )
    labels: int | None = Field(
        None, ge=2, description="Training images the probes fit on (None: the whole train/ split)."
    )
    eval_limit: int | None = Field(64, ge=1, description="Evaluation images (None: the whole val/ split).")
    k: int = Field(10, ge=1, description="Neighbours of the k-NN label transfer.")
    iters: int = Field(50, ge=1, description="L-BFGS iterations per linear fit.")

    @model_validator(mode="after")
    def _data_when_on(self) -> PretrainProbe:
        if self.every and not self.data:
            raise ValueError("probe.every needs probe.data (a folder written by `python -m jobs.make_synthetic`)")
        return self


class FaultSettings(Strict):
    """Fault drills."""

    kill_at_step: int | None = Field(
        None,
        ge=1,
        description="SIGKILL one worker process (kill_rank) when it reaches this step, once per run (a marker file "
        "remembers). None: no kill.",
    )
    kill_rank: int = Field(0, ge=0, description="The rank whose process kill_at_step kills.")
    disk_full_at_step: int | None = Field(
        None,
        ge=1,
        description="The checkpoint of this step meets a full disk (its shards go to /dev/full, whose every write "
        "fails with ENOSPC, as on a full local disk). None: no drill.",
    )


class PretrainConfig(TrainingConfig):
    operational = (
        *TrainingConfig.operational, "fault", "objective.check_finite", "model.compile", "model.activation_checkpointing", "data.read_segments",
        "data.read_cpus", "data.prefetch_batches", "data.plan_steps", "data.verify_sha256", "data.takedown_check_minutes", "probe",
    )  # fmt: skip

    model: ModelSettings = Field(ModelSettings(), description="The backbone: its size and how it is built.")
    objective: ObjectiveConfig = Field(
        ObjectiveConfig(),
        description="The pretraining objective (MAE + self-distillation): decoder, projection head, teacher, "
        "masking and views.",
    )
    data: DataSettings = Field(DataSettings(), description="Reading, decoding and batching the training shards.")
    optim: PretrainOptim = Field(PretrainOptim(), description="AdamW, its schedules and gradient accumulation.")
    checkpoint: PretrainCheckpoint = Field(
        PretrainCheckpoint(), description="When checkpoints are written and how many are kept."
    )
    log: PretrainLog = Field(PretrainLog(), description="Metrics: how often, where, and what else is logged.")
    fault: FaultSettings = Field(
        FaultSettings(), description="Fault drills: a killed worker or a full disk at a given step."
    )
    probe: PretrainProbe = Field(PretrainProbe(), description="Frozen probes of the EMA teacher during training.")

    @model_validator(mode="after")
    def _sizes_fit_the_model(self) -> PretrainConfig:
        bb = self.model.backbone()
        unit = bb.patch_size * (bb.window or 1)
        for name, (h, w) in (("global", self.objective.views.global_size), ("local", self.objective.views.local_size)):
            if h % unit or w % unit:
                raise ValueError(f"objective.views.{name}_size {h}x{w} must be a multiple of {unit} px")
        if self.data.image_size is not None and min(self.data.image_size) < 1:
            raise ValueError("data.image_size must be positive")
        return self

    @property
    def image_size(self) -> tuple[int, int]:
        return self.data.image_size or self.objective.views.global_size

    @model_validator(mode="after")
    def _one_accumulation(self) -> PretrainConfig:
        if self.data.global_batch is not None and self.optim.grad_accum != 1:
            raise ValueError("optim.grad_accum is derived from data.global_batch: set one of them")
        return self

    def samples_per_step(self, workers: int | None = None) -> int:
        if self.data.global_batch is not None:
            return self.data.global_batch
        return self.data.batch_size * self.optim.grad_accum * (workers or self.ray.workers)

    def split(self, workers: int) -> tuple[int, int]:
        """(images per micro-batch, micro-batches per step) of each of ``workers`` for ``data.global_batch``: the
        fewest micro-batches whose size fits ``data.batch_size``. A ``ConfigError`` naming the worker counts that
        fit when the global batch does not divide among ``workers``."""
        g, cap = self.samples_per_step(workers), self.data.batch_size
        if g % workers:
            fits = [w for w in range(1, min(g, 4096) + 1) if g % w == 0]
            raise ConfigError(
                f"data.global_batch={g} does not divide among {workers} workers: it fits {', '.join(map(str, fits))} "
                "workers; change ray.workers or data.global_batch"
            )
        per_worker = g // workers
        accum = next(a for a in range(-(-per_worker // cap), per_worker + 1) if per_worker % a == 0)
        return per_worker // accum, accum

    def for_workers(self, workers: int) -> PretrainConfig:
        """This config with ``data.global_batch`` resolved for ``workers`` into ``data.batch_size`` and
        ``optim.grad_accum``, what the workers run (itself when the global batch is not set)."""
        if self.data.global_batch is None:
            return self
        micro, accum = self.split(workers)
        resolved = self.model_copy(deep=True)
        resolved.data.global_batch = None
        resolved.data.batch_size, resolved.optim.grad_accum, resolved.ray.workers = micro, accum, workers
        return resolved

    def result_settings(self) -> dict:
        settings = super().result_settings()
        if self.data.global_batch is not None:  # the split follows the cluster; the global batch is the recipe
            settings.pop("ray.workers", None)
        return settings

    def model_hash(self) -> str:
        """Hash of what the checkpointed tensors' shapes depend on: a resume with another value is refused."""
        o, m = self.objective, self.model
        shapes = {"size": m.size, "patch_size": m.patch_size, "ffn_layer_scale": m.ffn_layer_scale}
        return hash_json({**shapes, "mae": o.mae.model_dump(mode="json"), "cl": o.cl.model_dump(mode="json")})
