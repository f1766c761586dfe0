"""The five tasks as one interface: head, loss, metric and picture, so the trainer has no per-task branches."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from finetune import heads, losses, metrics
from finetune.config import FinetuneConfig
from finetune.data import TASKS, LabelInfo


class Task:
    name: str

    def __init__(self, cfg: FinetuneConfig, info: LabelInfo) -> None:
        self.cfg, self.info = cfg, info
        h, w = info.image_size
        self.image_hw = (h, w)

    def build_head(self, width: int, stride: int) -> nn.Module:
        raise NotImplementedError

    def loss(self, head: nn.Module, out: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def metric(self) -> metrics.Accumulator:
        raise NotImplementedError

    def update(self, acc, head: nn.Module, out: Tensor, batch: dict[str, Tensor], valid: Tensor) -> None:
        raise NotImplementedError

    def picture(self, head: nn.Module, out: Tensor, batch: dict[str, Tensor], i: int) -> tuple[np.ndarray, np.ndarray]:
        """(target, prediction) of sample ``i`` as [H, W, 3] uint8 images."""
        raise NotImplementedError


def _rgb(x: Tensor) -> np.ndarray:
    return (x.detach().float().clamp(0, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)


def _masked(img: np.ndarray, mask: Tensor) -> np.ndarray:
    return np.where(mask.cpu().numpy()[..., None], img, 0).astype(np.uint8)


class Pose(Task):
    name = "pose"

    def build_head(self, width: int, stride: int) -> nn.Module:
        h = self.cfg.head
        return heads.PoseHead(width, self.info.num_keypoints, stride, h.channels, sigma=h.sigma, blur=h.blur)

    def loss(self, head, out, batch):
        target, weight = head.targets(batch["keypoints"], batch["visibility"], self.image_hw)
        mse = losses.heatmap_loss(out, target, weight)
        return mse, {"mse": mse.detach()}

    def metric(self):
        return metrics.PoseMetric(np.array(self.info.keypoint_sigmas), self.info.keypoint_groups)

    def update(self, acc, head, out, batch, valid):
        kp, scores = head.decode(out, self.image_hw)
        gt = batch["keypoints"][valid], batch["visibility"][valid], batch["area"][valid]
        acc.update(kp[valid], scores[valid], *gt)

    def picture(self, head, out, batch, i):
        from PIL import Image, ImageDraw

        image = batch["image"][i].permute(1, 2, 0).cpu().numpy()
        kp, _ = head.decode(out[i : i + 1], self.image_hw)
        vis = batch["visibility"][i].cpu().numpy()
        pictures = []
        for points, colour in ((batch["keypoints"][i].cpu().numpy(), (0, 255, 0)), (kp[0].cpu().numpy(), (255, 0, 0))):
            img = Image.fromarray(image.copy())
            draw = ImageDraw.Draw(img)
            for (x, y), v in zip(points, vis):
                if v > 0:
                    draw.ellipse([x - 1, y - 1, x + 1, y + 1], fill=colour)
            pictures.append(np.asarray(img))
        return pictures[0], pictures[1]


class Seg(Task):
    name = "seg"

    def __init__(self, cfg, info) -> None:
        super().__init__(cfg, info)
        w = cfg.head.class_weights
        if isinstance(w, list) and len(w) != info.num_classes:
            raise ValueError(f"head.class_weights has {len(w)} values, the data has {info.num_classes} classes")
        palette = np.random.default_rng(0).integers(40, 256, (256, 3)).astype(np.uint8)
        palette[0] = 0
        self.palette = palette

    def build_head(self, width, stride):
        return heads.SegHead(width, self.info.num_classes, stride, self.cfg.head.channels)

    def loss(self, head, out, batch):
        w = self.cfg.head.class_weights
        if w == "auto":
            raise ValueError(
                'head.class_weights="auto" is resolved from the data when a run starts (finetune.train.fit)'
            )
        weights = None if w is None else out.new_tensor(w, dtype=torch.float32)
        return losses.seg_loss(
            out, batch["parts"], class_weights=weights, ignore_index=self.cfg.head.ignore_index,
            ce_weight=self.cfg.loss.ce, dice_weight=self.cfg.loss.dice,
        )  # fmt: skip

    def metric(self):
        return metrics.SegMetric(self.info.num_classes, self.cfg.head.ignore_index)

    def update(self, acc, head, out, batch, valid):
        acc.update(out[valid].argmax(1), batch["parts"][valid])

    def picture(self, head, out, batch, i):
        target = batch["parts"][i].cpu().numpy()
        return self.palette[np.clip(target, 0, 255)], self.palette[out[i].argmax(0).cpu().numpy()]


class _Dense(Task):
    metric_cls: type[metrics.Accumulator]

    def update(self, acc, head, out, batch, valid):
        acc.update(out[valid], batch["target"][valid], batch["mask"][valid])

    def show(self, x: Tensor, mask: Tensor) -> np.ndarray:
        return _masked(_rgb(x), mask)

    def picture(self, head, out, batch, i):
        m = batch["mask"][i]
        return self.show(batch["target"][i], m), self.show(out[i], m)

    def metric(self):
        return self.metric_cls()


class Normal(_Dense):
    name = "normal"
    metric_cls = metrics.NormalMetric

    def build_head(self, width, stride):
        return heads.NormalHead(width, stride, self.cfg.head.channels)

    def loss(self, head, out, batch):
        c = self.cfg.loss
        return losses.normal_loss(
            out, batch["target"], batch["mask"], cos_weight=c.cos, l1_weight=c.l1, grad_weight=c.grad
        )

    def show(self, x, mask):
        return _masked(_rgb((x + 1) / 2), mask)


class Albedo(_Dense):
    name = "albedo"
    metric_cls = metrics.AlbedoMetric

    def build_head(self, width, stride):
        return heads.AlbedoHead(width, stride, self.cfg.head.channels)

    def loss(self, head, out, batch):
        c = self.cfg.loss
        return losses.albedo_loss(
            out, batch["target"], batch["mask"], l1_weight=c.l1, grad_weight=c.grad, chroma_weight=c.chroma
        )


class Pointmap(_Dense):
    name = "pointmap"
    metric_cls = metrics.PointmapMetric

    def build_head(self, width, stride):
        return heads.PointmapHead(width, stride, self.cfg.head.channels)

    def loss(self, head, out, batch):
        c = self.cfg.loss
        return losses.pointmap_loss(
            out, batch["target"], batch["mask"], aligned_weight=c.aligned, absolute_weight=c.absolute,
            grad_weight=c.grad,
        )  # fmt: skip

    def picture(self, head, out, batch, i):
        """Depth, near bright, over the target's depth range; the prediction after scale alignment."""
        m, target = batch["mask"][i], batch["target"][i].float()
        pred = out[i].detach().float()
        pred = pred * losses.align_scale(pred[None], target[None], m[None])[0]
        zt = target[..., 2][m] if m.any() else target[..., 2].flatten()
        lo, hi = zt.min(), zt.max()

        def show(z: Tensor) -> np.ndarray:
            shade = (1 - (z - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
            return _masked(_rgb(shade[..., None].expand(*shade.shape, 3)), m)

        return show(target[..., 2]), show(pred[..., 2])


REGISTRY: dict[str, type[Task]] = {t.name: t for t in (Pose, Seg, Pointmap, Normal, Albedo)}
assert set(REGISTRY) == set(TASKS)


def make(name: str, cfg: FinetuneConfig, info: LabelInfo) -> Task:
    if name not in REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    if name == "seg" and info.num_classes < 2:
        raise ValueError("the data names no body-part classes (metadata 'parts'); it cannot train seg")
    if name == "pose" and info.num_keypoints < 1:
        raise ValueError("the data names no keypoints (metadata 'keypoint_names'); it cannot train pose")
    return REGISTRY[name](cfg, info)


# --- labels at the model's output size (a 4K backbone decodes at half the input's) ---------------------------------


def _nearest(x: Tensor, hw: tuple[int, int]) -> Tensor:
    """[B, H, W] -> [B, h, w]: each output pixel takes the input pixel under its centre (class ids and masks are
    never blended)."""
    (H, W), (h, w) = x.shape[1:3], hw
    rows = ((torch.arange(h, device=x.device) + 0.5) * (H / h)).long().clamp_max(H - 1)
    cols = ((torch.arange(w, device=x.device) + 0.5) * (W / w)).long().clamp_max(W - 1)
    return x[:, rows][:, :, cols]


def _area_mean(x: Tensor, weight: Tensor, hw: tuple[int, int]) -> Tensor:
    """[B, H, W, C] -> [B, h, w, C]: the weight-averaged values over each output pixel's footprint (0 where it holds
    no weight), so background pixels, which carry no label, do not pull a surface value towards zero."""
    interpolate = torch.nn.functional.interpolate
    w = weight.float()[:, None]
    total = interpolate(x.float().permute(0, 3, 1, 2) * w, size=hw, mode="area")
    norm = interpolate(w, size=hw, mode="area")
    return torch.where(norm > 0, total / norm.clamp_min(1e-12), 0.0).permute(0, 2, 3, 1)


def resize_targets(batch: dict[str, Tensor], task: str, hw: tuple[int, int]) -> dict[str, Tensor]:
    """The batch's labels resized from its images' size to ``hw`` (the model's output size); ``image`` and the other
    keys are kept as they are. Seg ``parts`` and dense ``mask``: nearest pixel; dense ``target``: the area mean over
    the masked pixels (normals then back to unit length); pose ``keypoints`` on pixel centres,
    ``x' = (x + 0.5) * s - 0.5``, and ``area`` by the product of the two size ratios."""
    H, W = batch["image"].shape[-2:]
    h, w = hw
    out = dict(batch)
    if task == "pose":
        sx, sy = w / W, h / H
        out["keypoints"] = (batch["keypoints"] + 0.5) * batch["keypoints"].new_tensor([sx, sy]) - 0.5
        out["area"] = batch["area"] * (sx * sy)
    elif task == "seg":
        out["parts"] = _nearest(batch["parts"], hw)
    elif task in ("pointmap", "normal", "albedo"):
        target = _area_mean(batch["target"], batch["mask"], hw)
        if task == "normal":
            target = torch.nn.functional.normalize(target, dim=-1, eps=1e-12)
        out["target"] = target.to(batch["target"].dtype)
        out["mask"] = _nearest(batch["mask"], hw)
    else:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return out
