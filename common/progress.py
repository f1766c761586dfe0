"""Progress lines for long loops that have no progress bar: done/total, rate and time left, every ~10 s.

Used by the global curation phases (loops over partitions, buckets, clusters), the report's thumbnails and
fine-tuning's evaluation. Quiet for loops that finish within the interval: their summary line says enough. Lines go
to ``log``: the caller's logger's ``info`` (``common.console`` shows it), this module's by default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from common import watchdog

T = TypeVar("T")

_log = logging.getLogger(__name__)

EVERY_S = 10.0


class Progress:
    """``update(n)`` after each piece of work; a line goes to ``log`` when ``every_s`` seconds have passed since the
    last one (or since the start), until the work is done."""

    def __init__(
        self, label: str, total: int, log: Callable[[str], None] = _log.info, unit: str = "items",
        every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.label, self.total, self.log, self.unit, self.every_s, self.clock = label, total, log, unit, every_s, clock
        self.done = 0
        self.started = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.done += n
        watchdog.beat(f"{self.label} {self.done}/{self.total} {self.unit}")
        now = self.clock()
        if now - self.last < self.every_s or self.done >= self.total:
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        self.log(
            f"{self.label} {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
            f"{rate:.3g}/s, ~{left:.0f} s left"
        )


def progress(items: Iterable[T], label: str, total: int, log: Callable[[str], None] = _log.info, unit: str = "items",
             **kwargs) -> Iterator[T]:  # fmt: skip
    """``items`` unchanged, with a ``Progress`` line every ~10 s as they are consumed."""
    bar = Progress(label, total, log, unit, **kwargs)
    for item in items:
        yield item
        bar.update()
