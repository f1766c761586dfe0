"""An exclusive lease on an output folder (local or object store): one run writes it at a time.

Two runs on one output (a double submit, an overlapping retry) would delete and overwrite each other's files, so a
job takes the lease before it changes anything and gives it back when it ends. The lease is one record,
``<root>/_state/lease.json``: the holder (host, pid, Ray job submission id, start time, a random token) and a
heartbeat time that a background thread refreshes every ``heartbeat_s``.

**Taking it.** Read the record; refuse when another holder's lease is live. Otherwise write ours, wait
``settle_s``, read it back, and hold the lease only if the record read back is ours. pyarrow's filesystems offer no
create-if-absent, but every store they reach is last-writer-wins with read-after-write consistency (S3 since 2020,
GCS, a local rename), so of contenders racing for a free lease only the last writer reads its own token back.
Guarantee: two runs both hold the lease only if one of them took longer than ``settle_s`` between reading the
record and its write landing (a pause, a stalled request). Even then the holder reads the record before each
commit-point write (``check``) and on every heartbeat, so the overtaken run stops at its next check; what no
store without conditional writes can fence is the one write of a run paused between its check and that write.

**When a lease is not live.** Its heartbeat is older than ``stale_s`` (default 5 min, 10 heartbeats; compared with
this machine's clock, so clocks must agree to well under that); or its holder ran on this machine (same boot and
pid namespace) and that process is gone, so a killed driver resubmitted on the same node resumes at once; or the
new run is started with ``--break-lease``. The first two are taken over with a log line.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable

from common.layout import LAYOUT
from common.storage import (
    DamagedRecordError,
    delete_quietly,
    is_local,
    join,
    read_json,
    redact,
    resolve,
    write_json_atomic,
)

HEARTBEAT_S = 30.0
STALE_S = 300.0
# The wait between writing a claim and reading it back; it must exceed a contender's read-to-write time.
SETTLE_S = {"local": 0.5, "remote": 2.0}

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another live run holds the lease; the message names it and says how to break it."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over by another run; it must stop writing."""


def _machine() -> str:
    """Where a pid means one process: this boot and pid namespace on Linux (containers sharing a hostname differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"host:{socket.gethostname()}"


def _process(pid: int) -> str | None:
    """An identity of the live process ``pid`` that a reused pid does not share; None when there is none."""
    if pid <= 0:
        return None
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"  # field 22: start time since boot
        except OSError:
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return str(pid)


def _ray_job_id() -> str | None:
    """The submission id when this process is the entrypoint of a ``ray job submit``."""
    try:
        return json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"])["metadata"]["job_submission_id"]
    except (KeyError, ValueError, TypeError):
        return None


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def interrupt_main(lost: LeaseLost) -> None:
    """An ``on_lost`` for jobs: interrupt the main thread as Ctrl-C would (Ray Train aborts its run; elsewhere
    ``KeyboardInterrupt`` is raised), so a job stops between its commit points, not only at its next ``check``."""
    _thread.interrupt_main()


def exit_code_holding(lease: Lease, job: Callable[[], int]) -> int:
    """Run a job's body, which takes ``lease`` (``interrupt_main`` as its ``on_lost``); a lost lease ends the job with
    its message and exit code 2; the lease is given back however the job ends."""
    try:
        return job()
    except (LeaseLost, KeyboardInterrupt):
        if lease.lost is None:
            raise
        print(f"error: {lease.lost}", file=sys.stderr)
        return 2
    finally:
        lease.release()


def _describe(record: dict) -> str:
    job = f", Ray job {record['ray_job']}" if record.get("ray_job") else ""
    return f"{record.get('command', '?')} (host {record.get('host')}, pid {record.get('pid')}{job})"


class Lease:
    """The lease on ``root_uri``; ``acquire`` it, ``check`` it before commit-point writes, ``release`` it at the end.

    ``on_lost`` runs in the heartbeat thread when a heartbeat finds the lease taken over (a job interrupts its main
    thread there, to stop between commit points too).
    """

    def __init__(
        self,
        root_uri: str,
        *,
        holder: str = "",
        heartbeat_s: float = HEARTBEAT_S,
        stale_s: float = STALE_S,
        settle_s: float | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
    ) -> None:
        if stale_s < 3 * heartbeat_s:
            raise ValueError(f"stale_s ({stale_s}) must be several heartbeats ({heartbeat_s} s each)")
        self.root_uri, self.uri = root_uri, redact(root_uri)
        self.heartbeat_s, self.stale_s, self.on_lost = heartbeat_s, stale_s, on_lost
        self.settle_s = settle_s
        self.holder = holder or os.path.basename(sys.argv[0] or "python")
        self.token = uuid.uuid4().hex
        self.record: dict | None = None  # ours, while held
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.record is not None and self.lost is None

    def _read(self) -> dict | None:
        """The lease record, None when there is none; raises ``DamagedRecordError`` for one that cannot be read."""
        try:
            return read_json(
                self.fs,
                self.path,
                advice=(
                    "It keeps two runs off one output, and a damaged one may still be another run's, so this run does "
                    "not take it. Wait for any other run on this output to end, then rerun this command with "
                    "--break-lease, which writes it anew"
                ),
            )
        except FileNotFoundError:
            return None

    def _refusal(self, record: dict, why: str) -> LeaseHeld:
        now = time.time()
        started, beat = _ago(now - record.get("started", now)), _ago(now - record.get("heartbeat", 0))
        return LeaseHeld(
            f"{self.uri} is leased by another run{why}: {_describe(record)}, started {started} ago, last heartbeat "
            f"{beat} ago. Two runs on one output delete each other's files, so this one stops. Wait for that run to end "
            f"or stop it; its lease is taken over automatically once its heartbeat is older than {_ago(self.stale_s)}. "
            f"If that run is surely gone, rerun this command with --break-lease (record: {self.uri}/{LAYOUT.lease})."
        )

    def _free_to_take(self, record: dict) -> str | None:
        """Why ``record`` (another holder's) may be taken over, or None while it is live."""
        age = time.time() - record.get("heartbeat", 0)
        if age > self.stale_s:
            return f"its heartbeat is {_ago(age)} old (stale after {_ago(self.stale_s)})"
        if record.get("machine") == _machine() and _process(record.get("pid", -1)) != record.get("process"):
            return f"its process {record.get('pid')} on this machine has ended"
        return None

    def acquire(self, force: bool = False) -> Lease:
        """Take the lease (``force``: also from a live holder); raises ``LeaseHeld`` when another run holds it."""
        self.fs, root = resolve(self.root_uri)
        self.path = join(root, LAYOUT.lease)
        try:
            current = self._read()
        except DamagedRecordError as exc:
            if not force:
                raise LeaseHeld(str(exc)) from None
            log.info(
                f"[lease] taking over the lease on {self.uri}: --break-lease was given ({exc.path}: {exc.problem})"
            )
            current = None
        if current is not None and current.get("token") != self.token:
            reason = "--break-lease was given" if force else self._free_to_take(current)
            if reason is None:
                raise self._refusal(current, "")
            log.info(f"[lease] taking over the lease on {self.uri} from {_describe(current)}: {reason}")
        now = time.time()
        pid = os.getpid()
        self.record = {
            "token": self.token,
            "command": self.holder,
            "host": socket.gethostname(),
            "pid": pid,
            "process": _process(pid),
            "machine": _machine(),
            "ray_job": _ray_job_id(),
            "started": now,
            "heartbeat": now,
        }
        write_json_atomic(self.fs, self.path, self.record)
        time.sleep(self.settle_s if self.settle_s is not None else SETTLE_S["local" if is_local(self.fs) else "remote"])
        try:
            winner = self._read()
        except DamagedRecordError as exc:  # another writer's bytes landed over ours
            self.record = None
            raise LeaseHeld(str(exc)) from None
        if winner is None or winner.get("token") != self.token:
            self.record = None
            if winner is None:
                raise LeaseHeld(
                    f"{self.uri}: the lease record vanished while this run was taking it; rerun the command"
                )
            raise self._refusal(winner, " (it claimed the output at the same time as this one)")
        self._beats = threading.Thread(target=self._beat_until_stopped, name="lease-heartbeat", daemon=True)
        self._beats.start()
        return self

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this run still holds the lease; call it right before a commit-point write."""
        if self.lost is None:
            try:
                current = self._read()
                taker = _describe(current) if current else "nobody (its record was deleted)"
            except DamagedRecordError as exc:  # not ours any more, whoever wrote it: stopping is the safe side
                current, taker = None, f"an unknown run ({exc.path} is damaged: {exc.problem})"
            if current is None or current.get("token") != self.token:
                self.lost = LeaseLost(
                    f"{self.uri}: this run lost its lease to {taker}, so it stops before its next commit and leaves the "
                    "output to the other run. Rerun the same command once that run has ended to resume."
                )
        if self.lost is not None:
            raise self.lost

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.check()
                assert self.record is not None  # set before this thread starts; cleared only after it is joined
                write_json_atomic(self.fs, self.path, {**self.record, "heartbeat": time.time()})
            except LeaseLost as exc:
                log.warning(f"[lease] {exc}")
                if self.on_lost is not None:
                    self.on_lost(exc)
                return
            except OSError as exc:  # a store hiccup: the next beat retries; stale_s spans many beats
                log.warning(f"[lease] heartbeat on {self.uri} failed, retrying: {exc}")

    def release(self) -> None:
        """Stop the heartbeat and delete the record if it is still ours."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join()
        if self.held:
            try:
                ours = (self._read() or {}).get("token") == self.token
            except DamagedRecordError:  # not ours: leave it to whoever wrote it
                ours = False
            if ours:
                delete_quietly(self.fs, self.path)
        self.record = None
