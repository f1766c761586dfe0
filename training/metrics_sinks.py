"""Training metrics in the tools people already read them with: TensorBoard event files (the default), MLflow, W&B.

Both training loops hand every metrics record to ``Sinks`` (through ``training.metrics.MetricsLog``, on rank 0):
its numeric fields become scalars tagged ``<group>/<name>`` (``loss/mae``, ``optim/lr``, ``perf/images_per_s``,
``contrastive/teacher_entropy``, ``eval/mIoU``) at the record's step. The JSON lines under ``<run>/metrics/`` stay
the full record.

- **tensorboard** (``tensorboardX``, which Ray Train already installs): event files under ``<run>/tensorboard/``.
  A resumed run starts a new event file with a purge marker at the first step after its checkpoint, so TensorBoard
  (and its event reader) drops the steps the previous attempt wrote past it: no step appears twice. On an object
  store the events are written to a local folder and uploaded at every checkpoint and at the end, which is also
  exactly what a resume keeps.
- **mlflow**: a local file store under ``<run>/mlflow/`` (``MLFLOW_TRACKING_URI`` wins; a run on an object store
  needs it); the MLflow run's id is kept in ``<run>/mlflow_run.json`` so a resume logs into the same MLflow run.
- **wandb**: a W&B run whose id is derived from the run's URI (``resume="allow"``), project ``WANDB_PROJECT`` or
  ``humans1b``.

A backend whose package is missing is refused when the config is read, naming the package to install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Literal

from common import storage
from common.console import shown_place

Backend = Literal["tensorboard", "mlflow", "wandb"]
PACKAGES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}  # backend -> module to import
TENSORBOARD = "tensorboard"
MLFLOW = "mlflow"
MLFLOW_RUN_FILE = "mlflow_run.json"

# Scalar groups shared by the training loops; a record's other numeric fields go under its kind's group.
GROUPS = {
    **dict.fromkeys(("lr", "wd", "momentum", "grad_norm"), "optim"),
    **dict.fromkeys(
        (
            "images_per_s",
            "tokens_per_s",
            "step_s",
            "data_wait_s",
            "data_wait_max_s",
            "compute_s",
            "data_wait_frac",
            "mfu",
            "host_memory_peak_bytes",
        ),
        "perf",
    ),
}
KIND_GROUPS = {"train": "loss", "eval": "eval"}
NOT_SCALARS = {"step", "epoch", "attempt"}  # bookkeeping fields of a record


def check_backends(backends: list[Backend]) -> list[Backend]:
    """``backends`` unchanged when each one's package can be imported, else a ``ValueError`` naming the package."""
    for name in backends:
        module = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"the {name} backend needs the {module!r} package: pip install {module}")
    return backends


def describe(backends: list[Backend], run_uri: str) -> str:
    """Where a run's metrics can be looked at, for the job's last lines."""
    run = storage.redact(run_uri)  # no credentials on the console
    store = os.environ.get("MLFLOW_TRACKING_URI") or "file://" + storage.join(run, MLFLOW)
    where = {
        "tensorboard": f"tensorboard --logdir {storage.join(shown_place(run_uri), TENSORBOARD)}",
        "mlflow": f"mlflow ui --backend-store-uri {store}",
        "wandb": f"W&B project {os.environ.get('WANDB_PROJECT', 'humans1b')}",
    }
    return "; ".join(where[b] for b in backends)


def scalars(record: Mapping, groups: Mapping[str, str] = GROUPS) -> dict[str, float]:
    """The record's finite numeric fields, tagged ``<group>/<name>``."""
    kind = record.get("kind") or "metrics"
    default = KIND_GROUPS.get(kind, kind)
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{groups.get(key, GROUPS.get(key, default))}/{key}"] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, run_uri: str, first_step: int, **_) -> None:
        from tensorboardX import SummaryWriter

        self.fs, root = storage.resolve(run_uri)
        self.remote = storage.join(root, TENSORBOARD)
        self.staging = None if storage.is_local(self.fs) else tempfile.mkdtemp(prefix="tensorboard-")
        logdir = self.staging or self.remote
        # Steps after the checkpoint a resume starts from are written again: the marker makes readers drop the
        # previous attempt's copies of them.
        # The file name holds the second it was opened and the host; the suffix keeps two attempts within one
        # second apart, in the order they started (readers take files in name order).
        self.writer = SummaryWriter(
            logdir,
            purge_step=first_step + 1 if first_step else None,
            flush_secs=30,
            filename_suffix=f".{time.time_ns()}",
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        if not self.staging:  # on disk at once, as the JSON lines are: a killed worker loses nothing it logged
            self.writer.flush()

    def checkpoint(self) -> None:
        self.writer.flush()
        if self.staging:
            for name in os.listdir(self.staging):
                with open(os.path.join(self.staging, name), "rb") as f:
                    storage.write_bytes_atomic(self.fs, storage.join(self.remote, name), f.read())

    def close(self) -> None:
        self.checkpoint()
        self.writer.close()
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)


class MLflowSink:
    def __init__(self, run_uri: str, first_step: int, name: str, params: dict) -> None:
        import mlflow

        fs, root = storage.resolve(run_uri)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            if not storage.is_local(fs):
                raise ValueError("log.backends mlflow on an object-store run needs MLFLOW_TRACKING_URI")
            mlflow.set_tracking_uri("file://" + os.path.join(root, MLFLOW))
        record = storage.join(root, MLFLOW_RUN_FILE)
        run_id = storage.read_json(fs, record)["run_id"] if storage.exists(fs, record) else None
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else name)
        if run_id is None:
            storage.write_json_atomic(fs, record, {"run_id": self.run.info.run_id})
            mlflow.log_params(_flat(params))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def checkpoint(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


class WandbSink:
    def __init__(self, run_uri: str, first_step: int, name: str, params: dict) -> None:
        import wandb

        _, root = storage.resolve(run_uri)
        run_id = hashlib.sha256(storage.redact(run_uri).encode()).hexdigest()[:16]
        local_dir = root if "://" not in run_uri else tempfile.mkdtemp(prefix="wandb-")
        project = os.environ.get("WANDB_PROJECT", "humans1b")
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=local_dir, config=params)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def checkpoint(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MLflowSink, "wandb": WandbSink}


class Sinks:
    """The selected backends of one run, on rank 0: ``log`` each record, ``checkpoint`` when a checkpoint is
    committed (what a resume keeps), ``close`` at the end."""

    def __init__(
        self, backends: list[Backend], run_uri: str, first_step: int, params: dict,
        groups: Mapping[str, str] = GROUPS,
    ) -> None:  # fmt: skip
        name = os.path.basename(storage.redact(run_uri).rstrip("/"))
        self.groups = {**GROUPS, **groups}
        self.sinks = [SINKS[b](run_uri, first_step, name=name, params=params) for b in check_backends(backends)]

    def log(self, record: Mapping) -> None:
        if "step" not in record or record.get("kind") not in KIND_GROUPS:
            return
        values = scalars(record, self.groups)
        for sink in self.sinks:
            sink.log(int(record["step"]), values)

    def checkpoint(self) -> None:
        for sink in self.sinks:
            sink.checkpoint()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _flat(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested config as ``a.b.c -> value`` strings (MLflow params are flat)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out
