"""Loading plain weights safely: safetensors, or ``torch.load(weights_only=True)`` of a checkpoint of tensors only;
and the device and dtype a model runs in."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from curation.models.settings import Precision


log = logging.getLogger(__name__)


def device_and_dtype(precision: Precision) -> tuple[str, torch.dtype]:
    """CUDA when this process sees a GPU (Ray sets CUDA_VISIBLE_DEVICES for actors given num_gpus), else CPU.
    fp16 on CPU falls back to fp32: CPU kernels for half convolutions are missing or slow."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    wanted = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if precision == "auto":
        return device, torch.float16 if device == "cuda" else torch.float32
    dtype = wanted[precision]
    if device == "cpu" and dtype == torch.float16:
        log.warning("precision fp16 asked for but no GPU is visible: running fp32 on CPU")
        dtype = torch.float32
    return device, dtype


# -- state dicts ---------------------------------------------------------------------------------------------------


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or of a torch checkpoint holding only tensors (``weights_only``)."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return obj
