"""The one task runner of the global phases: Ray tasks launched through a bounded window, results in completion or
submission order, and units of work whose receipts are recorded so that a rerun skips them.

Every step of dedup, sample, write, the export and the takedown runs its tasks through ``run_tasks`` (or
``run_units`` when its units must survive a kill), so the driver holds at most ``window`` object refs however many
tasks a step has (10^6 shards at 1B images: 64 in flight on 32 CPUs, not 10^6), every finished task is a watchdog
beat, and the window is sized in one place (``task_window``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from common import watchdog
from common.layout import LAYOUT
from common.progress import Progress
from common.storage import exists, join, write_json_atomic
from curation.records import read_step_record

Launch = Callable[[], ray.ObjectRef]
T = TypeVar("T")
# Footers read at once by the driver: each is a round trip to the store, so threads hide its latency (a phase over
# 10^4 partitions at 1B images reads them in ~10^4 / 16 round trips).
FOOTER_THREADS = 16


@dataclass(frozen=True)
class Phase:
    """One global phase: its name (the ``--phases`` word), the phase that must be done first, the settings
    fingerprint its records are keyed by (other settings redo it), and what runs it (returns its done record)."""

    name: str
    needs: str
    fingerprint: Callable[[], str]
    run: Callable[[], dict]


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
    """(launch index, result) pairs: the loop behind ``run_tasks`` and ``run_units``."""
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


class UnitRecords:
    """Receipts of the finished units of a global step in ``_state/<step>/<unit>.json``, valid for one settings
    hash: the one resume record of every step whose units are too big to redo after a kill."""

    def __init__(self, fs: pafs.FileSystem, root: str, step: str, settings_hash: str):
        self.fs, self.root, self.step, self.settings_hash = fs, root, step, settings_hash

    def path(self, unit: str) -> str:
        return join(self.root, LAYOUT.units(self.step), f"{unit}.json")

    def get(self, unit: str) -> dict | None:
        path = self.path(unit)
        if not exists(self.fs, path):
            return None
        record = read_step_record(self.fs, path, self.step, "unit")
        return record["receipt"] if record["fingerprint"] == self.settings_hash else None

    def put(self, unit: str, receipt: dict) -> None:
        write_json_atomic(self.fs, self.path(unit), {"fingerprint": self.settings_hash, "receipt": receipt})


def run_units(records: UnitRecords, units: Mapping[str, Launch], window: int) -> Iterator[tuple[str, dict]]:
    """Run the units not yet recorded, at most ``window`` at a time, recording each receipt as its task finishes;
    yields (unit, receipt) for every unit, recorded ones first, then in completion order."""
    todo: list[str] = []
    for unit in units:
        done = records.get(unit)
        if done is None:
            todo.append(unit)
        else:
            yield unit, done
    for index, receipt in _run((units[u] for u in todo), window, ordered=False, progress=None):
        records.put(todo[index], receipt)
        yield todo[index], receipt
