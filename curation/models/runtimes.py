"""The runtimes the lite profile's CPU networks run on, and which one a node uses.

The same network file runs on OpenVINO and on the runtime it ships for (OpenCV's dnn module for the person graph,
onnxruntime for the text detector), with the same maps to ~2e-5 in fp32. Which is faster depends on the CPU: on
one 2-vCPU host OpenVINO ran the text detector 2.9x faster than onnxruntime, on another onnxruntime was 1.12x
faster (benchmarks/RESULTS.md). So ``auto`` times every runtime that imports on the network's own input size when
the actor starts and keeps the fastest; naming a runtime skips the timing.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Network = Callable[[np.ndarray], np.ndarray]

# Timed calls per runtime after one warm-up call, alternating between runtimes; the best of them counts, so a
# neighbour's burst of load during one call does not decide.
TIMED_CALLS = 3


def choose_runtime(
    setting: str, key: str, builders: dict[str, Callable[[], Network]], sample: np.ndarray
) -> tuple[str, Network]:
    """The runtime ``setting`` names and its network, built; for ``auto`` the fastest of ``builders`` on ``sample``.

    ``builders`` maps each runtime to a function that builds the network on it; a runtime whose module does not import
    (``openvino``) is left out with a log line naming ``key``."""
    if setting != "auto":
        return setting, builders[setting]()
    available = {name: build for name, build in builders.items() if _imports(name)}
    for name in builders.keys() - available.keys():
        log.warning(
            f"{key}=auto: {name} does not import here, so it is not among the runtimes tried ({_install(name)})"
        )
    networks = {name: build() for name, build in available.items()}
    if len(networks) == 1:
        return next(iter(networks.items()))
    best = dict.fromkeys(networks, float("inf"))
    for network in networks.values():
        network(sample)  # the first call plans and allocates
    for _ in range(TIMED_CALLS):
        for name, network in networks.items():
            start = time.perf_counter()
            network(sample)
            best[name] = min(best[name], time.perf_counter() - start)
    chosen = min(best, key=lambda name: best[name])
    timings = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in sorted(best.items(), key=lambda x: x[1]))
    log.info(f"{key}=auto: {chosen}, the fastest here on a {'x'.join(map(str, sample.shape))} input ({timings})")
    return chosen, networks[chosen]


_PACKAGES = {"opencv": ("cv2", "opencv-python-headless")}  # runtime -> (module, package) where the names differ


def _imports(runtime: str) -> bool:
    return importlib.util.find_spec(_PACKAGES.get(runtime, (runtime,))[0]) is not None


def _install(runtime: str) -> str:
    return f"pip install {_PACKAGES.get(runtime, (runtime, runtime))[1]}"


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
