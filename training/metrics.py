"""A run's metrics log: JSON lines under ``<run>/metrics/``, written on rank 0, and their readers.

The ``train`` and ``eval`` records also go to the run's ``log.backends`` (``training/metrics_sinks.py``:
TensorBoard by default).
"""

from __future__ import annotations

import json
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
    store makes it visible. After a resume, steps past the restored checkpoint appear again in the new attempt's
    parts: ``read_metrics`` keeps every line, ``latest_per_step`` the newest (TensorBoard readers drop the old ones).
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
        self.out = self.fs.open_output_stream(storage.join(self.dir, f"part-{self.attempt}-{step:09d}.jsonl"))

    def write(self, record: dict) -> None:
        self.out.write((json.dumps({**record, "attempt": self.attempt}) + "\n").encode())
        self.out.flush()
        if self.sinks:
            self.sinks.log(record)

    def roll(self, next_step: int) -> None:
        self.out.close()
        self._open(next_step)
        if self.sinks:
            self.sinks.checkpoint()

    def close(self) -> None:
        self.out.close()
        if self.sinks:
            self.sinks.close()


def read_metrics(run_uri: str, kind: str | None = "train") -> list[dict]:
    """Every metrics line of the run in the order written (all attempts), optionally of one ``kind``."""
    fs, root = storage.resolve(run_uri)
    records = []
    for path in storage.list_files(fs, storage.join(root, METRICS), ".jsonl"):
        with fs.open_input_stream(path) as f:
            records += [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    """step -> the record of the newest attempt that reached it."""
    return {r["step"]: r for r in records}
