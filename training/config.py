"""The settings of every training run, whatever it trains: optimiser, checkpoint retention, metrics, cluster.

Pretraining (``pretrain/config.py``) and fine-tuning (``finetune/config.py``) extend them with their model, data and
loop settings; the shipped configs are ``configs/{pretrain,finetune}/*.yaml``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from common.config import Strict
from common.watchdog import WatchdogSettings
from training.metrics_sinks import Backend, check_backends


class OptimSettings(Strict):
    """AdamW with a linear warm-up and cosine learning-rate decay, and a cosine weight-decay schedule (by optimiser
    step)."""

    lr: float = Field(
        1.5e-4,
        gt=0,
        description="Base learning rate for 256 images per optimiser step: the peak after warm-up is lr x global "
        "batch / 256 (training.schedules.peak_lr; Sapiens v1: 1.5e-4 x batch / 256).",
    )
    min_lr: float = Field(
        1e-6, ge=0, description="Learning rate at the end of the cosine decay; absolute, not scaled by the batch."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Optimiser steps of the linear learning-rate warm-up to the peak; 0: none."
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2) moment decay rates.")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon, added to the denominator of each update.")
    weight_decay: float = Field(
        0.04,
        ge=0,
        description="Weight decay at step 0, the start of the cosine schedule to weight_decay_end. Never on 1-D "
        "parameters and tokens.",
    )
    weight_decay_end: float | None = Field(
        0.2,
        ge=0,
        description="Weight decay at the last step, reached by a cosine from weight_decay (DINO-style); None: "
        "weight_decay throughout.",
    )
    grad_clip: float | None = Field(
        1.0,
        gt=0,
        description="Largest global gradient norm; larger gradients are scaled down to it. None: no clipping (the "
        "norm is still logged).",
    )


class CheckpointSettings(Strict):
    keep: int = Field(3, ge=1, description="Checkpoints kept: the newest this many stay, older ones are deleted.")
    async_save: bool = Field(
        False,
        description="Write checkpoints from a thread while training goes on (DCP's async save; staged in host "
        "memory, pinned on GPU, which holds a copy of each rank's shards); a checkpoint is committed at the first "
        "step at which every rank's files are durable.",
    )


class LogSettings(Strict):
    every: int = Field(10, ge=1, description="Optimiser steps per metrics line (the metrics are averaged over them).")
    backends: list[Backend] = Field(
        ["tensorboard"],
        description="Where metrics go besides <run>/metrics/*.jsonl (training/metrics_sinks.py): tensorboard, mlflow, "
        "wandb; each must be installed. Empty: the JSONL files only.",
    )

    @field_validator("backends")
    @classmethod
    def _installed(cls, v: list[Backend]) -> list[Backend]:
        return check_backends(list(dict.fromkeys(v)))


class RaySettings(Strict):
    address: str | None = Field(
        None,
        description="Address of the Ray cluster to join (auto: one started on this machine). None: join "
        "RAY_ADDRESS if set, else start a local Ray.",
    )
    num_cpus: int | None = Field(
        None, description="CPUs of a locally started Ray (None: Ray's default, the machine's); local Ray only."
    )
    workers: int = Field(1, ge=1, description="Ray Train workers (training processes, one rank each).")
    use_gpu: bool = Field(False, description="Give each worker one GPU and train on it; false: train on CPU.")
    cpus_per_worker: float = Field(1.0, ge=0, description="CPUs Ray reserves for each worker.")
    torch_threads: int | None = Field(
        None, ge=1, description="Intra-op threads per worker (CPU training); None: torch's default."
    )
    max_failures: int = Field(
        3,
        ge=-1,
        description="Restarts of the worker group from the newest committed checkpoint after a transient failure "
        "before the run fails (-1: unlimited).",
    )


class FsdpSettings(Strict):
    """How FSDP2 schedules its all-gathers (``training.sharding.configure_fsdp``); what a run computes stays the same.

    ``replicate`` x ``shard`` (torchtitan's ``dp_replicate`` x ``dp_shard``) is the device mesh: each parameter is
    sharded over groups of ``shard`` consecutive ranks (one node's, as Ray Train numbers them) and replicated over
    ``replicate`` such groups (HSDP): all-gathers stay inside a group, one all-reduce of the reduced gradient shards
    crosses them. The default, one group of every worker, is flat FSDP. Every rank still trains its own images: the
    gradient is the same mean over all of them.
    """

    reshard_after_forward: Literal["always", "default", "never"] = Field(
        "always",
        description="When a unit's gathered parameters are freed (torchtitan's policy names): always frees them "
        "after its forward and gathers them again for its backward; never keeps them from forward to backward (one "
        "all-gather less per unit and step, every trained unit held in full until its backward); default reshards "
        "every unit but the last trained one, whose backward comes right after the forward. Units without trainable "
        "parameters (the EMA teacher, a frozen backbone) have no backward to save a gather for and always reshard.",
    )
    prefetch: int = Field(
        1,
        ge=1,
        description="How many units ahead of the running one FSDP2 gathers along each chain of units: 1 is its "
        "implicit order, above 1 explicit prefetch lists (more overlap of communication with compute, more memory "
        "held).",
    )
    replicate: int = Field(
        1,
        description="Groups a parameter is replicated over (HSDP; torchtitan's dp_replicate); -1: the workers "
        "shard leaves. replicate x shard must be the worker count.",
    )
    shard: int = Field(
        -1,
        description="Consecutive ranks a parameter is sharded over (torchtitan's dp_shard); -1: the workers "
        "replicate leaves. replicate x shard must be the worker count.",
    )
    reduce_every_micro_batch: bool = Field(
        True,
        description="With gradient accumulation: each micro-batch's gradients are reduce-scattered as its backward "
        "ends and added to the sharded gradients, so no rank holds more than its shard (torchtitan's way); false "
        "holds every unsharded fp32 gradient on every rank until the step's last micro-batch (one reduce-scatter "
        "per step instead of one per micro-batch; at 5B, 20 GB per GPU).",
    )

    @field_validator("replicate", "shard")
    @classmethod
    def _degree(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("a degree is -1 (the workers the other leaves) or at least 1")
        return v

    @model_validator(mode="after")
    def _one_rest(self) -> FsdpSettings:
        if self.replicate == -1 and self.shard == -1:
            raise ValueError("fsdp.replicate and fsdp.shard are both -1 (the rest): give one of them")
        return self

    def mesh_shape(self, workers: int) -> tuple[int, int]:
        """(replicate, shard) on ``workers`` ranks, -1 resolved; a ``ValueError`` naming both settings and the
        worker count when their product is not it."""
        replicate, shard = self.replicate, self.shard
        if replicate == -1:
            replicate = workers // shard if workers % shard == 0 else 0
        elif shard == -1:
            shard = workers // replicate if workers % replicate == 0 else 0
        if replicate * shard != workers:
            raise ValueError(
                f"fsdp.replicate={self.replicate} x fsdp.shard={self.shard} does not fit {workers} worker(s): the "
                "product must be the worker count (-1 takes the rest)"
            )
        return replicate, shard


class TrainingConfig(Strict):
    # Settings that leave what a run computes as it is (where it runs, how it logs, saves or reads): a resume may
    # change them; every other setting is part of the run (``result_settings``). Keys or whole sections.
    operational: ClassVar[tuple[str, ...]] = (
        "checkpoint", "log", "watchdog", "ray.address", "ray.num_cpus", "ray.cpus_per_worker", "ray.torch_threads",
        "ray.max_failures", "fsdp",
    )  # fmt: skip

    seed: int = Field(
        0,
        description="Seed of the run's randomness: the model's initialisation, the data order and every step's "
        "random draws.",
    )
    steps: int = Field(ge=1, description="Optimiser steps of the whole run (the schedules' length); required.")
    precision: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="bf16: on GPU, parameters gathered and computed in bf16, gradients reduced in fp32; fp32: "
        "fp32 throughout. CPU runs are fp32 either way.",
    )
    checkpoint: CheckpointSettings = Field(
        CheckpointSettings(), description="How checkpoints are written and how many are kept."
    )
    log: LogSettings = Field(LogSettings(), description="Metrics: how often and where they are written.")
    ray: RaySettings = Field(RaySettings(), description="The Ray cluster and the Ray Train worker group.")
    watchdog: WatchdogSettings = Field(
        WatchdogSettings(), description="Reports of a job that stops making progress (common.watchdog)."
    )
    fsdp: FsdpSettings = Field(
        FsdpSettings(),
        description="How FSDP2 shards parameters and schedules its all-gathers; what a run computes stays the same.",
    )

    @model_validator(mode="after")
    def _mesh_fits_the_workers(self) -> TrainingConfig:
        self.fsdp.mesh_shape(self.ray.workers)  # refused at load, before Ray starts
        return self

    def result_settings(self) -> dict[str, Any]:
        """Every setting that changes the run's result, as ``{dotted key: JSON value}``: what a resume must keep."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}{k}.", v)
            else:
                flat[prefix[:-1]] = value

        walk("", self.model_dump(mode="json"))
        return {k: v for k, v in flat.items() if not any(k == o or k.startswith(o + ".") for o in self.operational)}

    @abstractmethod
    def samples_per_step(self, workers: int | None = None) -> int:
        """Images per optimiser step over all workers (the global batch); ``None``: ``ray.workers``."""
