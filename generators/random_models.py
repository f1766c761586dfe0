"""A model store of randomly initialised full-profile models, laid out as a cluster's store holds the real ones.

Offline machines cannot fetch YOLO or OpenCLIP weights, yet the full profile's loading, batching and wiring must
run there: tests and the CPU benchmark build the same architectures with random weights, save them in the
formats the real files use (safetensors for YOLO and OpenCLIP, a torch state dict for LAION's aesthetic head) and
load them back through ``curation.models``. Their scores mean nothing; their cost and shapes are real.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from curation import models

# A tiny OpenCLIP architecture in open_clip's own config format (what open_clip_config.json holds on the hub).
TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "patch_size": 16, "head_width": 32, "mlp_ratio": 2.0},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
OPENAI_NORM = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}


def build_random_store(
    out: Path, yolo: str = "yolo11n", clip_arch: str = "ViT-S-32", clip_cfg: dict | None = None, seed: int = 0
) -> list[str]:
    """Save a YOLO detector and pose model (``yolo``: an ultralytics model name such as yolo11n or yolo11m), an
    OpenCLIP model (``clip_arch``, with ``clip_cfg`` overriding its architecture; ``TINY_CLIP`` by default) and an
    aesthetic MLP head under ``out``; returns the config overrides that point the full profile at them."""
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
    return store_overrides(out, dim)


def store_overrides(out: Path, embedding_dim: int) -> list[str]:
    """Config overrides that point the full profile at a store written by ``build_random_store``."""
    return [
        f"models.yolo.detector={out / 'yolo-det.safetensors'}",
        f"models.yolo.pose={out / 'yolo-pose.safetensors'}",
        f"models.clip.checkpoint={out / 'clip'}",
        f"models.clip.aesthetic_head={out / 'aesthetic-mlp.pth'}",
        f"models.embedding.dim={embedding_dim}",
        f"models.store.cache_dir={out / 'cache'}",
    ]
