"""Frozen-feature evaluation: what a backbone's patch tokens already say about body parts, with nothing fine-tuned.

Fine-tuning a whole backbone on a few labelled renders mostly measures how fast the head and the backbone adapt;
these read-outs measure the features themselves, in seconds, on the seg task's 29 body-part labels:

- **Linear probes** (``probe``): for every transformer block's output and the final normed output, a 1x1 linear
  classifier (multinomial logistic regression over the standardised token features) trained on the training
  tokens against each token's majority label. (Soft targets, the class shares of the token's pixels, would learn
  the expected share, whose argmax is background for most limb tokens.) ``miou`` is scored at **token resolution**:
  the argmax against each evaluation token's majority label, the direct read-out of the features. ``pixel_miou``
  upsamples the logits bilinearly to the label maps (a 1x1 conv on upsampled features), comparable with
  fine-tuning's mIoU but capped by the token size: ``pixel_miou_ceiling`` is what the true token labels score so.
- **Dense k-NN label transfer** (``knn``): each evaluation token takes the vote of the majority labels of its k
  nearest training tokens (cosine similarity of the standardised features, faiss; each vote weighted by
  exp(cos / 0.07), as DINO's k-NN classifier); scored as the probe's (the vote
  shares are what is upsampled).
- **Left vs right** (``left_right``): tokens of sided parts (``left_*`` / ``right_*``, paired by
  ``finetune.augment.mirror_order``; the token's most frequent label other than background is one, and sided parts
  cover at least ``side_min_share`` of it) -> a linear probe predicting the side, scored as balanced accuracy. A
  figure's left and right limbs share their colours, and views come from any direction, so neither colour nor
  image position decides the side: the token has to know which way the figure faces.

Choices are made on the training split alone: the weight decay of each probe, and the layer reported as ``best``,
by the score on a held-out quarter of the training images (fit on the rest); the final probe is refit on all
training images. So the evaluation split is only ever scored. Grayscale inputs (``grayscale``) take colour away
from the backbone: left / right and part boundaries must then come from shape and context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from common import storage
from finetune import data
from finetune.augment import mirror_order
from finetune.metrics import confusion_matrix, iou_from_confusion
from pretrain.backbone import Sapiens2Backbone
from pretrain.config import PretrainProbe
from pretrain.data import DataError, DataIndex
from pretrain.views import IMAGENET_MEAN, IMAGENET_STD

LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's "L" mode
FINAL = "final"  # the layer name of the backbone's normed output

# uint8 images [B, 3, H, W] -> layer name -> patch tokens [B, gh, gw, D]
FeatureFn = Callable[[Tensor], dict[str, Tensor]]


@dataclass(frozen=True)
class ProbeSettings:
    k: int = 10  # neighbours of the k-NN transfer
    knn_temperature: float = 0.07  # of the neighbours' vote weights exp(cos / T) (DINO's k-NN classifier)
    iters: int = 50  # L-BFGS iterations per linear fit (the loss is then within about 1% of its minimum)
    weight_decays: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1)  # L2 on the weights, chosen on the training split
    holdout: float = 0.25  # fraction of the training images that choose weight decay and layer
    # left / right: tokens whose most frequent figure label is a sided part, and sided parts cover this share of it
    # (a limb is often thinner than a token: a strict majority would leave a few dozen tokens per 64 images)
    side_min_share: float = 0.25
    batch_size: int = 16  # images per backbone forward pass


@dataclass
class Split:
    images: Tensor  # [N, 3, H, W] uint8
    parts: Tensor  # [N, H, W] int64 body-part labels

    def head(self, n: int) -> Split:
        return Split(self.images[:n], self.parts[:n])


@dataclass
class Tokens:
    """One split's tokens: features per layer, and what each token's pixels are labelled."""

    features: dict[str, Tensor]  # layer -> [N, gh, gw, D]
    fractions: Tensor  # [N, gh, gw, C]: share of each class among the token's labelled pixels
    parts: Tensor  # [N, H, W] pixel labels (the pixel mIoU is scored against them)

    @property
    def majority(self) -> Tensor:
        """[N, gh, gw] each token's majority label."""
        return self.fractions.argmax(-1)

    def take(self, images: Tensor | np.ndarray) -> Tokens:
        idx = torch.as_tensor(images, dtype=torch.long)
        return Tokens({k: v[idx] for k, v in self.features.items()}, self.fractions[idx], self.parts[idx])


# --- data and features ----------------------------------------------------------------------------------------------


def read_split(uri: str, limit: int | None = None) -> tuple[Split, data.LabelInfo]:
    """The first ``limit`` samples of a labelled split (file order: a prefix of what ``jobs.make_synthetic`` wrote)."""
    index = DataIndex.scan(uri)
    info = data.read_info(index, uri)
    images, parts = [], []
    for batch, valid in data.eval_batches(index, "seg", info.image_size, batch_size=32, world=1, rank=0, limit=limit):
        images.append(batch["image"][valid])
        parts.append(batch["parts"][valid])
    return Split(torch.cat(images), torch.cat(parts)), info


def to_grayscale(images: Tensor) -> Tensor:
    """uint8 [B, 3, H, W] -> its luma replicated over the three channels (uint8)."""
    luma = torch.einsum("bchw,c->bhw", images.float(), torch.tensor(LUMA))
    return luma.round().clamp(0, 255).to(torch.uint8).unsqueeze(1).expand_as(images).contiguous()


def backbone_features(backbone: Sapiens2Backbone, device: torch.device | str = "cpu") -> FeatureFn:
    """The patch tokens after every global block (``block<i>``, the residual stream) and the normed output
    (``final``) of a frozen backbone, from uint8 images normalised as fine-tuning does (``FinetuneModel``); computed
    on ``device``, returned on the CPU."""
    backbone.eval().to(device)
    prefix = 1 + backbone.cfg.num_registers
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)

    @torch.no_grad()
    def features(images: Tensor) -> dict[str, Tensor]:
        captured: dict[str, Tensor] = {}

        def keep(name: str) -> Callable:
            def hook(module, args, output: Tensor) -> None:
                captured[name] = output[:, prefix:].float().cpu()

            return hook

        # forward hooks read the blocks' outputs off the backbone's own forward: no second copy of it to drift
        handles = [blk.register_forward_hook(keep(f"block{i}")) for i, blk in enumerate(backbone.blocks)]
        try:
            out = backbone((images.to(device).float() / 255 - mean) / std)
        finally:
            for h in handles:
                h.remove()
        captured[FINAL] = out.patches.float().cpu()
        return {k: v.unflatten(1, out.grid) for k, v in captured.items()}

    return features


def extract(features: FeatureFn, images: Tensor, batch_size: int) -> dict[str, Tensor]:
    chunks = [features(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


def token_fractions(parts: Tensor, grid: tuple[int, int], num_classes: int) -> Tensor:
    """[N, H, W] labels -> [N, gh, gw, C]: each token's share of its labelled pixels per class (labels outside
    [0, C), the ignore index, do not count; a token without labelled pixels is all zeros)."""
    n, h, w = parts.shape
    gh, gw = grid
    if h % gh or w % gw:
        raise ValueError(f"a {h}x{w} label map does not tile into a {gh}x{gw} token grid")
    rows = torch.arange(h) // (h // gh)
    cols = torch.arange(w) // (w // gw)
    token = (rows[:, None] * gw + cols[None, :]).expand(n, -1, -1)
    valid = (parts >= 0) & (parts < num_classes)
    slot = (token * num_classes + parts.clamp(0, num_classes - 1))[valid]
    image = torch.arange(n)[:, None, None].expand(-1, h, w)[valid]
    counts = torch.zeros(n, gh * gw * num_classes).index_put_((image, slot), torch.ones(len(slot)), accumulate=True)
    counts = counts.view(n, gh, gw, num_classes)
    return counts / counts.sum(-1, keepdim=True).clamp(min=1)


def tokens_of(split: Split, features: FeatureFn, num_classes: int, batch_size: int) -> Tokens:
    feats = extract(features, split.images, batch_size)
    grid = next(iter(feats.values())).shape[1:3]
    return Tokens(feats, token_fractions(split.parts, (int(grid[0]), int(grid[1])), num_classes), split.parts)


# --- linear probes ----------------------------------------------------------------------------------------------------


def standardiser(x: Tensor) -> Callable[[Tensor], Tensor]:
    """z-scores with the statistics of ``x`` [n, D] (a constant feature keeps scale 1)."""
    mean, std = x.mean(0), x.std(0)
    std = torch.where(std > 1e-6 * std.max().clamp(min=1e-12), std, torch.ones_like(std))
    return lambda t: (t - mean) / std


def fit_linear(x: Tensor, target: Tensor, weight_decay: float, iters: int) -> tuple[Tensor, Tensor]:
    """Multinomial logistic regression of targets [n, C] (one-hot, or rows summing to 1) on x [n, D], full-batch L-BFGS:
    mean cross-entropy + weight_decay / 2 * |W|^2. Returns (W [D, C], b [C])."""
    weight = torch.zeros(x.shape[1], target.shape[1], requires_grad=True)
    bias = torch.zeros(target.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1, max_iter=iters, history_size=10, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = -(target * F.log_softmax(x @ weight + bias, -1)).sum(-1).mean() + weight_decay / 2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return weight.detach(), bias.detach()


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit, held-out) image indices: a seeded ``fraction`` of ``n`` images held out (at least one each side).
    Whole images, not tokens: neighbouring tokens of one image are near copies of each other."""
    if n < 2:
        raise ValueError(f"a probe needs at least 2 training images, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    held = min(n - 1, max(1, round(fraction * n)))
    return np.sort(order[held:]), np.sort(order[:held])


def _miou(cm: np.ndarray) -> float:
    return cast(float, iou_from_confusion(cm)["mIoU"])  # the mean (the per-class list sits under "IoU")


def miou(pred: Tensor, labels: Tensor, num_classes: int) -> float:
    return _miou(confusion_matrix(pred.numpy(), labels.numpy(), num_classes))


def pixel_miou(scores: Tensor, parts: Tensor, num_classes: int, chunk: int = 16) -> float:
    """Token scores [N, gh, gw, C] bilinearly upsampled to the label maps [N, H, W], argmax, mIoU over pixels."""
    cm = np.zeros((num_classes, num_classes), np.int64)
    for i in range(0, len(scores), chunk):
        up = F.interpolate(scores[i : i + chunk].permute(0, 3, 1, 2), size=parts.shape[-2:], mode="bilinear")
        cm += confusion_matrix(up.argmax(1).numpy(), parts[i : i + chunk].numpy(), num_classes)
    return _miou(cm)


def _labelled(tokens: Tokens) -> Tensor:
    """[N, gh, gw] tokens that hold at least one labelled pixel."""
    return tokens.fractions.sum(-1) > 0


def _chosen(candidates: dict[float, float]) -> float:
    """The candidate with the best held-out score (the larger weight decay on a tie: the simpler model)."""
    return max(candidates, key=lambda wd: (candidates[wd], wd))


def seg_probe(train: Tokens, evaluate: Tokens, layer: str, cfg: ProbeSettings, seed: int) -> dict:
    """The per-layer 1x1 linear probe (module docstring): weight decay chosen on held-out training images."""
    c = train.fractions.shape[-1]
    fit_idx, held_idx = holdout_split(len(train.parts), cfg.holdout, seed)

    def fit(tokens: Tokens, wd: float) -> tuple[Callable[[Tensor], Tensor], Tensor, Tensor]:
        x, keep = tokens.features[layer], _labelled(tokens)
        norm = standardiser(x[keep])
        target = F.one_hot(tokens.majority[keep], c).float()
        return (norm, *fit_linear(norm(x[keep]), target, wd, cfg.iters))

    def scores(model: tuple[Callable[[Tensor], Tensor], Tensor, Tensor], tokens: Tokens) -> Tensor:
        norm, weight, bias = model
        return norm(tokens.features[layer]) @ weight + bias

    a, b = train.take(fit_idx), train.take(held_idx)
    keep_b = _labelled(b)
    held = {}
    for wd in cfg.weight_decays:
        pred = scores(fit(a, wd), b).argmax(-1)
        held[wd] = miou(pred[keep_b], b.majority[keep_b], c)
    wd = _chosen(held)
    s = scores(fit(train, wd), evaluate)
    keep = _labelled(evaluate)
    return {
        "miou": miou(s.argmax(-1)[keep], evaluate.majority[keep], c),
        "pixel_miou": pixel_miou(s, evaluate.parts, c),
        "weight_decay": wd,
        "holdout_miou": held[wd],
    }


# --- k-NN label transfer -----------------------------------------------------------------------------------------------


def knn_votes(
    index_x: Tensor, index_labels: Tensor, query_x: Tensor, k: int, num_classes: int, temperature: float
) -> Tensor:
    """[n_query, C]: the votes of the k nearest index rows (cosine similarity) for their labels, each weighted by
    exp(similarity / temperature) as DINO's k-NN classifier does, normalised to sum to 1. The weighting lets the
    few close neighbours of a rare part outvote the many loose ones of the background."""
    import faiss

    norm = standardiser(index_x)
    base = F.normalize(norm(index_x), dim=-1).numpy()
    query = F.normalize(norm(query_x), dim=-1).numpy()
    index = faiss.IndexFlatIP(base.shape[1])
    index.add(base)
    sims, nearest = index.search(query, min(k, len(base)))
    weight = torch.from_numpy(sims / temperature).softmax(-1)  # [n, k]
    return (F.one_hot(index_labels[torch.from_numpy(nearest)], num_classes).float() * weight[..., None]).sum(1)


def knn_transfer(train: Tokens, evaluate: Tokens, layer: str, cfg: ProbeSettings, seed: int) -> dict:
    """Dense k-NN label transfer of the majority labels of the labelled training tokens."""
    c = train.fractions.shape[-1]

    def votes(index: Tokens, query: Tokens) -> Tensor:
        keep = _labelled(index)
        x, q = index.features[layer], query.features[layer]
        v = knn_votes(x[keep], index.majority[keep], q.flatten(0, 2), cfg.k, c, cfg.knn_temperature)
        return v.view(*q.shape[:3], c)

    fit_idx, held_idx = holdout_split(len(train.parts), cfg.holdout, seed)
    a, b = train.take(fit_idx), train.take(held_idx)
    keep_b = _labelled(b)
    held = miou(votes(a, b).argmax(-1)[keep_b], b.majority[keep_b], c)
    v = votes(train, evaluate)
    keep = _labelled(evaluate)
    return {
        "miou": miou(v.argmax(-1)[keep], evaluate.majority[keep], c),
        "pixel_miou": pixel_miou(v, evaluate.parts, c),
        "holdout_miou": held,
    }


# --- left vs right -----------------------------------------------------------------------------------------------------


def sides(parts: tuple[str, ...]) -> Tensor:
    """[C] per class: 0 a left part, 1 a right part, -1 unsided; the pairs are those ``mirror_order`` swaps."""
    order = mirror_order(parts)
    if order is None:
        raise ValueError("the label set has a left_ part without its right_ partner: no left / right probe")
    side = [-1 if order[i] == i else (0 if name.startswith("left") else 1) for i, name in enumerate(parts)]
    if 0 not in side:
        raise ValueError("the label set has no left / right parts")
    return torch.tensor(side)


def balanced_accuracy(pred: Tensor, target: Tensor) -> float:
    recalls = [float((pred[target == s] == s).float().mean()) for s in (0, 1) if (target == s).any()]
    return float(np.mean(recalls)) if recalls else float("nan")


def left_right_probe(train: Tokens, evaluate: Tokens, layer: str, side: Tensor, cfg: ProbeSettings, seed: int) -> dict:
    """A linear probe of the side (left / right) of the tokens whose majority label is a sided part."""

    def sided(tokens: Tokens) -> tuple[Tensor, Tensor]:
        s = side[tokens.fractions[..., 1:].argmax(-1) + 1]  # the token's most frequent label of the figure
        share = (tokens.fractions * (side >= 0)).sum(-1)
        keep = (s >= 0) & (share >= cfg.side_min_share)
        return tokens.features[layer][keep], s[keep]

    def fit(x: Tensor, y: Tensor, wd: float) -> Callable[[Tensor], Tensor]:
        norm = standardiser(x)
        weight, bias = fit_linear(norm(x), F.one_hot(y, 2).float(), wd, cfg.iters)
        return lambda t: (norm(t) @ weight + bias).argmax(-1)

    x, y = sided(train)
    xe, ye = sided(evaluate)
    counts = {
        "train_tokens": [int((y == s).sum()) for s in (0, 1)],
        "eval_tokens": [int((ye == s).sum()) for s in (0, 1)],
    }
    fit_idx, held_idx = holdout_split(len(train.parts), cfg.holdout, seed)
    (xa, ya), (xb, yb) = sided(train.take(fit_idx)), sided(train.take(held_idx))
    if min(counts["train_tokens"]) < 2 or len(ye) == 0 or len(torch.unique(ya)) < 2 or len(yb) == 0:
        return {"balanced_acc": None, "acc": None, **counts}  # too few sided tokens to fit or to score
    held = {wd: balanced_accuracy(fit(xa, ya, wd)(xb), yb) for wd in cfg.weight_decays}
    wd = _chosen(held)
    pred = fit(x, y, wd)(xe)
    return {
        "balanced_acc": balanced_accuracy(pred, ye),
        "acc": float((pred == ye).float().mean()),
        "weight_decay": wd,
        "holdout_balanced_acc": held[wd],
        **counts,
    }


# --- the whole evaluation -----------------------------------------------------------------------------------------------


def _best(per_layer: dict[str, dict], selection: str, *scores: str) -> dict:
    """The layer with the best held-out training score, and its evaluation scores."""
    scored = {k: v for k, v in per_layer.items() if v.get(selection) is not None}
    if not scored:
        return {"layer": None, **dict.fromkeys(scores)}
    layer = max(scored, key=lambda k: scored[k][selection])
    return {"layer": layer, **{s: scored[layer][s] for s in scores}}


def evaluate_tokens(train: Tokens, evaluate: Tokens, parts: tuple[str, ...], cfg: ProbeSettings, seed: int) -> dict:
    """Every read-out on every layer of already computed tokens (``train`` fits, ``evaluate`` is scored)."""
    side = sides(parts)
    out: dict[str, dict] = {"probe": {}, "knn": {}, "left_right": {}}
    for layer in train.features:
        out["probe"][layer] = seg_probe(train, evaluate, layer, cfg, seed)
        out["knn"][layer] = knn_transfer(train, evaluate, layer, cfg, seed)
        out["left_right"][layer] = left_right_probe(train, evaluate, layer, side, cfg, seed)
    return {
        **out,
        "probe_best": _best(out["probe"], "holdout_miou", "miou", "pixel_miou"),
        "knn_best": _best(out["knn"], "holdout_miou", "miou", "pixel_miou"),
        "left_right_best": _best(out["left_right"], "holdout_balanced_acc", "balanced_acc"),
    }


@dataclass
class FrozenEval:
    """What to evaluate: training prefixes of ``labels`` images each (all when empty), on one evaluation split."""

    settings: ProbeSettings = field(default_factory=ProbeSettings)
    labels: tuple[int, ...] = ()
    grayscale: bool = False
    seed: int = 0

    def run(self, features: FeatureFn, train: Split, evaluate: Split, parts: tuple[str, ...]) -> dict:
        counts = self.labels or (len(train.parts),)
        if max(counts) > len(train.parts):
            raise ValueError(f"{max(counts)} labelled images asked for, the training split holds {len(train.parts)}")
        started = time.perf_counter()
        gray = to_grayscale if self.grayscale else (lambda images: images)
        train = Split(gray(train.images[: max(counts)]), train.parts[: max(counts)])
        evaluate = Split(gray(evaluate.images), evaluate.parts)
        bs = self.settings.batch_size
        train_tokens = tokens_of(train, features, len(parts), bs)
        eval_tokens = tokens_of(evaluate, features, len(parts), bs)
        feature_s = time.perf_counter() - started
        results = {
            str(n): evaluate_tokens(train_tokens.take(np.arange(n)), eval_tokens, parts, self.settings, self.seed)
            for n in counts
        }
        grid = list(eval_tokens.fractions.shape[1:3])
        truth = F.one_hot(eval_tokens.majority, len(parts)).float()  # the true token labels, upsampled as the probes
        return {
            "config": {
                **asdict(self.settings),
                "labels": list(counts),
                "grayscale": self.grayscale,
                "seed": self.seed,
                "eval_images": len(evaluate.parts),
                "layers": list(train_tokens.features),
                "grid": grid,
                "image_size": list(evaluate.parts.shape[-2:]),
                "miou": "tokens: the argmax against each token's majority label",
                "pixel_miou": "pixels: token logits (k-NN: vote shares) bilinearly upsampled to the label maps",
                "selection": "weight decay and best layer by the score on held-out training images",
            },
            "results": results,
            "pixel_miou_ceiling": pixel_miou(truth, eval_tokens.parts, len(parts)),
            "timing": {"features_s": feature_s, "total_s": time.perf_counter() - started},
        }


class RunProbe:
    """The frozen probe on the EMA teacher during pretraining (``pretrain.config.PretrainProbe``; the evaluator of
    ``pretrain.train.fit``). The labelled splits are read once, at the worker's start. Every rank computes the
    features, since a sharded backbone's forward needs them all; the scoring rank fits and scores the probes and
    returns the ``best`` figures of ``jobs.probe``."""

    def __init__(self, settings: PretrainProbe, seed: int) -> None:
        assert settings.data is not None  # PretrainProbe requires it when on
        train_uri, val_uri = storage.join(settings.data, "train"), storage.join(settings.data, "val")
        self.train, info = read_split(train_uri, settings.labels)
        self.evaluate, val_info = read_split(val_uri, settings.eval_limit)
        if val_info != info:
            raise DataError(f"probe.data {storage.redact(settings.data)}: train/ and val/ labels differ")
        self.parts, self.seed = info.parts, seed
        self.settings = ProbeSettings(k=settings.k, iters=settings.iters)

    def __call__(self, backbone: Sapiens2Backbone, device: torch.device, score: bool) -> dict[str, float] | None:
        started = time.perf_counter()
        features, bs, classes = backbone_features(backbone, device), self.settings.batch_size, len(self.parts)
        train, evaluate = tokens_of(self.train, features, classes, bs), tokens_of(self.evaluate, features, classes, bs)
        if not score:
            return None
        out = evaluate_tokens(train, evaluate, self.parts, self.settings, self.seed)
        p, k, s = out["probe_best"], out["knn_best"], out["left_right_best"]
        scores = {"probe_miou": p["miou"], "knn_miou": k["miou"], "left_right_acc": s["balanced_acc"]}
        return {
            **{name: float(v) for name, v in scores.items() if v is not None},
            "labels": len(self.train.parts),
            "eval_images": len(self.evaluate.parts),
            "eval_s": time.perf_counter() - started,
        }
