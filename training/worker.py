"""The worker side of a training run on Ray Train: the checkpoint and metrics protocol every training loop shares.

A loop subclasses ``Worker``: after ``Worker.__init__`` it builds ``model`` and ``optimizer`` (FSDP2-sharded, the
same on every rank) and calls ``resume``; its ``run`` trains and calls ``save``. What a loop says for itself: its
state besides the tensors and the step (``train_state`` / ``restore_state``, kept in the commit record), what its
model hash covers (``model_hash``), and the loop.

- ``resume``: rank 0 deletes the checkpoints a save left uncommitted, then the ranks take the newest committed one
  that verifies (``checkpoint.verify``, each rank a share of its files) and fits this model; one that fails to read
  is set aside with one line naming its file, and the next newest is tried. None left while some were set aside: the
  run stops (``checkpoint.CheckpointError``, permanent). Rank 0 then drops the metrics an earlier attempt wrote past
  the restored step (``training.metrics.drop_after``) and opens the metrics log with a ``resume`` record.
- ``save``: a committed checkpoint of the current step (``training/checkpoint.py``), a ``checkpoint`` record and a
  roll of the metrics log, then retention of the newest ``checkpoint.keep``. With ``checkpoint.async_save`` it
  returns once the state is staged; the loop calls ``poll_save`` after every step, which commits the save (record,
  roll, retention) at the first step every rank's files are durable, and ``finish_save`` at its end. A save waits
  for the one before; a preemption's save is committed before the loop goes on.

The project, not Ray Train, keeps the checkpoints (``training/checkpoint.py`` says why); Ray Train restarts the
worker group after a transient failure, and ``training.failures`` stops it after a permanent one.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from common import storage, watchdog
from common.storage import StorageError
from training import checkpoint
from training.config import TrainingConfig
from training.metrics import MetricsLog, drop_after, host_memory_peak_bytes

C = TypeVar("C", bound=TrainingConfig)


def log_line(line: str) -> None:
    """One line to the job log (Ray Train's patched ``print`` would log it twice from a worker)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Worker(ABC, Generic[C]):
    job: ClassVar[str]  # the job's name in console lines
    scalar_groups: ClassVar[dict[str, str]] = {}  # the loop's metrics groups beyond metrics_sinks.GROUPS
    hash_covers: ClassVar[str]  # what ``model_hash`` covers, named when a checkpoint of another model is refused

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, cfg: C, run_uri: str) -> None:
        import ray.train
        import ray.train.torch

        self.cfg, self.run_uri = cfg, run_uri
        if cfg.ray.torch_threads:
            torch.set_num_threads(cfg.ray.torch_threads)
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.ray_storage = ctx.get_storage()
        self.device = ray.train.torch.get_device()
        if self.rank == 0:  # the driver's watchdog follows the run's steps (common.watchdog)
            watchdog.relay(watchdog.progress_key(run_uri))
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint, restored or saved
        self.log: MetricsLog | None = None  # rank 0's, from ``resume`` on
        self._host_peak: int | None = None  # this rank's peak RSS after the attempt's first step, until it is logged
        self._host_peak_taken = False
        self.saver: checkpoint.AsyncSaver | None = None  # made at the first async save

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # each step a loop takes (and the one a resume restores) is the progress the driver's watchdog watches
        self._step = value
        watchdog.beat(f"step {value}/{self.cfg.steps}")

    def take_host_peak(self) -> None:
        """After each step: the first time, this rank's peak RSS so far (what building, sharding, restoring and one
        step took of the host)."""
        if not self._host_peak_taken:
            self._host_peak, self._host_peak_taken = host_memory_peak_bytes(), True

    def host_peak_field(self) -> dict[str, int]:
        """``host_memory_peak_bytes``, the largest rank's ``take_host_peak``, for the attempt's first metrics record;
        empty after it. A collective: every rank calls it at each metrics record."""
        if self._host_peak is None:
            return {}
        peak = torch.tensor([self._host_peak], dtype=torch.int64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self._host_peak = None
        return {"host_memory_peak_bytes": int(peak.item())}

    @abstractmethod
    def model_hash(self) -> str:
        """Hash of what the checkpointed tensors depend on: a resume with another value is refused."""

    @abstractmethod
    def train_state(self) -> dict:
        """The loop's state besides the tensors and the step, as JSON data for a checkpoint's commit record."""

    def summary(self, state: dict, group: dist.ProcessGroup | None) -> dict:
        """The commit record's entries computed from the checkpointed tensors (``checkpoint.Summary``)."""
        return {}

    @abstractmethod
    def restore_state(self, commit: dict) -> dict:
        """Take the loop's state back from a commit record (every rank); returns what the ``resume`` record adds."""

    @abstractmethod
    def run(self) -> None:
        """The training loop, from ``self.step`` to the config's ``steps``."""

    # --- resume ---

    def resume(self) -> None:
        """Continue from the newest readable committed checkpoint, if any; then open rank 0's metrics log."""
        restored = self._restore()
        if self.rank == 0:
            dropped = drop_after(self.run_uri, self.step)
            self.log = MetricsLog.for_run(self.run_uri, self.step, self.cfg, self.scalar_groups)
            if restored:
                self.log.write({"kind": "resume", "step": self.step, "world_size": self.world,
                                "dropped_records": dropped, **restored})  # fmt: skip

    def _restore(self) -> dict | None:
        if self.rank == 0:
            checkpoint.remove_uncommitted(self.run_uri)
        while True:
            # one decision for every rank, taken after the clean-up: the checkpoint, its record or why it has none
            choice: list = [None, None, None]
            if self.rank == 0 and (uri := checkpoint.latest_committed(self.run_uri)):
                try:
                    choice = [uri, checkpoint.read_commit(uri), None]
                except StorageError as exc:  # a commit record that does not parse
                    choice = [uri, None, f"{checkpoint.COMMIT_FILE}: {exc}"]
            dist.broadcast_object_list(choice, src=0)
            uri, commit, damaged = choice
            if uri is None:
                self._refuse_a_fresh_start()
                return None
            if damaged:
                self._set_aside(uri, [damaged])
                continue
            if commit["model_hash"] != self.model_hash():
                raise checkpoint.CheckpointError(
                    f"{storage.redact(uri)} was saved for another {self.hash_covers}; use a new run name"
                )
            problems = self._verify(uri, commit)
            if not problems:
                try:
                    checkpoint.load(uri, self.model, self.optimizer, commit)
                    break
                except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank when one fails
                    last = str(exc).strip().splitlines()
                    problems = [f"it fails to load: {type(exc).__name__}: {last[-1] if last else ''}"]
            self._set_aside(uri, problems)
        self.step = self.saved_step = commit["step"]
        return {
            "checkpoint": storage.redact(uri),  # the run's records hold no query or credentials
            "saved_world_size": commit["world_size"],
            **self.restore_state(commit),
        }

    def _verify(self, uri: str, commit: dict) -> list[str]:
        """Every rank's findings on ``uri`` (each checks a share of its files), the same list on every rank."""
        mine = checkpoint.verify(uri, commit, self.rank, self.world)
        every: list[list[str]] = [[] for _ in range(self.world)]
        dist.all_gather_object(every, mine)
        return sorted({p for found in every for p in found})

    def _set_aside(self, uri: str, problems: list[str]) -> None:
        if self.rank == 0:
            moved = checkpoint.set_aside(uri)
            log_line(
                f"[{self.job}] checkpoint {storage.redact(uri)} does not read back ({problems[0]}"
                f"{f'; and {len(problems) - 1} more' if len(problems) > 1 else ''}): set aside as {moved}, "
                "trying the next newest"
            )
        dist.barrier()  # the next choice is made without it

    def _refuse_a_fresh_start(self) -> None:
        """A run with no checkpoint starts afresh, unless it had some that were set aside as damaged."""
        damaged = checkpoint.set_aside_names(self.run_uri)
        if damaged:
            raise checkpoint.CheckpointError(
                f"no readable checkpoint left in {storage.redact(storage.join(self.run_uri, checkpoint.CHECKPOINTS))}: "
                f"{', '.join(damaged)} were set aside as damaged. Restore one from a backup under its step_* name, or "
                "start a new run (--name)"
            )

    # --- save ---

    def save(self, reason: str = "interval") -> None:
        """Checkpoint the current step (every rank calls this), committed now or, with ``checkpoint.async_save``, by
        ``poll_save`` / ``finish_save`` once written; the save in flight before is committed first."""
        self.finish_save()
        uri = checkpoint.step_uri(self.run_uri, self.step)
        record = {
            "step": self.step,
            **self.train_state(),
            "model_hash": self.model_hash(),
            "config": self.cfg.model_dump(mode="json"),
            "reason": reason,
        }
        if not self.cfg.checkpoint.async_save:
            seconds = checkpoint.save(uri, self.model, self.optimizer, record, self.summary)
            self._committed(uri, record, seconds)
            return
        if self.saver is None:
            self.saver = checkpoint.AsyncSaver(pinned=self.device.type == "cuda")
        self.saver.start(uri, self.model, self.optimizer, record, self.summary)
        if reason == "preemption":  # the node is about to go: durable first
            self.finish_save()

    def poll_save(self) -> None:
        """Commit the async save in flight if every rank has written it (every rank, after every step)."""
        if self.saver is not None and self.saver.in_flight is not None and self.saver.ready(self.device):
            self.finish_save()

    def finish_save(self) -> None:
        """Wait for the async save in flight, if any, and commit it (every rank)."""
        if self.saver is None or self.saver.in_flight is None:
            return
        self._committed(*self.saver.commit())

    def _committed(self, uri: str, record: dict, seconds: dict[str, float]) -> None:
        """After a commit: the ``checkpoint`` record (with the seconds the save took: ``write_s`` and ``summary_s``,
        the fingerprint's, both on the step path of a blocking save; an async one adds ``stage_s``, its only time on
        the step path), a roll of the metrics log, retention."""
        self.saved_step = record["step"]
        if self.log:
            self.log.write({"kind": "checkpoint", "step": record["step"], "uri": storage.redact(uri),
                            "reason": record["reason"], "at_step": self.step, **seconds})  # fmt: skip
            self.log.roll(self.step + 1)
        if self.rank == 0:
            checkpoint.keep_newest(self.run_uri, self.cfg.checkpoint.keep)
