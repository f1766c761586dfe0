"""A run's metrics log: JSON lines under ``<run>/metrics/``, written on rank 0, and their readers.

The ``train`` and ``eval`` records also go to the run's ``log.backends`` (``training/metrics_sinks.py``:
TensorBoard by default).
"""

from __future__ import annotations

import json
import resource
import sys
import time

from common import storage
from training.config import TrainingConfig
from training.metrics_sinks import Sinks

METRICS = "metrics"


class MetricsLog:
    """JSON lines under ``<run>/metrics/``: one part file per attempt and checkpoint interval, each record also
    handed to ``sinks``.

    A part is ``part-<attempt start ns>-<first step>.jsonl``; names sort chronologically. Lines are flushed as
    written (visible at once on a local disk); ``roll`` closes the part at a checkpoint, which is when an object
    store makes it visible. A resume first drops what earlier attempts wrote past the restored checkpoint
    (``drop_after``), so the files hold each step once, as TensorBoard does (its purge marker).
    """

    def __init__(self, run_uri: str, first_step: int, sinks: Sinks | None = None) -> None:
        self.fs, root = storage.resolve(run_uri)
        self.dir = storage.join(root, METRICS)
        self.fs.create_dir(self.dir, recursive=True)
        self.attempt = time.time_ns()
        self.sinks = sinks
        self._open(first_step)

    @classmethod
    def for_run(
        cls, run_uri: str, first_step: int, cfg: TrainingConfig, groups: dict[str, str] | None = None
    ) -> MetricsLog:
        """The log of a run, with the sinks its ``log.backends`` name (``groups``: its scalar groups)."""
        params = cfg.model_dump(mode="json")
        return cls(run_uri, first_step, Sinks(cfg.log.backends, run_uri, first_step, params, groups or {}))

    def _open(self, step: int) -> None:
        self.first_step = step
        self.out = self.fs.open_output_stream(storage.join(self.dir, f"part-{self.attempt}-{step:09d}.jsonl"))

    def write(self, record: dict) -> None:
        self.out.write((json.dumps({**record, "attempt": self.attempt}) + "\n").encode())
        self.out.flush()
        if self.sinks:
            self.sinks.log(record)

    def roll(self, next_step: int) -> None:
        # two commits after one step (an async save's, then the next save's) share the part: reopened, it would be
        # emptied
        if next_step != self.first_step:
            self.out.close()
            self._open(next_step)
        if self.sinks:
            self.sinks.checkpoint()

    def close(self) -> None:
        self.out.close()
        if self.sinks:
            self.sinks.close()


def host_memory_peak_bytes() -> int:
    """This process's peak resident set size so far (the kernel's high-water mark: Linux counts KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _part_first_step(path: str) -> tuple[str, int]:
    """(attempt, first step) of a part file's name ``part-<attempt>-<first step>.jsonl``."""
    _, attempt, first = path.rsplit("/", 1)[-1].removesuffix(".jsonl").split("-")
    return attempt, int(first)


def drop_after(run_uri: str, step: int) -> int:
    """Remove every record past ``step`` from the run's parts (what attempts before a resume from ``step`` wrote
    beyond it). Returns how many were removed. Only each attempt's parts from its last one starting at or before
    ``step`` on are read: the parts roll at every checkpoint, so the earlier ones end before it."""
    fs, root = storage.resolve(run_uri)
    folder = storage.join(root, METRICS)
    if not storage.exists(fs, folder):
        return 0
    parts: dict[str, list[tuple[int, str]]] = {}
    for path in storage.list_files(fs, folder, ".jsonl"):
        attempt, first = _part_first_step(path)
        parts.setdefault(attempt, []).append((first, path))
    dropped = 0
    for found in parts.values():
        found.sort()
        straddles = max((i for i, (first, _) in enumerate(found) if first <= step), default=0)
        for _, path in found[straddles:]:
            with fs.open_input_stream(path) as f:
                lines = [line for line in f.read().decode().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
            dropped += len(lines) - len(kept)
            if not kept:
                fs.delete_file(path)
            elif len(kept) < len(lines):
                storage.write_bytes_atomic(fs, path, ("\n".join(kept) + "\n").encode())
    return dropped


def read_metrics(run_uri: str, kind: str | None = "train") -> list[dict]:
    """Every metrics line of the run in the order written (all attempts), optionally of one ``kind``."""
    fs, root = storage.resolve(run_uri)
    records = []
    for path in storage.list_files(fs, storage.join(root, METRICS), ".jsonl"):
        with fs.open_input_stream(path) as f:
            records += [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    """step -> its record (the newest, should a run's parts hold one twice)."""
    return {r["step"]: r for r in records}
