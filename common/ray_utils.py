"""Connecting to Ray the same way from ``python -m`` and from ``ray job submit``."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, TypedDict

import ray

from common.telemetry import TELEMETRY_OFF, disable_telemetry

# Ray log lines that tell a user nothing to act on, by the logger that writes them: the start of each message. Ray's
# warnings about resources and failures, and its progress bars, are kept.
QUIET = {
    # every few seconds for a whole training run: the check needs the State API, served by the dashboard that a
    # local Ray here runs without (the clean-up it guards still happens when the run ends)
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": (
        "Failed to query Ray Train Controller actor state",
    ),
    # every rank's whole report at each checkpoint; this logger is named by its file's path, so Ray Train's own
    # log level (RunConfig's LoggingConfig, which quiets its other INFO lines) does not reach it
    os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py"): (
        "Reporting training result",
    ),
    # two lines per dataset (kept in Ray Data's log file); pretraining starts one per worker and plan chunk
    "ray.data._internal.execution.streaming_executor": ("Starting execution of Dataset", "Execution plan of Dataset"),
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
    file: there Ray Data logs its progress as plain lines (it draws bars on a terminal only), every minute rather than
    every 10 s, and the ``(pid=...)`` prefix of the workers' lines comes without colour codes. Our own console never
    colours anything."""
    if terminal:
        return {}
    return {"RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL": "60", "RAY_COLOR_PREFIX": "0"}


class _InitOptions(TypedDict):
    """The ``ray.init`` arguments shared by joining a cluster and starting a local Ray."""

    logging_level: int
    log_to_driver: bool
    runtime_env: dict[str, Any]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster a submitted job runs on (RAY_ADDRESS), a given address (``auto`` finds a cluster started on
    this machine), or start a local Ray; with the libraries' telemetry off (``common.telemetry``) and the quiet logs
    of ``QUIET`` in the driver and every worker.

    Ray 2.59+ local clusters use token authentication; a submitted job and ``ray.init`` on the head node find the
    token Ray wrote under ``~/.ray``; a remote client needs ``RAY_AUTH_MODE=token`` and the token (infra/README).
    """
    disable_telemetry()  # first: a local Ray started below inherits it
    quiet_ray_logs()
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
