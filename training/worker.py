"""The worker side of a training run on Ray Train: the checkpoint and metrics protocol every training loop shares.

A loop subclasses ``Worker``: after ``Worker.__init__`` it builds ``model`` and ``optimizer`` (FSDP2-sharded, the
same on every rank) and calls ``resume``; its ``run`` trains and calls ``save``. What a loop says for itself: its
state besides the tensors and the step (``train_state`` / ``restore_state``, kept in the commit record), what its
model hash covers (``model_hash``), and the loop.

- ``resume``: rank 0 picks the newest committed checkpoint, Ray Train's latest or a newer one Ray never registered
  (Ray registers a checkpoint once it has collected every rank's report; a worker killed right after reporting can
  take its report with it), deletes the uncommitted ones and any newer than it, and broadcasts the choice; every
  rank loads it and refuses one of another model. A checkpoint Ray had not registered is reported again
  ("adopted"), which puts it under Ray's retention like the others. Rank 0 then opens the metrics log at the step
  reached, with a ``resume`` record.
- ``save``: a committed checkpoint of the current step (``training/checkpoint.py``), a ``checkpoint`` record and a
  roll of the metrics log, then retention of the newest ``checkpoint.keep``: Ray Train's for a loop that reports its
  checkpoints to it in place, else done here.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from common import storage, watchdog
from training import checkpoint
from training.config import TrainingConfig
from training.metrics import MetricsLog

C = TypeVar("C", bound=TrainingConfig)


def log_line(line: str) -> None:
    """One line to the job log (Ray Train's patched ``print`` would log it twice from a worker)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Worker(ABC, Generic[C]):
    # Checkpoints reported to Ray Train, which keeps the newest ``checkpoint.keep`` (the driver's ``launch(keep=)``);
    # False: not reported, and pruned by ``save``.
    reports_checkpoints: ClassVar[bool] = True
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

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        # each step a loop takes (and the one a resume restores) is the progress the driver's watchdog watches
        self._step = value
        watchdog.beat(f"step {value}/{self.cfg.steps}")

    @abstractmethod
    def model_hash(self) -> str:
        """Hash of what the checkpointed tensors depend on: a resume with another value is refused."""

    @abstractmethod
    def train_state(self) -> dict:
        """The loop's state besides the tensors and the step, as JSON data for a checkpoint's commit record."""

    @abstractmethod
    def restore_state(self, commit: dict) -> dict:
        """Take the loop's state back from a commit record (every rank); returns what the ``resume`` record adds."""

    @abstractmethod
    def run(self) -> None:
        """The training loop, from ``self.step`` to the config's ``steps``."""

    # --- resume ---

    def resume(self) -> None:
        """Continue from the newest committed checkpoint, if any; then open rank 0's metrics log."""
        restored = self._restore()
        if self.rank == 0:
            self.log = MetricsLog.for_run(self.run_uri, self.step, self.cfg, self.scalar_groups)
            if restored:
                self.log.write({"kind": "resume", "step": self.step, "world_size": self.world, **restored})

    def _restore(self) -> dict | None:
        import ray.train

        from_ray = None
        registered = ray.train.get_checkpoint()
        if registered is not None:
            name = os.path.basename(registered.path.rstrip("/"))
            from_ray = storage.join(self.run_uri, checkpoint.CHECKPOINTS, name)
        choice: list[str | None] = [None]
        if self.rank == 0:
            newest = checkpoint.latest_committed(self.run_uri)
            if newest and (from_ray is None or checkpoint.step_of(newest) > checkpoint.step_of(from_ray)):
                choice[0] = newest
            else:
                choice[0] = from_ray
            checkpoint.remove_stale(self.run_uri, checkpoint.step_of(choice[0]) if choice[0] else None)
        dist.broadcast_object_list(choice, src=0)  # one decision, taken after the clean-up
        uri = choice[0]
        if uri is None:
            return None
        commit = checkpoint.load(uri, self.model, self.optimizer)
        if commit["model_hash"] != self.model_hash():
            raise checkpoint.CheckpointError(f"{uri} was saved for another {self.hash_covers}; use a new run name")
        self.step = self.saved_step = commit["step"]
        restored = {
            "checkpoint": storage.redact(uri),  # the run's records hold no query or credentials
            "saved_world_size": commit["world_size"],
            **self.restore_state(commit),
        }
        if self.reports_checkpoints:
            restored["adopted"] = uri != from_ray
            if restored["adopted"]:
                self._report(storage.basename(uri), {"step": self.step})
        return restored

    # --- save ---

    def save(self, metrics: dict | None = None, reason: str = "interval") -> None:
        """Commit a checkpoint of the current step (every rank calls this); ``metrics`` go to Ray Train with it."""
        uri = checkpoint.step_uri(self.run_uri, self.step)
        commit = {
            "step": self.step,
            **self.train_state(),
            "model_hash": self.model_hash(),
            "config": self.cfg.model_dump(mode="json"),
            "reason": reason,
        }
        checkpoint.save(uri, self.model, self.optimizer, commit)
        self.saved_step = self.step
        if self.log:
            self.log.write({"kind": "checkpoint", "step": self.step, "uri": storage.redact(uri), "reason": reason})
            self.log.roll(self.step + 1)
        if self.reports_checkpoints:
            self._report(storage.basename(uri), {**(metrics or {}), "step": self.step})
        elif self.rank == 0:
            checkpoint.keep_newest(self.run_uri, self.cfg.checkpoint.keep)

    def _report(self, name: str, metrics: dict) -> None:
        """Hand a committed checkpoint to Ray Train in place: registered without a copy, evicted past ``keep``."""
        import ray.train
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        path = storage.join(self.ray_storage.experiment_fs_path, checkpoint.CHECKPOINTS, name)
        ray.train.report(
            metrics,
            checkpoint=Checkpoint(path=path, filesystem=self.ray_storage.storage_filesystem),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
