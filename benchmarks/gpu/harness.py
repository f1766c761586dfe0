"""What every part shares: its report file, its deadline and the GPU's utilisation while it runs."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARGIN_S = 5.0  # a part stops starting new work this long before its hard stop, to write what it has


class PartReport:
    """A part's results, rewritten to its JSON file at every change, so a part stopped mid-way still tells what it
    measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"status": "running"}
        self._lock = threading.Lock()
        self._write()

    def set(self, **values) -> None:
        with self._lock:
            self.data.update(values)
            self._write()

    def append(self, key: str, item: dict) -> None:
        with self._lock:
            self.data.setdefault(key, []).append(item)
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


@dataclass
class Deadline:
    at: float  # time.monotonic()

    def left(self) -> float:
        return self.at - time.monotonic()


class GpuSampler:
    """GPU utilisation (%) and memory in use (MiB), sampled in a thread from nvidia-smi (else torch's NVML
    query); no samples where neither is there."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s, self.samples = every_s, []  # (monotonic time, utilisation %, memory MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def query() -> tuple[float, float] | None:
        if shutil.which("nvidia-smi"):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.returncode == 0 and out.stdout.strip():
                util, mem = out.stdout.strip().splitlines()[0].split(",")
                return float(util), float(mem)
        import torch

        if torch.cuda.is_available():
            try:
                return float(torch.cuda.utilization()), float("nan")
            except Exception:  # noqa: BLE001 - pynvml missing: no utilisation figure
                return None
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self.query()
            if sample is None:
                return
            self.samples.append((time.monotonic(), *sample))
            self._stop.wait(self.every_s)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def mean_between(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u, _ in self.samples if t0 <= t <= t1]
        return round(statistics.mean(inside), 1) if inside else None
