"""Timing for the benchmarks: wall seconds of a call, with the GPU's queue drained around it.

Imported as ``benchmarks.timing`` (a script puts the repository root on ``sys.path`` first), so it serves both
``python benchmarks/x.py`` and ``python -m benchmarks.x``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def synchronize() -> None:
    """Wait for the GPU's queued work, where torch is in use and sees a GPU (torch is not imported for it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], T], repeats: int = 1, warmup: int = 0) -> tuple[float, T]:
    """(median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, the last call's result)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        result = fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
