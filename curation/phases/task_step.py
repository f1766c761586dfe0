"""A ``Step`` whose units are calls of one Ray task: the shape of the write phase's steps, the takedown's and the
export's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import ray

from curation.phases.step import Step


class TaskStep(Step):
    """Unit ``u`` is ``task.remote(*calls[u])``, the units in ``calls``' order; ``own`` is what the step adds to
    its fingerprint. Its stats: the receipts, in unit order (subclasses reduce them further)."""

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


def task_step(name: str, unit_name: str, task: Any) -> type[TaskStep]:
    """The ``TaskStep`` named ``name`` whose units, counted as ``unit_name``, are calls of ``task``."""
    return type(f"TaskStep[{name}]", (TaskStep,), {"name": name, "unit_name": unit_name, "task": task})
