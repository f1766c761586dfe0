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
    channels: list[int] | None = Field(
        None,
        description="Widths of the head's x2 upsampling stages, one per stage; None: halving from the backbone width.",
    )
    sigma: float = Field(2.0, gt=0, description="pose: Gaussian sigma of the target heatmaps, in heatmap pixels.")
    blur: float = Field(
        1.0,
        ge=0,
        description="pose: Gaussian blur (sigma, heatmap pixels) before sub-pixel decoding, which steadies the step "
        "on noisy maps (DARK) but biases peaks within ~2 sigma of the map's edge; 0: none (exact for "
        "Gaussian-shaped outputs).",
    )
    class_weights: list[float] | Literal["auto"] | None = Field(
        None,
        description='seg: per-class CE and Dice weights; "auto": from the training set\'s class frequencies '
        "(finetune.losses.balanced_class_weights over its first 256 samples, fixed when the run starts); None: "
        "all 1.",
    )
    ignore_index: int = Field(255, description="seg: label value that counts neither in the loss nor in the metrics.")


class LossSettings(Strict):
    """Weights of the terms of each task's loss (finetune.losses); a task reads only its own. pose has one term, the
    heatmap MSE, and no weight."""

    ce: float = Field(1.0, ge=0, description="seg: weight of the per-pixel class-weighted cross-entropy.")
    dice: float = Field(1.0, ge=0, description="seg: weight of the Dice loss.")
    cos: float = Field(1.0, ge=0, description="normal: weight of the cosine term (1 - n.n*).")
    l1: float = Field(1.0, ge=0, description="normal, albedo: weight of the L1 term.")
    grad: float = Field(
        0.5,
        ge=0,
        description="normal, albedo, pointmap: weight of the L1 of the spatial gradients (for pointmap, of the "
        "aligned points).",
    )
    chroma: float = Field(
        0.5, ge=0, description="albedo: weight of the chromaticity L1 (colour ratios, independent of brightness)."
    )
    aligned: float = Field(
        1.0,
        ge=0,
        description="pointmap: weight of the L1 after the least-squares scale alignment, divided by the mean depth.",
    )
    absolute: float = Field(0.1, ge=0, description="pointmap: weight of the scale-aware (absolute) L1.")


class FinetuneOptim(OptimSettings):
    """Sapiens2 fine-tuning: AdamW (0.9, 0.999), weight decay 0.1 (constant, none on 1-D params), short warm-up,
    layer-wise learning-rate decay."""

    lr: float = Field(
        1e-4,
        gt=0,
        description="Base learning rate for 256 images per step: the peak is lr x data.batch_size x workers / 256.",
    )
    min_lr: float = Field(
        0.0, ge=0, description="Learning rate at the end of the cosine decay; absolute, not scaled by the batch."
    )
    warmup_steps: int = Field(50, ge=0, description="Steps of the linear learning-rate warm-up to the peak; 0: none.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2) moment decay rates.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Weight decay; with weight_decay_end set, its value at step 0. Never on 1-D parameters and tokens.",
    )
    weight_decay_end: float | None = Field(
        None,
        ge=0,
        description="Weight decay at the last step, reached by a cosine from weight_decay; None: constant weight "
        "decay.",
    )
    layer_decay: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Layer-wise learning-rate decay: each layer's rate is this factor times the rate of the layer "
        "above it. None: the size's default (finetune.config.LAYER_DECAY, from the public Sapiens2 fine-tuning "
        "configs; 0.85 for sizes without one).",
    )
    freeze_backbone: bool = Field(False, description="Train the head only (dense probing of the pretrained features).")
    probe_steps: int = Field(
        0,
        ge=0,
        description="LP-FT (Kumar et al., ICLR 2022): the first probe_steps steps train the head alone (the "
        "backbone's rate is 0), so that the head first fits the pretrained features and a random head's gradients "
        "do not distort them; then the whole model trains. The backbone's warm-up and cosine start when it "
        "unfreezes (its schedule runs on step - probe_steps over steps - probe_steps), the head's run on the plain "
        "step. 0: no probe.",
    )


class FinetuneData(Strict):
    batch_size: int = Field(8, ge=1, description="Training images per worker per step.")
    eval_batch_size: int = Field(8, ge=1, description="Evaluation images per worker per batch.")
    shuffle: bool = Field(
        True,
        description="Shuffle the training samples each epoch, seeded by the run's seed and the epoch: row groups in a random "
        "order, rows shuffled inside each. false: no shuffling.",
    )
    prefetch: int = Field(4, ge=1, description="Training batches decoded ahead, per worker.")
    augment: AugmentSettings | None = Field(
        AugmentSettings(), description="Augmentation of the training samples (never of evaluation ones); null: none."
    )


class EvalSettings(Strict):
    every: int = Field(
        0,
        ge=0,
        description="Steps between evaluations on the validation set; there is always one at the end (0: at the "
        "end only).",
    )
    max_samples: int | None = Field(
        None, ge=1, description="Evaluate on the first N validation samples; None: on all of them."
    )
    visualise: int = Field(
        4, ge=0, description="PNGs (input | target | prediction) written after the final evaluation."
    )


class FinetuneCheckpoint(CheckpointSettings):
    every: int = Field(
        0, ge=0, description="Steps between checkpoints; there is always one at the end (0: at the end only)."
    )
    keep: int = Field(2, ge=1, description="Checkpoints kept: the newest this many stay, older ones are deleted.")


class FinetuneConfig(TrainingConfig):
    operational = (
        *TrainingConfig.operational, "model.compile", "model.activation_checkpointing", "data.prefetch",
        "data.eval_batch_size", "eval.every", "eval.visualise",
    )  # fmt: skip

    model: ModelSettings = Field(
        ModelSettings(),
        description="The backbone, as pretraining's model section; with a pretrained backbone, size and patch_size "
        "must be those it was pretrained with.",
    )
    head: HeadSettings = Field(
        HeadSettings(), description="The task head: its upsampling widths and task-specific target settings."
    )
    loss: LossSettings = Field(LossSettings(), description="Weights of the terms of the task's loss.")
    optim: FinetuneOptim = Field(
        FinetuneOptim(),
        description="AdamW, its schedules, layer-wise learning-rate decay and what of the model trains.",
    )
    data: FinetuneData = Field(FinetuneData(), description="Batching, order and augmentation of the samples.")
    eval: EvalSettings = Field(EvalSettings(), description="Evaluation on the validation set.")
    checkpoint: FinetuneCheckpoint = Field(
        FinetuneCheckpoint(), description="When checkpoints are written and how many are kept."
    )

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
