"""The runtimes the lite profile's CPU networks run on, and which one a node uses.

The same network file runs on OpenVINO and on the runtime it ships for (OpenCV's dnn module for the person graph,
onnxruntime for the text detector), with the same maps to ~2e-5 in fp32. Which is faster depends on the CPU: on
one 2-vCPU host OpenVINO ran the text detector 2.9x faster than onnxruntime, on another onnxruntime was 1.12x
faster (benchmarks/RESULTS.md). So ``auto`` times every runtime that imports on the network's own input size and
keeps the fastest; naming a runtime skips the timing.

Timing costs a few seconds (every runtime built, four calls each), so the choice is kept in ``runtimes.json`` in the
node's model cache, keyed by what decides it: the network file, the input size, the thread count, the CPU model and
the runtimes' versions. Later actors on the node, and later runs, build only the chosen runtime; a node of another
CPU type, or an upgraded runtime, times again. Actors that start at once take turns (a lock beside the record): the
first times and keeps its choice, the others read it. Otherwise each could choose by its own timing, and the runtimes
agree to ~2e-5, not to the bit: shards scored on one node would then differ in their float bytes from a rescored
copy, and a resumed run would not reproduce an uninterrupted one byte for byte.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Network = Callable[[np.ndarray], np.ndarray]

# Timed calls per runtime after one warm-up call, alternating between runtimes; the best of them counts, so a
# neighbour's burst of load during one call does not decide.
TIMED_CALLS = 3
CHOICES_FILE = "runtimes.json"
_PACKAGES = {"opencv": ("cv2", "opencv-python-headless")}  # runtime -> (module, package) where the names differ


def choose_runtime(
    setting: str,
    key: str,
    builders: dict[str, Callable[[], Network]],
    sample: np.ndarray,
    model: Path,
    threads: int,
    cache_dir: Path | None = None,
) -> tuple[str, Network]:
    """The runtime ``setting`` names and its network, built; for ``auto`` the fastest of ``builders`` on ``sample``.

    ``builders`` maps each runtime to a function that builds the network (the file ``model``, run with ``threads``)
    on it; a runtime whose module does not import (``openvino``) is left out with a log line naming ``key``. With
    ``cache_dir`` the choice is read from and kept in its ``runtimes.json``."""
    if setting != "auto":
        return setting, builders[setting]()
    available = {name: build for name, build in builders.items() if _imports(name)}
    for name in builders.keys() - available.keys():
        log.warning(
            f"{key}=auto: {name} does not import here, so it is not among the runtimes tried ({_install(name)})"
        )
    if len(available) == 1:
        name, build = next(iter(available.items()))
        return name, build()
    record = None if cache_dir is None else cache_dir / CHOICES_FILE
    fingerprint = _fingerprint(key, model, sample.shape, threads, sorted(available))
    with _node_lock(record):
        known = _read_choices(record).get(fingerprint)
        if known is None or known.get("runtime") not in available:
            networks = {name: build() for name, build in available.items()}
            ms = _time(networks, sample)
            chosen = min(ms, key=lambda name: ms[name])
            log.info(
                f"{key}=auto: {chosen}, the fastest here on a {'x'.join(map(str, sample.shape))} input ({_timings(ms)})"
            )
            if record is not None:
                _keep_choice(record, fingerprint, {"key": key, "runtime": chosen, "ms": ms, "cpu": cpu_model()})
            return chosen, networks[chosen]
    # built after the lock is let go: the node's other actors load their networks at the same time, not in turn
    log.info(f"{key}=auto: {known['runtime']}, as timed on this node before ({_timings(known['ms'])}; {record})")
    return known["runtime"], available[known["runtime"]]()


def _time(networks: dict[str, Network], sample: np.ndarray) -> dict[str, float]:
    """Milliseconds of each network's best call on ``sample``, the calls alternating between networks."""
    best = dict.fromkeys(networks, float("inf"))
    for network in networks.values():
        network(sample)  # the first call plans and allocates
    for _ in range(TIMED_CALLS):
        for name, network in networks.items():
            start = time.perf_counter()
            network(sample)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(seconds * 1e3, 1) for name, seconds in best.items()}


@contextlib.contextmanager
def _node_lock(record: Path | None) -> Iterator[None]:
    """Hold the node's lock on its runtime choices (a file beside the record) while one actor reads, times and keeps
    a choice. Without a record there is nothing to share; where the cache cannot hold a lock (read-only, a file system
    without locks) each actor chooses alone, as the warning says."""
    if record is None:
        yield
        return
    path = record.with_name(f".{record.name}.lock")
    with contextlib.ExitStack() as held:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(open(path, "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError as err:
            log.warning(
                f"{path}: no lock on the node's runtime choices ({err}); actors starting at once may choose apart"
            )
        yield


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo) and architecture: the runtimes rank differently across CPUs."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _module(runtime: str) -> str:
    return _PACKAGES[runtime][0] if runtime in _PACKAGES else runtime


def _imports(runtime: str) -> bool:
    return importlib.util.find_spec(_module(runtime)) is not None


def _install(runtime: str) -> str:
    return f"pip install {_PACKAGES[runtime][1] if runtime in _PACKAGES else runtime}"


def _timings(ms: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.0f} ms" for name, value in sorted(ms.items(), key=lambda item: item[1]))


def _fingerprint(key: str, model: Path, shape: tuple[int, ...], threads: int, runtimes: list[str]) -> str:
    from curation.models.packages import sha256_of

    versions = {name: getattr(importlib.import_module(_module(name)), "__version__", "") for name in runtimes}
    facts = [key, sha256_of(model), list(shape), threads, cpu_model(), os.cpu_count(), versions]
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def _read_choices(record: Path | None) -> dict[str, Any]:
    if record is None or not record.is_file():
        return {}
    try:
        choices = json.loads(record.read_text())
    except (OSError, ValueError) as err:  # a torn or foreign file: time again and write it anew
        log.warning(f"{record}: not a record of runtime choices ({err}); timing the runtimes again")
        return {}
    return choices if isinstance(choices, dict) else {}


def _keep_choice(record: Path, fingerprint: str, choice: dict[str, Any]) -> None:
    """Add one choice to the node's record. Actors that time at once each write a whole file (rename is atomic);
    one of them may drop the other's entry, which is then timed once more."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        choices = _read_choices(record) | {fingerprint: choice}
        tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choices, indent=1, sort_keys=True))
        os.replace(tmp, record)
    except OSError as err:  # a read-only cache: the choice holds for this actor
        log.warning(f"{record}: could not keep the runtime choice ({err})")


def openvino_config(threads: int) -> dict[str, Any]:
    """How OpenVINO compiles our networks for the CPU.

    fp32 is asked for explicitly: on CPUs with bf16 or AMX OpenVINO would otherwise infer in bf16 and move the
    networks' peaks and boxes. Thread pinning is turned off: each process pins its threads from the first core up,
    not knowing of the others, so the single-thread actors of one node would all run on its first core (two on 2 CPUs:
    each at half speed, the other core idle; ``benchmarks/bench_openvino_pinning.py``)."""
    return {
        "INFERENCE_PRECISION_HINT": "f32",
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_CPU_PINNING": False,
    }


class OpenVinoNetwork:
    """One compiled model (``openvino_config``) and its infer request: an array in, the first output out (a copy: the
    request reuses it). Input shapes may change from call to call (models read with dynamic dimensions)."""

    def __init__(self, model: Path, threads: int, config: dict[str, Any] | None = None):
        import openvino as ov

        core = ov.Core()
        self._request = core.compile_model(
            core.read_model(str(model)), "CPU", openvino_config(threads) if config is None else config
        ).create_infer_request()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self._request.infer({0: x})
        return self._request.get_output_tensor(0).data.copy()
