"""The bounded task window every step runs on: Ray tasks launched through a bounded window, results in completion or
submission order.

Every step of dedup, sample, write, the export and the takedown runs its tasks through ``run_tasks`` (most of them
as units of a ``curation.steps.runner.Step``, whose runner records their receipts), so the driver holds at most
``window`` object refs however many tasks a step has (10^6 shards at 1B images: 64 in flight on 32 CPUs, not 10^6),
every finished task is a watchdog beat, and the window is sized in one place (``task_window``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common import watchdog
from common.progress import Progress

Launch = Callable[[], ray.ObjectRef]
T = TypeVar("T")
# Footers read at once by the driver: each is a round trip to the store, so threads hide its latency (a phase over
# 10^4 partitions at 1B images reads them in ~10^4 / 16 round trips).
FOOTER_THREADS = 16


def task_window(per_cpu: int = 2) -> int:
    """Tasks a step keeps in flight: ``per_cpu`` per CPU of the cluster, at least 2. Two per CPU keeps every CPU busy
    while the driver collects a result; steps whose tasks are mostly waiting on the store ask for more."""
    return max(2, per_cpu * int(ray.cluster_resources().get("CPU", 1)))


def run_tasks(
    launches: Iterable[Launch], window: int, *, ordered: bool = False, progress: Progress | None = None
) -> Iterator[Any]:
    """Call each launch (it starts one Ray task) with at most ``window`` tasks in flight or finished but not yet
    yielded; yield their results as they finish, or in launch order when ``ordered`` (a straggler then holds back
    only the results after it, never more than ``window`` of them). ``progress`` is told of each finished task."""
    return (result for _, result in _run(launches, window, ordered, progress))


def _run(
    launches: Iterable[Launch], window: int, ordered: bool, progress: Progress | None
) -> Iterator[tuple[int, Any]]:
    """(launch index, result) pairs: the loop behind ``run_tasks``."""
    pending: dict[ray.ObjectRef, int] = {}
    finished: dict[int, Any] = {}
    next_out = 0

    def collect() -> Iterator[tuple[int, Any]]:
        nonlocal next_out
        ready, _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(ready[0])
        result = ray.get(ready[0])
        watchdog.beat("a task finished")
        if progress is not None:
            progress.update()
        if not ordered:
            yield index, result
            return
        finished[index] = result
        while next_out in finished:
            yield next_out, finished.pop(next_out)
            next_out += 1

    for index, launch in enumerate(launches):
        while len(pending) + len(finished) >= window:
            yield from collect()
        pending[launch()] = index
    while pending:
        yield from collect()


def map_footers(read: Callable[[str], T], paths: Sequence[str]) -> list[T]:
    """``read(path)`` for each of ``paths`` (a footer or another small read), in order, ``FOOTER_THREADS`` at a time."""
    with ThreadPoolExecutor(FOOTER_THREADS) as pool:
        return list(pool.map(read, paths))


def parquet_rows(fs: pafs.FileSystem, paths: Sequence[str]) -> list[int]:
    """Rows of each Parquet file, from its footer."""

    def rows(path: str) -> int:
        with fs.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata.num_rows

    return map_footers(rows, paths)
