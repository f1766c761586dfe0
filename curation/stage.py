"""The one Stage abstraction every curation filter and scorer uses.

A stage declares its name, the columns it reads and writes and its resources; ``setup()`` loads models once per
Ray actor (or once per worker process for task stages) and ``process_batch()`` scores a batch of rows. The
runner around it (``StageRunner``) is what Ray Data calls: it hands the stage only the rows still pending,
turns rejections into ledger fields, drops the bytes of rejected images so they stop flowing, and isolates an
image that makes the stage raise so one bad input never fails a batch.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common import schema

if TYPE_CHECKING:
    from curation.config import CurateConfig

REJECT = "reject"  # key of an update dict that rejects the row; its value is "reason_code: detail"

Row = dict[str, Any]
Update = dict[str, Any]


class Stage:
    """Base class. Subclasses set the class attributes and implement ``process_batch``."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ("image",)
    writes: ClassVar[tuple[str, ...]] = ()
    # Model stages run in a Ray actor pool (setup once per actor); cheap stateless stages run as tasks.
    uses_actors: ClassVar[bool] = False

    def __init__(self, cfg: CurateConfig):
        self.cfg = cfg
        self.settings = cfg.stages[self.name]

    def setup(self) -> None:
        """Load models and other per-process state. Called once before the first batch."""

    def process_batch(self, rows: list[Row]) -> list[Update]:
        """Return one update per row: column -> value for columns in ``writes``, plus ``REJECT`` to reject."""
        raise NotImplementedError

    @property
    def threads(self) -> int:
        """Threads a stage's native libraries may use: its CPU share, at least one."""
        return max(1, int(round(self.settings.num_cpus)))


def reject(code: str, detail: str = "") -> Update:
    """An update that rejects a row; ``code`` is stable (summaries group by it), ``detail`` is for people."""
    return {REJECT: f"{code}: {detail}" if detail else code}


class StageRunner:
    """Ray Data callable around one stage: ``pa.Table -> pa.Table`` over the working schema."""

    def __init__(self, stage_name: str, cfg_json: str):
        from curation.config import CurateConfig
        from curation.stages import STAGES

        cfg = CurateConfig.model_validate_json(cfg_json)
        self.stage: Stage = STAGES[stage_name](cfg)
        self.stage.setup()
        self.schema = schema.working_schema(cfg.embedding_dim)

    def __call__(self, table: pa.Table) -> pa.Table:
        status = table.column("status").to_pylist()
        pending = [i for i, s in enumerate(status) if s == schema.PENDING]
        if not pending:
            return table
        picked = table.take(pending)
        columns = {c: picked.column(c).to_pylist() for c in self.stage.reads}
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else [{}] * len(pending)
        updates = self._process_isolating_errors(rows)
        return self._merge(table, pending, updates)

    def _process_isolating_errors(self, rows: list[Row]) -> list[Update]:
        try:
            updates = self.stage.process_batch(rows)
            if len(updates) != len(rows):
                raise RuntimeError(f"stage {self.stage.name} returned {len(updates)} updates for {len(rows)} rows")
            return updates
        except Exception:
            if len(rows) == 1:
                raise
        # Re-run one row at a time so only the image that raises is marked as an error.
        out = []
        for row in rows:
            try:
                out.extend(self.stage.process_batch([row]))
            except Exception as exc:  # noqa: BLE001 - recorded in the ledger, never swallowed
                where = traceback.extract_tb(exc.__traceback__)[-1]
                out.append({"_error": f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"})
        return out

    def _merge(self, table: pa.Table, pending: list[int], updates: list[Update]) -> pa.Table:
        n = table.num_rows
        for column in self.stage.writes:
            values = table.column(column).to_pylist()
            for i, update in zip(pending, updates):
                if column in update:
                    values[i] = update[column]
            table = table.set_column(
                table.schema.get_field_index(column), self.schema.field(column), pa.array(values, self.schema.field(column).type)
            )
        status = table.column("status").to_pylist()
        stage = table.column("stage").to_pylist()
        reason = table.column("reason").to_pylist()
        stopped = np.zeros(n, dtype=bool)
        for i, update in zip(pending, updates):
            if "_error" in update:
                status[i], reason[i] = schema.ERROR, f"stage_error: {update['_error']}"
            elif REJECT in update:
                status[i], reason[i] = schema.REJECTED, update[REJECT]
            else:
                stage[i] = self.stage.name
                continue
            stage[i] = self.stage.name
            stopped[i] = True
        for name, values in (("status", status), ("stage", stage), ("reason", reason)):
            table = table.set_column(table.schema.get_field_index(name), self.schema.field(name), pa.array(values, pa.string()))
        if stopped.any():
            # A stopped image stops flowing: drop its bytes (its ledger row keeps scores, stage and reason).
            image_index = table.schema.get_field_index("image")
            image = pc.if_else(pa.array(stopped), pa.nulls(n, schema.IMAGE_TYPE), table.column("image"))
            table = table.set_column(image_index, self.schema.field("image"), image)
        return table
