"""Ultralytics YOLO detect and pose models, saved as safetensors plus their architecture, and loaded from official
``.pt`` files without running pickled code: only the layer classes YOLO11 / YOLOv8 models are made of may appear,
and only through stand-ins that cannot be called while unpickling (see ``_YOLO_LAYERS``)."""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from common.telemetry import disable_telemetry
from curation.models.weights import load_state_dict

if TYPE_CHECKING:
    from torch import nn
    from ultralytics.nn.tasks import DetectionModel


YOLO_FORMAT = "humans1b-ultralytics-yolo-v1"


def import_ultralytics() -> None:
    """Import ultralytics while keeping PIL's own ``Image.open`` (ultralytics replaces it on import with a version
    that tries to pip-install a HEIF plugin on unidentified bytes), offline (no start-up DNS probe) and with no
    analytics or settings file in the home folder (``common.telemetry``)."""
    from PIL import Image

    opener = Image.open
    disable_telemetry()
    try:
        importlib.import_module("ultralytics.nn.tasks")
    finally:
        Image.open = opener


def save_yolo(model: nn.Module, path: str | Path) -> None:
    """Write an ultralytics model as safetensors: its weights, plus its architecture (the model's yaml dict), class
    names and task in the file's metadata, so ``load_yolo`` rebuilds it without a pickle. Converting an official
    ``.pt`` once: ``save_yolo(YOLO("yolo11m-pose.pt").model, "yolo11m-pose.safetensors")`` on a trusted machine."""
    from safetensors.torch import save_file
    from ultralytics.nn.tasks import PoseModel

    # cast: ultralytics models keep {class id: name} here; nn.Module types unknown attributes as Tensor | Module
    names = {str(k): str(v) for k, v in cast(dict[int, str], model.names).items()}
    metadata = {
        "format": YOLO_FORMAT,
        "task": "pose" if isinstance(model, PoseModel) else "detect",
        "yaml": json.dumps(model.yaml),
        "names": json.dumps(names),
    }
    tensors = {
        k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.detach().contiguous().clone()
        for k, v in model.state_dict().items()
    }
    save_file(tensors, str(path), metadata=metadata)


# The classes ultralytics YOLO11 and YOLOv8 detect and pose checkpoints are made of (what
# torch.serialization.get_unsafe_globals_in_checkpoint lists for such models built from their yaml). Nothing else is
# allowed in a .pt: not AutoBackend (it loads the file it is given with full pickle), ultralytics.engine, the YOLO
# wrapper, nor layers that fetch weights (TorchVision). Each class is exposed to the unpickler only as a stand-in
# that cannot be called (``_uncallable``), so no constructor runs while loading.
_YOLO_LAYERS = frozenset(
    {
        "torch.nn.modules.activation.SiLU",
        "torch.nn.modules.batchnorm.BatchNorm2d",
        "torch.nn.modules.container.ModuleList",
        "torch.nn.modules.container.Sequential",
        "torch.nn.modules.conv.Conv2d",
        "torch.nn.modules.linear.Identity",
        "torch.nn.modules.pooling.MaxPool2d",
        "torch.nn.modules.upsampling.Upsample",
        "ultralytics.nn.modules.block.Attention",
        "ultralytics.nn.modules.block.Bottleneck",
        "ultralytics.nn.modules.block.C2PSA",
        "ultralytics.nn.modules.block.C2f",
        "ultralytics.nn.modules.block.C3k",
        "ultralytics.nn.modules.block.C3k2",
        "ultralytics.nn.modules.block.DFL",
        "ultralytics.nn.modules.block.PSABlock",
        "ultralytics.nn.modules.block.SPPF",
        "ultralytics.nn.modules.conv.Concat",
        "ultralytics.nn.modules.conv.Conv",
        "ultralytics.nn.modules.conv.DWConv",
        "ultralytics.nn.modules.head.Detect",
        "ultralytics.nn.modules.head.Pose",
        "ultralytics.nn.tasks.DetectionModel",
        "ultralytics.nn.tasks.PoseModel",
    }
)
_CONVERT_ONCE = (
    "Convert the checkpoint once, on a trusted machine, to safetensors (weights plus the architecture as data): "
    "curation.models.save_yolo(ultralytics.YOLO('model.pt').model, 'model.safetensors'), and point the config at that."
)


# Where the allowed layers' __setstate__ is defined; each of these was read: it only updates the instance's __dict__.
_AUDITED_SETSTATE = {
    "torch.nn.modules.module.Module",
    "torch.nn.modules.conv._ConvNd",
    "torch.nn.modules.upsampling.Upsample",
}


class _RefusedCall(ValueError):
    """A checkpoint asked the unpickler to run code that loading a YOLO model never needs."""


class _NotCallable(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _RefusedCall(
            f"the checkpoint calls {cls.__module__}.{cls.__qualname__}(...); layer constructors never "
            "run while loading (torch.save writes modules without calling them)"
        )


@functools.cache
def _uncallable(layer: type) -> type:
    """The stand-in registered with the weights-only unpickler under ``layer``'s name.

    The unpickler makes objects of an allowed class three ways. REDUCE calls ``cls(*args)`` with arguments taken from
    the file, running ``__init__``: ``DetectionModel({...})`` ``eval``s the activation string of the dict it is given
    and opens a yaml path, ``AutoBackend(path)`` unpickles another file. The stand-in refuses calls. NEWOBJ calls
    ``cls.__new__``: here a bare instance, no constructor. BUILD passes the saved attributes to ``__setstate__``,
    which for these classes is a dictionary update (``nn.Module``'s, after filling defaults for old files in
    Conv2d's and Upsample's). torch.save writes modules with NEWOBJ and BUILD alone, so genuine checkpoints load;
    ``_real_classes`` then gives every instance its own class back."""
    setstate_owner = next(k for k in layer.__mro__ if "__setstate__" in vars(k))
    if type(layer) is not type or f"{setstate_owner.__module__}.{setstate_owner.__name__}" not in _AUDITED_SETSTATE:
        raise TypeError(f"{layer} restores its state with unaudited code ({vars(setstate_owner)['__setstate__']})")

    def new(stand_in: type, *args: Any) -> Any:
        if args:
            raise _RefusedCall(f"the checkpoint passes arguments to {layer.__qualname__}.__new__")
        return object.__new__(stand_in)

    return _NotCallable(
        layer.__name__, (layer,), {"__new__": new, "__module__": layer.__module__, "__qualname__": layer.__qualname__}
    )


def _layer_forward(stand_in: Any, name: str) -> Any:
    """``builtins.getattr`` for checkpoints of older ultralytics, whose pose head keeps ``Detect.forward`` (pickled
    as ``getattr(Detect, "forward")``); it answers that lookup only."""
    if isinstance(stand_in, _NotCallable) and name == "forward":
        return getattr(stand_in, name)  # the layer's forward, inherited by its stand-in class
    raise _RefusedCall(f"the checkpoint looks up {name!r} on {stand_in!r}; only a layer's forward is served")


def _yolo_globals() -> dict[str, Any]:
    """Every global a YOLO .pt may name, mapped to what the unpickler gets for it. Besides the layers: training
    arguments (namespaces, paths, as inert pure paths) and numpy scalars in the training metrics."""
    import pathlib
    import types

    import numpy as np
    from ultralytics.utils import IterableSimpleNamespace

    scalar, reconstruct = np.float64(0).__reduce__()[0], np.zeros(0).__reduce__()[0]
    allowed: dict[str, Any] = {
        "ultralytics.utils.IterableSimpleNamespace": IterableSimpleNamespace,
        "types.SimpleNamespace": types.SimpleNamespace,
        "builtins.getattr": _layer_forward,
        "numpy.dtype": np.dtype,
        "numpy.ndarray": np.ndarray,
    }
    for core in ("numpy.core", "numpy._core"):
        allowed |= {f"{core}.multiarray.scalar": scalar, f"{core}.multiarray._reconstruct": reconstruct}
    for module in ("pathlib", "pathlib._local"):
        allowed |= {f"{module}.PosixPath": pathlib.PurePosixPath, f"{module}.WindowsPath": pathlib.PureWindowsPath}
    for name in _YOLO_LAYERS:
        module, _, attr = name.rpartition(".")
        allowed[name] = _uncallable(getattr(importlib.import_module(module), attr))
    return allowed


def _real_classes(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(type(m), _NotCallable):
            m.__class__ = type(m).__bases__[0]


def _load_ultralytics_pt(path: Path) -> DetectionModel:
    import numpy as np
    import torch
    from ultralytics.nn.tasks import DetectionModel

    needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    allowed = _yolo_globals()
    refused = sorted(set(needed) - set(allowed))
    if refused:
        raise ValueError(
            f"{path}: refusing to load: the checkpoint names globals outside the allow-list of YOLO11 / "
            f"YOLOv8 detect and pose layers: {refused}. {_CONVERT_ONCE}"
        )
    # A real layer class registered process-wide (torch.serialization.add_safe_globals) would be callable by REDUCE.
    registered = {e[0] if isinstance(e, tuple) else e for e in torch.serialization.get_safe_globals()}
    exposed = sorted(n for n in needed if n in _YOLO_LAYERS and allowed[n].__bases__[0] in registered)
    if exposed:
        raise RuntimeError(
            f"{path}: not loaded: {exposed} are registered with torch.serialization.add_safe_globals in "
            "this process, which would let a checkpoint call their constructors"
        )
    entries: list[Any] = [(allowed[n], n) for n in needed]
    if "numpy.dtype" in needed:  # a dtype's state is restored on its numpy.dtypes class, which the file never names
        entries += [type(np.dtype(code)) for code in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]]
    try:
        with torch.serialization.safe_globals(entries):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except _RefusedCall as exc:
        raise ValueError(f"{path}: refusing to load: {exc}. {_CONVERT_ONCE}") from None
    model = None
    if isinstance(ckpt, dict):
        model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if not isinstance(model, DetectionModel):
        raise ValueError(f"{path} is not an ultralytics detect or pose checkpoint (its model entry is {type(model)})")
    _real_classes(model)
    return model.float()


def _check_yolo_architecture(cfg: Any, path: Path) -> None:
    """Refuse an architecture dict that ultralytics' parse_model would turn into code: it ``eval``s the activation
    string and resolves layer names in a namespace that also holds its file loaders. Allowed: the YOLO layers above
    and an argument-free ``nn.<Activation>()``."""
    layer_names = {
        name.rpartition(".")[2] if name.startswith("ultralytics.") else "nn." + name.rpartition(".")[2]
        for name in _YOLO_LAYERS
    }
    act = cfg.get("activation") if isinstance(cfg, dict) else None
    layers = (cfg.get("backbone") or []) + (cfg.get("head") or []) if isinstance(cfg, dict) else []
    names = {str(layer[2]) if isinstance(layer, list) and len(layer) == 4 else repr(layer) for layer in layers}
    bad = sorted(names - layer_names)
    if act is not None and not (isinstance(act, str) and re.fullmatch(r"(torch\.)?nn\.[A-Za-z]\w*\(\)", act)):
        bad.append(f"activation {act!r}")
    if not layers or bad:
        raise ValueError(
            f"{path}: refusing to build the architecture in its metadata: {bad or 'no layers'} outside "
            f"the YOLO11 / YOLOv8 detect and pose layers {sorted(layer_names)}"
        )


def load_yolo(path: Path) -> nn.Module:
    """An ultralytics DetectionModel or PoseModel from a ``save_yolo`` safetensors file or an ultralytics ``.pt``,
    in eval mode on CPU with float32 weights."""
    import_ultralytics()
    from ultralytics.nn.tasks import DetectionModel, PoseModel

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != YOLO_FORMAT:
            raise ValueError(
                f"{path} has no ultralytics architecture in its metadata (format {meta.get('format')!r}); "
                "write YOLO safetensors with curation.models.save_yolo"
            )
        cfg = json.loads(meta["yaml"])
        _check_yolo_architecture(cfg, path)
        cls = PoseModel if meta["task"] == "pose" else DetectionModel
        model = cls(cfg, nc=cfg.get("nc"), verbose=False)
        model.load_state_dict(load_state_dict(path), strict=True)
        model.names = {int(k): v for k, v in json.loads(meta["names"]).items()}
    elif path.suffix == ".pt":
        model = _load_ultralytics_pt(path)
    else:
        raise ValueError(f"{path}: expected an ultralytics .pt or a .safetensors written by save_yolo")
    return model.eval()


# -- OpenCLIP and the aesthetic head -----------------------------------------------------------------------------------
