"""OpenCLIP image-text models from the model store, and LAION's heads on their embeddings: the aesthetic predictor
and the CLIP-based NSFW detector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from curation.models.settings import ClipModelSettings
    from curation.models.store import ModelStore


# Files of an open_clip hub folder; safetensors preferred (no pickle even under weights_only).
_CLIP_HUB_FILES = ("open_clip_config.json", "open_clip_model.safetensors")


@dataclass
class LoadedClip:
    model: Any  # open_clip CLIP
    tokenizer: Any
    preprocess: dict[str, Any]  # open_clip's preprocess config: size, mode, mean, std, interpolation, resize_mode
    source: str  # what was loaded, for messages


def load_clip(store: ModelStore, s: ClipModelSettings, device: str, dtype: torch.dtype) -> LoadedClip:
    import open_clip
    import torch

    path = store.fetch(s.checkpoint, "models.clip.checkpoint", hub_files=_CLIP_HUB_FILES)
    precision = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    if path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise ValueError(f"models.clip.checkpoint: folder {path} holds no open_clip_config.json")
        name = f"local-dir:{path}"
        model = open_clip.create_model(
            name, precision=precision, device=device, weights_only=True, require_pretrained=True
        )
    else:
        name = s.arch
        if open_clip.get_model_config(name) is None:
            raise ValueError(f"models.clip.arch {name!r} is not an open_clip model config; see open_clip.list_models()")
        model = open_clip.create_model(
            name, pretrained=str(path), precision=precision, device=device, weights_only=True, require_pretrained=True
        )
    model.eval()
    return LoadedClip(model, open_clip.get_tokenizer(name), open_clip.get_model_preprocess_cfg(model), str(path))


def _Mlp(layers: list[nn.Module]) -> nn.Module:
    """A module whose state-dict keys are ``layers.N.*``, like LAION's ``MLP`` class."""
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    return Mlp()


def aesthetic_head_from_state_dict(sd: dict[str, torch.Tensor]) -> nn.Module:
    """LAION's aesthetic predictors: the improved one (an MLP saved as ``layers.N.*`` of an ``nn.Sequential`` of
    Linear layers with Dropout between and no activations) or the first linear one (``weight``, ``bias``)."""
    from torch import nn

    if set(sd) == {"weight", "bias"}:
        head: nn.Module = nn.Linear(sd["weight"].shape[1], sd["weight"].shape[0])
    elif sd and all(k.startswith("layers.") for k in sd):
        linear_at = sorted({int(k.split(".")[1]) for k in sd})
        # Dropout slots hold no weights; Identity keeps the indices (and so the state-dict keys) of the original.
        layers: list[nn.Module] = [nn.Identity() for _ in range(linear_at[-1] + 1)]
        for i in linear_at:
            w = sd[f"layers.{i}.weight"]
            layers[i] = nn.Linear(w.shape[1], w.shape[0])
        head = _Mlp(layers)
    else:
        raise ValueError(
            f"unknown aesthetic head layout (keys {sorted(sd)[:6]}...): expected LAION's MLP (layers.N.weight/bias) "
            "or a linear head (weight, bias)"
        )
    head.load_state_dict(sd, strict=True)
    out = next(m for m in reversed(list(head.modules())) if isinstance(m, nn.Linear)).out_features
    if out != 1:
        raise ValueError(f"aesthetic head outputs {out} values; expected one score")
    return head.eval()


# LAION's CLIP-based NSFW detector for ViT-L/14 (github.com/LAION-AI/CLIP-based-NSFW-Detector, MIT), in the layout of
# its PyTorch port (clip_autokeras_binary_nsfw.pth, which NeMo Curator loads): the Keras model's Normalization layer
# as buffers, then four Linear layers.
NSFW_HEAD_KEYS = (
    "norm.mean",
    "norm.variance",
    *(f"linear_{i}.{p}" for i in range(1, 5) for p in ("weight", "bias")),
)


def nsfw_head_from_state_dict(sd: dict[str, torch.Tensor]) -> nn.Module:
    """LAION's NSFW head: (x - mean) / sqrt(variance), then Linear+ReLU x3 and Linear+Sigmoid: P(NSFW) of an
    L2-normalised CLIP image embedding. Layer sizes come from the weights (768 -> 64 -> 512 -> 256 -> 1 for L/14)."""
    import torch
    from torch import nn

    if set(sd) != set(NSFW_HEAD_KEYS):
        raise ValueError(
            f"unknown NSFW head layout (keys {sorted(sd)[:6]}...): expected LAION's CLIP NSFW head "
            f"({', '.join(NSFW_HEAD_KEYS)})"
        )

    def linear(i: int) -> nn.Linear:
        out_features, in_features = sd[f"linear_{i}.weight"].shape
        return nn.Linear(in_features, out_features)

    class Normalization(nn.Module):
        mean: torch.Tensor
        variance: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros_like(sd["norm.mean"]))
            self.register_buffer("variance", torch.ones_like(sd["norm.variance"]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - self.mean) / self.variance.sqrt()  # as NeMo Curator's port: no epsilon

    class NsfwHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Normalization()
            self.linear_1, self.linear_2, self.linear_3, self.linear_4 = (linear(i) for i in range(1, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.norm(x)
            for layer in (self.linear_1, self.linear_2, self.linear_3):
                x = torch.relu(layer(x))
            return torch.sigmoid(self.linear_4(x))

    head = NsfwHead()
    head.load_state_dict(sd, strict=True)
    if head.linear_4.out_features != 1:
        raise ValueError(f"NSFW head outputs {head.linear_4.out_features} values; expected one probability")
    return head.eval()


def head_input_dim(head: nn.Module) -> int:
    from torch import nn

    return next(m for m in head.modules() if isinstance(m, nn.Linear)).in_features
