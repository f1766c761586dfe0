"""A stage called as a run calls it, for tests that call one stage on rows of their own."""

from __future__ import annotations

from curation.score.stage import Row, Stage, Update
from curation.score.stage_runner import with_decisions


def decided(stage: Stage, rows: list[Row]) -> list[Update]:
    """The stage's updates as a run makes them: its scores, then its decision on the stored values."""
    return with_decisions(stage, rows, stage.process_batch(rows))
