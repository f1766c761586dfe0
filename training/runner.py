"""The driver side of a training run: where it lives, what it trains, and its Ray Train worker group.

A run is ``<storage>/<name>``: Ray Train's run (checkpoint registry, restarts after failures) and the project's
files (``run.json``, checkpoints, metrics) side by side. The same command again resumes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from common import storage, watchdog
from common.config import ConfigError
from common.folders import TRAINING_RUN_RECORD as RUN_FILE
from training import checkpoint
from training.config import RaySettings


def run_uri_for(storage_path: str, name: str) -> str:
    """Where Ray Train puts the run: ``<storage>/<name>`` (local paths made absolute, as Ray does; a URI keeps its
    query, which reaches the store). ``name`` must be one folder name."""
    if not name or name in (".", "..") or any(c in name for c in "/\\?#"):
        raise ConfigError(f"--name {name!r}: give one folder name (no '/', '\\', '?' or '#'), e.g. --name run1")
    if "://" in storage_path:
        return storage.join(storage_path, name)
    return os.path.join(os.path.abspath(os.path.expanduser(storage_path)), name)


def committed(storage_path: str, name: str) -> str:
    """What an interrupted run of ``<storage>/<name>`` keeps: its newest committed checkpoint, where a rerun of the
    same command goes on from."""
    latest = checkpoint.latest_committed(run_uri_for(storage_path, name))
    return f"newest committed checkpoint {storage.redact(latest)}" if latest else "no checkpoint committed yet"


def ray_storage(storage_path: str) -> dict:
    """``RunConfig``'s storage arguments for ``storage_path``: a local folder as an absolute path; a URI as the
    project's pyarrow filesystem and a plain path on it, so that Ray Train reaches the store the way every job
    does (the URI's query: endpoint, region, scheme), and Ray never parses the URI on its own."""
    fs, path = storage.resolve(storage_path)
    if storage.is_local(fs):
        return {"storage_path": path}
    return {"storage_path": path, "storage_filesystem": fs}


def check_run(run_uri: str, identity: dict) -> bool:
    """Whether ``<run>/run.json`` exists (the command resumes); raises ``ConfigError`` when it records another
    ``identity``. Writes nothing, so a job calls it before it takes the run's lease."""
    fs, run = storage.resolve(run_uri)
    path = storage.join(run, RUN_FILE)
    if not storage.exists(fs, path):
        return False
    earlier = storage.read_json(fs, path)
    for key, value in identity.items():
        if earlier.get(key) != value:
            raise ConfigError(
                f"run {storage.redact(run_uri)} was started with {key}={earlier.get(key)!r}, this command gives {value!r}; "
                "use a new --name for a different run"
            )
    return True


def claim_run(run_uri: str, identity: dict, info: dict | None = None) -> bool:
    """Record what the run trains in ``<run>/run.json``; a rerun under the same name must give the same ``identity``
    (``info`` is recorded, not compared). Returns True when resuming."""
    if check_run(run_uri, identity):
        return True
    fs, run = storage.resolve(run_uri)
    storage.write_json_atomic(fs, storage.join(run, RUN_FILE), {**identity, **(info or {}), "created": time.time()})
    return False


def launch(
    loop: Callable[[dict], None], loop_config: dict, settings: RaySettings, storage_path: str, name: str,
    keep: int | None = None, requests: watchdog.Requests | None = None,
):  # fmt: skip
    """``loop(loop_config)`` on a Ray Train worker group sized by ``settings``; Ray Train's run (its checkpoint
    registry, restarts after failures) lives in ``<storage_path>/<name>`` and keeps the newest ``keep`` checkpoints
    reported to it. ``requests``: what the loop's own Ray tasks ask for, named when the driver's watchdog reports."""
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": settings.cpus_per_worker} | ({"GPU": 1} if settings.use_gpu else {})
    trainer = TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=settings.workers, use_gpu=settings.use_gpu, resources_per_worker=resources
        ),
        # ray.train re-exports Train v2's RunConfig at runtime (is_v2_enabled()); mypy sees the v1 class it
        # imports first, which has no logging_config
        run_config=ray.train.RunConfig(  # type: ignore[call-arg]
            name=name,
            **ray_storage(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=settings.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
            # Ray Train's own INFO lines (every rank's whole report at each checkpoint, worker-group start-up) stay
            # in its log files; the console gets rank 0's progress lines and Ray Train's warnings and errors
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    watchdog.stage(
        "the Ray Train run",
        requests,
        groups={"the Ray Train worker group (ray.workers x ray.cpus_per_worker)": resources},  # one bundle a worker
        follow=watchdog.progress_key(run_uri_for(storage_path, name)),  # the steps rank 0 relays (training.worker)
    )
    return trainer.fit()
