"""The fine-tuning config: model size, head, loss weights, optimiser (layer-wise LR decay), data, eval, cluster.

Shipped configs live in ``configs/finetune/*.yaml``; every field has a default here so a config only states what
it changes. Overrides use the same ``key=value`` style as the other jobs (``optim.lr=3e-4``,
``optim.freeze_backbone=true``). The model section is pretraining's; optimiser, logging and cluster settings are
every training run's (``training/config.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config import Strict
from finetune.augment import AugmentSettings
from pretrain.config import ModelSettings
from training.config import CheckpointSettings, OptimSettings, TrainingConfig

# Layer-wise LR decay per size: the public Sapiens2 fine-tuning configs (sapiens2 repository).
LAYER_DECAY = {"0.4b": 0.8, "0.8b": 0.85, "1b": 0.9, "5b": 0.94}
# Sizes without a public config (tiny, 0.1b): our choice, the single figure the Sapiens2 paper's text quotes.
DEFAULT_LAYER_DECAY = 0.85


class HeadSettings(Strict):
    channels: list[int] | None = None  # widths of the x2 upsampling stages; None: halving from the backbone width
    sigma: float = Field(2.0, gt=0)  # pose: Gaussian sigma of the target heatmaps, in heatmap pixels
    # pose: Gaussian blur (sigma, heatmap pixels) before sub-pixel decoding, which steadies the step on noisy maps
    # (DARK) but biases peaks within ~2 sigma of the map's edge; 0: none (exact for Gaussian-shaped outputs)
    blur: float = Field(1.0, ge=0)
    # seg: per-class CE and Dice weights; "auto": from the training set's class frequencies
    # (finetune.losses.balanced_class_weights over its first 256 samples, fixed when the run starts); None: all 1
    class_weights: list[float] | Literal["auto"] | None = None
    ignore_index: int = 255  # seg: label value that neither counts in the loss nor in the metrics


class LossSettings(Strict):
    ce: float = Field(1.0, ge=0)  # seg
    dice: float = Field(1.0, ge=0)  # seg
    cos: float = Field(1.0, ge=0)  # normal
    l1: float = Field(1.0, ge=0)  # normal, albedo
    grad: float = Field(0.5, ge=0)  # normal, albedo, pointmap: gradient L1
    chroma: float = Field(0.5, ge=0)  # albedo
    aligned: float = Field(1.0, ge=0)  # pointmap: L1 after scale alignment
    absolute: float = Field(0.1, ge=0)  # pointmap: scale-aware L1


class FinetuneOptim(OptimSettings):
    # Sapiens2 fine-tuning: AdamW (0.9, 0.999), weight decay 0.1 (constant, none on 1-D params), short warm-up.
    # lr (ours) is the base rate for 256 images per step: the peak is lr x data.batch_size x workers / 256.
    lr: float = Field(1e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(50, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.1, ge=0)
    weight_decay_end: float | None = Field(None, ge=0)  # None: constant weight decay
    layer_decay: float | None = Field(None, gt=0, le=1)  # None: per-size default (LAYER_DECAY)
    freeze_backbone: bool = False  # train the head only (dense probing of the pretrained features)
    # LP-FT (Kumar et al., ICLR 2022): the first probe_steps steps train the head alone (the backbone's rate is 0), so
    # that the head first fits the pretrained features and a random head's gradients do not distort them; then the
    # whole model trains. The backbone's warm-up and cosine start when it unfreezes (its schedule runs on
    # step - probe_steps over steps - probe_steps), the head's run on the plain step. 0: no probe.
    probe_steps: int = Field(0, ge=0)


class FinetuneData(Strict):
    batch_size: int = Field(8, ge=1)  # per worker
    eval_batch_size: int = Field(8, ge=1)
    shuffle: bool = True
    prefetch: int = Field(4, ge=1)  # batches decoded ahead, per worker
    augment: AugmentSettings | None = AugmentSettings()  # training samples only; null: none


class EvalSettings(Strict):
    every: int = Field(0, ge=0)  # steps between evaluations on the validation set (0: at the end only)
    max_samples: int | None = Field(None, ge=1)  # evaluate on the first N validation samples
    visualise: int = Field(4, ge=0)  # PNGs (input | target | prediction) written after the final evaluation


class FinetuneCheckpoint(CheckpointSettings):
    every: int = Field(0, ge=0)  # steps between checkpoints (0: at the end only)
    keep: int = Field(2, ge=1)


class FinetuneConfig(TrainingConfig):
    operational = (
        *TrainingConfig.operational, "model.compile", "model.activation_checkpointing", "data.prefetch",
        "data.eval_batch_size", "eval.every", "eval.visualise",
    )  # fmt: skip

    model: ModelSettings = ModelSettings()
    head: HeadSettings = HeadSettings()
    loss: LossSettings = LossSettings()
    optim: FinetuneOptim = FinetuneOptim()
    data: FinetuneData = FinetuneData()
    eval: EvalSettings = EvalSettings()
    checkpoint: FinetuneCheckpoint = FinetuneCheckpoint()

    @model_validator(mode="after")
    def _backbone_unfreezes(self) -> FinetuneConfig:
        if self.optim.probe_steps and self.optim.probe_steps >= self.steps:
            raise ValueError(
                f"optim.probe_steps={self.optim.probe_steps} leaves no step of the {self.steps} to fine-tune the "
                "backbone; optim.freeze_backbone=true trains the head alone"
            )
        return self

    def samples_per_step(self, workers: int | None = None) -> int:
        return self.data.batch_size * (workers or self.ray.workers)

    def layer_decay(self) -> float:
        if self.optim.layer_decay is not None:
            return self.optim.layer_decay
        return LAYER_DECAY.get(self.model.size.removesuffix("-4k"), DEFAULT_LAYER_DECAY)
