"""A job that stops moving says where, and what it waits for.

``Watchdog`` is a daemon thread beside a job. The job's existing progress points call ``beat`` (a shard committed,
a partition or tar written, a ``Progress`` update, a training step reported by a worker). After
``watchdog.minutes`` without one it prints one block: the stage or phase that is stuck, the Ray tasks and actors
that run or wait, what resources the waiting ones ask for against what the cluster has and has free, and who in the
job asks for that (the ``requests`` a stage declares). It prints again every ``watchdog.minutes`` while the job
stays stuck, and once when progress resumes. It only reports: the job keeps waiting, as Ray does.

Ray's State API (``ray.util.state``) names the pending tasks and actors, but it is served by the dashboard, which a
local Ray started by ``common.ray_utils.init_ray`` runs without. Then the pending resource shapes come from the GCS
(the autoscaler's demand summary, which every Ray keeps) and are named by matching them with the job's ``requests``.

Training workers run in other processes: ``relay(key)`` there makes every ``beat`` in the process reach the driver's
watchdog through Ray's internal key-value store (``stage(follow=key)`` on the driver), from a thread of its own so
that a slow GCS never slows a step.

Nothing here may crash or slow the job: each Ray query runs on a helper thread under a timeout, and an error in the
watchdog's own thread is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import Field

from common.config import Strict

_log = logging.getLogger(__name__)

# who in the job -> the resources each of its tasks or actors asks Ray for (``{"CPU": 0.5, "memory": 2**30}``)
Requests = Mapping[str, Mapping[str, float]]

_NAMESPACE = "humans1b-watchdog"
_PLACEMENT = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")  # CPU_group_0_<pg id>, bundle_group_<pg id>
_LIST_LIMIT = 10_000  # tasks or actors one State API listing returns; a count at the limit reads "at least"
_GROUPS_SHOWN = 8  # waiting groups per block: a stuck Ray Data chain has one per operator
_BUNDLE = "placement-group bundle"
_PLURALS = {"task": "tasks", "actor": "actors", "task or actor": "tasks or actors", _BUNDLE: _BUNDLE + "s"}


class WatchdogSettings(Strict):
    # minutes without progress before the job says what it waits for, and again every as many while it stays
    # stuck; fractions allowed; 0 turns the watchdog off
    minutes: float = Field(10.0, ge=0)


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


# --- what Ray says --------------------------------------------------------------------------------------------------


@dataclass
class Waiting:
    """``count`` tasks, actors or placement-group bundles of one kind, name and shape that wait to be placed."""

    count: int
    kind: str  # task, actor, task or actor (the GCS does not tell them apart), placement-group bundle
    shape: dict[str, float]
    name: str | None = None  # Ray's name of the task or actor class, where the State API gave it


@dataclass
class Snapshot:
    total: dict[str, float]
    free: dict[str, float]
    nodes: list[dict[str, float]]  # each alive node's resources
    waiting: list[Waiting] = field(default_factory=list)
    running: str | None = None  # what runs, in words
    named: bool = False  # whether the State API answered (names, running tasks)
    unknown: str | None = None  # why what waits could not be read


def snapshot(state_api: bool = True, timeout_s: float = 5.0) -> Snapshot:
    """What the connected Ray cluster has, has free, runs and cannot place yet, for this job."""
    import ray

    context = ray.get_runtime_context()
    gcs, job = context.gcs_address, context.get_job_id()
    snap = Snapshot(
        total=dict(ray.cluster_resources()),
        free=dict(ray.available_resources()),
        nodes=[dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")],
    )
    if state_api:
        try:
            snap.waiting, snap.running = _from_state_api(gcs, job, timeout_s)
            snap.named = True
        except Exception:  # noqa: BLE001 - no dashboard (a local Ray of init_ray): the GCS alone below
            pass
    if not snap.named:
        try:
            snap.running = _actors_from_gcs(job)
        except Exception:  # noqa: BLE001 - a count of actors is a nicety
            pass
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        demand = get_cluster_status(gcs, timeout=max(1, math.ceil(timeout_s))).resource_demands
    except Exception as exc:  # noqa: BLE001 - the totals above still say something
        snap.unknown = f"the GCS's summary of what waits could not be read: {type(exc).__name__}: {exc}"
        return snap
    if not snap.named:
        snap.waiting = [
            Waiting(b.count, "task or actor", dict(b.bundle))
            for d in demand.ray_task_actor_demand
            for b in d.bundles_by_count
        ]
    for pg in demand.placement_group_demand:  # Ray Train's worker groups wait as placement groups
        snap.waiting += [Waiting(b.count, _BUNDLE, dict(b.bundle)) for b in pg.bundles_by_count]
    return snap


def _from_state_api(address: str, job: str, timeout_s: float) -> tuple[list[Waiting], str]:
    from ray.util.state import list_actors, list_tasks

    def listing(fn: Callable, state: str, detail: bool = False) -> list:
        filters = [("state", "=", state), ("job_id", "=", job)]
        return fn(
            address=address, filters=filters, detail=detail, limit=_LIST_LIMIT, timeout=timeout_s,
            raise_on_missing_output=False,
        )  # fmt: skip

    groups: Counter = Counter()
    for task in listing(list_tasks, "PENDING_NODE_ASSIGNMENT", detail=True):
        if task.type == "NORMAL_TASK":  # an actor's creation task is counted as the actor below
            groups["task", task.name, _key(task.required_resources or {})] += 1
    for actor in listing(list_actors, "PENDING_CREATION", detail=True):
        groups["actor", actor.class_name, _key(actor.required_resources or {})] += 1
    waiting = [Waiting(n, kind, dict(shape), name) for (kind, name, shape), n in groups.items()]
    tasks = listing(list_tasks, "RUNNING")
    actors = Counter(a.class_name for a in listing(list_actors, "ALIVE"))
    alive = _count(sum(actors.values()), "actor")
    return waiting, f"this job: {_count(len(tasks), 'task')} running, {alive} alive{_names(actors)}"


def _actors_from_gcs(job: str) -> str | None:
    from ray._private import state

    by_state: dict[str, Counter] = {}
    for actor in state.actors().values():
        if actor.get("JobID") == job and actor.get("State") != "DEAD":
            by_state.setdefault(actor.get("State", "?"), Counter())[actor.get("ActorClassName", "?")] += 1
    if not by_state:
        return None
    parts = [
        f"{sum(names.values())} {state_name.lower().replace('_', ' ')}{_names(names)}"
        for state_name, names in sorted(by_state.items())
    ]
    return "this job: actors " + ", ".join(parts)


def _key(shape: Mapping[str, float]) -> tuple:
    return tuple(sorted((r, float(v)) for r, v in shape.items() if v))


def _count(n: int, noun: str) -> str:
    more = "at least " if n >= _LIST_LIMIT else ""
    return f"{more}{n} {noun}{'' if n == 1 else 's'}"


def _names(names: Counter) -> str:
    # Ray's own helpers (_StatsActor, ...) are counted, not named
    ours = [(name, n) for name, n in names.most_common() if not name.startswith("_")]
    if not ours:
        return ""
    shown = ", ".join(f"{n} {name}" for name, n in ours[:4])
    return f" ({shown}{', ...' if len(ours) > 4 else ''})"


# --- the words ------------------------------------------------------------------------------------------------------


def describe(snap: Snapshot, requests: Requests | None = None, groups: Requests | None = None) -> list[str]:
    """The block's Ray lines: each waiting group with what it asks for, what the cluster has, and why it waits;
    the requests of the job that no node could ever hold; what runs; the cluster."""
    requests, groups = requests or {}, groups or {}
    lines = []
    matched = set()
    waiting = sorted(snap.waiting, key=lambda w: -w.count)
    for w in waiting[:_GROUPS_SHOWN]:
        owners = _owners(w, groups if w.kind == _BUNDLE else requests)
        matched.update(owners)
        of = f" of {_or(owners)}" if owners else ""
        named = f" ({w.name})" if w.name else ""
        verb = "waits" if w.count == 1 else "wait"
        why = _why(w.shape, snap, w.count > 1, None if w.kind == _BUNDLE else groups)
        lines.append(
            f"{w.count} {w.kind if w.count == 1 else _PLURALS[w.kind]}{of}{named} {verb} for {_shape(w.shape)}; "
            f"the cluster has {_has(w.shape, snap)}: {why}"
        )
    if len(waiting) > _GROUPS_SHOWN:
        lines.append(f"... and {sum(w.count for w in waiting[_GROUPS_SHOWN:])} more waiting")
    unplaceable = [
        (who, s) for who, s in {**requests, **groups}.items() if who not in matched and not _fits(s, snap.nodes)
    ]
    for who, shape in unplaceable:  # asked for, but not (yet) among what Ray says waits
        lines.append(
            f"{who} asks for {_shape(shape)} each; the cluster has {_has(shape, snap)}: {_why(shape, snap, True)}"
        )
    if snap.unknown:
        lines.append(snap.unknown)
    elif not waiting and not unplaceable:
        lines.append(
            "nothing waits for cluster resources: what runs is slow or blocked (a long or hung task, I/O, a lock, "
            "workers still starting)"
        )
    if not snap.named:
        lines.append("(names of tasks need Ray's State API, served by the dashboard, which this Ray runs without)")
    if snap.running:
        lines.append(snap.running)
    lines.append(f"cluster: {_count(len(snap.nodes), 'node')}; {_resources(snap)}")
    return lines


def _owners(w: Waiting, requests: Requests) -> list[str]:
    same = [who for who, shape in requests.items() if _key(shape) == _key(w.shape)]
    if w.name and len(same) > 1:  # Ray's name settles which of the same shape it is: "MapBatches(person)"
        named = [who for who in same if who.split()[-1].strip("()") in w.name]
        same = named or same
    return same


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _fits(shape: Mapping[str, float], nodes: list[dict[str, float]]) -> bool:
    return any(all(node.get(r, 0.0) + 1e-9 >= v for r, v in shape.items() if v) for node in nodes)


def _why(shape: Mapping[str, float], snap: Snapshot, many: bool, groups: Requests | None = None) -> str:
    """Why work of ``shape`` waits; ``groups``: the job's placement groups, when the work runs outside them."""
    they, wait, start = ("they", "wait", "start") if many else ("it", "waits", "starts")
    if not _fits(shape, snap.nodes):
        short = [r for r, v in shape.items() if v and max((n.get(r, 0.0) for n in snap.nodes), default=0.0) < v]
        if short:
            return (
                f"no node has {' or '.join(f'{_amount(r, shape[r])} {r}' for r in short)}, so {they} {wait} until one "
                "joins (add such a node, or lower the request)"
            )
        return f"no single node has all of it, so {they} {wait} until one joins (add such a node, or lower the request)"
    busy = [r for r, v in shape.items() if v and snap.free.get(r, 0.0) + 1e-9 < v]
    for r in busy if groups is not None else ():
        held, total = _reserved(snap, r), snap.total.get(r, 0.0)
        if held and total - held + 1e-9 < shape[r]:  # what placement groups leave cannot hold it: a deadlock if
            by = f" of {_or(list(groups))}" if groups else ""  # the work inside them waits on this work
            return (
                f"placement groups{by} reserve {_amount(r, held)} of the {_amount(r, total)} {r}, leaving less than "
                f"{they} need: if what runs inside them waits on {'these' if many else 'this'}, nothing will free "
                f"it (reserve less, or add {r})"
            )
    if busy:
        return f"{they} {start} when the running work frees {' and '.join(busy)}"
    return f"enough is free now, so {they} should start shortly"


def _reserved(snap: Snapshot, resource: str) -> float:
    """How much of ``resource`` placement groups hold: each group's reservation shows as ``<resource>_group_<id>``."""
    pattern = re.compile(re.escape(resource) + r"_group_[0-9a-f]{16,}")
    return sum(v for r, v in snap.total.items() if pattern.fullmatch(r))


def _has(shape: Mapping[str, float], snap: Snapshot) -> str:
    parts = []
    for r in sorted(shape, key=_order):
        if not shape[r]:
            continue
        total = snap.total.get(r, 0.0)
        parts.append(f"no {r}" if not total else f"{_amount(r, total)} {r} ({_amount(r, snap.free.get(r, 0.0))} free)")
    return ", ".join(parts)


def _resources(snap: Snapshot) -> str:
    names = sorted((r for r in snap.total if not _internal(r)), key=_order)
    return ", ".join(f"{_amount(r, snap.total[r])} {r} ({_amount(r, snap.free.get(r, 0.0))} free)" for r in names)


def _internal(resource: str) -> bool:
    """Resources Ray derives for itself: a node's name, its accelerator type, a placement group's reservations."""
    return resource.startswith(("node:", "accelerator_type:")) or _PLACEMENT.search(resource) is not None


def _shape(shape: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {_amount(r, shape[r])}" for r in sorted(shape, key=_order) if shape[r]) + "}"


def _order(resource: str) -> tuple:
    return {"CPU": 0, "GPU": 1, "memory": 2, "object_store_memory": 3}.get(resource, 4), resource


def _amount(resource: str, value: float) -> str:
    if resource in ("memory", "object_store_memory"):
        return f"{value / 2**30:.2g} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"
    return f"{value:g}"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
