"""Phase 1's decisions taken again from stored scores: what other thresholds make of inputs already scored.

A stage's thresholds are of two kinds (``Stage.decided``). A decided threshold is applied by ``Stage.decide`` to the
values the ledger stores, so a new value of it needs no model: each input's row is walked through the stages in
order, each stage that scored it deciding again, until one rejects it (the columns of later stages are blanked, as a
run with that threshold never computes them) or it passes the last one. An input the cascade stopped before a stage
it now reaches, and every input that reached a stage whose computed settings changed (``Stage.computed_settings``:
which persons are prominent, which prompt sets a filter compares, ...), needs that stage run again: the walk says
which stage it must start at. Anything else that changes what phase 1 computes (a model, a stage's own settings, the
stage list) needs ``--new-run``.

The walk is a pure function of one ledger row and two configs, so a what-if (``what_if``) and a re-decided output
give what a fresh run with the new thresholds gives, to the bit: a run decides on the stored values too
(``StageRunner._decide``).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import pyarrow as pa
import pyarrow.parquet as pq

from common import schema
from common.layout import LAYOUT
from common.progress import Progress
from common.storage import join, redact, resolve
from curation.config import CurateConfig, config_from_json
from curation.records import read_run_record
from curation.score.ledger import committed_files, reason_code
from curation.score.stage import Stage
from curation.stages import stage_classes

# The walk's end for an input: ("kept", None), ("rejected"/"error", stage) or ("needs", the stage to run again from).
NEEDS = "needs"


class NeedsNewRun(ValueError):
    """The configs differ in more than thresholds: phase 1 must score the pool again."""


def scoring_hash(cfg: CurateConfig) -> str:
    """The hash of what phase 1 computes, less the enabled stages' thresholds: two configs of one scoring hash differ
    only in what a re-decide (and a rerun of the stages a changed threshold computes with) takes care of."""
    thresholds = {t for name in cfg.enabled_stages for t in stage_classes()[name].thresholds}
    return cfg.model_copy(update={"filters": cfg.filters.model_copy(update=dict.fromkeys(thresholds))}).results_hash()


def threshold_changes(scored: CurateConfig, new: CurateConfig) -> dict[str, tuple]:
    """``filters.<name>`` -> (scored with, new) for each threshold that differs."""
    a, b = scored.filters.model_dump(mode="json"), new.filters.model_dump(mode="json")
    return {f"filters.{k}": (a[k], b[k]) for k in a if a[k] != b[k]}


@dataclass(frozen=True)
class Walk:
    """Where one input ends under the new thresholds."""

    status: str  # kept, rejected, error, or NEEDS
    stage: str | None  # the deciding stage; for NEEDS the first stage to run again
    reason: str | None


class Decider:
    """The walk of ledger rows scored under ``scored`` to the thresholds of ``new``."""

    def __init__(self, scored: CurateConfig, new: CurateConfig):
        if scoring_hash(scored) != scoring_hash(new):
            raise NeedsNewRun(
                "the settings differ in more than the stages' thresholds (filters.*): a model, a stage's own "
                "settings or the stage list changed; score the pool again with --new-run"
            )
        self.new = new
        self.stages: list[type[Stage]] = [stage_classes()[n] for n in new.enabled_stages]
        self.order = {s.name: i for i, s in enumerate(self.stages)}
        # the first stage whose computation changed: every input that reached it runs it again
        changed = [
            i
            for i, s in enumerate(self.stages)
            if s.computed_settings(scored.filters) != s.computed_settings(new.filters)
        ]
        self.recompute_from = changed[0] if changed else len(self.stages)
        self.changes = threshold_changes(scored, new)
        # a stage's columns, blanked when an earlier stage now rejects the input
        self.columns_after = {
            i: sorted({c for s in self.stages[i + 1 :] for c in s.writes} - set(self.stages[i].writes))
            for i in range(len(self.stages))
        }

    def walk(self, row: dict) -> Walk:
        """Where the ledger row ``row`` (its fate and every stored score) ends under the new thresholds."""
        reached = self.order.get(row["stage"])
        if reached is None:  # stopped before the stages (a download that failed): no threshold reaches it
            return Walk(row["status"], row["stage"], row["reason"])
        for i, stage in enumerate(self.stages):
            if i > reached or i >= self.recompute_from:
                return Walk(NEEDS, stage.name, None)
            if i == reached and row["status"] != schema.KEPT and not _is_decision(stage, row["reason"]):
                return Walk(row["status"], stage.name, row["reason"])  # what the image is, not a threshold
            try:
                reason = stage.decide(row, self.new.filters)
            except KeyError:  # a score this output's tables do not hold (scored before its column existed)
                return Walk(NEEDS, stage.name, None)
            if reason is not None:
                return Walk(schema.REJECTED, stage.name, reason)
        return Walk(schema.KEPT, self.stages[-1].name, None)

    def ledger(self, table: pa.Table) -> tuple[pa.Table, list[Walk]]:
        """The ledger rows of ``table`` re-decided (later stages' columns blanked where an earlier stage now rejects;
        a row that needs a stage again left as it was), and each row's walk."""
        rows = table.to_pylist()
        walks = [self.walk(r) for r in rows]
        for r, w in zip(rows, walks):
            if w.status == NEEDS:
                continue
            r["status"], r["stage"], r["reason"] = w.status, w.stage, w.reason
            for c in self.columns_after.get(self.order.get(w.stage or "", -1), ()):
                if c in r:
                    r[c] = None
        return pa.Table.from_pylist(rows, schema=table.schema), walks


def _is_decision(stage: type[Stage], reason: str | None) -> bool:
    code = reason_code(reason)
    return any(fnmatch.fnmatchcase(code, pattern) for pattern in stage.decision_codes)


@dataclass
class Funnel:
    """Phase 1's funnel before and after a re-decide, counted a ledger file at a time."""

    inputs: int = 0
    before: Counter = field(default_factory=Counter)  # (status, stage, reason code)
    after: Counter = field(default_factory=Counter)
    needs: Counter = field(default_factory=Counter)  # first stage to run again -> inputs
    files: int = 0  # ledger files counted

    def merge(self, other: Funnel) -> None:
        self.inputs += other.inputs
        self.files += other.files
        for mine, theirs in ((self.before, other.before), (self.after, other.after), (self.needs, other.needs)):
            mine.update(theirs)

    def add(self, rows: Iterable[dict], walks: Iterable[Walk]) -> None:
        for r, w in zip(rows, walks):
            self.inputs += 1
            self.before[(r["status"], r["stage"], reason_code(r["reason"]))] += 1
            if w.status == NEEDS:
                self.needs[w.stage] += 1
            else:
                self.after[(w.status, w.stage, reason_code(w.reason))] += 1

    def kept(self, which: Counter) -> int:
        return sum(n for (status, *_), n in which.items() if status == schema.KEPT)

    def lines(self, stage_order: list[str], changes: dict[str, tuple]) -> list[str]:
        """The funnel in words: the thresholds changed, kept before and after, each (stage, reason) whose count
        changes, and the inputs that need model work by stage."""
        out = [
            "thresholds: "
            + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items()) if changes else "none changed")
        ]
        unknown = sum(self.needs.values())
        after = f"{self.kept(self.after)}" + (f" + up to {unknown} that need model work" if unknown else "")
        out.append(f"kept after scoring: {self.kept(self.before)} of {self.inputs} inputs -> {after}")
        place = {s: i for i, s in enumerate(stage_order)}
        keys = {k for k in {*self.before, *self.after} if k[0] != schema.KEPT}
        for status, stage, code in sorted(keys, key=lambda k: (place.get(k[1], -1), k[0], k[2])):
            a, b = self.before[(status, stage, code)], self.after[(status, stage, code)]
            if a != b:
                out.append(f"  {stage}: {status} {code}: {a} -> {b}")
        if unknown:
            runs = ", ".join(f"{n} from stage {s}" for s, n in sorted(self.needs.items(), key=lambda kv: place[kv[0]]))
            out.append(f"need model work: {unknown} inputs ({runs}); the others are re-decided from stored scores")
        else:
            out.append("need model work: none (every input is re-decided from stored scores)")
        return out


def what_if(scored: CurateConfig, new: CurateConfig, ledgers: Iterable[pa.Table]) -> tuple[Funnel, Decider]:
    """The phase-1 funnel of ``ledgers`` (phase 1's committed ledger files, one table at a time) under ``new``."""
    decider = Decider(scored, new)
    funnel = Funnel()
    for table in ledgers:
        rows = table.to_pylist()
        funnel.add(rows, [decider.walk(r) for r in rows])
    return funnel, decider


# Ledger files one what-if task walks, and the count past which a what-if walks them in Ray tasks (a Humans-1B ledger
# of ~4·10^9 rows walks at ~3,000 rows/s in one process: 16 days; in tasks, that over the cluster's CPUs).
FILES_PER_TASK = 64
TASKS_FROM_FILES = 256


def _walk_files(out_uri: str, paths: list[str], scored_json: str, new_json: str) -> Funnel:
    """The funnel of the ledger files ``paths`` (relative to the output root) under the new config."""
    fs, root = resolve(out_uri)
    decider = Decider(config_from_json(scored_json), config_from_json(new_json))
    funnel = Funnel()
    for path in paths:
        rows = pq.read_table(join(root, path), filesystem=fs).to_pylist()
        funnel.add(rows, [decider.walk(r) for r in rows])
        funnel.files += 1
    return funnel


def output_what_if(
    out_uri: str, scored: CurateConfig, new: CurateConfig, tasks_from_files: int = TASKS_FROM_FILES
) -> list[str]:
    """The what-if of an output's phase-1 ledger under ``new``, in words; ``scored`` must be the config the output was
    scored with (its run record's hash says so). Writes nothing. Up to ``tasks_from_files`` committed ledger files
    are walked here one at a time; more, in Ray tasks of ``FILES_PER_TASK`` (``scored.ray`` says which cluster), a
    bounded number in flight, their counts summed as they finish."""
    fs, root = resolve(out_uri)
    run = read_run_record(fs, root)
    if run["results_hash"] != scored.results_hash():
        raise NeedsNewRun(
            f"{redact(out_uri)} was scored with config hash {run['results_hash']}, and the config given (less the "
            f"--what-if changes) has {scored.results_hash()}: pass the config and overrides it was curated with"
        )
    files = committed_files(out_uri, LAYOUT.ledger)
    decider = Decider(scored, new)  # here first: a change that needs --new-run stops before any task
    args = (scored.model_dump_json(), new.model_dump_json())
    if len(files) <= tasks_from_files:
        funnel = _walk_files(out_uri, files, *args)
    else:
        funnel = _walk_in_tasks(out_uri, files, scored, *args)
    return funnel.lines(new.enabled_stages, decider.changes)


def _walk_in_tasks(out_uri: str, files: list[str], scored: CurateConfig, *args: str) -> Funnel:
    import ray

    from common.ray_utils import init_ray

    init_ray(scored.ray.address, scored.ray.num_cpus)
    walk = ray.remote(num_cpus=1)(_walk_files)
    groups = [files[i : i + FILES_PER_TASK] for i in range(0, len(files), FILES_PER_TASK)]
    window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    funnel, pending = Funnel(), cast(list[ray.ObjectRef], [])
    bar = Progress("what-if", len(files), unit="ledger files")

    def count_one() -> None:
        nonlocal pending
        done, pending = ray.wait(pending, num_returns=1)
        part: Funnel = ray.get(done[0])
        funnel.merge(part)
        bar.update(part.files)

    for group in groups:
        pending.append(walk.remote(out_uri, group, *args))
        if len(pending) >= window:
            count_one()
    while pending:
        count_one()
    return funnel
