"""A model store of randomly initialised full-profile models, laid out as a cluster's store holds the real ones.

Offline machines cannot fetch YOLO or OpenCLIP weights, yet the full profile's loading, batching and wiring must
run there: tests and the CPU benchmark build the same architectures with random weights, save them in the
formats the real files use (safetensors for YOLO and OpenCLIP, a torch state dict for LAION's aesthetic head, the
keys of LAION's CLIP NSFW head) and
load them back through ``curation.models``. Their scores mean nothing; their cost and shapes are real, and so is
how many candidate boxes their detectors hand to NMS (``calibrate_detector``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from curation import models
from curation.models.settings import YoloModelSettings

# A tiny OpenCLIP architecture in open_clip's own config format (what open_clip_config.json holds on the hub).
TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
OPENAI_NORM = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}


def build_random_store(
    out: Path,
    yolo: str = "yolo11n",
    clip_arch: str = "ViT-S-32",
    clip_cfg: dict | None = None,
    seed: int = 0,
    imgsz: int = YoloModelSettings().imgsz,
) -> list[str]:
    """Save a YOLO detector and pose model (``yolo``: an ultralytics model name such as yolo11n or yolo11m,
    calibrated for ``imgsz``-pixel inputs), an OpenCLIP model (``clip_arch``, with ``clip_cfg`` overriding its
    architecture; ``TINY_CLIP`` by default), an aesthetic MLP head and an NSFW head under ``out``; returns the config
    overrides that point the full profile at them."""
    import open_clip
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    models.import_ultralytics()  # keeps PIL's Image.open
    from ultralytics.nn.tasks import DetectionModel, PoseModel

    torch.manual_seed(seed)
    det = DetectionModel(f"{yolo}.yaml", nc=80, verbose=False)
    det.names = {0: "person", **{i: f"class{i}" for i in range(1, 80)}}  # COCO's layout: person is class 0
    pose = PoseModel(f"{yolo}-pose.yaml", nc=1, verbose=False)  # 17 COCO keypoints, one class as in yolo11*-pose
    pose.names = {0: "person"}
    photos = calibration_batch(imgsz)
    for model in (det, pose):
        calibrate_detector(model, photos, person_class=0)
    models.save_yolo(det, out / "yolo-det.safetensors")
    models.save_yolo(pose, out / "yolo-pose.safetensors")

    clip_cfg = TINY_CLIP if clip_cfg is None else clip_cfg
    clip = open_clip.create_model(clip_arch, pretrained=None, **clip_cfg)
    dim = int(clip.visual.output_dim)
    folder = out / "clip"
    folder.mkdir(exist_ok=True)
    model_cfg = clip_cfg or open_clip.get_model_config(clip_arch)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": OPENAI_NORM}))
    save_file({k: v.contiguous() for k, v in clip.state_dict().items()}, str(folder / "open_clip_model.safetensors"))

    # LAION's improved predictor layout (Linear/Dropout Sequential saved as layers.N.*), as a torch state dict
    sizes = [(dim, 64), (64, 16), (16, 8), (8, 1)]
    mlp = {}
    for index, (i, o) in zip((0, 2, 4, 5), sizes):
        mlp[f"layers.{index}.weight"] = torch.randn(o, i) * 0.3
        mlp[f"layers.{index}.bias"] = torch.full((o,), 5.0 if o == 1 else 0.0)
    torch.save(mlp, out / "aesthetic-mlp.pth")
    save_file(random_nsfw_head(dim, final_bias=-8.0), str(out / "nsfw-head.safetensors"))
    return store_overrides(out, dim)


def random_nsfw_head(dim: int, final_bias: float = 0.0) -> dict[str, torch.Tensor]:
    """A state dict in the layout of LAION's CLIP NSFW head (curation.models.NSFW_HEAD_KEYS) on ``dim``-dimensional
    embeddings; ``final_bias`` shifts the logit (-8 keeps every probability far below a 0.5 threshold)."""
    sizes = [(dim, 64), (64, 512), (512, 256), (256, 1)]
    # about the spread of a unit-norm embedding's coordinates, so the normalised inputs are of order one
    sd = {"norm.mean": torch.randn(dim) / dim, "norm.variance": (torch.rand(dim) + 0.5) / dim}
    for i, (n_in, n_out) in enumerate(sizes, 1):
        sd[f"linear_{i}.weight"] = torch.randn(n_out, n_in) / math.sqrt(n_in)
        sd[f"linear_{i}.bias"] = torch.full((n_out,), final_bias) if n_out == 1 else torch.randn(n_out) * 0.1
    return sd


# How many boxes a random detector scores above the stage's confidence threshold on the median calibration photo:
# a trained YOLO11 passes a few to tens on a photo of people.
CANDIDATES_PER_PHOTO = 20


def calibration_batch(imgsz: int) -> torch.Tensor:
    """The package photos letterboxed to the stage's input size, as the stage feeds its models (N, 3, imgsz, imgsz)."""
    from ultralytics.data.augment import LetterBox

    from common.imageio import decode
    from generators.sample_pool import load_photos

    letterbox = LetterBox((imgsz, imgsz), auto=False, stride=32)
    # cast: LetterBox returns the image alone when given no labels (its annotation is for both uses)
    images = [cast(np.ndarray, letterbox(image=decode(p.data, max_side=imgsz))) for p in load_photos().values()]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div_(255)


def calibrate_detector(
    model: Any,
    photos: torch.Tensor,
    person_class: int,
    candidates: int = CANDIDATES_PER_PHOTO,
    threshold: float = YoloModelSettings().min_candidate_score,
) -> None:
    """Give a random-init ultralytics detect or pose model batch-norm statistics measured on ``photos`` and the
    person-class bias at which the median photo has ``candidates`` anchors scoring above ``threshold``.

    As built, the features fade to nothing through the layers (default init, batch norms at mean 0 and variance 1),
    so the head scores every anchor of a level alike, at ultralytics' class prior (``Detect.bias_init``): no box
    reaches the stage's threshold, or with the prior raised all 8400 do and NMS runs on thousands. With batch-norm
    statistics taken from photos, as training leaves them, the features keep unit scale and vary with the image;
    the person bias is then set as ``bias_init`` sets a prior, from an expected count, but over the person logits
    measured on the photos rather than assumed. Their spread follows each photo's texture, so counts range from none
    on flat images (a page of text) to hundreds on busy ones. The other classes keep ultralytics' prior, far below
    any threshold: the stage keeps persons only."""
    head = model.model[-1]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: this one batch's statistics
    person_bias = [branch[-1].bias for branch in head.cv3]
    with torch.no_grad():
        for bias in person_bias:
            bias[person_class] = 0.0
        model.train()
        out = model(photos)  # in training mode the head returns raw logits, and batch norms record their statistics
        model.eval()
        logits = (out["one2many"] if "one2many" in out else out)["scores"][:, person_class].float()
        kth = logits.topk(min(candidates, logits.shape[1]), dim=1).values[
            :, -1
        ]  # per photo, the logit its candidates-th best anchor has
        for bias in person_bias:
            bias[person_class] = math.log(threshold / (1 - threshold)) - float(kth.median())
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def store_overrides(out: Path, embedding_dim: int) -> list[str]:
    """Config overrides that point the full profile at a store written by ``build_random_store``."""
    return [
        f"models.yolo.detector={out / 'yolo-det.safetensors'}",
        f"models.yolo.pose={out / 'yolo-pose.safetensors'}",
        f"models.clip.checkpoint={out / 'clip'}",
        f"models.clip.aesthetic_head={out / 'aesthetic-mlp.pth'}",
        f"models.clip.nsfw_head={out / 'nsfw-head.safetensors'}",
        f"models.embedding.dim={embedding_dim}",
        f"models.store.cache_dir={out / 'cache'}",
    ]
