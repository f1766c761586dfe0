"""Which failures of a training run a restart can fix, and the one line a job ends with for the others.

Ray Train restarts a failed worker group up to ``ray.max_failures`` times, from the newest committed checkpoint. That
fixes what a spot cluster does (a node lost or preempted, a collective cut off), and nothing else: a data shard gone,
a full disk, a refused quota or a setting that does not fit the checkpoint fail again on every attempt, each after
retraining the steps since that checkpoint. So the failures are split once, here:

- **permanent**: the project's own errors that name a file or setting (``Permanent``, ``ConfigError``,
  ``StorageError``; ``DataError`` and ``CheckpointError`` are ``Permanent``) and the OS errors no retry clears
  (``PERMANENT_ERRNO``: disk full, quota, read-only, permission; an object store's access refusal). A worker turns
  one into ``Permanent`` with one line (``permanent``), the controller's ``FailurePolicy`` then ends the run at once
  instead of restarting it (``StopOnPermanent``), and the job prints that line and exits with 2 (``ended``).
- **transient**: everything else, restarted within ``FailureConfig`` as Ray Train does; when they outlast it, the
  job ends with one line too (``Exhausted``, exit 1).

The traceback of a permanent failure goes to ``<run>/errors/`` (one file per rank and failure), not to the console.
"""

from __future__ import annotations

import errno
import logging
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from common import storage
from common.config import ConfigError
from common.storage import StorageError

ERRORS = "errors"  # <run>/errors/: the tracebacks of the failures that ended a run
PERMANENT_ERRNO = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
STORE_REFUSALS = ("ACCESS_DENIED", "AccessDenied", "QuotaExceeded")  # an object store's permanent refusals
WHAT_TO_DO = {
    errno.ENOSPC: "free space there (or lower checkpoint.keep), then run the same command again",
    errno.EDQUOT: "raise the quota or free space there, then run the same command again",
}


class Permanent(Exception):
    """A failure no restart fixes: its message is the one line the job ends with (the file or setting named, what to
    do next)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps, each once: causes, contexts, a Ray task error's ``cause`` and the ranks' errors a
    DCP ``CheckpointException`` gathered."""
    from torch.distributed.checkpoint.api import CheckpointException  # torch only where a chain is walked

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        if isinstance(e, CheckpointException):
            todo += [wrapped for wrapped, _ in e.failures.values()]


def os_error(exc: BaseException) -> OSError | None:
    """The first OS error ``exc`` is or wraps."""
    return next((e for e in _chain(exc) if isinstance(e, OSError)), None)


PERMANENT_TYPES = (Permanent, ConfigError, StorageError)


def _permanent_names() -> set[str]:
    """The qualified names of the permanent error types (those of the modules imported so far)."""
    names, todo = set(), list(PERMANENT_TYPES)
    while todo:
        t = todo.pop()
        names.add(f"{t.__module__}.{t.__qualname__}")
        todo += t.__subclasses__()
    return names


def _in_task_text(e: BaseException) -> str | None:
    """A permanent error a Ray task raised, as its text carries it: a task's error reaches the caller as a
    ``RayTaskError`` whose message holds the task's traceback (``pretrain.data.DataError: <message>``), the original
    exception object itself left behind (Ray Data's ``UserCodeException`` wraps it)."""
    names = _permanent_names()
    for line in str(e).splitlines():
        name, sep, message = line.strip().partition(": ")
        if sep and name in names:
            return message
    return None


def permanent(exc: BaseException) -> str | None:
    """The one line of a permanent failure, or None for a transient one."""
    for e in _chain(exc):
        if isinstance(e, PERMANENT_TYPES):
            return str(e).splitlines()[0] if str(e) else type(e).__name__
        if (line := _in_task_text(e)) is not None:
            return line
        if isinstance(e, OSError) and e.errno in PERMANENT_ERRNO:
            where = f" writing {e.filename}" if e.filename else ""
            todo = WHAT_TO_DO.get(e.errno, "fix that, then run the same command again")
            return f"{PERMANENT_ERRNO[e.errno]}{where}: {todo}"
        if isinstance(e, OSError) and any(s in str(e) for s in STORE_REFUSALS):
            return f"the object store refused: {str(e).splitlines()[0]}; check the credentials and quota of --storage"
    return None


def record(run_uri: str, rank: int, exc: BaseException) -> None:
    """Keep ``exc``'s traceback under ``<run>/errors/`` (where a full disk allows it)."""
    fs, run = storage.resolve(run_uri)
    try:
        fs.create_dir(storage.join(run, ERRORS), recursive=True)
        with fs.open_output_stream(storage.join(run, ERRORS, f"rank-{rank:05d}-{time.time_ns()}.txt")) as f:
            f.write("".join(traceback.format_exception(exc)).encode())
    except Exception:  # noqa: BLE001 - the failure itself is what the run ends with
        pass


RAY_TRAIN_ERRORS = "ray.train.v2._internal.util"  # the logger of Ray Train's "Error in training function"


def _not_permanent(rec: logging.LogRecord) -> bool:
    return f"{Permanent.__module__}.{Permanent.__qualname__}" not in rec.getMessage()


@contextmanager
def classified(run_uri: str, rank: int) -> Iterator[None]:
    """A worker's training loop: a permanent failure leaves as ``Permanent`` with its one line (its traceback
    ``record``-ed), which Ray Train then does not restart; a transient one leaves as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        line = permanent(exc)
        if line is None:
            raise
        record(run_uri, rank, exc)
        # Ray Train logs every failure's traceback at error level; a permanent one is the job's one line instead
        logging.getLogger(RAY_TRAIN_ERRORS).addFilter(_not_permanent)
        raise Permanent(line) from None


class Exhausted(Exception):
    """Transient failures outlasted Ray Train's restarts (``ray.max_failures``): the message is the job's last line."""


def ended(exc: BaseException) -> Permanent | Exhausted:
    """What a job ends with when Ray Train's run failed with ``exc`` (its ``TrainingFailedError``): a permanent
    failure's own line, or the last transient failure's, each one line."""
    failures = getattr(exc, "worker_failures", {}) or {}
    for rank in sorted(failures):
        line = permanent(failures[rank])
        if line:
            return Permanent(line)
    first = next((failures[r] for r in sorted(failures)), exc)
    detail = str(first).strip().splitlines()
    return Exhausted(
        f"training failed again after its restarts (ray.max_failures): {type(first).__name__}: "
        f"{detail[-1] if detail else ''}; the same command resumes from the newest committed checkpoint"
    )


def stop_on_permanent(policy):  # -> FailurePolicy; Ray Train's internal type, imported late
    """Ray Train's failure policy, except that a worker group whose failure is ``permanent`` is not restarted."""
    from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
    from ray.train.v2.api.exceptions import WorkerGroupError

    class StopOnPermanent(FailurePolicy):
        def __init__(self, inner: FailurePolicy) -> None:
            super().__init__(inner.failure_config)
            self.inner = inner

        def make_decision(self, training_failed_error) -> FailureDecision:
            if isinstance(training_failed_error, WorkerGroupError) and any(
                permanent(e) for e in training_failed_error.worker_failures.values()
            ):
                return FailureDecision.RAISE
            return self.inner.make_decision(training_failed_error)

    return StopOnPermanent(policy)
