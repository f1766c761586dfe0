"""Light task heads on the backbone's patch-token feature map [B, D, H / s, W / s] (s = patch x window).

As in Sapiens2: the pose and segmentation heads upsample with transposed convolutions to 1/4 of the input; the
dense regression heads (pointmap, normal, albedo) upsample with pixel shuffle to the full input resolution.

- ``PoseHead``: K heatmaps at 1/4 resolution. UDP (unbiased data processing): image and heatmap are related
  through their pixel-centre grids, ``x_heatmap = x_image * (w - 1) / (W - 1)``, so encoding then decoding a
  keypoint is exact; targets are Gaussians of configurable sigma (heatmap pixels) centred there. Decoding takes the
  arg-max and refines it to sub-pixel precision with a second-order Taylor step on the log of the (optionally
  blurred) heatmap (DARK), which is exact for a Gaussian, on the map's edge too.
- ``SegHead``: per-class logits, bilinearly resized to the input size.
- ``PointmapHead``: per-pixel (x / z, y / z, log z), returned as the camera-frame point (x, y, z), so depth is
  positive by construction.
- ``NormalHead``: three channels scaled to unit length.
- ``AlbedoHead``: a sigmoid keeps albedo in [0, 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _norm(c: int) -> nn.GroupNorm:
    # GroupNorm: independent of the (small, per-worker) batch size, unlike BatchNorm
    return nn.GroupNorm(math.gcd(8, c), c)


def upsampling_stages(stride: int, out_stride: int) -> int:
    """Number of x2 stages from a feature stride to an output stride (both powers of two)."""
    ratio = stride // out_stride
    if ratio < 1 or stride % out_stride or ratio & (ratio - 1):
        raise ValueError(f"cannot upsample from stride {stride} to stride {out_stride} in x2 stages")
    return int(math.log2(ratio))


def default_channels(width: int, stages: int) -> list[int]:
    """Stage widths halving from min(width, 256), at least 16."""
    return [max(16, min(width, 256) // 2**i) for i in range(stages)]


class Upsampler(nn.Module):
    """x2 stages, each an upsampling step then a 3x3 conv block; ``deconv`` or ``shuffle`` (conv + pixel shuffle)."""

    def __init__(self, in_dim: int, channels: list[int], mode: str) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_dim
        for out in channels:
            if mode == "deconv":
                layers += [nn.ConvTranspose2d(c, out, 4, stride=2, padding=1, bias=False)]
            elif mode == "shuffle":
                layers += [nn.Conv2d(c, out * 4, 3, padding=1, bias=False), nn.PixelShuffle(2)]
            else:
                raise ValueError(f"unknown upsampling mode {mode!r}")
            layers += [_norm(out), nn.SiLU(), nn.Conv2d(out, out, 3, padding=1, bias=False), _norm(out), nn.SiLU()]
            c = out
        self.layers = nn.Sequential(*layers)
        self.out_channels = c

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class _Head(nn.Module):
    mode = "shuffle"
    out_stride = 1

    def __init__(self, in_dim: int, out_ch: int, stride: int, channels: list[int] | None = None) -> None:
        super().__init__()
        stages = upsampling_stages(stride, self.out_stride)
        channels = channels if channels is not None else default_channels(in_dim, stages)
        if len(channels) != stages:
            raise ValueError(
                f"{type(self).__name__} needs {stages} upsampling stages from stride {stride} to "
                f"{self.out_stride}, got channels {channels}; give head.channels a list of {stages} widths"
            )
        self.up = Upsampler(in_dim, channels, self.mode)
        self.out = nn.Conv2d(self.up.out_channels, out_ch, 1)

    def features(self, feat: Tensor, out_hw: tuple[int, int] | None = None) -> Tensor:
        x = self.out(self.up(feat))
        if out_hw is not None and tuple(x.shape[-2:]) != tuple(out_hw):
            x = F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False)
        return x


class PoseHead(_Head):
    mode = "deconv"
    out_stride = 4

    def __init__(self, in_dim: int, num_keypoints: int, stride: int, channels=None, sigma: float = 2.0,
                 blur: float = 1.0) -> None:  # fmt: skip
        super().__init__(in_dim, num_keypoints, stride, channels)
        self.sigma, self.blur = sigma, blur

    def forward(self, feat: Tensor, image_hw: tuple[int, int]) -> Tensor:
        """Heatmaps [B, K, H / 4, W / 4]."""
        return self.features(feat, (image_hw[0] // self.out_stride, image_hw[1] // self.out_stride))

    def targets(self, keypoints: Tensor, visibility: Tensor, image_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
        return udp_heatmaps(keypoints, visibility, image_hw, self.out_stride, self.sigma)

    def decode(self, heatmaps: Tensor, image_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
        return decode_heatmaps(heatmaps, image_hw, self.blur)


class SegHead(_Head):
    mode = "deconv"
    out_stride = 4

    def forward(self, feat: Tensor, image_hw: tuple[int, int]) -> Tensor:
        """Logits [B, C, H, W]."""
        return self.features(feat, image_hw)


class PointmapHead(_Head):
    def __init__(self, in_dim: int, stride: int, channels=None, depth_init: float = 2.0) -> None:
        super().__init__(in_dim, 3, stride, channels)
        with torch.no_grad():  # start at a plausible depth, on the optical axis
            self.out.weight.mul_(0.1)
            assert self.out.bias is not None  # the output conv has a bias (nn.Conv2d's default)
            self.out.bias.copy_(torch.tensor([0.0, 0.0, math.log(depth_init)]))

    def forward(self, feat: Tensor, image_hw: tuple[int, int]) -> Tensor:
        """Camera-frame points [B, H, W, 3]."""
        raw = self.features(feat, image_hw).float()
        z = raw[:, 2].clamp(-10, 10).exp()
        return torch.stack([raw[:, 0] * z, raw[:, 1] * z, z], dim=-1)


class NormalHead(_Head):
    def __init__(self, in_dim: int, stride: int, channels=None) -> None:
        super().__init__(in_dim, 3, stride, channels)

    def forward(self, feat: Tensor, image_hw: tuple[int, int]) -> Tensor:
        """Unit normals [B, H, W, 3]."""
        return F.normalize(self.features(feat, image_hw).float(), dim=1, eps=1e-6).permute(0, 2, 3, 1)


class AlbedoHead(_Head):
    def __init__(self, in_dim: int, stride: int, channels=None) -> None:
        super().__init__(in_dim, 3, stride, channels)

    def forward(self, feat: Tensor, image_hw: tuple[int, int]) -> Tensor:
        """Albedo [B, H, W, 3] in [0, 1]."""
        return torch.sigmoid(self.features(feat, image_hw).float()).permute(0, 2, 3, 1)


# --- UDP heatmaps -------------------------------------------------------------------------------------------------


def heatmap_scale(image_hw: tuple[int, int], heatmap_hw: tuple[int, int]) -> tuple[float, float]:
    """(x, y) factors from image to heatmap pixel coordinates (pixel-centre grids, UDP)."""
    (H, W), (h, w) = image_hw, heatmap_hw
    return (w - 1) / (W - 1), (h - 1) / (H - 1)


def udp_heatmaps(
    keypoints: Tensor, visibility: Tensor, image_hw: tuple[int, int], stride: int, sigma: float
) -> tuple[Tensor, Tensor]:
    """Gaussian targets [B, K, h, w] and per-keypoint weights [B, K] (1 where labelled and on the heatmap)."""
    h, w = image_hw[0] // stride, image_hw[1] // stride
    sx, sy = heatmap_scale(image_hw, (h, w))
    mx, my = keypoints[..., 0] * sx, keypoints[..., 1] * sy  # [B, K]
    ys = torch.arange(h, device=keypoints.device, dtype=torch.float32)
    xs = torch.arange(w, device=keypoints.device, dtype=torch.float32)
    gy = torch.exp(-((ys - my[..., None]) ** 2) / (2 * sigma**2))  # [B, K, h]
    gx = torch.exp(-((xs - mx[..., None]) ** 2) / (2 * sigma**2))  # [B, K, w]
    inside = (mx >= -0.5) & (mx <= w - 0.5) & (my >= -0.5) & (my <= h - 0.5)
    weight = ((visibility > 0) & inside).float()
    return gy[..., :, None] * gx[..., None, :] * weight[..., None, None], weight


def _gaussian_blur(x: Tensor, sigma: float) -> Tensor:
    radius = max(1, math.ceil(3 * sigma))
    t = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    k = k / k.sum()
    B, K, h, w = x.shape
    y = x.reshape(B * K, 1, h, w)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))
    return y.view(B, K, h, w)


def _pad_quadratic(x: Tensor) -> Tensor:
    """Pad [..., h, w] by one on each side with the quadratic through the three edge samples: exact for the log of
    a Gaussian, so a peak on the heatmap's edge is refined like any other (replicate padding would bias it)."""
    if x.shape[-1] >= 3:
        x = torch.cat([3 * x[..., :1] - 3 * x[..., 1:2] + x[..., 2:3], x,
                       3 * x[..., -1:] - 3 * x[..., -2:-1] + x[..., -3:-2]], dim=-1)  # fmt: skip
    else:
        x = F.pad(x, (1, 1), mode="replicate")
    if x.shape[-2] >= 3:
        return torch.cat([3 * x[..., :1, :] - 3 * x[..., 1:2, :] + x[..., 2:3, :], x,
                          3 * x[..., -1:, :] - 3 * x[..., -2:-1, :] + x[..., -3:-2, :]], dim=-2)  # fmt: skip
    return F.pad(x.unsqueeze(0), (0, 0, 1, 1), mode="replicate").squeeze(0)


@torch.no_grad()
def decode_heatmaps(heatmaps: Tensor, image_hw: tuple[int, int], blur: float = 1.0) -> tuple[Tensor, Tensor]:
    """Heatmaps [B, K, h, w] -> keypoints [B, K, 2] (image pixels) and scores [B, K] (the heatmap maxima)."""
    hm = heatmaps.float()
    _B, _K, h, w = hm.shape
    scores, idx = hm.flatten(2).max(-1)
    y, x = idx // w, idx % w
    smooth = _gaussian_blur(hm, blur) if blur > 0 else hm
    p = _pad_quadratic(torch.log(smooth.clamp_min(1e-10))).flatten(2)
    W2 = w + 2

    def at(dy: int, dx: int) -> Tensor:
        return p.gather(2, ((y + 1 + dy) * W2 + (x + 1 + dx)).unsqueeze(-1)).squeeze(-1)

    c = at(0, 0)
    dx = 0.5 * (at(0, 1) - at(0, -1))
    dy = 0.5 * (at(1, 0) - at(-1, 0))
    dxx = at(0, 1) - 2 * c + at(0, -1)
    dyy = at(1, 0) - 2 * c + at(-1, 0)
    dxy = 0.25 * (at(1, 1) - at(1, -1) - at(-1, 1) + at(-1, -1))
    det = dxx * dyy - dxy**2
    ok = (det > 1e-8) & (dxx < 0) & (dyy < 0)  # a proper maximum; else keep the arg-max
    safe = torch.where(ok, det, torch.ones_like(det))
    ox = torch.where(ok, -(dyy * dx - dxy * dy) / safe, torch.zeros_like(det)).clamp(-1, 1)
    oy = torch.where(ok, -(dxx * dy - dxy * dx) / safe, torch.zeros_like(det)).clamp(-1, 1)
    sx, sy = heatmap_scale(image_hw, (h, w))
    keypoints = torch.stack([(x.float() + ox) / sx, (y.float() + oy) / sy], dim=-1)
    return keypoints, scores
