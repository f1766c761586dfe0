"""OpenVINO for the lite profile's CPU networks: where it imports it runs them at 2-3x the speed of OpenCV's dnn module
or onnxruntime on the same files (benchmarks/RESULTS.md), in fp32 and with the actor's thread share."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def resolve_runtime(setting: str, key: str, fallback: str, slower: str) -> str:
    """``auto`` -> ``openvino`` where it imports, else ``fallback`` with a log line naming ``key`` and the cost."""
    if setting != "auto":
        return setting
    if importlib.util.find_spec("openvino") is not None:
        return "openvino"
    log.warning(
        f"{key}=auto: openvino does not import here, so this network runs on {fallback} ({slower}; pip install openvino)"
    )
    return fallback


class OpenVinoNetwork:
    """One compiled model and its infer request: an array in, the first output out (a copy: the request reuses it).

    fp32 is asked for explicitly: on CPUs with bf16 or AMX OpenVINO would otherwise infer in bf16 and move the
    networks' peaks and boxes. Input shapes may change from call to call (models read with dynamic dimensions)."""

    def __init__(self, model: Path, threads: int):
        import openvino as ov

        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": "f32",
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
        }
        core = ov.Core()
        self._request = core.compile_model(core.read_model(str(model)), "CPU", config).create_infer_request()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self._request.infer({0: x})
        return self._request.get_output_tensor(0).data.copy()
