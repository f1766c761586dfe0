"""Evaluation metrics of the five tasks, as accumulators that merge across workers.

- pose: COCO keypoint AP: object keypoint similarity (OKS) with per-keypoint sigmas and the person's area as
  scale, greedy score-ordered matching per image, precision made monotone and sampled at 101 recall points,
  averaged over OKS thresholds 0.50:0.05:0.95 (``AP``), and at 0.50 / 0.75. Ground truths without a labelled
  keypoint are ignored, as in COCO, and so are detections matched to them.
- seg: mean IoU and mean pixel accuracy over the classes present (a class with neither a label nor a prediction
  is left out), from one confusion matrix over the whole set; ``ignore_index`` pixels are skipped.
- normal: angular error in degrees over labelled pixels: mean, median, and % of pixels within 11.25 / 22.5 / 30.
- pointmap: per image, the prediction is scaled by the least-squares factor onto the target; relative point error
  mean(|s p - p*| / |p*|) and depth AbsRel mean(|s z - z*| / z*), averaged over images.
- albedo: MAE over labelled pixels and channels; PSNR (peak 1) per image, averaged over images.

Each accumulator keeps plain numpy arrays (``state()``), so worker states can be gathered and ``merge``d.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

OKS_THRESHOLDS = np.linspace(0.5, 0.95, 10)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)


class Accumulator:
    """State: a dict of lists of numpy arrays; merging concatenates the lists."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def _add(self, **arrays: np.ndarray) -> None:
        for k, v in arrays.items():
            self.parts.setdefault(k, []).append(np.asarray(v))

    def state(self) -> dict[str, list[np.ndarray]]:
        return self.parts

    def merge(self, states: list[dict[str, list[np.ndarray]]]) -> None:
        for s in states:
            for k, v in s.items():
                self.parts.setdefault(k, []).extend(v)

    def _cat(self, key: str) -> np.ndarray:
        return np.concatenate(self.parts[key]) if self.parts.get(key) else np.zeros(0)

    def compute(self) -> dict[str, float]:
        raise NotImplementedError


# --- pose -----------------------------------------------------------------------------------------------------------


def oks(pred: np.ndarray, gt: np.ndarray, visibility: np.ndarray, area: float, sigmas: np.ndarray) -> float:
    """COCO object keypoint similarity of one prediction [K, 2] with one ground truth [K, 2] (labelled: vis > 0)."""
    labelled = visibility > 0
    if not labelled.any():
        return 0.0
    var = (2 * sigmas) ** 2
    d2 = ((pred - gt) ** 2).sum(-1)
    e = d2 / var / (area + np.spacing(1)) / 2
    return float(np.exp(-e[labelled]).mean())


def keypoint_ap(
    ground_truths: list[list[tuple[np.ndarray, np.ndarray, float]]],
    detections: list[list[tuple[np.ndarray, float]]],
    sigmas: np.ndarray,
    thresholds: np.ndarray = OKS_THRESHOLDS,
    max_dets: int = 20,
) -> dict[str, float]:
    """COCO keypoint AP. Per image: ground truths (keypoints, visibility, area), detections (keypoints, score)."""
    n_gt = 0
    per_image = []
    for gts, dets in zip(ground_truths, detections, strict=True):
        dets = sorted(dets, key=lambda d: -d[1])[:max_dets]
        ignore = np.array([not (v > 0).any() for _, v, _ in gts], bool)
        order = np.argsort(ignore, kind="stable")  # non-ignored ground truths first, as COCOeval
        gts = [gts[i] for i in order]
        ignore = ignore[order]
        n_gt += int((~ignore).sum())
        ious = np.array([[oks(d[0], g[0], g[1], g[2], sigmas) for g in gts] for d in dets]).reshape(len(dets), len(gts))
        ious[:, ignore] = 1.0  # COCO scores these by the person's box: a detection on the person is set aside
        per_image.append((np.array([d[1] for d in dets]), ious, ignore))
    aps = []
    for t in thresholds:
        scores, tps, ignored = [], [], []
        for s, ious, ignore in per_image:
            matched = np.zeros(len(ignore), bool)
            for di in range(len(s)):
                best, best_iou = -1, min(t, 1 - 1e-10)
                for gi in range(len(ignore)):
                    if matched[gi]:
                        continue
                    if best > -1 and not ignore[best] and ignore[gi]:
                        break  # a real match beats any ignored one
                    if ious[di, gi] < best_iou:
                        continue
                    best, best_iou = gi, ious[di, gi]
                if best > -1:
                    matched[best] = True
                scores.append(s[di])
                tps.append(best > -1 and not ignore[best])
                ignored.append(best > -1 and ignore[best])
        aps.append(_average_precision(np.array(scores), np.array(tps, bool), np.array(ignored, bool), n_gt))
    ap = np.array(aps)  # per threshold
    out = {"AP": float(ap.mean())}
    for name, t in (("AP50", 0.5), ("AP75", 0.75)):
        hit = np.isclose(thresholds, t)
        if hit.any():
            out[name] = float(ap[hit][0])
    return out


def _average_precision(scores: np.ndarray, tp: np.ndarray, ignored: np.ndarray, n_gt: int) -> float:
    if n_gt == 0:
        return float("nan")
    order = np.argsort(-scores, kind="mergesort")
    tp, ignored = tp[order], ignored[order]
    keep = ~ignored
    tps = np.cumsum(tp[keep])
    fps = np.cumsum(~tp[keep])
    recall = tps / n_gt
    precision = tps / np.maximum(tps + fps, np.spacing(1))
    precision = np.maximum.accumulate(precision[::-1])[::-1] if len(precision) else precision
    idx = np.searchsorted(recall, RECALL_POINTS, side="left")
    sampled = np.array([precision[i] if i < len(precision) else 0.0 for i in idx])
    return float(sampled.mean())


class PoseMetric(Accumulator):
    """One person per image: one ground truth and one detection (score: mean keypoint heatmap maximum). With
    ``groups`` (one name per keypoint), also AP and OKS over each group's keypoints alone (``AP_face``, ...)."""

    def __init__(self, sigmas: np.ndarray, groups: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.sigmas = np.asarray(sigmas, np.float64)
        self.groups = tuple(groups)

    def update(self, pred: Tensor, scores: Tensor, gt: Tensor, visibility: Tensor, area: Tensor) -> None:
        self._add(
            pred=pred.detach().cpu().double().numpy(),
            score=scores.detach().cpu().double().numpy(),
            gt=gt.cpu().double().numpy(),
            vis=visibility.cpu().numpy(),
            area=area.cpu().double().numpy(),
        )

    def compute(self) -> dict[str, float]:
        pred, score, gt, vis, area = (self._cat(k) for k in ("pred", "score", "gt", "vis", "area"))
        out = _pose_scores(pred, score, gt, vis, area, self.sigmas)
        names = self.groups if len(self.groups) == len(self.sigmas) else ()
        for group in dict.fromkeys(names):
            sel = np.array([g == group for g in names])
            scores = _pose_scores(pred[:, sel], score[:, sel], gt[:, sel], vis[:, sel], area, self.sigmas[sel])
            out.update({f"{k}_{group}": v for k, v in scores.items() if k in ("AP", "OKS")})
        return out


def _pose_scores(
    pred: np.ndarray, score: np.ndarray, gt: np.ndarray, vis: np.ndarray, area: np.ndarray, sigmas: np.ndarray
) -> dict[str, float]:
    """Keypoint AP and mean OKS of one detection per image; the detection's score is its keypoints' mean."""
    gts = [[(gt[i], vis[i], float(area[i]))] for i in range(len(gt))]
    dets = [[(pred[i], float(score[i].mean()))] for i in range(len(pred))]
    out = keypoint_ap(gts, dets, sigmas)
    sims = [oks(pred[i], gt[i], vis[i], area[i], sigmas) for i in range(len(gt)) if (vis[i] > 0).any()]
    out["OKS"] = float(np.mean(sims)) if sims else float("nan")
    return out


# --- segmentation -------------------------------------------------------------------------------------------------


def confusion_matrix(pred: np.ndarray, labels: np.ndarray, num_classes: int, ignore_index: int = 255) -> np.ndarray:
    """[C, C] counts, rows = label, columns = prediction."""
    valid = (labels != ignore_index) & (labels >= 0) & (labels < num_classes)
    idx = labels[valid].astype(np.int64) * num_classes + pred[valid].astype(np.int64)
    return np.bincount(idx, minlength=num_classes**2).reshape(num_classes, num_classes)


def iou_from_confusion(cm: np.ndarray) -> dict[str, float | list[float | None]]:
    tp = np.diag(cm).astype(np.float64)
    label, predicted = cm.sum(1), cm.sum(0)
    union = label + predicted - tp
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, tp / union, np.nan)
        acc = np.where(label > 0, tp / label, np.nan)
    return {
        "mIoU": float(np.nanmean(iou)) if np.isfinite(iou).any() else float("nan"),
        "mAcc": float(np.nanmean(acc)) if np.isfinite(acc).any() else float("nan"),
        "aAcc": float(tp.sum() / max(1, cm.sum())),
        "IoU": [None if math.isnan(x) else float(x) for x in iou],
    }


class SegMetric(Accumulator):
    def __init__(self, num_classes: int, ignore_index: int = 255) -> None:
        super().__init__()
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def update(self, pred: Tensor, labels: Tensor) -> None:
        cm = confusion_matrix(pred.cpu().numpy(), labels.cpu().numpy(), self.num_classes, self.ignore_index)
        self._add(cm=cm[None])

    def compute(self) -> dict:
        cm = self._cat("cm").sum(0) if self.parts.get("cm") else np.zeros((self.num_classes,) * 2, np.int64)
        return iou_from_confusion(cm)


# --- normals ------------------------------------------------------------------------------------------------------


def angular_errors(pred: Tensor, target: Tensor, mask: Tensor) -> np.ndarray:
    """Degrees between [..., 3] vectors at the ``mask`` pixels."""
    p = torch.nn.functional.normalize(pred.float()[mask], dim=-1)
    t = torch.nn.functional.normalize(target.float()[mask], dim=-1)
    cos = (p * t).sum(-1).clamp(-1, 1)
    return torch.rad2deg(torch.acos(cos)).cpu().double().numpy()


class NormalMetric(Accumulator):
    def update(self, pred: Tensor, target: Tensor, mask: Tensor) -> None:
        self._add(err=angular_errors(pred, target, mask))

    def compute(self) -> dict[str, float]:
        e = self._cat("err")
        if not len(e):
            return {"mean": float("nan"), "median": float("nan")}
        return {
            "mean": float(e.mean()),
            "median": float(np.median(e)),
            "within_11.25": float((e < 11.25).mean() * 100),
            "within_22.5": float((e < 22.5).mean() * 100),
            "within_30": float((e < 30).mean() * 100),
        }


# --- pointmap -----------------------------------------------------------------------------------------------------


def pointmap_errors(pred: Tensor, target: Tensor, mask: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per image (with labelled pixels): relative point error and depth AbsRel after least-squares scale."""
    rel, absrel = [], []
    for p, t, m in zip(pred.double(), target.double(), mask):
        if not m.any():
            continue
        p, t = p[m], t[m]
        s = (p * t).sum() / (p * p).sum().clamp_min(1e-12)
        rel.append(((s * p - t).norm(dim=-1) / t.norm(dim=-1).clamp_min(1e-12)).mean().item())
        absrel.append(((s * p[:, 2] - t[:, 2]).abs() / t[:, 2].abs().clamp_min(1e-12)).mean().item())
    return np.array(rel), np.array(absrel)


class PointmapMetric(Accumulator):
    def update(self, pred: Tensor, target: Tensor, mask: Tensor) -> None:
        rel, absrel = pointmap_errors(pred, target, mask)
        self._add(rel=rel, absrel=absrel)

    def compute(self) -> dict[str, float]:
        rel, absrel = self._cat("rel"), self._cat("absrel")
        if not len(rel):
            return {"rel_point": float("nan"), "abs_rel_depth": float("nan")}
        return {"rel_point": float(rel.mean()), "abs_rel_depth": float(absrel.mean())}


# --- albedo -------------------------------------------------------------------------------------------------------


class AlbedoMetric(Accumulator):
    def update(self, pred: Tensor, target: Tensor, mask: Tensor) -> None:
        for p, t, m in zip(pred.double(), target.double(), mask):
            if not m.any():
                continue
            d = p[m] - t[m]
            mse = (d**2).mean().item()
            self._add(
                abs_sum=np.array([d.abs().sum().item()]),
                count=np.array([d.numel()]),
                psnr=np.array([10 * math.log10(1 / max(mse, 1e-10))]),
            )

    def compute(self) -> dict[str, float]:
        count = self._cat("count").sum()
        nan = float("nan")
        return {
            "mae": float(self._cat("abs_sum").sum() / count) if count else nan,
            "psnr": float(self._cat("psnr").mean()) if count else nan,
        }
