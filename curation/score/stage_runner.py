"""The runner Ray Data calls around one stage (``StageRunner``): it hands the stage only the rows still pending,
writes their updates into the batch's Arrow columns, turns rejections into ledger fields, drops the bytes of rejected
images so they stop flowing, counts the funnel in Ray metrics, and confines a fault to the image that caused it.

Faults. A row on which the stage raises becomes an ``error`` row (``stage_error: <exception>``), whatever the batch
size, and so does a row that runs past ``stages.<name>.timeout_s`` (``stage_timeout``). Only a failing ``setup()``
stops the job (its exception, noted with the stage's name): a model that cannot load says nothing about any image,
and turning every image into an error row would hide it.

- ``process_batch`` runs in a worker thread under a limit of ``timeout_s`` per row. A batch that raises or overruns
  is re-run one row at a time, each under ``timeout_s``, so only the rows at fault become errors.
- An overrunning call is stopped by raising ``StageTimeout`` in its thread (``PyThreadState_SetAsyncExc``), which
  takes effect at the thread's next Python bytecode; a BaseException, so ``except Exception`` cannot swallow it.
- A call stuck in native code cannot be stopped. Its row still ends as an error and the batch's results are
  returned, but the thread keeps running, so the process must go: in a Ray worker, the first stage call of the next
  Ray task exits the process (``os._exit``) before any stage work of that task, unless the stuck threads have ended
  by then. Ray restarts it (Ray Data gives actor pools ``max_restarts=-1`` and ``max_task_retries=-1``, and map
  tasks ``max_retries=-1``) and re-runs only that new task: the task holding the hanging row has completed (a worker
  runs one task at a time). Outside Ray (``score_in_process``) nobody would restart the process; it keeps going
  with ``needs_recycle`` set. A native call that never releases the GIL would freeze the process itself; the
  decoders and model runtimes the stages use release it.
- The hanging row is not run again: its source is recorded for the Ray job (Ray's internal KV), and runners built
  later, such as a restarted actor re-running a task whose completion the exit raced, mark it ``stage_timeout``
  without calling the stage.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from common import schema
from curation.score.ledger import reason_code
from curation.score.stage import REJECT, Row, Stage, Update
from curation.settings import CurationSettings

_FAULT = "_fault"  # key of an update dict that makes the row an error row; its value is the ledger reason

# A stopped call reaches its next bytecode within milliseconds unless it is inside a native call; one still running
# after this grace (or after its own limit, if shorter) is taken to be stuck in native code.
_STOP_GRACE_S = 5.0
_STUCK_ROWS_NAMESPACE = "humans1b_stuck_rows"


class StageTimeout(BaseException):
    """Raised inside a stage call's thread to stop it at its time limit; not an Exception, so that stage code
    catching Exception cannot swallow it."""


class _CallFault(Exception):
    """A stage call raised or ran past its limit; ``reason`` is the ledger reason of its row(s)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _StuckCall:
    thread: threading.Thread
    stage: str
    ray_task: str | None  # the Ray task the call was left behind in; None outside a Ray worker


# Process-wide, because the process, not one stage, is what must be recycled.
_stuck_calls: list[_StuckCall] = []
_stuck_rows: set[str] = set()  # row tokens (see _row_token) whose call could not be stopped


def _in_ray_worker() -> bool:
    return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE


def _current_ray_task() -> str | None:
    return ray.get_runtime_context().get_task_id() if _in_ray_worker() else None


def _live_stuck_calls() -> list[_StuckCall]:
    _stuck_calls[:] = [c for c in _stuck_calls if c.thread.is_alive()]  # one that ended on its own needs no recycle
    return _stuck_calls


def _exit_if_stuck_from_an_earlier_task() -> None:
    """Recycle this worker at the start of a new Ray task if it holds a call that could not be stopped."""
    stuck = _live_stuck_calls()
    task = _current_ray_task() if stuck else None
    if task is None or all(c.ray_task == task for c in stuck):
        return
    stages = ", ".join(sorted({c.stage for c in stuck}))
    print(
        f"[stage {stages}] exiting this worker: it holds {len(stuck)} call(s) that ran past their time limit in native"
        " code and could not be stopped; Ray restarts it and re-runs only the task that just began",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _raise_in_thread(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Make ``thread`` raise ``exc_type`` at its next Python bytecode."""
    assert thread.ident is not None  # only called on a started thread
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))


def _row_token(stage: str, source: str) -> str:
    return f"{stage}/{hashlib.sha1(source.encode()).hexdigest()}"


def _stuck_rows_prefix() -> str:
    return ray.get_runtime_context().get_job_id() + "/"


def _remember_stuck_row(token: str) -> None:
    _stuck_rows.add(token)
    if _in_ray_worker():  # so that processes started later (a restarted actor) skip it too
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(_stuck_rows_prefix() + token, b"", namespace=_STUCK_ROWS_NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - losing the note costs at most one more hang on a retry
            print(f"[stage] could not record a stuck row for this job: {type(exc).__name__}: {exc}", file=sys.stderr)


def _load_stuck_rows(stage: str) -> None:
    if _in_ray_worker():
        from ray.experimental import internal_kv

        prefix = _stuck_rows_prefix()
        keys = internal_kv._internal_kv_list(f"{prefix}{stage}/", namespace=_STUCK_ROWS_NAMESPACE)
        _stuck_rows.update(key.decode()[len(prefix) :] for key in keys)


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


_funnel_metrics: tuple | None = None


def _fate(update: Update) -> tuple[str, str] | None:
    """(ledger status, reason) of a row its update stops; None for a row that flows on."""
    if _FAULT in update:
        return schema.ERROR, update[_FAULT]
    if REJECT in update:
        return schema.REJECTED, update[REJECT]
    return None


def _outcome(update: Update) -> tuple[str, str]:
    """(outcome, reason code) of one row's update: the ledger's status and the stable part of its reason."""
    fate = _fate(update)
    return ("passed", "") if fate is None else (fate[0], reason_code(fate[1]))


def _record_funnel(stage: str, updates: list[Update], seconds: float) -> None:
    """The funnel as Ray metrics (Prometheus / the Ray dashboard): images per stage, outcome and reason code, and
    the seconds each stage spent, so images/s per stage is one ratio of two rates. Metrics are for people watching
    a run; they never fail a batch, and outside a Ray worker there is nowhere to send them."""
    global _funnel_metrics
    if not ray.is_initialized():
        return
    try:
        if _funnel_metrics is None:
            from ray.util.metrics import Counter as RayCounter

            _funnel_metrics = (
                RayCounter("humans1b_curation_images", "Images a curation stage finished, by outcome and reason code",
                           tag_keys=("stage", "outcome", "reason")),
                RayCounter("humans1b_curation_stage_seconds", "Seconds a curation stage spent scoring its images",
                           tag_keys=("stage",)),
            )  # fmt: skip
        images, busy = _funnel_metrics
        for (outcome, reason), n in Counter(map(_outcome, updates)).items():
            images.inc(n, tags={"stage": stage, "outcome": outcome, "reason": reason})
        if seconds > 0:
            busy.inc(seconds, tags={"stage": stage})
    except Exception:  # noqa: BLE001 - a metrics backend problem must never cost an image its score
        pass


def with_decisions(stage: Stage, rows: list[Row], updates: list[Update]) -> list[Update]:
    """The updates of ``stage.process_batch(rows)`` with the stage's decision (``Stage.decide``) on each row that
    passed, taken on its values as the tables store them (a float64 score as its float32), as a re-decide from stored
    scores takes it (``curation.score.redecide``)."""
    kind = type(stage)
    passing = [j for j, update in enumerate(updates) if _fate(update) is None] if kind.decided else []
    if not passing:
        return updates
    types = schema.working_schema(stage.cfg.embedding_dim)
    stored = {c: pa.array([updates[j].get(c) for j in passing], types.field(c).type).to_pylist() for c in kind.writes}
    out = list(updates)
    for i, j in enumerate(passing):
        try:
            reason = kind.decide({**rows[j], **{c: values[i] for c, values in stored.items()}}, stage.cfg.filters)
        except Exception as exc:  # noqa: BLE001 - recorded in the ledger like a fault of the stage's own code
            out[j] = {_FAULT: f"stage_error: {_describe(exc)}"}
            continue
        if reason is not None:
            out[j] = {**updates[j], REJECT: reason}
    return out


class StageRunner:
    """Ray Data callable around one stage: ``pa.Table -> pa.Table`` over the working schema."""

    def __init__(self, stage_class: type[Stage], cfg: CurationSettings):
        self.stage: Stage = stage_class(cfg)
        try:
            self.stage.setup()
        except Exception as exc:
            exc.add_note(f"stage {stage_class.name!r} could not set up, so it cannot score any image: the job stops")
            raise
        self.schema = schema.working_schema(cfg.embedding_dim)
        self.timeout_s = self.stage.settings.timeout_s
        _load_stuck_rows(stage_class.name)

    @property
    def needs_recycle(self) -> bool:
        """Whether this process holds a stage call that ran past its limit and could not be stopped."""
        return bool(_live_stuck_calls())

    def __call__(self, table: pa.Table) -> pa.Table:
        _exit_if_stuck_from_an_earlier_task()
        is_pending = pc.fill_null(pc.equal(table.column("status"), schema.PENDING), False)
        pending = np.flatnonzero(is_pending.to_numpy())
        if not len(pending):
            return table
        picked = table.take(pending)
        columns = {c: picked.column(c).to_pylist() for c in self.stage.reads}
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else [{}] * len(pending)
        tokens = [_row_token(self.stage.name, source) for source in picked.column("source").to_pylist()]
        start = time.perf_counter()
        updates = with_decisions(self.stage, rows, self._process_skipping_stuck_rows(rows, tokens))
        _record_funnel(self.stage.name, updates, time.perf_counter() - start)
        return self._merge(table, pending, updates)

    def _process_skipping_stuck_rows(self, rows: list[Row], tokens: list[str]) -> list[Update]:
        todo = [i for i, token in enumerate(tokens) if token not in _stuck_rows]
        if len(todo) == len(rows):
            return self._process_isolating_faults(rows, tokens)
        skipped = {_FAULT: self._timeout_reason("; stuck in native code earlier in this job, not run again")}
        updates = [skipped] * len(rows)
        done = self._process_isolating_faults([rows[i] for i in todo], [tokens[i] for i in todo]) if todo else []
        for i, update in zip(todo, done):
            updates[i] = update
        return updates

    def _process_isolating_faults(self, rows: list[Row], tokens: list[str]) -> list[Update]:
        try:
            return self._call(rows, tokens)
        except _CallFault as fault:
            if len(rows) == 1:
                return [{_FAULT: fault.reason}]
        # Re-run one row at a time so only the rows at fault become error rows.
        out = []
        for row, token in zip(rows, tokens):
            try:
                out.extend(self._call([row], [token]))
            except _CallFault as fault:
                out.append({_FAULT: fault.reason})
        return out

    def _process(self, rows: list[Row]) -> list[Update]:
        updates = self.stage.process_batch(rows)
        if len(updates) != len(rows):
            raise RuntimeError(f"stage {self.stage.name} returned {len(updates)} updates for {len(rows)} rows")
        return updates

    def _call(self, rows: list[Row], tokens: list[str]) -> list[Update]:
        """``process_batch`` under the batch's time limit; a call that raises or overruns raises ``_CallFault``."""
        if self.timeout_s is None:
            try:
                return self._process(rows)
            except Exception as exc:  # noqa: BLE001 - recorded in the ledger, never swallowed
                raise _CallFault(f"stage_error: {_describe(exc)}") from None
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["updates"] = self._process(rows)
            except BaseException as exc:  # noqa: BLE001 - StageTimeout included: the thread must end quietly
                outcome["error"] = exc

        thread = threading.Thread(target=run, name=f"stage-{self.stage.name}", daemon=True)
        limit_s = self.timeout_s * len(rows)
        thread.start()
        thread.join(limit_s)
        if thread.is_alive():
            _raise_in_thread(thread, StageTimeout)
            thread.join(min(_STOP_GRACE_S, limit_s))
            stuck = thread.is_alive()
            if stuck:
                _stuck_calls.append(_StuckCall(thread, self.stage.name, _current_ray_task()))
                if len(rows) == 1:
                    _remember_stuck_row(tokens[0])
            raise _CallFault(self._timeout_reason("; it could not be stopped (stuck in native code)" if stuck else ""))
        error = outcome.get("error")
        if error is None:
            return outcome["updates"]
        if not isinstance(error, Exception):
            raise error  # KeyboardInterrupt, SystemExit: not a fact about an image
        raise _CallFault(f"stage_error: {_describe(error)}")

    def _timeout_reason(self, detail: str) -> str:
        name = self.stage.name
        limit = f"{self.timeout_s:g} s per image (stages.{name}.timeout_s)"
        return f"stage_timeout: stage {name} ran past its limit of {limit}{detail}"

    def _merge(self, table: pa.Table, pending: np.ndarray, updates: list[Update]) -> pa.Table:
        """The table with the updates of its ``pending`` rows in place: only their values become Arrow arrays."""
        for column in self.stage.writes:
            updated = [j for j, update in enumerate(updates) if column in update]
            if updated:
                table = self._scatter(table, pending[updated], {column: [updates[j][column] for j in updated]})
        table = self._scatter(table, pending, {"stage": [self.stage.name] * len(pending)})
        fates = [(j, fate) for j, fate in enumerate(map(_fate, updates)) if fate is not None]
        if fates:
            stopped = pending[[j for j, _ in fates]]
            statuses, reasons = zip(*(fate for _, fate in fates))
            table = self._scatter(table, stopped, {"status": statuses, "reason": reasons})
            # A stopped image stops flowing: drop its bytes (its ledger row keeps scores, stage and reason). A take
            # with null indices there copies the other images once.
            dropped = np.zeros(table.num_rows, dtype=bool)
            dropped[stopped] = True
            image = table.column("image").take(pa.array(np.arange(table.num_rows), mask=dropped))
            table = table.set_column(table.schema.get_field_index("image"), self.schema.field("image"), image)
        return table

    def _scatter(self, table: pa.Table, rows: np.ndarray, values: dict[str, Sequence[Any]]) -> pa.Table:
        """``table`` with each named column's ``values`` at ``rows`` (typed as the working schema says), the rest as
        it was: a take over the old column followed by the new values."""
        index = np.arange(table.num_rows)
        index[rows] = table.num_rows + np.arange(len(rows))
        index = pa.array(index)
        for column, new in values.items():
            field = self.schema.field(column)
            chunks = [*table.column(column).cast(field.type).chunks, pa.array(new, field.type)]
            table = table.set_column(table.schema.get_field_index(column), field, pa.chunked_array(chunks).take(index))
        return table
