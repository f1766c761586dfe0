"""Phase 1's stages run again for the inputs that new thresholds take where their stored scores do not reach: an input
the cascade stopped before a stage it now reaches, or one that reached a stage whose computation the thresholds
change (``curation.score.redecide.Decider`` says which stage each must start at).

An input's bytes were kept only while it was kept, so they are read again from the pool by the ledger's ``source``
and checked against its ``key`` (``SourceReader``); one that cannot be read, or no longer hashes to its key, becomes an
``error`` row (``source_unreadable``) instead of being scored on other bytes. The columns of the stages before its
start are the stored ones: those stages computed them with the same settings, so the stages from its start see what
they saw in the run that scored it, and the row ends as a fresh run with the new thresholds ends it. The stages run
in this process, a batch of their ``batch_size`` at a time, their models set up once per process.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common import schema
from curation.config import CurateConfig
from curation.score.chain import finalise, task_runner
from curation.score.inputs import input_row
from curation.score.originals import SourceReader
from curation.score.stage import Stage

# A row of a re-run whose first stage is still ahead: the runners pass over it (they take pending rows only).
WAITING = "waiting"
UNREADABLE = "source_unreadable"


def rerun_rows(
    rows: pa.Table, starts: list[int], stages: list[type[Stage]], cfg: CurateConfig, reader: SourceReader
) -> tuple[pa.Table, Counter]:
    """The ledger rows ``rows`` (their stored scores) run through ``stages`` from ``starts[i]`` on, under ``cfg``:
    the rows as phase 1 ends them (the working schema's columns), and how many inputs each stage was run on."""
    keys = dict(zip(rows.column("source").to_pylist(), rows.column("key").to_pylist()))
    found, problems = reader.read_verified(keys)
    working = schema.working_schema(cfg.embedding_dim)
    records = []
    for row, start in zip(rows.to_pylist(), starts):
        blanked = {c for s in stages[start:] for c in s.writes} - {c for s in stages[:start] for c in s.writes}
        record = {**{c: None for c in blanked}, **{k: v for k, v in row.items() if k not in blanked}}
        record.update(input_row(row["source"], found.get(row["source"])))
        record["reason"] = None
        if row["source"] in problems:
            why = problems[row["source"]]
            record.update(status=schema.ERROR, stage=stages[start].name, reason=f"{UNREADABLE}: {why}")
        else:
            record["status"] = WAITING
        records.append(record)
    table = pa.Table.from_pylist(records, schema=working)
    begin = np.asarray(starts)
    calls: Counter = Counter()
    for j in range(min(starts, default=len(stages)), len(stages)):
        due = pc.and_(pc.equal(table.column("status"), WAITING), pa.array(begin == j))
        status = pc.if_else(due, schema.PENDING, table.column("status"))
        table = table.set_column(table.schema.get_field_index("status"), working.field("status"), status)
        pending = pc.sum(pc.equal(table.column("status"), schema.PENDING)).as_py() or 0
        if not pending:
            continue
        name = stages[j].name
        calls[name] += pending
        runner, size = task_runner(name, cfg.model_dump_json()), cfg.stages[name].batch_size
        table = pa.concat_tables([runner(table.slice(i, size)) for i in range(0, table.num_rows, size)])
    return finalise(table), calls
