"""The one contract of curation work: a ``Step`` says what its units are and how they run; the ``StepRunner`` owns
everything else, once, for the score phase and every step of dedup, sample, write, the export and the takedown.

A step is a list of units (input shards, survivor partitions, pair partitions, buckets, shard groups), each of which
writes its outputs atomically and ends in a receipt (a small JSON dict: rows, counts, file names). Most steps run a
unit as one Ray task (``run_unit``); the score phase streams its input shards through one Ray Data pipeline and
yields each shard's receipt when its last part is written (``run_units``). The runner:

- fingerprints the step: the phase's fingerprint (its settings, and the release it curates against), the previous
  step's fingerprint (so a change upstream redoes everything after it) and what the step adds (``fingerprint()``:
  its plan, its inputs' footers);
- clears the step's outputs and records when a rerun finds them written under another fingerprint, and only then;
- runs the units not yet receipted (by default through the bounded task window, ``curation.steps.window``), writes
  each receipt as its unit finishes, beats the watchdog and logs progress;
- reduces the receipts, in unit order, to the step's stats, and writes its done record last: a rerun with the same
  fingerprint returns the recorded stats without touching the cluster.

Every record has one format and one place (``common.layout.OutputLayout.step_*``)::

    _state/steps/<phase>/<step>.started.json   {"fingerprint"}
    _state/steps/<phase>/<step>/<unit>.json     {"fingerprint", "receipt"}
    _state/steps/<phase>/<step>.done.json       {"fingerprint", "stats", "seconds", "units"}

At 10^9 images a step has at most ~10^6 units (the score phase's input shards of 10^3 images; a global step's
survivor partitions of 10^5 rows are ~10^4): the driver holds that many receipts and never more than ``window``
tasks in flight; a resume reads the receipts with one listing and ``window.FOOTER_THREADS`` reads at a time.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import ray

from common import watchdog
from common.config import hash_json
from common.layout import LAYOUT
from common.progress import Progress
from common.storage import delete_quietly, exists, list_files, remove_temporaries, write_json_atomic
from curation.records import read_step_record
from curation.steps.output import Output
from curation.steps.window import map_footers, run_tasks

log = logging.getLogger(__name__)


class Step(ABC):
    """One step of curation work. Subclasses set ``name`` (unique within the phase; ``/`` nests, as in
    ``components/round-002/hook``), ``unit_name`` (what progress lines count), and implement ``units`` and
    ``run_unit`` (or ``run_units``, for units that stream); ``outputs`` names what the step writes (cleared with its records when its fingerprint changes),
    ``fingerprint`` what it depends on beyond the phase's settings and the steps before it, and ``reduce`` its
    stats. A unit's receipt must be a small JSON dict: it is recorded and handed back on every rerun."""

    name: ClassVar[str] = ""
    unit_name: ClassVar[str] = "tasks"

    def fingerprint(self) -> Any:
        return None

    def outputs(self) -> Sequence[str]:
        return ()

    @abstractmethod
    def units(self) -> Sequence[str]: ...

    def run_unit(self, unit: str) -> ray.ObjectRef:
        """One Ray task running ``unit``, whose result is its receipt."""
        raise NotImplementedError(f"step {self.name} runs its units neither one task each nor as a stream")

    def run_units(self, todo: Sequence[str], window: int, progress: Progress) -> Iterator[tuple[str, dict]]:
        """``(unit, receipt)`` for each unit of ``todo`` as it finishes. Default: ``run_unit`` for each, at most
        ``window`` in flight, in ``todo``'s order. A step whose units stream through one Ray Data pipeline (the score
        phase's input shards) yields them as they complete instead."""
        launches = (lambda u=u: self.run_unit(u) for u in todo)
        return zip(todo, run_tasks(launches, window, ordered=True, progress=progress))

    def reduce(self, receipts: Sequence[dict]) -> dict:
        """The step's stats from every unit's receipt, in ``units()`` order. Default: the sum of each numeric field."""
        totals: dict[str, Any] = {}
        for receipt in receipts:
            for key, value in receipt.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    totals[key] = totals.get(key, 0) + value
        return totals


class StepRunner:
    """Runs the steps of one phase of ``output`` in order (see the module docstring). ``phase_fingerprint``: the
    phase's settings fingerprint; ``window``: tasks in flight; ``guard`` runs before each done record and raises
    when this run may no longer write the output (``common.lease.Lease.check``)."""

    def __init__(
        self,
        output: Output,
        phase: str,
        phase_fingerprint: str,
        window: int,
        guard: Callable[[], None] = lambda: None,
    ):
        self.output, self.phase, self.window, self.guard = output, phase, window, guard
        self._phase_fingerprint = self.previous = phase_fingerprint

    @property
    def phase_fingerprint(self) -> str:
        """The phase's settings fingerprint the runner was made with (the first step's ``previous``)."""
        return self._phase_fingerprint

    def fingerprint(self, step: Step) -> str:
        return hash_json({"previous": self.previous, "step": step.name, "own": step.fingerprint()})

    def run(self, step: Step) -> dict:
        """The step's stats: recorded ones when it is done with this fingerprint, else from running its missing
        units. The next step's fingerprint follows from this one."""
        out, fingerprint = self.output, self.fingerprint(step)
        self.previous = fingerprint
        done = self._record(LAYOUT.step_done(self.phase, step.name), "done")
        if done is not None and done["fingerprint"] == fingerprint and self._all_receipted(step, done):
            return done["stats"]
        watchdog.stage(f"{self.phase} step {step.name}")
        start = time.monotonic()
        self._claim(step, fingerprint)
        units = list(step.units())
        receipts = self._recorded(step, fingerprint)
        todo = [u for u in units if u not in receipts]
        if len(todo) < len(units):
            log.info(
                f"[{self.phase}] {step.name}: {len(units) - len(todo)} of {len(units)} {step.unit_name} done before"
            )
        shown = Progress(f"[{self.phase}] {step.name}", len(todo), log.info, unit=step.unit_name)
        for unit, receipt in step.run_units(todo, self.window, shown):
            write_json_atomic(
                out.fs,
                out.path(LAYOUT.step_unit(self.phase, step.name, unit)),
                {"fingerprint": fingerprint, "receipt": receipt},
            )
            receipts[unit] = receipt
        stats = step.reduce([receipts[u] for u in units])
        self.guard()
        seconds = round(time.monotonic() - start, 2)
        record = {"fingerprint": fingerprint, "stats": stats, "seconds": seconds, "units": len(units)}
        write_json_atomic(out.fs, out.path(LAYOUT.step_done(self.phase, step.name)), record)
        return stats

    # --- records ---------------------------------------------------------------------------------------------------

    def _record(self, rel: str, kind: str) -> dict | None:
        path = self.output.path(rel)
        return read_step_record(self.output.fs, path, self.phase, kind) if exists(self.output.fs, path) else None

    def _all_receipted(self, step: Step, done: dict) -> bool:
        """Whether every unit the done record counts still has its receipt: a receipt deleted to have its unit run
        again (as a damaged record's advice says) reopens the step. One listing (~10^3 calls for 10^6 units)."""
        if "units" not in done:  # a record written before they were counted
            return True
        have = len(list_files(self.output.fs, self.output.path(LAYOUT.step_units(self.phase, step.name)), ".json"))
        if have == done["units"]:
            return True
        log.info(
            f"[{self.phase}] {step.name}: {done['units'] - have} of {done['units']} receipts gone: runs them again"
        )
        return False

    def _claim(self, step: Step, fingerprint: str) -> None:
        """Keep what an interrupted run of this fingerprint wrote (less its torn temporaries); clear anything else."""
        out = self.output
        started = self._record(LAYOUT.step_started(self.phase, step.name), "started")
        folders = [*step.outputs(), LAYOUT.step_units(self.phase, step.name)]
        if started is not None and started["fingerprint"] == fingerprint:
            for rel in folders:
                remove_temporaries(out.fs, out.path(rel), recursive=True)
            return
        if started is not None:
            log.info(f"[{self.phase}] {step.name}: settings or inputs changed since it ran: its outputs are cleared")
        for rel in (*folders, LAYOUT.step_done(self.phase, step.name)):
            delete_quietly(out.fs, out.path(rel))
        write_json_atomic(out.fs, out.path(LAYOUT.step_started(self.phase, step.name)), {"fingerprint": fingerprint})

    def _recorded(self, step: Step, fingerprint: str) -> dict[str, dict]:
        out = self.output
        paths = list_files(out.fs, out.path(LAYOUT.step_units(self.phase, step.name)), ".json")
        records = map_footers(lambda p: read_step_record(out.fs, p, self.phase, "unit"), paths)
        return {
            p.rsplit("/", 1)[-1].removesuffix(".json"): r["receipt"]
            for p, r in zip(paths, records)
            if r["fingerprint"] == fingerprint
        }


class TaskStep(Step):
    """A step whose unit ``u`` is ``task.remote(*calls[u])``, the units in ``calls``' order (a class attribute, so a
    test can put a counting or failing task in its place); ``own`` is what the step adds to its fingerprint. Stats:
    the receipts in unit order, unless a subclass (or ``task_step``'s ``reduce``) sums them up."""

    task: ClassVar[Any]  # a Ray remote function

    def __init__(self, calls: Mapping[str, tuple], own: Any = None):
        self.calls, self.own = dict(calls), own

    def fingerprint(self) -> Any:
        return self.own

    def units(self) -> list[str]:
        return list(self.calls)

    def run_unit(self, unit: str) -> ray.ObjectRef:
        return self.task.remote(*self.calls[unit])

    def reduce(self, receipts: Sequence[dict]) -> dict:
        return {"receipts": list(receipts)}


def task_step(
    name: str,
    unit_name: str,
    task: Any,
    *,
    outputs: Sequence[str] = (),
    reduce: Callable[[Sequence[dict]], dict] | None = None,
) -> type[TaskStep]:
    """The ``TaskStep`` named ``name`` whose units, counted as ``unit_name``, are calls of ``task``; ``outputs``: what
    it writes (cleared when its fingerprint changes); ``reduce``: its stats from the receipts."""
    body: dict[str, Any] = {"name": name, "unit_name": unit_name, "task": task, "outputs": lambda self: list(outputs)}
    if reduce is not None:
        body["reduce"] = lambda self, receipts: reduce(receipts)
    return type(f"TaskStep[{name}]", (TaskStep,), body)
