"""Global and local views of an image batch for the joint MAE + self-distillation objective, batched in torch.

For each image: ``n_global`` global crops at the model's input size and ``n_local`` smaller local crops, all
random resized crops that keep the output's aspect ratio, with random horizontal flips. Each global crop comes
out twice with the same geometry:

- ``global_clean``: no colour change. The student encodes it (masked) and the MAE target is cut from it, so skin
  tone and lighting stay as photographed.
- ``global_aug``: colour jitter, grayscale, blur and solarisation (DINO's recipe). The teacher encodes it (whole).

Local crops always get the colour recipe; the student encodes them whole. Colour invariance is learned across
views: the teacher's augmented view of one crop against the student's clean view of the other and its locals.

Cropping is one ``grid_sample`` per view over the whole batch, each sample with its own affine box. Before it,
the batch is resized once with antialiasing so that the smallest possible crop maps about 1:1 to the output;
larger crops then shrink by at most ``1 / sqrt(min scale)`` through bilinear sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor

from common.config import Strict

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RGB -> YIQ and back; a hue shift is a rotation of the (I, Q) chroma plane.
_YIQ = torch.tensor(((0.299, 0.587, 0.114), (0.596, -0.274, -0.322), (0.211, -0.523, 0.312)))
_YIQ_INV = torch.linalg.inv(_YIQ)
_LUMA = (0.299, 0.587, 0.114)


class ViewsConfig(Strict):
    global_size: tuple[int, int] = Field(
        (1024, 768), description="(H, W) of the global views in pixels: the model's input size."
    )
    local_size: tuple[int, int] = Field(
        (256, 192), description="(H, W) of the local crops in pixels, multiples of the patch size."
    )
    n_local: int = Field(8, ge=0, description="Local crops per image, which the student encodes whole; 0: none.")
    global_scale: tuple[float, float] = Field(
        (0.32, 1.0),
        description="(low, high) of a global crop's area / the area of the largest box of the output's aspect in the "
        "image, drawn uniformly.",
    )
    local_scale: tuple[float, float] = Field(
        (0.05, 0.32),
        description="(low, high) of a local crop's area / the area of the largest box of the output's aspect in the "
        "image, drawn uniformly.",
    )
    flip_prob: float = Field(0.5, ge=0, le=1, description="Probability that a crop is mirrored horizontally.")
    jitter_prob: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Probability of colour jitter (brightness, contrast, saturation, hue) on a colour-augmented view.",
    )
    brightness: float = Field(
        0.4, ge=0, description="Colour jitter: brightness factor drawn from [1 - brightness, 1 + brightness]."
    )
    contrast: float = Field(
        0.4, ge=0, description="Colour jitter: contrast factor drawn from [1 - contrast, 1 + contrast]."
    )
    saturation: float = Field(
        0.2, ge=0, description="Colour jitter: saturation factor drawn from [1 - saturation, 1 + saturation]."
    )
    hue: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="Colour jitter: hue shift drawn from [-hue, hue], as a fraction of a full turn of the chroma "
        "plane.",
    )
    grayscale_prob: float = Field(
        0.2, ge=0, le=1, description="Probability that a colour-augmented view is turned grey."
    )
    global_blur_prob: tuple[float, ...] = Field(
        (1.0, 0.1),
        description="Gaussian blur probability of each global view's colour-augmented copy, one entry per global "
        "view: their count is the number of global views. As in DINO: one always blurred, one solarised.",
    )
    global_solarize_prob: tuple[float, ...] = Field(
        (0.0, 0.2),
        description="Solarisation probability of each global view's colour-augmented copy, one entry per global "
        "view (as many as global_blur_prob). As in DINO: one always blurred, one solarised.",
    )
    local_blur_prob: float = Field(
        0.5, ge=0, le=1, description="Gaussian blur probability of each local crop (local crops are never solarised)."
    )
    blur_sigma: tuple[float, float] = Field(
        (0.1 / 224, 2.0 / 224),
        description="(low, high) of the blur's Gaussian sigma, as a fraction of the crop's short side, drawn "
        "uniformly.",
    )
    mean: tuple[float, float, float] = Field(
        IMAGENET_MEAN,
        description="Per-channel (RGB) mean subtracted from every view (pixels in [0, 1]); ImageNet's by default.",
    )
    std: tuple[float, float, float] = Field(
        IMAGENET_STD,
        description="Per-channel (RGB) standard deviation every view is divided by after the mean; ImageNet's by "
        "default.",
    )

    @model_validator(mode="after")
    def _check(self) -> ViewsConfig:
        if len(self.global_blur_prob) != len(self.global_solarize_prob) or not self.global_blur_prob:
            raise ValueError("global_blur_prob and global_solarize_prob need one entry per global view")
        for name in ("global_scale", "local_scale", "blur_sigma"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 0 < low <= high")
        if self.global_scale[1] > 1 or self.local_scale[1] > 1:
            raise ValueError("crop scales are fractions of the image, at most 1")
        return self

    @property
    def n_global(self) -> int:
        return len(self.global_blur_prob)


@dataclass
class Views:
    """View-major batches: rows ``v * B : (v + 1) * B`` are view ``v`` of the ``B`` images."""

    global_clean: Tensor  # [G * B, 3, H, W], normalised, no colour augmentation
    global_aug: Tensor  # [G * B, 3, H, W], normalised, the same crops colour-augmented
    local: Tensor  # [L * B, 3, h, w], normalised, colour-augmented (L may be 0)
    n_global: int
    n_local: int


def _uniform(n: int, lo: float, hi: float, generator: torch.Generator | None, device: torch.device) -> Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=generator, device=device)


def _chance(n: int, p: float, generator: torch.Generator | None, device: torch.device) -> Tensor:
    return torch.rand(n, generator=generator, device=device) < p


def crop_boxes(
    n: int,
    image_hw: tuple[int, int],
    out_hw: tuple[int, int],
    scale: tuple[float, float],
    flip_prob: float,
    generator: torch.Generator | None,
    device: torch.device,
) -> Tensor:
    """[n, 2, 3] affine maps from output to input coordinates (``affine_grid``'s convention, [-1, 1] units).

    The box has the output's aspect ratio and ``scale`` x the area of the largest such box inside the image; its
    position is uniform over where it fits; a negative x scale flips it horizontally.
    """
    (h, w), (oh, ow) = image_hw, out_hw
    full_h = min(h, w * oh / ow)  # the largest box of the output's aspect that fits
    full_w = full_h * ow / oh
    side = torch.sqrt(_uniform(n, scale[0], scale[1], generator, device))
    half_x, half_y = side * full_w / w, side * full_h / h  # half extents in [-1, 1] units
    cx = (2 * torch.rand(n, generator=generator, device=device) - 1) * (1 - half_x)
    cy = (2 * torch.rand(n, generator=generator, device=device) - 1) * (1 - half_y)
    flip = _chance(n, flip_prob, generator, device)
    theta = torch.zeros(n, 2, 3, device=device)
    theta[:, 0, 0] = torch.where(flip, -half_x, half_x)
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = half_y
    theta[:, 1, 2] = cy
    return theta


def _prescale(images: Tensor, out_hw: tuple[int, int], min_scale: float) -> Tensor:
    """Antialiased resize so the smallest crop of ``min_scale`` maps about 1:1 (never enlarges)."""
    h, w = images.shape[-2:]
    full_h = min(h, w * out_hw[0] / out_hw[1])
    factor = out_hw[0] / (math.sqrt(min_scale) * full_h)
    if factor >= 1:
        return images
    size = (max(1, round(h * factor)), max(1, round(w * factor)))
    return F.interpolate(images, size=size, mode="bilinear", antialias=True, align_corners=False)


def resized_crops(images: Tensor, theta: Tensor, out_hw: tuple[int, int]) -> Tensor:
    grid = F.affine_grid(theta, [images.shape[0], images.shape[1], *out_hw], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray(x: Tensor) -> Tensor:
    return torch.einsum("bchw,c->bhw", x, x.new_tensor(_LUMA)).unsqueeze(1)


def _gaussian_blur(x: Tensor, sigma: Tensor, max_sigma: float) -> Tensor:
    """Separable Gaussian blur with one sigma (in pixels) per image, as grouped convolutions over the batch."""
    b, c, h, w = x.shape
    radius = min(max(1, math.ceil(3 * max_sigma)), (min(h, w) - 1) // 2)
    taps = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (taps / sigma.clamp(min=1e-3).to(x.dtype).view(-1, 1)) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [b * c, taps]
    y = x.reshape(1, b * c, h, w)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="reflect"), kernel.view(b * c, 1, 1, -1), groups=b * c)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="reflect"), kernel.view(b * c, 1, -1, 1), groups=b * c)
    return y.view(b, c, h, w)


def colour_augment(
    x: Tensor, cfg: ViewsConfig, blur_prob: float, solarize_prob: float, generator: torch.Generator | None
) -> Tensor:
    """Colour jitter (brightness, contrast, saturation, hue), grayscale, blur, solarise; x in [0, 1], [B, 3, H, W].

    Every image draws its own factors; where an operation is not drawn its factor is the identity. The jitter
    operations run in a fixed order (torchvision shuffles it), which keeps the batch a single pass each.
    """
    b, dev = x.shape[0], x.device
    jitter = _chance(b, cfg.jitter_prob, generator, dev)

    def factor(strength: float, identity: float) -> Tensor:
        f = _uniform(b, identity - strength, identity + strength, generator, dev)
        return torch.where(jitter, f, torch.full_like(f, identity)).view(b, 1, 1, 1)

    brightness, contrast, saturation = (
        factor(s, 1.0).clamp(min=0) for s in (cfg.brightness, cfg.contrast, cfg.saturation)
    )
    hue = factor(cfg.hue, 0.0).view(b) * (2 * math.pi)
    x = (x * brightness).clamp(0, 1)
    mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
    x = (mean + contrast * (x - mean)).clamp(0, 1)
    gray = _gray(x)
    x = (gray + saturation * (x - gray)).clamp(0, 1)
    # Hue: rotate the chroma plane in YIQ, one 3x3 colour matrix per image.
    cos, sin = torch.cos(hue), torch.sin(hue)
    rot = torch.zeros(b, 3, 3, device=dev, dtype=x.dtype)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = cos, -sin, sin, cos
    matrix = _YIQ_INV.to(x) @ rot @ _YIQ.to(x)
    x = torch.einsum("bij,bjhw->bihw", matrix, x).clamp(0, 1)
    x = torch.where(_chance(b, cfg.grayscale_prob, generator, dev).view(b, 1, 1, 1), _gray(x).expand_as(x), x)
    short = min(x.shape[-2:])
    sigma = _uniform(b, *cfg.blur_sigma, generator, dev) * short
    blurred = _gaussian_blur(x, sigma, cfg.blur_sigma[1] * short)
    x = torch.where(_chance(b, blur_prob, generator, dev).view(b, 1, 1, 1), blurred, x)
    solarize = _chance(b, solarize_prob, generator, dev).view(b, 1, 1, 1)
    return torch.where(solarize & (x >= 0.5), 1 - x, x)


def normalize(x: Tensor, cfg: ViewsConfig) -> Tensor:
    return (x - x.new_tensor(cfg.mean).view(1, 3, 1, 1)) / x.new_tensor(cfg.std).view(1, 3, 1, 1)


def make_views(images: Tensor, cfg: ViewsConfig, generator: torch.Generator | None = None) -> Views:
    """Views of ``images`` ([B, 3, H, W], uint8 or float in [0, 1], any size): see the module docstring."""
    x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    b, dev = x.shape[0], x.device
    hw = (x.shape[-2], x.shape[-1])
    source = _prescale(x, cfg.global_size, cfg.global_scale[0])
    clean, aug = [], []
    for blur_p, solarize_p in zip(cfg.global_blur_prob, cfg.global_solarize_prob):
        theta = crop_boxes(b, hw, cfg.global_size, cfg.global_scale, cfg.flip_prob, generator, dev)
        crop = resized_crops(source, theta, cfg.global_size)
        clean.append(normalize(crop, cfg))
        aug.append(normalize(colour_augment(crop, cfg, blur_p, solarize_p, generator), cfg))
    local = []
    if cfg.n_local:
        source = _prescale(x, cfg.local_size, cfg.local_scale[0])
        for _ in range(cfg.n_local):
            theta = crop_boxes(b, hw, cfg.local_size, cfg.local_scale, cfg.flip_prob, generator, dev)
            crop = resized_crops(source, theta, cfg.local_size)
            local.append(normalize(colour_augment(crop, cfg, cfg.local_blur_prob, 0.0, generator), cfg))
    empty_local = x.new_zeros(0, 3, *cfg.local_size)
    return Views(
        global_clean=torch.cat(clean),
        global_aug=torch.cat(aug),
        local=torch.cat(local) if local else empty_local,
        n_global=cfg.n_global,
        n_local=cfg.n_local,
    )
