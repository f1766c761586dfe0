"""A job that stops moving says where, and what it waits for.

``Watchdog`` is a daemon thread beside a job. The job's existing progress points call ``beat`` (a shard committed,
a partition or tar written, a ``Progress`` update, a training step reported by a worker). After
``watchdog.minutes`` without one it prints one block: the stage or phase that is stuck, the Ray tasks and actors
that run or wait, what resources the waiting ones ask for against what the cluster has and has free, and who in the
job asks for that (the ``requests`` a stage declares). It prints again every ``watchdog.minutes`` while the job
stays stuck, and once when progress resumes. It only reports: the job keeps waiting, as Ray does.

What Ray has, runs and cannot place, and the words for it, come from ``common.ray_waits``.

Training workers run in other processes: ``relay(key)`` there makes every ``beat`` in the process reach the driver's
watchdog through Ray's internal key-value store (``stage(follow=key)`` on the driver), from a thread of its own so
that a slow GCS never slows a step.

Nothing here may crash or slow the job: each Ray query runs on a helper thread under a timeout, and an error in the
watchdog's own thread is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import Field

from common.config import Strict
from common.ray_waits import Requests, describe, snapshot

_log = logging.getLogger(__name__)

_NAMESPACE = "humans1b-watchdog"


class WatchdogSettings(Strict):
    """The ``watchdog`` section: when a job that stops moving says where, and what it waits for."""

    minutes: float = Field(
        10.0,
        ge=0,
        description="Minutes without progress before the job says what it waits for, and again every as many while "
        "it stays stuck; fractions allowed. 0 turns the watchdog off.",
    )


# --- the process-wide beat ------------------------------------------------------------------------------------------

_active: list[Watchdog] = []
_relay: _Relay | None = None


def beat(label: str | None = None) -> None:
    """Progress happened (``label`` says what): tells this process's running watchdogs, or the driver's through the
    relay. Costs nothing without either."""
    for watchdog in list(_active):
        watchdog.beat(label)
    if _relay is not None:
        _relay.label = label or "progress"


def stage(
    name: str, requests: Requests | None = None, *, groups: Requests | None = None, follow: str | None = None
) -> None:
    """The job enters stage ``name`` (counts as progress). ``requests``: what its tasks and actors ask Ray for;
    ``groups``: what each bundle of its placement groups asks for (a Ray Train worker group); ``follow``: a key
    that workers ``relay`` their beats to."""
    for watchdog in list(_active):
        watchdog.stage(name, requests, groups=groups, follow=follow)


def progress_key(run: str) -> str:
    """The relay key of a run (a training run's URI), free of whatever the URI carries."""
    return "progress-" + hashlib.sha256(run.encode()).hexdigest()[:24]


def relay(key: str | None, every_s: float = 2.0) -> None:
    """From now on this process's beats reach the watchdog that follows ``key`` (at most one write every ``every_s``
    seconds, from a daemon thread); ``None`` stops that. Call it in a Ray worker; where the key-value store is out
    of reach the relay ends quietly."""
    global _relay
    if _relay is not None and _relay.key == key:
        return
    if _relay is not None:
        _relay.stop.set()
    _relay = None if key is None else _Relay(key, every_s)


class _Relay:
    def __init__(self, key: str, every_s: float) -> None:
        self.key, self.every_s = key, every_s
        self.label: str | None = None
        self.stop = threading.Event()
        threading.Thread(target=self._run, name="watchdog-relay", daemon=True).start()

    def _run(self) -> None:
        sent = None
        while not self.stop.wait(self.every_s):
            label = self.label
            if label is None or label is sent:  # identity, not equality: a new beat with the same words is progress
                continue
            try:
                from ray.experimental import internal_kv

                # a fresh value at every write, so the driver sees each one as new even when the label repeats
                value = f"{time.time_ns()} {label}"
                internal_kv._internal_kv_put(self.key, value, overwrite=True, namespace=_NAMESPACE)
                sent = label
            except Exception:  # noqa: BLE001 - no store, no relay: the driver's watchdog reports a stall then
                return


# --- the watchdog ---------------------------------------------------------------------------------------------------


class Watchdog:
    """``with Watchdog("jobs.curate", cfg.watchdog.minutes): ...`` watches the job while the block runs."""

    def __init__(
        self, job: str, minutes: float, log: Callable[[str], None] | None = None, *, ray_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.job, self.minutes, self.ray_timeout_s, self.clock = job, minutes, ray_timeout_s, clock
        self.log = log or _log.info  # the console handler flushes each line: a stuck job's block is not held back
        self.period = 60.0 * minutes
        self._lock = threading.Lock()
        self._stage = _Stage()
        self._seen: bytes | None = None  # the followed key's value last read; None: not cleared yet
        self._last = clock()
        self._label: str | None = None  # what the last beat said
        self._reported: float | None = None  # when the current stall was last reported; None: not stalled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._query: threading.Thread | None = None  # a Ray query still running past its timeout
        self._state_api: bool | None = None  # whether Ray's State API answers (None: not tried yet)
        self._failed = False

    @property
    def last_progress(self) -> str | None:
        """What the latest beat said."""
        return self._label

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Watchdog:
        if self.period > 0 and self._thread is None:
            _active.append(self)
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self in _active:
            _active.remove(self)

    def stage(
        self, name: str, requests: Requests | None = None, *, groups: Requests | None = None, follow: str | None = None
    ) -> None:
        with self._lock:
            if follow != self._stage.follow:
                self._seen = None
            self._stage = _Stage(name, dict(requests or {}), dict(groups or {}), follow)
        self.beat(f"{name} started")

    def beat(self, label: str | None = None) -> None:
        try:
            with self._lock:
                now = self.clock()
                idle, resumed = now - self._last, self._reported is not None
                self._last, self._label, self._reported = now, label or self._label, None
                where = self._stage.name
            if resumed:
                self.log(
                    f"[watchdog] {self.job}: progress again{f' in {where}' if where else ''} after {_duration(idle)}"
                    f" without: {label or 'progress'}"
                )
        except Exception as exc:  # noqa: BLE001 - the job's own thread: a watchdog fault must never stop it
            self._fault(exc)

    # --- the thread ---

    def _run(self) -> None:
        tick = min(5.0, max(0.05, self.period / 20))
        while not self._stop.wait(tick):
            try:
                self._poll_followed()
                self._check()
            except Exception as exc:  # noqa: BLE001 - logged once; the watchdog keeps watching
                self._fault(exc)

    def _fault(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        try:
            self.log(f"[watchdog] {self.job}: the watchdog hit {type(exc).__name__}: {exc} (not shown again)")
        except Exception:  # noqa: BLE001 - a log that fails cannot be told so
            pass

    def _poll_followed(self) -> None:
        key = self._stage.follow
        if key is None or not _ray_up() or self._busy():
            return
        if self._seen is None:  # an earlier attempt's value is no progress of this one
            self._bounded(lambda: _kv_del(key))
            self._seen = b""
            return
        value = self._bounded(lambda: _kv_get(key))
        if value is not None and value != self._seen:
            self._seen = value
            self.beat(value.decode(errors="replace").partition(" ")[2] or None)

    def _check(self) -> None:
        with self._lock:
            now = self.clock()
            idle = now - self._last
            due = idle >= self.period and (self._reported is None or now - self._reported >= self.period)
            if due:
                self._reported = now
            at, label = self._stage, self._label
        if due:
            self.log(self.report(idle, at, label))

    def report(self, idle: float, at: _Stage, label: str | None) -> str:
        """The block printed after ``idle`` seconds without progress in stage ``at``."""
        last = f"last progress: {label}" if label else "no progress since it started"
        lines = [f"{self.job}: no progress for {_duration(idle)}{f' in {at.name}' if at.name else ''} ({last})"]
        lines += ["  " + line for line in self._ray_lines(at)]
        lines.append(
            f"  the job keeps waiting; this repeats every {_duration(self.period)} while nothing moves "
            f"(watchdog.minutes={self.minutes:g}) and a line says when progress resumes"
        )
        return "\n".join(f"[watchdog] {line}" for line in lines)

    def _ray_lines(self, at: _Stage) -> list[str]:
        if not _ray_up():
            return []
        if self._busy():
            return ["Ray has not answered the previous query yet: its GCS may be overloaded or gone"]
        try:
            snap = self._bounded(lambda: snapshot(self._state_api is not False, self.ray_timeout_s / 2))
        except TimeoutError:
            return [f"Ray did not answer within {self.ray_timeout_s:g} s: its GCS may be overloaded or gone"]
        except Exception as exc:  # noqa: BLE001 - a Ray that cannot say is itself worth a line
            return [f"Ray's state could not be read: {type(exc).__name__}: {exc}"]
        self._state_api = snap.named
        return describe(snap, at.requests, at.groups)

    def _busy(self) -> bool:
        return self._query is not None and self._query.is_alive()

    def _bounded(self, fn: Callable):
        """``fn()`` on a daemon thread, waited for ``ray_timeout_s``; a call that hangs is left behind (and no other
        is started while it runs)."""
        box: dict = {}

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=call, name="watchdog-query", daemon=True)
        thread.start()
        thread.join(self.ray_timeout_s)
        if thread.is_alive():
            self._query = thread
            raise TimeoutError
        if "error" in box:
            raise box["error"]
        return box["value"]


@dataclass(frozen=True)
class _Stage:
    name: str | None = None  # None: the job has named no stage
    requests: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    groups: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    follow: str | None = None


def _ray_up() -> bool:
    ray = sys.modules.get("ray")  # a job that never imported Ray has nothing of Ray to report
    return ray is not None and ray.is_initialized()


def _kv_get(key: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=_NAMESPACE)


def _kv_del(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=_NAMESPACE)


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
