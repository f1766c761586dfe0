"""The driver side of a training run: where it lives, what it trains, and its Ray Train worker group.

A run is ``<storage>/<name>``: Ray Train's run (its restarts after failures) and the project's files (``run.json``,
checkpoints, metrics) side by side. The same command again resumes it, with the settings it started with: ``run.json``
records what the run trains (``identity``) and every setting that changes its result (``TrainingConfig.
result_settings``); a resume that changes one is refused unless the command allows it (``--allow-change``), and an
allowed change is recorded there under ``changes``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable

from common import storage, watchdog
from common.config import ConfigError
from common.folders import TRAINING_RUN_RECORD as RUN_FILE
from common.storage import StorageError
from training import checkpoint, failures
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


def _listed(changes: dict[str, tuple], keys: Iterable[str]) -> str:
    """``optim.lr 0.00015 -> 0.01, steps 30 -> 60``: the changes of ``keys``, as the console and refusals name them."""
    shown = [(k, *(repr(v) if isinstance(v, str) else str(v) for v in changes[k])) for k in keys]
    return ", ".join(f"{k} {old} -> {new}" for k, old, new in shown)


def check_run(
    run_uri: str, identity: dict, settings: dict | None = None, allowed: Iterable[str] = ()
) -> dict[str, tuple] | None:
    """None when ``<run>/run.json`` does not exist (a new run), else the settings this command changes, as
    ``{key: (recorded, given)}``: only those ``allowed`` names (a key or a section, e.g. ``optim``). Raises
    ``ConfigError`` when the run records another ``identity`` or the command changes a setting it does not allow.
    Writes nothing, so a job calls it before it takes the run's lease."""
    fs, run = storage.resolve(run_uri)
    path = storage.join(run, RUN_FILE)
    if not storage.exists(fs, path):
        return None
    earlier = storage.read_json(fs, path)
    for key, value in identity.items():
        if earlier.get(key) != value:
            raise ConfigError(
                f"run {storage.redact(run_uri)} was started with {key}={earlier.get(key)!r}, this command gives {value!r}; "
                "use a new --name for a different run"
            )
    recorded = earlier.get("settings")
    if settings is None or recorded is None:  # a run recorded before its settings were
        return {}
    changes = {
        k: (recorded.get(k), settings.get(k))
        for k in sorted({*recorded, *settings})
        if recorded.get(k) != settings.get(k)
    }
    allowed = list(allowed)
    refused = [k for k in changes if not any(k == a or k.startswith(a + ".") for a in allowed)]
    if refused:
        raise ConfigError(
            f"run {storage.redact(run_uri)} goes on with the settings it started with; this command changes "
            f"{_listed(changes, refused)}. "
            f"To change {'it' if len(refused) == 1 else 'them'} from the newest checkpoint on, add --allow-change "
            f"{','.join(refused)} (recorded in {RUN_FILE}); for a different run use a new --name"
        )
    return changes


def claim_run(
    run_uri: str, identity: dict, settings: dict | None = None, allowed: Iterable[str] = (), info: dict | None = None
) -> dict[str, tuple] | None:
    """Record what the run trains and its settings in ``<run>/run.json``; a rerun under the same name must give the
    same ``identity`` and change only ``allowed`` settings, which are then recorded (``info`` is recorded, never
    compared). Returns ``check_run``'s answer: None for a new run, else the changes taken."""
    changes = check_run(run_uri, identity, settings, allowed)
    fs, run = storage.resolve(run_uri)
    path = storage.join(run, RUN_FILE)
    if changes is None:
        record = {**identity, **(info or {}), "settings": settings, "created": time.time()}
    else:
        record = storage.read_json(fs, path)
        if not changes and "settings" in record:
            return changes  # nothing new to record
        record["settings"] = settings  # a run recorded before its settings were: from now on
        if changes:
            at = checkpoint.latest_committed(run_uri)
            record.setdefault("changes", []).append(
                {"at": time.time(), "newest_checkpoint": checkpoint.step_of(at) if at else None,
                 "settings": {k: list(v) for k, v in changes.items()}}
            )  # fmt: skip
    storage.write_json_atomic(fs, path, record)
    return changes


def add_allow_change(parser) -> None:
    """A training job's ``--allow-change``: the settings a resume may change (``check_run``)."""
    parser.add_argument(
        "--allow-change", default=[], metavar="KEY[,KEY]", type=lambda text: [k.strip() for k in text.split(",") if k.strip()],
        help="settings (or sections, e.g. optim) a resume may change from the newest checkpoint on, e.g. steps to "
        "extend a finished run; the change is recorded in the run's run.json",
    )  # fmt: skip


def ended_with(exc: failures.Permanent | failures.Exhausted) -> int:
    """The last line of a training job whose run failed, and its exit code: 2 for a permanent failure (its traceback
    is under ``<run>/errors/``), 1 when transient failures outlasted the restarts."""
    print(f"error: {exc}", file=sys.stderr, flush=True)
    return 2 if isinstance(exc, failures.Permanent) else 1


def describe_changes(changes: dict[str, tuple] | None) -> str:
    """`` with optim.lr 0.00015 -> 0.01`` for the console's start line ('' without changes)."""
    if not changes:
        return ""
    return " with " + _listed(changes, changes)


def check_free_space(run_uri: str, estimate: int, keep: int) -> None:
    """Refuse a local run folder whose disk cannot hold one more checkpoint: the newest committed one's size, else
    ``estimate`` bytes. An object store states no free space; nothing is checked there."""
    fs, run = storage.resolve(run_uri)
    if not storage.is_local(fs):
        return
    latest = checkpoint.latest_committed(run_uri)
    files = checkpoint.read_commit(latest).get("files") if latest else None
    need = sum(f["bytes"] for f in files.values()) if files else estimate
    existing = run
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if free < need:
        gib = 1 << 30
        raise StorageError(
            f"{existing} has {free / gib:.2f} GiB free; one checkpoint of this run takes about {need / gib:.2f} GiB "
            f"(and checkpoint.keep={keep} are kept): free space there, or give --storage on a larger disk"
        )


def launch(
    loop: Callable[[dict], None], loop_config: dict, settings: RaySettings, storage_path: str, name: str,
    requests: watchdog.Requests | None = None,
):  # fmt: skip
    """``loop(loop_config)`` on a Ray Train worker group sized by ``settings``; Ray Train's run (its restarts after
    transient failures, none after a permanent one: ``training.failures``) lives in ``<storage_path>/<name>``.
    ``requests``: what the loop's own Ray tasks ask for, named when the driver's watchdog reports. A failed run
    raises ``failures.Permanent`` or ``failures.Exhausted``, with the line the job ends with."""
    import ray.train
    from ray.train import TrainingFailedError
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        # Ray Train takes no failure policy of a user's; its controller gets ours here (training.failures)
        def _initialize_and_run_controller(self, **kwargs):
            kwargs["failure_policy"] = failures.stop_on_permanent(kwargs["failure_policy"])
            return super()._initialize_and_run_controller(**kwargs)

    _forget_ray_registry(run_uri_for(storage_path, name))
    resources = {"CPU": settings.cpus_per_worker} | ({"GPU": 1} if settings.use_gpu else {})
    trainer = Trainer(
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
            # Ray Train's own INFO lines (worker-group start-up, failure decisions) stay in its log files; the
            # console gets rank 0's progress lines and Ray Train's warnings and errors
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    watchdog.stage(
        "the Ray Train run",
        requests,
        groups={"the Ray Train worker group (ray.workers x ray.cpus_per_worker)": resources},  # one bundle a worker
        follow=watchdog.progress_key(run_uri_for(storage_path, name)),  # the steps rank 0 relays (training.worker)
    )
    try:
        return trainer.fit()
    except TrainingFailedError as exc:
        raise failures.ended(exc) from None


def _forget_ray_registry(run_uri: str) -> None:
    """Remove Ray Train's record of reported checkpoints from a run that reported them (earlier versions did): the
    checkpoints are the project's now, and Ray refuses to start a run whose record names a folder pruned since."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    fs, run = storage.resolve(run_uri)
    storage.delete_quietly(fs, storage.join(run, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME))
