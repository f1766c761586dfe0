"""A stage that fails on purpose, to test how the runner confines faults (curation/score/stage_runner.py).

It is in the stage registry so that Ray workers can build it, and in no profile: a config turns it on by listing it
under ``stages`` and names its victims in ``models.fault_injection``.
"""

from __future__ import annotations

import time

from curation.score.stage import Row, Stage, Update


class FaultInjectionStage(Stage):
    name = "fault_injection"
    reads = ("key",)
    uses_actors = True  # like the model stages, whose hangs it stands for
    internal = True
    model_section = "fault_injection"

    def process_batch(self, rows: list[Row]) -> list[Update]:
        plan = self.cfg.models.fault_injection
        for row in rows:
            if row["key"] in plan.raise_on:
                raise RuntimeError(f"injected fault on image {row['key'][:12]}")
            if row["key"] in plan.hang_on:
                _hang(plan.hang, plan.hang_s)
        return [{} for _ in rows]


def _hang(kind: str, seconds: float) -> None:
    if kind == "native":
        time.sleep(seconds)  # one C call: an exception raised into the thread waits until it returns
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # Python-level: stoppable between sleeps
        time.sleep(0.01)
