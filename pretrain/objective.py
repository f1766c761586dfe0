"""The pretraining objective: L = L_MAE + lambda * L_CL (+ w * KoLeo), with an EMA teacher for the contrastive term.

- L_MAE: the student encodes the visible patches of each clean global view; a light transformer decoder puts mask
  tokens at the hidden positions and predicts every patch's pixels, normalised per patch (mean / variance over
  the patch's pixels and channels, as MAE's ``norm_pix_loss``). The loss is the mean squared error over the masked
  patches only. Patches are cut with ``pixel_unshuffle`` and put back with ``pixel_shuffle``.
- L_CL: DINO-style self-distillation on the [CLS] token. A projection head (MLP -> bottleneck -> L2 norm ->
  weight-normalised prototypes) turns [CLS] into prototype scores. The teacher, an exponential moving average of
  the student's backbone and head, encodes the whole colour-augmented global views; its scores are centred (or
  balanced by Sinkhorn-Knopp) and sharpened by a low temperature. The student encodes the masked clean global
  views and the local crops; the loss is the cross-entropy between the teacher's softmax on one global view and
  the student's log-softmax on every other view. KoLeo on the student's [CLS] of each global view, summed over the
  views and weighted by ``cl.koleo`` alone (as DINOv2 / DINOv3 add it, outside the lambda of L_CL). The prototype
  layer's learning rate is 0 for the first ``cl.freeze_prototypes_steps`` steps (``pretrain.train``), as theirs.

Schedules (by optimiser step): teacher momentum cosine from 0.996 to 1 over the run; teacher temperature linear
from its warm-up value to its final value. The teacher never receives gradients: it runs under ``no_grad`` and
its parameters have ``requires_grad=False``; only ``update_teacher`` changes it.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from common.config import Strict
from pretrain.backbone import BackboneConfig, BackboneOutput, Sapiens2Backbone, init_streamed, step_part
from pretrain.masking import MaskingConfig, Masks, generate_masks
from pretrain.views import Views, ViewsConfig, make_views
from training.sharding import copy_module, write_full, write_local


class MAEConfig(Strict):
    width: int = Field(
        512,
        ge=4,
        multiple_of=4,
        description="Token width of the MAE decoder; a multiple of 4 for the 2D sin-cos position code.",
    )
    depth: int = Field(4, ge=1, description="Transformer blocks of the MAE decoder.")
    heads: int = Field(16, ge=1, description="Attention heads of each decoder block.")
    ffn_ratio: float = Field(4.0, gt=0, description="Hidden width of each decoder block's FFN, as a multiple of width.")
    norm_pix: bool = Field(
        True,
        description="Per-patch normalised pixel targets (zero mean, unit variance over the patch's pixels and "
        "channels, as MAE's norm_pix_loss); false: the clean view's pixels as the model gets them.",
    )
    norm_eps: float = Field(
        1e-6, gt=0, description="Added to a patch's pixel variance before its square root (norm_pix)."
    )


class CLConfig(Strict):
    hidden: int = Field(2048, ge=1, description="Hidden width of the projection head's MLP.")
    bottleneck: int = Field(
        256, ge=1, description="Output width of the projection MLP, L2-normalised before the prototypes."
    )
    layers: int = Field(
        3, ge=1, description="Linear layers of the projection MLP (GELU between them), the last one to the bottleneck."
    )
    prototypes: int = Field(65536, ge=2, description="Prototypes: the number of scores the head gives each [CLS] (K).")
    student_temp: float = Field(0.1, gt=0, description="Softmax temperature of the student's prototype scores.")
    teacher_temp: float = Field(
        0.07,
        gt=0,
        description="Softmax temperature of the teacher's prototype scores after its warm-up; a low one sharpens "
        "the targets.",
    )
    teacher_temp_warmup: float = Field(
        0.04,
        gt=0,
        description="Starting teacher temperature, linear to teacher_temp over teacher_temp_warmup_steps.",
    )
    teacher_temp_warmup_steps: int = Field(
        0, ge=0, description="Optimiser steps of the teacher temperature's warm-up; 0: teacher_temp from the start."
    )
    normalize: Literal["center", "sinkhorn"] = Field(
        "center",
        description="How the teacher's scores become targets: center subtracts a running centre of the batch-mean "
        "scores before the softmax; sinkhorn balances them by Sinkhorn-Knopp, so that the prototypes are used "
        "uniformly over the (global) batch.",
    )
    center_momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="Momentum of the running centre (normalize: center): each step it moves 1 - center_momentum of "
        "the way to the batch mean; it starts at the first batch's mean.",
    )
    sinkhorn_iters: int = Field(3, ge=1, description="Sinkhorn-Knopp iterations (normalize: sinkhorn).")
    momentum: float = Field(
        0.996, ge=0, le=1, description="Teacher EMA momentum at step 0 (cosine to momentum_end at the last step)."
    )
    momentum_end: float = Field(
        1.0, ge=0, le=1, description="Teacher EMA momentum at the last step (cosine from momentum at step 0)."
    )
    koleo: float = Field(
        0.0,
        ge=0,
        description="Weight of KoLeo (DINOv2 / DINOv3): spreads the student's [CLS] of each global view over the "
        "batch, so a [CLS] that ignores the image costs loss from step 0. As theirs: summed over the global views, "
        "weighted by this alone (not by lambda_cl; DINOv2's koleo_loss_weight is 0.1). 0 turns it off.",
    )
    freeze_prototypes_steps: int = Field(
        1250,
        ge=0,
        description="Optimiser steps at the start during which the prototype layer does not move (its learning "
        "rate is 0), as DINOv2 / DINOv3's freeze_last_layer_epochs (one epoch of 1250 iterations there): the "
        "prototypes stay put while the head's first layers find image-dependent directions.",
    )


class ObjectiveConfig(Strict):
    lambda_cl: float = Field(
        1.0,
        ge=0,
        description="Weight of the self-distillation term: L = L_MAE + lambda_cl x L_CL (+ cl.koleo x KoLeo). "
        "0: no contrastive term in the loss.",
    )
    mae: MAEConfig = Field(MAEConfig(), description="The MAE decoder and its pixel targets.")
    cl: CLConfig = Field(
        CLConfig(),
        description="Self-distillation: the projection head, the EMA teacher and how its targets are made.",
    )
    masking: MaskingConfig = Field(
        MaskingConfig(), description="Which patches of the global views the student does not see."
    )
    views: ViewsConfig = Field(
        ViewsConfig(), description="The global and local views cut from each image, and their augmentation."
    )
    check_finite: bool = Field(True, description="Raise on a NaN / inf loss term (one host sync per step).")


class NonFiniteLossError(FloatingPointError):
    """A loss term became NaN or infinite; the message names the step and the term."""


# --- schedules ----------------------------------------------------------------------------------------------------


def teacher_momentum(step: int, total_steps: int, start: float = 0.996, end: float = 1.0) -> float:
    """Cosine from ``start`` at step 0 to ``end`` at ``total_steps`` (and after)."""
    progress = min(max(step, 0), total_steps) / max(total_steps, 1)
    return end - (end - start) * (math.cos(math.pi * progress) + 1) / 2


def teacher_temperature(step: int, cfg: CLConfig) -> float:
    if step >= cfg.teacher_temp_warmup_steps:
        return cfg.teacher_temp
    return cfg.teacher_temp_warmup + (cfg.teacher_temp - cfg.teacher_temp_warmup) * step / cfg.teacher_temp_warmup_steps


# --- MAE ----------------------------------------------------------------------------------------------------------


def patchify(images: Tensor, patch: int) -> Tensor:
    """[B, C, H, W] -> [B, N, C * patch * patch], patches row-major, each vector laid out (C, p, p)."""
    return F.pixel_unshuffle(images, patch).flatten(2).transpose(1, 2)


def unpatchify(patches: Tensor, grid: tuple[int, int], patch: int) -> Tensor:
    """Inverse of ``patchify``: [B, N, C * patch * patch] -> [B, C, gh * patch, gw * patch]."""
    return F.pixel_shuffle(patches.transpose(1, 2).unflatten(2, grid), patch)


def mae_targets(images: Tensor, patch: int, norm_pix: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-patch pixel targets [B, N, C * patch * patch], each patch normalised to zero mean, unit variance."""
    target = patchify(images.float(), patch)
    if not norm_pix:
        return target
    mean = target.mean(dim=-1, keepdim=True)
    var = target.var(dim=-1, keepdim=True)
    return (target - mean) / (var + eps).sqrt()


def mae_loss(pred: Tensor, target: Tensor, masked: Tensor) -> Tensor:
    """Mean squared error over the masked patches only; ``masked`` [B, n_mask] indexes the patch axis.

    Visible patches are never read, so whatever is predicted there (even NaN) changes neither loss nor gradient.
    """
    index = masked.unsqueeze(-1).expand(-1, -1, pred.shape[-1])
    return (pred.gather(1, index).float() - target.gather(1, index)).pow(2).mean()


def sincos_2d(grid: tuple[int, int], dim: int, device: torch.device | str | None = None) -> Tensor:
    """Fixed 2D sin-cos position code [gh * gw, dim] (MAE's): a quarter of the dims each for sin/cos of row/col."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    rows, cols = torch.meshgrid(
        torch.arange(grid[0], device=device, dtype=torch.float32),
        torch.arange(grid[1], device=device, dtype=torch.float32),
        indexing="ij",
    )
    y, x = rows.reshape(-1, 1) * omega, cols.reshape(-1, 1) * omega
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1)


class MAEDecoder(nn.Module):
    """Encoder tokens + mask tokens at the hidden positions -> per-patch pixels [B, N, C * patch * patch].

    The encoder's [CLS] and register tokens join the sequence as context (MAE keeps [CLS] in its decoder).
    """

    def __init__(self, in_dim: int, cfg: MAEConfig, patch: int, channels: int = 3) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(in_dim, cfg.width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        layer = nn.TransformerEncoderLayer(
            cfg.width,
            cfg.heads,
            round(cfg.ffn_ratio * cfg.width),
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.depth, norm=nn.LayerNorm(cfg.width), enable_nested_tensor=False)
        self.pred = nn.Linear(cfg.width, channels * patch * patch)
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, enc: BackboneOutput) -> Tensor:
        x = self.embed(enc.patches)
        b, n_vis, width = x.shape
        n = enc.grid[0] * enc.grid[1]
        if enc.keep is not None:
            full = self.mask_token.to(x.dtype).expand(b, n, width)
            x = full.scatter(1, enc.keep.unsqueeze(-1).expand(-1, -1, width), x)
        elif n_vis != n:
            raise ValueError(f"{n_vis} tokens without `keep` on a {enc.grid} grid")
        x = x + sincos_2d(enc.grid, width, x.device).to(x.dtype)
        prefix = self.embed(torch.cat([enc.cls.unsqueeze(1), enc.registers], dim=1))
        x = self.blocks(torch.cat([prefix, x], dim=1))
        return self.pred(x[:, prefix.shape[1] :])


def decoder_macs(cfg: MAEConfig, in_dim: int, visible: int, tokens: int, prefix: int, out_dim: int) -> float:
    """Forward multiply-adds of ``MAEDecoder`` for one image: ``visible`` encoder tokens and ``prefix`` [CLS] and
    register tokens in, ``tokens`` patches out (``out_dim`` pixels each); attention products included, as
    ``backbone.flops(attention=True)`` counts them."""
    w, length = cfg.width, prefix + tokens
    layer = length * (4 * w * w + 2 * w * round(cfg.ffn_ratio * w)) + 2 * length * length * w  # qkv+out, MLP, attn
    return float((visible + prefix) * in_dim * w + cfg.depth * layer + tokens * w * out_dim)


# --- self-distillation --------------------------------------------------------------------------------------------


class DINOHead(nn.Module):
    """MLP -> bottleneck -> L2 normalisation -> weight-normalised prototypes (unit-norm rows, norm frozen at 1)."""

    def __init__(self, in_dim: int, cfg: CLConfig) -> None:
        super().__init__()
        dims = [in_dim] + [cfg.hidden] * (cfg.layers - 1) + [cfg.bottleneck]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(dims) - 2 else [])
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.prototypes = nn.utils.parametrizations.weight_norm(nn.Linear(cfg.bottleneck, cfg.prototypes, bias=False))
        magnitude = self.prototypes.parametrizations.weight.original0
        with torch.no_grad():
            magnitude.fill_(1.0)
        magnitude.requires_grad_(False)  # scores are cosine similarities: only the directions learn

    def forward(self, x: Tensor) -> Tensor:
        return self.prototypes(F.normalize(self.mlp(x), dim=-1))


def _all_reduce(t: Tensor) -> int:
    """Sum ``t`` over data-parallel ranks in place; returns the world size (1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
        return dist.get_world_size()
    return 1


@torch.no_grad()
def sinkhorn_knopp(scores: Tensor, temp: float, iters: int) -> Tensor:
    """Teacher targets [B, K] whose prototype marginals are uniform over the (global) batch (DINOv2 / SwAV)."""
    q = torch.exp(scores.float() / temp).t()  # [K, B]; scores are cosines in [-1, 1], so no overflow
    k = q.shape[0]
    total = q.sum()
    world = _all_reduce(total)
    q /= total
    n = q.shape[1] * world
    for _ in range(iters):
        rows = q.sum(dim=1, keepdim=True)
        _all_reduce(rows)
        q /= rows * k
        q /= q.sum(dim=0, keepdim=True) * n
    return (q * n).t()


def koleo_loss(x: Tensor, eps: float = 1e-8) -> Tensor:
    """Kozachenko-Leonenko entropy estimate of the rows of ``x`` [B, D], as DINOv2's KoLeoLoss: rows L2-normalised,
    each row's nearest other row found by inner product, then minus the mean log of the distance of the two vectors
    themselves (``|a - b + eps|``, torch's PairwiseDistance), in fp32.

    The distance is taken of the vectors, not as ``sqrt(2 - 2 cos)``: in fp32 that rounds to 0 below ~3e-4, where the
    loss would sit at -log(eps) with no gradient, exactly in the near-collapse KoLeo is there to undo.
    """
    x = F.normalize(x.float(), dim=-1, eps=eps)
    with torch.no_grad():
        sim = x @ x.t()
        sim.fill_diagonal_(-1.0)  # never its own nearest neighbour
        nearest = sim.argmax(dim=-1)
    distance = F.pairwise_distance(x, x[nearest], eps=eps)
    return -torch.log(distance + eps).mean()


def distillation_loss(teacher_probs: Tensor, student_logits: Tensor, student_temp: float) -> Tensor:
    """Mean over view pairs (teacher view g, student view v != g) of the cross-entropy, averaged over the batch.

    teacher_probs [G, B, K]; student_logits [V, B, K] with the G global views first, in the teacher's order.
    """
    g, b = teacher_probs.shape[:2]
    log_p = F.log_softmax(student_logits.float() / student_temp, dim=-1)
    ce = -torch.einsum("gbk,vbk->gv", teacher_probs.float(), log_p) / b  # [G, V]
    pairs = ~torch.eye(g, log_p.shape[0], dtype=torch.bool, device=ce.device)
    return ce[pairs].mean()


# --- diagnostics and collapse detection ---------------------------------------------------------------------------

# Every scalar ``JointObjective.losses`` returns, in a fixed order so the training loop can stack them.
DIAGNOSTICS = ("teacher_entropy", "batch_entropy", "student_entropy", "cls_std", "cls_rms", "proto_used")
TERMS = ("loss", "mae", "cl", "koleo", *DIAGNOSTICS)

# Collapse rules (``collapse_state``), scale-free so they hold for any K, width and batch. Both collapses of DINO
# (Caron et al. 2021, sec. 5.3) leave targets that do not tell the images apart: their information about the row,
# I = H(batch-mean target) - mean H(target), falls to 0. Which one it is, the mean target's entropy tells.
UNINFORMATIVE = 0.2  # I below 20% of what telling the batch's images apart takes (ln of the images per worker)
ONE_PROTOTYPE_PERPLEXITY = 1.5  # the batch-mean target's perplexity: (nearly) every row on one prototype
CONSTANT_CLS = 0.01  # CLS std across the batch below 1% of the CLS's RMS value


@torch.no_grad()
def contrastive_diagnostics(
    teacher_probs: Tensor, student_logits: Tensor, cls: Tensor, student_temp: float
) -> dict[str, Tensor]:
    """Detached 0-d diagnostics of the self-distillation term, from tensors the loss already has; no host sync.

    teacher_probs [G, B, K]; student_logits [G, B, K] (the global views); cls [G * B, D] (the student's global-view
    [CLS]). All are over this worker's micro-batch (the training loop averages them over steps and workers):

    - teacher_entropy: mean over rows of H(teacher probs); ln K means the targets are uniform, 0 one-hot.
    - batch_entropy: H of the batch-mean teacher row: about 0 when every row targets one prototype; minus
      teacher_entropy it is the targets' information about the row (0 in either collapse).
    - student_entropy: the same for the student's softmax at the student temperature.
    - cls_std: mean over feature dims of the std of [CLS] across the rows (every global crop of every image);
      cls_rms: the RMS of the [CLS] entries, the scale to read cls_std against (both after the final norm).
    - proto_used: how many prototypes are the argmax of at least one teacher row (at most G * B). The exp of the
      entropy of the batch-mean target would be the alternative, but Sinkhorn makes that mean uniform by design.
    """
    t = teacher_probs.detach().float().flatten(0, -2)
    log_s = F.log_softmax(student_logits.detach().float().flatten(0, -2) / student_temp, dim=-1)
    c = cls.detach().float()
    # A scatter into K flags, not torch.unique: its data-dependent size would sync with the host on a GPU.
    used = torch.zeros(t.shape[-1], device=t.device).index_fill_(0, t.argmax(-1), 1.0).sum()
    return {
        "teacher_entropy": torch.special.entr(t).sum(-1).mean(),  # entr(0) = 0: one-hot rows are exact
        "batch_entropy": torch.special.entr(t.mean(0)).sum(),
        "student_entropy": -(log_s.exp() * log_s).sum(-1).mean(),
        "cls_std": c.std(dim=0, correction=min(1, c.shape[0] - 1)).mean(),  # one row: 0 rather than NaN
        "cls_rms": c.pow(2).mean().sqrt(),
        "proto_used": used,
    }


def collapse_state(diag: dict[str, float], prototypes: int, images: int) -> str | None:
    """Names the self-distillation collapse the diagnostics show (several joined by " + "), or None when healthy.

    ``images``: the distinct images in one worker's micro-batch (the rows the diagnostics were taken over are their
    global views). The targets' information I = batch_entropy - teacher_entropy can reach ln(images) when each
    image gets its own target; below ``UNINFORMATIVE`` of that the targets teach nothing, and

    - "one prototype": the batch-mean target's perplexity below 1.5: every row on (nearly) the same prototype
      (centring / Sinkhorn are not holding the prototypes apart);
    - "uniform targets": otherwise; every row near the same spread-out target (the centring wins over the
      sharpening; L_CL then sits near ln K with a uniform student as its minimum).
    - "constant CLS": the [CLS] std across the batch below 1% of its RMS: the backbone output ignores the image.
    """
    names = []
    info = diag["batch_entropy"] - diag["teacher_entropy"]
    if images > 1 and info < UNINFORMATIVE * math.log(min(images, prototypes)):
        one = diag["batch_entropy"] < math.log(ONE_PROTOTYPE_PERPLEXITY)
        names.append("one prototype" if one else "uniform targets")
    if diag["cls_std"] <= CONSTANT_CLS * diag["cls_rms"]:  # <=: an all-zero [CLS] is constant too
        names.append("constant CLS")
    return " + ".join(names) or None


class CollapseMonitor:
    """Debounces ``collapse_state`` over metrics windows: the reported state (a collapse, or None: healthy) only
    changes once the new state has held for ``patience`` steps, so a run hovering at a threshold reports once
    when a collapse starts and once when it ends, not every window."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.reported: str | None = None
        self.candidate: str | None = None
        self.since = 0  # the step before the candidate state's first window

    def update(self, state: str | None, start: int, end: int) -> tuple[str | None, int] | None:
        """Feed the state of the window of steps (start, end]; returns (the newly reported state, the step it has
        held since) when the reported state changes, else None."""
        if state != self.candidate:
            self.candidate, self.since = state, start
        if state != self.reported and end - self.since >= self.patience:
            self.reported = state
            return state, self.since
        return None


# --- the joint objective ------------------------------------------------------------------------------------------


def heads(backbone: BackboneConfig, cfg: ObjectiveConfig) -> tuple[MAEDecoder, DINOHead]:
    """The MAE decoder and the projection head on ``backbone``, drawn in this order from the default generator."""
    patch = backbone.patch_size * (backbone.window or 1)
    return MAEDecoder(backbone.width, cfg.mae, patch, backbone.in_chans), DINOHead(backbone.width, cfg.cl)


class JointObjective(nn.Module):
    """Student backbone + MAE decoder + projection head, their EMA teacher, and L = L_MAE + lambda * L_CL.

    Optimise the parameters with ``requires_grad`` (student, decoder, head); call ``update_teacher(step)`` after
    each optimiser step. The teacher and the centre are part of ``state_dict`` so a resume restores them.
    """

    center: Tensor  # buffers, registered in __init__
    center_ready: Tensor

    def __init__(self, backbone: Sapiens2Backbone, cfg: ObjectiveConfig, total_steps: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.total_steps = total_steps
        self.student = backbone
        self.decoder, self.head = heads(backbone.cfg, cfg)
        self.teacher = nn.ModuleDict({"backbone": copy.deepcopy(backbone), "head": copy.deepcopy(self.head)})
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        self.register_buffer("center", torch.zeros(1, cfg.cl.prototypes))
        self.register_buffer("center_ready", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def init_materialised(self) -> None:
        """The weights of the plain construction from the default generator's current state, for a model built on
        the meta device, sharded and materialised (``to_empty``): each rank writes only its shards. The backbone is
        drawn one module at a time (``init_streamed``); the decoder and head, small, are built whole on the CPU
        and copied; the teacher then copies the student's shards, as the plain build's deep copy."""
        init_streamed(self.student.cfg, lambda name, full: write_full(self.student.get_parameter(name), full))
        for dst, src in zip((self.decoder, self.head), heads(self.student.cfg, self.cfg)):
            copy_module(dst, src)
        for t, s in zip(self._teacher_params(), self._student_params()):
            write_local(t, s.to_local() if isinstance(s, DTensor) else s)
        self.center.zero_()
        self.center_ready.fill_(False)

    def _teacher_params(self) -> list[Tensor]:
        return [*self.teacher["backbone"].parameters(), *self.teacher["head"].parameters()]

    def _student_params(self) -> list[Tensor]:
        return [*self.student.parameters(), *self.head.parameters()]

    def train(self, mode: bool = True) -> JointObjective:
        super().train(mode)
        self.teacher.eval()  # the teacher only ever infers
        return self

    def no_weight_decay(self) -> set[str]:
        """Trainable parameter names exempt from weight decay: the backbone's, plus norms, biases, mask token."""
        names = {f"student.{n}" for n in self.student.no_weight_decay()}
        for prefix, module in (("decoder", self.decoder), ("head", self.head)):
            names |= {f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad and p.ndim <= 1}
        return names | {"decoder.mask_token"}

    def forward(self, images: Tensor, step: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Views and masks from ``images`` ([B, 3, H, W], uint8 or [0, 1] floats), then ``losses``."""
        views = make_views(images, self.cfg.views, generator)
        return self.losses(views, step, self.masks_for(views, generator))

    def masks_for(self, views: Views, generator: torch.Generator | None = None) -> Masks:
        """Masks on the encoder's token grid for every global view (on the views' device)."""
        grid = self.student.token_grid(*views.global_clean.shape[-2:])
        batch = views.global_clean.shape[0]
        return generate_masks(batch, grid, self.cfg.masking, generator=generator, device=views.global_clean.device)

    def losses(self, views: Views, step: int, masks: Masks) -> dict[str, Tensor]:
        """{"loss": L, "mae": L_MAE, "cl": L_CL, and the ``contrastive_diagnostics``}, every value a 0-d tensor
        (in the order of ``TERMS``); only "loss" carries gradients."""
        g, n_local = views.n_global, views.n_local
        b = views.global_clean.shape[0] // g
        student = self.student(views.global_clean, self._patch_keep(masks.keep, views.global_clean))
        target = mae_targets(views.global_clean, self.decoder.patch, self.cfg.mae.norm_pix, self.cfg.mae.norm_eps)
        with step_part("mae_decoder"):
            pred = self.decoder(student)
        mae = mae_loss(pred, target, masks.masked)

        cls = [student.cls]
        if n_local:
            cls.append(self.student(views.local).cls)
        student_logits = self.head(torch.cat(cls)).view(g + n_local, b, -1)
        with torch.no_grad():
            teacher = self.teacher["head"](self.teacher["backbone"](views.global_aug).cls)
            probs = self.teacher_probs(teacher, step).view(g, b, -1)
        cl = distillation_loss(probs, student_logits, self.cfg.cl.student_temp)

        # KoLeo within each global view (two crops of one image are meant to be close), summed over the views
        koleo = (
            sum((koleo_loss(v) for v in student.cls.view(g, b, -1)), mae.new_zeros(())) if b > 1 else mae.new_zeros(())
        )
        total = mae + self.cfg.lambda_cl * cl + self.cfg.cl.koleo * koleo
        if self.cfg.check_finite:
            _check_finite(step, {"mae": mae, "cl": cl, "koleo": koleo, "loss": total})
        # Read with the loss terms: a CL term stuck at ln K is either collapse or plain slow learning; these tell.
        diag = contrastive_diagnostics(probs, student_logits[:g], student.cls, self.cfg.cl.student_temp)
        return {"loss": total, "mae": mae.detach(), "cl": cl.detach(), "koleo": koleo.detach(), **diag}

    @torch.no_grad()
    def teacher_probs(self, scores: Tensor, step: int) -> Tensor:
        """Teacher targets [N, K] from its prototype scores: centred softmax (then the centre moves), or Sinkhorn."""
        cl = self.cfg.cl
        temp = teacher_temperature(step, cl)
        if cl.normalize == "sinkhorn":
            return sinkhorn_knopp(scores, temp, cl.sinkhorn_iters)
        batch_mean = scores.float().sum(dim=0, keepdim=True)
        batch_mean /= scores.shape[0] * _all_reduce(batch_mean)
        # The centre starts at the first batch's mean: a zero centre would leave the first teacher targets one-hot
        # on the prototype every image shares, the very collapse the centring is there to prevent.
        self.center.copy_(torch.where(self.center_ready, self.center, batch_mean))
        self.center_ready.fill_(True)
        probs = F.softmax((scores.float() - self.center) / temp, dim=-1)
        self.center.lerp_(batch_mean, 1 - cl.center_momentum)
        return probs

    @torch.no_grad()
    def update_teacher(self, step: int) -> float:
        """teacher <- m * teacher + (1 - m) * student for backbone and head; returns the momentum m used."""
        m = teacher_momentum(step, self.total_steps, self.cfg.cl.momentum, self.cfg.cl.momentum_end)
        with step_part("ema_teacher"):
            torch._foreach_lerp_(self._teacher_params(), self._student_params(), 1.0 - m)
        return m

    def _patch_keep(self, keep: Tensor, images: Tensor) -> Tensor:
        """Encoder ``keep`` from token-grid indices: the same for a plain backbone; for the 4K variant every patch
        of each kept window (the encoder keeps exactly those windows)."""
        window = self.student.cfg.window
        if not window:
            return keep
        gh, gw = self.student.patch_grid(*images.shape[-2:])
        th, tw = gh // window, gw // window
        slots = torch.arange(gh * gw, device=keep.device).view(th, window, tw, window).transpose(1, 2)
        return slots.reshape(th * tw, window * window)[keep].flatten(1).sort(dim=1).values


def _check_finite(step: int, terms: dict[str, Tensor]) -> None:
    finite = torch.stack([torch.isfinite(v.detach()).all() for v in terms.values()]).tolist()  # one host sync
    for (name, value), ok in zip(terms.items(), finite):
        if not ok:
            raise NonFiniteLossError(f"step {step}: loss term {name!r} is {value.item()}")
