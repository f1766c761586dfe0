"""Connecting to Ray the same way from ``python -m`` and from ``ray job submit``."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any, TypedDict

import ray

from common.telemetry import TELEMETRY_OFF, disable_telemetry

# Ray log lines that tell a user nothing to act on, by the logger that writes them: the start of each message. Ray's
# warnings about resources and failures are kept.
QUIET = {
    # Ray Train's placement-group cleaner, a detached helper that removes a run's placement group only if its
    # controller dies (on a normal end the controller removes it). Every few seconds for a whole run: its check needs
    # the State API, served by the dashboard that a local Ray here runs without. At the end of a run: asked to stop,
    # it cannot within 12 s, its thread being inside that check, and the controller stops waiting; the thread ends
    # after the check and the helper exits. Nothing of the run is at stake.
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": (
        "Failed to query Ray Train Controller actor state",
        "Monitor thread did not exit within",
    ),
    "ray.train.v2._internal.callbacks.placement_group_callback": ("Failed to stop PlacementGroupCleaner gracefully",),
    # every rank's whole report at each checkpoint; this logger is named by its file's path, so Ray Train's own
    # log level (RunConfig's LoggingConfig, which quiets its other INFO lines) does not reach it
    os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py"): (
        "Reporting training result",
    ),
    # three lines per dataset; pretraining starts one per worker and plan chunk. A failed dataset's line is kept.
    "ray.data._internal.execution.streaming_executor": (
        "Starting execution of Dataset",
        "Execution plan of Dataset",
        "✔️  Dataset",  # "... execution finished in 57.28 seconds"
    ),
    # how progress is shown, once per process
    "ray.data._internal.progress": (
        "Progress will be logged because",
        "Progress bars disabled",
        "[dataset]: A new progress UI",
    ),
}


# Ray log lines dropped in the driver of a local Ray only, which this process starts itself. Ray 2.59+ starts a local
# Ray with token authentication on where RAY_AUTH_MODE is unset, and says so at every start; token authentication
# stays on (the warning Ray gives when it is off is never dropped), and a cluster's driver keeps every line.
LOCAL_QUIET = {
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray cluster",),
}


# Lines Ray relays to the driver from other processes' stdout and stderr, C++ logs among them, that tell a user nothing
# to act on: regular expressions, searched in each line. They stay in those processes' log files (worker-*.err, and
# python-core-worker-*.log for the core worker's). The driver drops them with Ray's own filter of relayed lines, the
# one RAY_DEDUP_LOGS_SKIP_REGEX sets (a pattern set there is kept), so RAY_DEDUP_LOGS=0 shows them again.
QUIET_RELAYED = (
    # once per head-pose actor, at INFO: the TFLite runtime's C++ logger says which CPU kernels the face networks
    # run on; no setting reaches that logger (TF_CPP_MIN_LOG_LEVEL is TensorFlow's)
    r"^INFO: Created TensorFlow Lite XNNPACK delegate for CPU\.$",
    # once per process, at ERROR: the core worker cautions that a restartable actor's constructor arguments live in
    # the object store, where losing them would fail a restart. Ray Train's preemption watcher (the handles of the
    # workers it watches, which the controller holds while it lives) and Ray Data's actor pools (whose operator holds
    # the arguments while it runs) are the only such actors of a run.
    r"core_worker\.cc:\d+: Actor with class name: '(PreemptionWatcher|MapWorker\(.*\))' and ID: '\w+' has "
    r"constructor arguments in the object store and max_restarts > 0\.",
)


# Ray Train's placement-group cleaner checks its controller through the same State API on a thread of its own; when
# finding the API server fails with another error than the one it catches (no dashboard to find, a stale address
# of an earlier local Ray), the thread ends with a traceback. The clean-up it guards still happens when the run ends.
QUIET_THREADS = ("PlacementGroupCleanerMonitor",)


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _drop(quiet: Mapping[str, tuple[str, ...]]) -> None:
    for name, starts in quiet.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(starts))


def quiet_ray_logs() -> None:
    """Install the ``QUIET`` filters in this process: the driver, and every worker process of a job started by
    ``init_ray`` (through the workers' setup hook, ``setup_worker``)."""
    _drop(QUIET)
    if threading.excepthook is not _quiet_thread_errors:
        global _next_excepthook
        _next_excepthook = threading.excepthook
        threading.excepthook = _quiet_thread_errors


_next_excepthook = threading.excepthook


def _quiet_thread_errors(args: threading.ExceptHookArgs) -> None:
    """A ``QUIET_THREADS`` thread's end goes to the debug log; any other thread's to the hook installed before."""
    if args.thread is not None and args.thread.name in QUIET_THREADS:
        logging.getLogger(__name__).debug("thread %s ended: %r", args.thread.name, args.exc_value)
        return
    _next_excepthook(args)


def setup_worker() -> None:
    """Ray's setup hook for every worker process of a job started by ``init_ray``, run before its first task: the
    libraries' telemetry off (``common.telemetry``), then the ``QUIET`` filters."""
    disable_telemetry()
    quiet_ray_logs()


# Merged with a submitted job's own runtime environment; the hook is imported by name on every worker, and the
# telemetry switches are in the workers' environment from their start, on every node.
RUNTIME_ENV: dict[str, Any] = {
    "worker_process_setup_hook": "common.ray_utils.setup_worker",
    "env_vars": dict(TELEMETRY_OFF),
}


def console_env(terminal: bool) -> dict[str, str]:
    """The environment Ray's console output in the driver needs, on a terminal or (``terminal`` false) in a log
    file: there the ``(pid=...)`` prefix of the workers' lines comes without colour codes. Our own console never
    colours anything."""
    if terminal:
        return {}
    return {"RAY_COLOR_PREFIX": "0"}


def quiet_driver() -> None:
    """The driver's share of a quiet console. Ray Data shows no progress of its own, neither bars on a terminal nor
    blocks of lines in a log (the jobs print theirs, and Ray Data's executor still writes its state to ray-data.log
    every few seconds), unless RAY_DATA_DISABLE_PROGRESS_BARS is set, Ray Data's own switch. ``QUIET_RELAYED``
    joins Ray's filter of the lines it relays to this driver."""
    if "RAY_DATA_DISABLE_PROGRESS_BARS" not in os.environ:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
    # Ray reads RAY_DEDUP_LOGS_SKIP_REGEX once, when it is imported: the filter is set on its two relays instead
    from ray._private import ray_logging

    patterns = [p for p in (os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX"), *QUIET_RELAYED) if p]
    skip = re.compile("|".join(f"(?:{p})" for p in patterns))
    for relay in (ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator):
        relay.skip_re = skip


class _Restartable:
    """Made a restartable actor whose argument lives in the object store, it draws the core worker's caution of
    ``QUIET_RELAYED``."""

    def __init__(self, _: object) -> None:
        pass


def _spend_restart_caution() -> None:
    """The driver's own core worker writes its once-per-process caution about restartable actors (``QUIET_RELAYED``)
    to this process's stderr, past any filter of Ray's, when Ray Data starts an actor pool here. Its only setting,
    the C++ log level, would hide every error of that core worker; so the caution is spent at the start, on an
    actor made for it while stderr points at a file in Ray's log folder, and Ray Data's pools come later (the jobs'
    drivers make no restartable actor of their own)."""
    logs = ray._private.worker._global_node.get_logs_dir_path()  # type: ignore[attr-defined]  # None until ray.init
    log = os.path.join(logs, f"driver-{os.getpid()}-start.err")
    sys.stderr.flush()
    console = os.dup(2)
    try:
        with open(log, "ab") as file:
            os.dup2(file.fileno(), 2)
            # the core worker logs while it submits the actor, in this thread; the handle, dropped at once, ends it
            ray.remote(num_cpus=0, max_restarts=1)(_Restartable).remote(ray.put(None))
    finally:
        sys.stderr.flush()
        os.dup2(console, 2)
        os.close(console)


class _InitOptions(TypedDict):
    """The ``ray.init`` arguments shared by joining a cluster and starting a local Ray."""

    logging_level: int
    log_to_driver: bool
    runtime_env: dict[str, Any]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster a submitted job runs on (RAY_ADDRESS), a given address (``auto`` finds a cluster started on
    this machine), or start a local Ray; with the libraries' telemetry off (``common.telemetry``), the quiet logs of
    ``QUIET`` in the driver and every worker, and the driver's quiet console (``quiet_driver``, ``QUIET_RELAYED``).

    Ray 2.59+ local clusters use token authentication; a submitted job and ``ray.init`` on the head node find the
    token Ray wrote under ``~/.ray``; a remote client needs ``RAY_AUTH_MODE=token`` and the token (infra/README).
    """
    disable_telemetry()  # first: a local Ray started below inherits it
    quiet_ray_logs()
    quiet_driver()
    for name, value in console_env(sys.stdout.isatty()).items():
        os.environ.setdefault(name, value)
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: _InitOptions = {"logging_level": logging.WARNING, "log_to_driver": True, "runtime_env": RUNTIME_ENV}
    if address:
        ray.init(address=address, **kwargs)
    else:
        # "local": always a fresh Ray for this process, even where a `ray start` cluster runs on the machine
        _drop(LOCAL_QUIET)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
    _spend_restart_caution()
