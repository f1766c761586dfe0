"""What waits in a Ray cluster, and why: ``snapshot`` reads what the connected cluster has, has free, runs and cannot
place yet; ``describe`` puts it in words, naming who in the job asks for what waits (``common.watchdog`` prints them
when a job stops moving).

Ray's State API (``ray.util.state``) names the pending tasks and actors, but it is served by the dashboard, which a
local Ray started by ``common.ray_utils.init_ray`` runs without. Then the pending resource shapes come from the GCS
(the autoscaler's demand summary, which every Ray keeps) and are named by matching them with the job's ``requests``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# who in the job -> the resources each of its tasks or actors asks Ray for (``{"CPU": 0.5, "memory": 2**30}``)
Requests = Mapping[str, Mapping[str, float]]

_PLACEMENT = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")  # CPU_group_0_<pg id>, bundle_group_<pg id>
_LIST_LIMIT = 10_000  # tasks or actors one State API listing returns; a count at the limit reads "at least"
_GROUPS_SHOWN = 8  # waiting groups per block: a stuck Ray Data chain has one per operator
_BUNDLE = "placement-group bundle"
_PLURALS = {"task": "tasks", "actor": "actors", "task or actor": "tasks or actors", _BUNDLE: _BUNDLE + "s"}


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
