"""Phase 1's decisions taken again from stored scores: what other thresholds make of inputs already scored.

A stage's thresholds are of two kinds (``Stage.decided``). A decided threshold is applied by ``Stage.decide`` to the
values the ledger stores, so a new value of it needs no model: each input's row is walked through the stages in
order, each stage that scored it deciding again, until one rejects it (the columns of later stages are blanked, as a
run with that threshold never computes them) or it passes the last one. An input the cascade stopped before a stage
it now reaches, and every input that reached a stage whose computed settings changed (``Stage.computed_settings``:
which persons are prominent, which prompt sets a filter compares, ...), needs that stage run again: the walk says
which stage it must start at, and ``redecide_shard`` runs it from there (``curation.score.rerun``: its bytes read again
from the pool). Anything else that changes what phase 1 computes (a model, a stage's own settings, the stage list)
needs ``--new-run``.

The walk is a pure function of one ledger row and two configs, so a what-if (``what_if``) and a re-decided output
give what a fresh run with the new thresholds gives, to the bit: a run decides on the stored values too
(``StageRunner._decide``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common import schema
from common.console import plural
from common.layout import LAYOUT
from common.progress import Progress
from common.storage import delete_quietly, join, read_json, redact, resolve, write_json_atomic, write_parquet_atomic
from curation.config import CurateConfig, config_from_json
from curation.records import read_commits, read_run_record
from curation.score.chain import scored_target, write_scored
from curation.score.ledger import read_part, reason_code
from curation.score.metadata import merge_all, metadata_types
from curation.score.originals import SourceReader
from curation.score.rerun import rerun_rows
from curation.score.stage import Stage
from curation.settings import Filters
from curation.stages import stage_classes
from curation.steps.output import Output

T = TypeVar("T")

# The walk's end for an input: ("kept", None), ("rejected"/"error", stage) or ("needs", the stage to run again from).
NEEDS = "needs"


class NeedsNewRun(ValueError):
    """The configs differ in more than thresholds: phase 1 must score the pool again."""


def enabled_stages(cfg: CurateConfig) -> list[type[Stage]]:
    """The classes of the config's enabled stages, in their order."""
    classes = stage_classes()
    return [classes[name] for name in cfg.enabled_stages]


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
        self.stages = enabled_stages(new)
        self.order = {s.name: i for i, s in enumerate(self.stages)}
        # the first stage whose computation changed: every input that reached it runs it again
        changed = [
            i
            for i, s in enumerate(self.stages)
            if s.computed_settings(scored.filters) != s.computed_settings(new.filters)
        ]
        self.recompute_from = changed[0] if changed else len(self.stages)
        self.changes = threshold_changes(scored, new)
        # where a re-run must start to reach each stage: at an earlier stage whose columns the ledger does not keep
        # (an embedding, crop hashes: a newly kept input needs them) or a later stage rewrites (the persons)
        stored = set(schema.ledger_schema().names)
        self.start_of = [
            next(
                (
                    k
                    for k, s in enumerate(self.stages[:i])
                    if set(s.writes) - stored or set(s.writes) & {c for t in self.stages[i:] for c in t.writes}
                ),
                i,
            )
            for i in range(len(self.stages))
        ]
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
                return self._needs(i)
            if i == reached and row["status"] != schema.KEPT and not _is_decision(stage, row["reason"]):
                return Walk(row["status"], stage.name, row["reason"])  # what the image is, not a threshold
            try:
                reason = stage.decide(row, self.new.filters)
            except KeyError:  # a score this output's tables do not hold (scored before its column existed)
                return self._needs(i)
            if reason is not None:
                return Walk(schema.REJECTED, stage.name, reason)
        return Walk(schema.KEPT, self.stages[-1].name, None)

    def _needs(self, i: int) -> Walk:
        return Walk(NEEDS, self.stages[self.start_of[i]].name, None)

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

    def add(self, before: Iterable[Walk], after: Iterable[Walk]) -> None:
        for b, w in zip(before, after):
            self.inputs += 1
            self.before[(b.status, b.stage, reason_code(b.reason))] += 1
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
        out.append(f"kept after scoring: {self.kept(self.before)} of {plural(self.inputs, 'input')} -> {after}")
        place = {s: i for i, s in enumerate(stage_order)}
        keys = {k for k in {*self.before, *self.after} if k[0] != schema.KEPT}
        for status, stage, code in sorted(keys, key=lambda k: (place.get(k[1], -1), k[0], k[2])):
            a, b = self.before[(status, stage, code)], self.after[(status, stage, code)]
            if a != b:
                out.append(f"  {stage}: {status} {code}: {a} -> {b}")
        if unknown:
            runs = ", ".join(f"{n} from stage {s}" for s, n in sorted(self.needs.items(), key=lambda kv: place[kv[0]]))
            out.append(
                f"need model work: {plural(unknown, 'input')} ({runs}); the others are re-decided from stored scores"
            )
        else:
            out.append("need model work: none (every input is re-decided from stored scores)")
        return out


# Ledger files one what-if task walks, and the count past which a what-if walks them in Ray tasks (a Humans-1B ledger
# of ~4·10^9 rows walks at ~3,000 rows/s in one process: 16 days; in tasks, that over the cluster's CPUs).
FILES_PER_TASK = 64
TASKS_FROM_FILES = 256


def _walk_files(
    out_uri: str, files: list[tuple[str, dict | None]], scored_json: str, current_json: str, new_json: str
) -> Funnel:
    """The funnel of the scores files ``files`` (relative to the output root, each with the thresholds its shard was
    scored with: ``shard_scored``) from the current thresholds to the new ones."""
    fs, root = resolve(out_uri)
    scored, current, new = map(config_from_json, (scored_json, current_json, new_json))
    deciders: dict[str, tuple[Decider, Decider]] = {}
    funnel = Funnel()
    for path, filters in files:
        key = json.dumps(filters, sort_keys=True)
        if key not in deciders:
            base = shard_scored(filters, scored)
            deciders[key] = Decider(base, current), Decider(base, new)
        now, then = deciders[key]
        rows = pq.read_table(join(root, path), filesystem=fs).to_pylist()
        funnel.add([now.walk(r) for r in rows], [then.walk(r) for r in rows])
        funnel.files += 1
    return funnel


def output_funnel(
    out_uri: str,
    scored: CurateConfig,
    current: CurateConfig,
    new: CurateConfig,
    tasks_from_files: int,
    commits: dict[str, dict] | None = None,
) -> Funnel:
    """Phase 1's funnel of the output, scored with ``scored`` and decided with ``current``, under ``new``: its
    committed shards' scores (``commits``: their records, read here when not given) walked here up to
    ``tasks_from_files`` files, else in Ray tasks of ``FILES_PER_TASK`` (on the cluster ``current.ray`` names), a
    bounded number in flight, their counts summed as they finish."""
    Decider(scored, new)  # here first: a change that needs --new-run stops before any task
    if commits is None:
        commits = read_commits(*resolve(out_uri))
    files = sorted((f, record.get("scored_filters")) for record in commits.values() for f in _scores_files(record))
    args = (scored.model_dump_json(), current.model_dump_json(), new.model_dump_json())
    if len(files) <= tasks_from_files:
        return _walk_files(out_uri, files, *args)
    return _walk_in_tasks(out_uri, files, current, *args)


def output_what_if(
    out_uri: str, cfg: CurateConfig, new: CurateConfig, tasks_from_files: int = TASKS_FROM_FILES
) -> list[str]:
    """The what-if of an output under ``new``, in words; ``cfg`` must be the config the output was curated with (its
    run record's hash says so). Writes nothing."""
    fs, root = resolve(out_uri)
    run = read_run_record(fs, root)
    if run["results_hash"] != cfg.results_hash():
        raise NeedsNewRun(
            f"{redact(out_uri)} was curated with config hash {run['results_hash']}, and the config given (less the "
            f"--what-if changes) has {cfg.results_hash()}: pass the config and overrides it was curated with"
        )
    funnel = output_funnel(out_uri, scored_config(run, cfg), cfg, new, tasks_from_files)
    return funnel.lines(new.enabled_stages, threshold_changes(cfg, new))


def _walk_in_tasks(out_uri: str, files: list[tuple[str, dict | None]], scored: CurateConfig, *args: str) -> Funnel:
    groups = [files[i : i + FILES_PER_TASK] for i in range(0, len(files), FILES_PER_TASK)]
    funnel = Funnel()
    bar = Progress("what-if", len(files), unit="ledger files")

    def count(part: Funnel) -> None:
        funnel.merge(part)
        bar.update(part.files)

    in_tasks(scored, _walk_files, [(out_uri, group, *args) for group in groups], count)
    return funnel


def in_tasks(
    cfg: CurateConfig, fn: Callable[..., T], calls: list[tuple], each: Callable[[T], None], num_gpus: float = 0.0
) -> None:
    """``fn(*call)`` for each call in Ray tasks of one CPU (and ``num_gpus``) on the cluster ``cfg.ray`` names, at
    most two per CPU in flight, ``each`` called on every result as it comes (so the driver holds counts, not
    results)."""
    import ray

    from common.ray_utils import init_ray

    init_ray(cfg.ray.address, cfg.ray.num_cpus)
    remote: Any = ray.remote(num_cpus=1, num_gpus=num_gpus)(fn)
    window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    pending: list[ray.ObjectRef] = []

    def take_one() -> None:
        nonlocal pending
        done, pending = ray.wait(pending, num_returns=1)
        each(ray.get(done[0]))

    for call in calls:
        pending.append(remote.remote(*call))
        if len(pending) >= window:
            take_one()
    while pending:
        take_one()


# --- applying new thresholds to an output -----------------------------------------------------------------------------


def scoring_record(cfg: CurateConfig) -> dict:
    """What an output's run record keeps of the settings phase 1 scores it with, while its thresholds change: their
    ``scoring_hash``, the results hash that fingerprints the score step, and the thresholds."""
    return {
        "hash": scoring_hash(cfg),
        "results_hash": cfg.results_hash(),
        "filters": cfg.filters.model_dump(mode="json"),
    }


def scored_config(run: dict, cfg: CurateConfig) -> CurateConfig:
    """``cfg`` with the thresholds phase 1 scored the output with (its run record's ``scoring``; ``cfg`` itself for
    an output whose record predates it, which was never re-decided)."""
    if "scoring" not in run:
        return cfg
    return cfg.model_copy(update={"filters": Filters.model_validate(run["scoring"]["filters"])})


def shard_scored(filters: dict | None, scored: CurateConfig) -> CurateConfig:
    """``scored`` with the thresholds an input shard's scores were computed with (its commit record's
    ``scored_filters``: a re-decide that reran stages records the thresholds it reran them with), if it says."""
    return scored if filters is None else scored.model_copy(update={"filters": Filters.model_validate(filters)})


def decided_config(run: dict, cfg: CurateConfig) -> CurateConfig:
    """``cfg`` with the thresholds the output is decided with now (the run record's ``filters`` after a re-decide)."""
    if "filters" not in run:
        return scored_config(run, cfg)
    return cfg.model_copy(update={"filters": Filters.model_validate(run["filters"])})


def plan_thresholds(out_uri: str, run: dict, new: CurateConfig, commits: dict[str, dict]) -> Funnel:
    """The funnel of re-deciding the output of run record ``run`` and commit records ``commits`` to ``new``, with the
    inputs that need a stage run again by stage; raises ``NeedsNewRun`` when more than thresholds changed."""
    return output_funnel(out_uri, scored_config(run, new), decided_config(run, new), new, TASKS_FROM_FILES, commits)


@dataclass
class Applied:
    """What re-deciding an output did: the input shards re-decided and the inputs each stage was run on."""

    order: list[str]  # the stages in their order
    shards: int = 0
    calls: Counter = field(default_factory=Counter)

    def add(self, done: tuple[dict, dict[str, int]]) -> None:
        self.shards += 1
        self.calls.update(done[1])

    def words(self) -> str:
        runs = [(stage, self.calls[stage]) for stage in self.order if self.calls[stage]]
        if not runs:
            return "no model call"
        (first, n), rest = runs[0], runs[1:]
        return f"stages run again: {first} on {plural(n, 'input')}" + "".join(f", {s} on {k}" for s, k in rest)


# Inputs needing model work past which a re-decide runs its shards in Ray tasks however few they are: the driver's one
# process would score them one at a time (a person rule changed on a 2,000-input pool reruns the person stage for
# 1,990 inputs: 379 s in one process, where scoring the pool again takes 274-293 s on Ray Data).
RERUN_TASKS_FROM_INPUTS = 256


def apply_thresholds(
    out: Output,
    run: dict,
    scored: CurateConfig,
    new: CurateConfig,
    commits: dict[str, dict],
    pool: str,
    model_work: int = 0,
) -> Applied:
    """Re-decide every input shard of ``commits`` (the commit records ``plan_thresholds`` walked) to ``new``'s
    thresholds, a shard at a time, each committed by rewriting its commit record; then record ``new`` in the run
    record. An input whose stored scores decide it is decided from them; one that needs a stage run again is read
    from the pool ``pool`` and run through the stages it needs (``curation.score.rerun``). A shard already decided to
    ``new`` is skipped (so a rerun after a kill goes on), as is one committed since ``commits`` were read (scored with
    ``new``). Up to ``TASKS_FROM_FILES`` shards are re-decided in this process, unless ``model_work`` (the inputs the
    plan says need stages run again) reaches ``RERUN_TASKS_FROM_INPUTS``; else in Ray tasks, each with the largest
    GPU share a stage of ``new`` asks for where stages must run again."""
    results_hash = new.results_hash()
    todo = sorted(s for s, record in commits.items() if record["results_hash"] != results_hash)
    calls = [(out.uri, shard_id, scored.model_dump_json(), new.model_dump_json(), pool) for shard_id in todo]
    bar = Progress("re-decide", len(todo), unit="input shards")
    applied = Applied(new.enabled_stages)

    def done(result: tuple[dict, dict[str, int]]) -> None:
        applied.add(result)
        bar.update()

    if len(todo) <= TASKS_FROM_FILES and model_work < RERUN_TASKS_FROM_INPUTS:
        for call in calls:
            done(redecide_shard(*call))
    else:
        gpus = max((new.stages[name].num_gpus for name in new.enabled_stages), default=0.0) if model_work else 0.0
        in_tasks(new, redecide_shard, calls, done, num_gpus=gpus)
    record = {**run, "results_hash": results_hash, "filters": new.filters.model_dump(mode="json")}
    write_json_atomic(out.fs, out.path(LAYOUT.run_record), record)
    return applied


def redecide_shard(out_uri: str, shard_id: str, scored_json: str, new_json: str, pool: str) -> tuple[dict, dict]:
    """Re-decide one committed input shard and commit it: its inputs decided from their stored scores, those that need
    a stage run again run through the stages from there; new ledger files (one per scores file, its rows in its
    order), new scores and scored files where stages ran, its kept count and metadata types, in its commit record.
    Returns that record and the inputs each stage was run on."""
    fs, root = resolve(out_uri)
    path = join(root, LAYOUT.score_commit(shard_id))
    unit = read_json(fs, path, fields={"fingerprint": str, "receipt": dict})
    record, new = unit["receipt"], config_from_json(new_json)
    results_hash = new.results_hash()
    if record["results_hash"] == results_hash:
        return record, {}
    decider = Decider(shard_scored(record.get("scored_filters"), config_from_json(scored_json)), new)
    target = schema.with_metadata(schema.ledger_schema(), table="ledger", config_hash=results_hash)
    scores = _scores_files(record)
    tables = [read_part(fs, join(root, f), target.names, target) for f in scores]
    decided = [decider.ledger(t) for t in tables]
    # the inputs that need stages run again, as (scores file, row)
    needs = [(k, i) for k, (_, walks) in enumerate(decided) for i, w in enumerate(walks) if w.status == NEEDS]
    token = hashlib.sha256(json.dumps([scores, record["scored_files"], results_hash]).encode()).hexdigest()[:16]
    calls: Counter = Counter()
    new_scores, scored_files = list(scores), list(record["scored_files"])
    if needs:
        rows = pa.concat_tables([tables[k].slice(i, 1) for k, i in needs])
        reader = SourceReader(new.input, new.filters.max_file_bytes, pool=pool)
        starts = [decider.order[decided[k][1][i].stage or ""] for k, i in needs]
        again, calls = rerun_rows(rows, starts, decider.stages, new, reader)
        ran = again.select(target.names).cast(target)
        for k in sorted({k for k, _ in needs}):
            mine = [j for j, (kk, _) in enumerate(needs) if kk == k]
            at = [needs[j][1] for j in mine]
            new_scores[k] = _renamed(scores[k], f"scores-{token}")
            write_parquet_atomic(
                fs,
                join(root, new_scores[k]),
                _replaced(tables[k], at, ran.take(mine)),
                row_group_size=new.output.ledger_row_group_size,
                compression=new.output.compression,
            )
            decided[k] = (_replaced(decided[k][0], at, ran.take(mine)), decided[k][1])
        scored_files = _rescored(fs, root, shard_id, scored_files, again, new, token)
    ledger_files, kept = [], []
    for f, (table, _) in zip(scores, decided):
        name = _renamed(f, results_hash[:16])
        write_parquet_atomic(
            fs,
            join(root, name),
            table.cast(target),
            row_group_size=new.output.ledger_row_group_size,
            compression=new.output.compression,
        )
        ledger_files.append(name)
        kept += table.filter(pc.equal(table.column("status"), schema.KEPT)).column("source").to_pylist()
    texts = []
    for f in scored_files:  # the kept rows' pool metadata types, as a run's writer records them
        t = pq.read_table(join(root, f), columns=["source", "metadata_json"], filesystem=fs)
        texts += t.filter(pc.is_in(t.column("source"), value_set=pa.array(kept, pa.string())))[
            "metadata_json"
        ].to_pylist()
    updated = {
        **record,
        "ledger_files": ledger_files,
        "scores_files": new_scores,
        "scored_files": scored_files,
        "kept": len(kept),
        "results_hash": results_hash,
        "metadata_types": merge_all([metadata_types(texts)]),
    }
    if needs:  # its scores now hold what stages computed with the new thresholds
        updated["scored_filters"] = new.filters.model_dump(mode="json")
    write_json_atomic(fs, path, {**unit, "receipt": updated})
    for f in {*record["ledger_files"], *scores} - {*new_scores, *ledger_files}:  # never the scores still used
        delete_quietly(fs, join(root, f))
    for f in set(record["scored_files"]) - set(scored_files):
        delete_quietly(fs, join(root, LAYOUT.images_of(f)))
        delete_quietly(fs, join(root, f))
    return updated, dict(calls)


def _renamed(part: str, suffix: str) -> str:
    """A phase-1 part's path (``<folder>/part-<16 hex>[-...].parquet``) with ``suffix`` in place of any it has."""
    folder, name = posixpath.split(part)
    return posixpath.join(folder, "-".join(name.removesuffix(".parquet").split("-")[:2]) + f"-{suffix}.parquet")


def _replaced(table: pa.Table, rows: list[int], values: pa.Table) -> pa.Table:
    """``table`` with its ``rows`` replaced by ``values``' rows, in order."""
    index = np.arange(table.num_rows)
    index[rows] = table.num_rows + np.arange(len(rows))
    return pa.concat_tables([table, values.select(table.column_names).cast(table.schema)]).take(pa.array(index))


def _rescored(
    fs, root: str, shard_id: str, scored_files: list[str], again: pa.Table, new: CurateConfig, token: str
) -> list[str]:
    """The shard's scored files once the rows ``again`` were run again: the parts holding none of them as they are;
    the others' remaining rows and the rows kept now in one new part (named by ``token``), image bytes with them."""
    rerun = again.column("source").combine_chunks()
    touched = [
        f
        for f in scored_files
        if pc.any(pc.is_in(pq.read_table(join(root, f), columns=["source"], filesystem=fs)["source"], rerun)).as_py()
    ]
    target = scored_target(new, new.results_hash())
    pieces = [read_part(fs, join(root, f), target.names, target) for f in touched]
    pieces = [t.filter(pc.invert(pc.is_in(t.column("source"), rerun))) for t in pieces]
    kept = again.filter(pc.equal(again.column("status"), schema.KEPT))
    merged = pa.concat_tables([*pieces, kept.select(target.names).cast(target)])
    rest = [f for f in scored_files if f not in touched]
    if not merged.num_rows:
        return rest
    name = f"{LAYOUT.scored}/{shard_id}/part-{token}.parquet"
    write_scored(fs, root, name, merged, new, new.results_hash())
    return sorted([*rest, name])


def scores_files(out_uri: str, commits: dict[str, dict] | None = None) -> list[str]:
    """Every committed input shard's scores files (relative to the output root): phase 1's ledger files as the run
    that scored them wrote them, with every score it computed. ``commits``: the commit records, read when not given
    (one small file per input shard: a driver reads them once where it can)."""
    if commits is None:
        commits = read_commits(*resolve(out_uri))
    return sorted(f for record in commits.values() for f in _scores_files(record))


def _scores_files(record: dict) -> list[str]:
    """A committed shard's scores: the ledger files of the run that scored it (its ledger files until re-decided)."""
    return list(record.get("scores_files") or record["ledger_files"])
