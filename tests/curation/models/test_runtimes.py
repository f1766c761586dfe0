"""Which runtime a lite network runs on: ``auto`` times the runtimes that import, keeps the fastest and records the
choice in the node's model cache."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from curation.models.runtimes import CHOICES_FILE, TIMED_CALLS, Network, choose_runtime

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


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "net.onnx"
    path.write_bytes(b"weights")
    return path


def _slow_openvino(calls: list[str]) -> dict[str, Callable[[], Network]]:
    return {"openvino": _network(0.03, calls, "openvino"), "onnxruntime": _network(0.0, calls, "onnxruntime")}


def test_auto_keeps_the_fastest_and_says_what_it_measured(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    with caplog.at_level("INFO", logger="curation.models.runtimes"):
        name, network = choose_runtime("auto", "models.ocr.runtime", _slow_openvino(calls), SAMPLE, model, 1)
    assert name == "onnxruntime"
    assert np.array_equal(network(SAMPLE), SAMPLE + 1) and calls[-1] == "onnxruntime"
    # One warm-up call each, then the timed calls alternate between the runtimes.
    assert calls.count("openvino") == calls.count("onnxruntime") - 1 == 1 + TIMED_CALLS
    assert calls[2:6] == ["openvino", "onnxruntime", "openvino", "onnxruntime"]
    expected = "models.ocr.runtime=auto: onnxruntime, the fastest here on a 1x3x64x64 input (onnxruntime 0 ms, openvino"
    assert expected in caplog.text


def test_the_choice_is_kept_per_node_and_timed_again_when_what_decides_it_changes(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first: list[str] = []
    choose_runtime("auto", "models.ocr.runtime", _slow_openvino(first), SAMPLE, model, 1, cache)
    (choice,) = json.loads((cache / CHOICES_FILE).read_text()).values()
    assert choice["runtime"] == "onnxruntime" and choice["ms"]["openvino"] >= 30 and choice["cpu"]

    # Another actor on the node: the chosen runtime is built alone, nothing is timed.
    again: list[str] = []
    with caplog.at_level("INFO", logger="curation.models.runtimes"):
        name, _ = choose_runtime("auto", "models.ocr.runtime", _slow_openvino(again), SAMPLE, model, 1, cache)
    assert name == "onnxruntime" and again == ["build onnxruntime"]
    assert "models.ocr.runtime=auto: onnxruntime, as timed on this node before" in caplog.text

    # Another thread count, input size or network file decides anew.
    for args in [(SAMPLE, model, 2), (np.zeros((1, 3, 32, 32), np.float32), model, 1)]:
        calls: list[str] = []
        choose_runtime("auto", "models.ocr.runtime", _slow_openvino(calls), *args, cache)
        assert calls.count("openvino") == 1 + TIMED_CALLS
    model.write_bytes(b"other weights")
    calls = []
    choose_runtime("auto", "models.ocr.runtime", _slow_openvino(calls), SAMPLE, model, 1, cache)
    assert calls.count("openvino") == 1 + TIMED_CALLS
    assert len(json.loads((cache / CHOICES_FILE).read_text())) == 4


def test_actors_that_start_at_once_take_turns_and_agree(model: Path, tmp_path: Path) -> None:
    """Four actors whose own timings would each pick another runtime (every second one finds OpenVINO faster): the
    first to take the node's lock times, the others read its choice, so one node scores with one runtime (the two
    agree to ~2e-5, not to the bit)."""
    cache, start = tmp_path / "cache", threading.Barrier(4)
    calls: list[list[str]] = [[] for _ in range(4)]
    chosen: list[str] = [""] * 4

    def actor(i: int) -> None:
        fast, slow = ("openvino", "onnxruntime") if i % 2 else ("onnxruntime", "openvino")
        builders = {fast: _network(0.0, calls[i], fast), slow: _network(0.02, calls[i], slow)}
        start.wait()
        chosen[i] = choose_runtime("auto", "models.ocr.runtime", builders, SAMPLE, model, 1, cache)[0]

    threads = [threading.Thread(target=actor, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timed = [i for i in range(4) if len(calls[i]) > 1]
    assert len(timed) == 1 and len(set(chosen)) == 1  # one actor timed; every actor runs its choice
    assert all(calls[i] == [f"build {chosen[0]}"] for i in range(4) if i not in timed)
    (kept,) = json.loads((cache / CHOICES_FILE).read_text()).values()
    assert kept["runtime"] == chosen[0]


def test_a_cache_that_cannot_hold_the_lock_still_chooses(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" / "cache"  # no folder can be made here, so neither the lock nor the record
    calls: list[str] = []
    with caplog.at_level("WARNING", logger="curation.models.runtimes"):
        name, _ = choose_runtime("auto", "models.ocr.runtime", _slow_openvino(calls), SAMPLE, model, 1, cache)
    assert name == "onnxruntime" and calls.count("openvino") == 1 + TIMED_CALLS
    assert "no lock on the node's runtime choices" in caplog.text and "could not keep the runtime choice" in caplog.text


def test_a_torn_record_is_timed_again_and_rewritten(model: Path, tmp_path: Path) -> None:
    (tmp_path / CHOICES_FILE).write_text('{"abc": ')
    calls: list[str] = []
    name, _ = choose_runtime("auto", "models.ocr.runtime", _slow_openvino(calls), SAMPLE, model, 1, tmp_path)
    assert name == "onnxruntime" and calls.count("openvino") == 1 + TIMED_CALLS
    assert [c["runtime"] for c in json.loads((tmp_path / CHOICES_FILE).read_text()).values()] == ["onnxruntime"]


def test_a_named_runtime_is_built_alone_and_not_timed(model: Path) -> None:
    calls: list[str] = []
    builders = {"openvino": _network(0.0, calls, "openvino"), "opencv": _network(0.0, calls, "opencv")}
    name, _ = choose_runtime("opencv", "models.person.runtime", builders, SAMPLE, model, 1)
    assert name == "opencv" and calls == ["build opencv"]


def test_auto_leaves_out_a_runtime_that_does_not_import(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real_find_spec(name, *a)
    )
    calls: list[str] = []
    builders = {"openvino": _network(0.0, calls, "openvino"), "opencv": _network(0.0, calls, "opencv")}
    with caplog.at_level("WARNING", logger="curation.models.runtimes"):
        name, _ = choose_runtime("auto", "models.person.runtime", builders, SAMPLE, model, 1)
    # The one runtime left is used as it is: nothing to time.
    assert name == "opencv" and calls == ["build opencv"]
    assert "models.person.runtime=auto: openvino does not import here" in caplog.text
    assert "(pip install openvino)" in caplog.text
