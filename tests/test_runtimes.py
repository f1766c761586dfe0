"""Which runtime a lite network runs on: ``auto`` times the runtimes that import and keeps the fastest."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import numpy as np
import pytest

from curation.models.runtimes import TIMED_CALLS, Network, choose_runtime

SAMPLE = np.zeros((1, 3, 64, 64), np.float32)


def _network(seconds: float, calls: list[str], name: str) -> Callable[[], Network]:
    def build() -> Network:
        calls.append(f"build {name}")

        def forward(x: np.ndarray) -> np.ndarray:
            calls.append(name)
            time.sleep(seconds)
            return x + 1

        return forward

    return build


def test_auto_keeps_the_fastest_and_says_what_it_measured(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    builders = {"openvino": _network(0.03, calls, "openvino"), "onnxruntime": _network(0.0, calls, "onnxruntime")}
    with caplog.at_level("INFO", logger="curation.models.runtimes"):
        name, network = choose_runtime("auto", "models.ocr.runtime", builders, SAMPLE)
    assert name == "onnxruntime"
    assert np.array_equal(network(SAMPLE), SAMPLE + 1) and calls[-1] == "onnxruntime"
    # One warm-up call each, then the timed calls alternate between the runtimes.
    assert calls.count("openvino") == calls.count("onnxruntime") - 1 == 1 + TIMED_CALLS
    assert calls[2:6] == ["openvino", "onnxruntime", "openvino", "onnxruntime"]
    assert (
        "models.ocr.runtime=auto: onnxruntime, the fastest here on a 1x3x64x64 input (onnxruntime 0 ms, openvino"
        in (caplog.text)
    )


def test_a_named_runtime_is_built_alone_and_not_timed() -> None:
    calls: list[str] = []
    builders = {"openvino": _network(0.0, calls, "openvino"), "opencv": _network(0.0, calls, "opencv")}
    name, _ = choose_runtime("opencv", "models.person.runtime", builders, SAMPLE)
    assert name == "opencv" and calls == ["build opencv"]


def test_auto_leaves_out_a_runtime_that_does_not_import(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real_find_spec(name, *a)
    )
    calls: list[str] = []
    builders = {"openvino": _network(0.0, calls, "openvino"), "opencv": _network(0.0, calls, "opencv")}
    with caplog.at_level("WARNING", logger="curation.models.runtimes"):
        name, _ = choose_runtime("auto", "models.person.runtime", builders, SAMPLE)
    # The one runtime left is used as it is: nothing to time.
    assert name == "opencv" and calls == ["build opencv"]
    assert "models.person.runtime=auto: openvino does not import here" in caplog.text
