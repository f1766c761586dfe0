"""The threshold explorer of the report's score histograms: what phase 1 would keep at other values of a threshold.

For each histogram whose threshold an enabled stage decides on stored values (``Stage.decided``), a handful of
candidate values (the configured one and quantiles of the sampled scores) each get a ``Decider`` from the config to
the config with that value. Phase 1's scores (``redecide.scores_files``) are then read a file at a time, each row
walked against every decider, and only counters are held: per candidate the inputs kept and the inputs that would
need model work, per score the inputs the cascade stopped before its stage. Past a few hundred files the walk runs in
Ray tasks over groups of files, whose counters are summed as they come (``Exploration.merge``). The candidates come from the histogram samples
``report_data.gather`` collects, so this is a second pass over ledger files (gather's pass may read the final ledger,
whose fates are the global phases'; the walk needs phase 1's).

A threshold a stage computes with (which persons are prominent) is not decided: changing it reruns that stage for
every input that reached it, which the explorer counts instead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from common import schema
from common.storage import join, resolve
from curation.audit.report_data import ScoreSpec, ScoreValues
from curation.config import CurateConfig, config_from_json
from curation.score.redecide import (
    FILES_PER_TASK,
    NEEDS,
    TASKS_FROM_FILES,
    Decider,
    enabled_stages,
    in_tasks,
    scores_files,
)
from curation.score.stage import Stage

CANDIDATES = 7  # rows of a table: the configured value and quantiles of the sampled scores
_FATE = ("status", "stage", "reason")


@dataclass
class Candidate:
    value: float | int | None  # None: the threshold off (a configured value of None)
    current: bool
    kept: int = 0
    needs: int = 0  # inputs whose walk needs a stage run again (model work)


@dataclass
class Explored:
    """One decided threshold's table."""

    column: str
    threshold: str
    stage: str
    keep: str  # "min" or "max"
    candidates: list[Candidate]
    missing: int = 0  # inputs without the score: the cascade stopped them before its stage


@dataclass
class Computed:
    """A threshold a stage computes with: a change reruns the stage for every input that reached it."""

    column: str
    threshold: str
    stage: str
    reached: int = 0


@dataclass
class Exploration:
    inputs: int = 0
    kept: int = 0  # phase 1's kept inputs under the thresholds the output is decided with
    tables: dict[str, Explored] = field(default_factory=dict)  # by score column
    computed: dict[str, Computed] = field(default_factory=dict)

    def merge(self, other: Exploration) -> None:
        """Add the counts of ``other``, a copy of the same plan counted over other files."""
        self.inputs += other.inputs
        self.kept += other.kept
        for column, table in self.tables.items():
            table.missing += other.tables[column].missing
            for mine, theirs in zip(table.candidates, other.tables[column].candidates):
                mine.kept += theirs.kept
                mine.needs += theirs.needs
        for column, note in self.computed.items():
            note.reached += other.computed[column].reached


def stage_of(threshold: str, cfg: CurateConfig) -> type[Stage] | None:
    """The enabled stage whose thresholds include ``threshold`` (the first in the stage list)."""
    return next((stage for stage in enabled_stages(cfg) if threshold in stage.thresholds), None)


def candidates(values: np.ndarray, current: float | int | None, integer: bool, n: int = CANDIDATES) -> list:
    """``current`` and up to ``n - 1`` values spread over the sampled ``values`` (quantiles), rounded to two
    significant digits (three where two make quantiles coincide; integers for an integer threshold), distinct and
    sorted; None (off) first."""
    values = values[np.isfinite(values)]
    quantiles = np.quantile(values, np.linspace(0.05, 0.95, n - 1)) if len(values) else np.empty(0)
    picked: set = set()
    for digits in (2, 3):
        nice = [float(f"{q:.{digits}g}") for q in quantiles]
        picked = {max(1, int(v)) for v in nice} if integer else set(nice)
        if len(picked) == len(set(quantiles.tolist())):
            break
    picked.discard(current)
    spread = sorted(picked)
    if current is None:
        return [None, *spread]
    return sorted([current, *spread])


def _with(cfg: CurateConfig, threshold: str, value) -> CurateConfig:
    return cfg.model_copy(update={"filters": cfg.filters.model_copy(update={threshold: value})})


def _derived(row: dict, column: str):
    w, h = row.get("width"), row.get("height")
    if column == "short_side":
        return min(w, h) if w and h else None
    if column == "aspect_ratio":
        return max(w, h) / min(w, h) if w and h else None
    return row.get(column)


def explore(
    out_uri: str, cfg: CurateConfig, specs: Iterable[ScoreSpec], sampled: dict[str, ScoreValues]
) -> Exploration:
    """The explorer's counts for ``specs`` over ``out_uri``'s phase-1 scores; ``cfg`` must be the config the output
    is curated with. ``sampled``: the histograms' values, where the candidates come from. Up to
    ``TASKS_FROM_FILES`` scores files are walked here; more, in Ray tasks of ``FILES_PER_TASK`` (every row is walked
    once per candidate: ~40 walks, ~15 ms a row, so a 10^9-row output needs the cluster)."""
    plan = _plan(cfg, specs, sampled)
    if not plan.tables and not plan.computed:
        return plan
    files, cfg_json = scores_files(out_uri), cfg.model_dump_json()
    if len(files) <= TASKS_FROM_FILES:
        return _count_files(out_uri, files, cfg_json, plan)
    groups = [files[i : i + FILES_PER_TASK] for i in range(0, len(files), FILES_PER_TASK)]
    blank = copy.deepcopy(plan)  # what every task counts from: ``plan`` takes their counts as they come
    in_tasks(cfg, _count_files, [(out_uri, group, cfg_json, blank) for group in groups], plan.merge)
    return plan


def _plan(cfg: CurateConfig, specs: Iterable[ScoreSpec], sampled: dict[str, ScoreValues]) -> Exploration:
    """The tables and notes to fill, their candidates chosen and every count at zero."""
    out = Exploration()
    for spec in specs:
        threshold = spec.threshold
        stage = stage_of(threshold, cfg) if threshold else None
        if threshold is None or stage is None or spec.column not in sampled:
            continue
        if threshold not in stage.decided:
            out.computed[spec.column] = Computed(spec.column, threshold, stage.name)
            continue
        current = getattr(cfg.filters, threshold)
        integer = isinstance(current, int) and not isinstance(current, bool)
        values, _ = sampled[spec.column].arrays()
        rows = [Candidate(v, v == current) for v in candidates(values, current, integer)]
        out.tables[spec.column] = Explored(spec.column, threshold, stage.name, spec.keep, rows)
    return out


def _count_files(out_uri: str, paths: list[str], cfg_json: str, plan: Exploration) -> Exploration:
    """``plan``'s counts over the scores files ``paths`` (relative to the output root), in a copy of it."""
    cfg = config_from_json(cfg_json)
    out = copy.deepcopy(plan)
    order = {n: i for i, n in enumerate(cfg.enabled_stages)}
    same = Decider(cfg, cfg)  # the configured values: one walk serves every table's current row
    current_rows = [c for t in out.tables.values() for c in t.candidates if c.current]
    deciders = [
        (Decider(cfg, _with(cfg, t.threshold, c.value)), c)
        for t in out.tables.values()
        for c in t.candidates
        if not c.current
    ]
    needed = {*_FATE, "width", "height"}
    for stage in enabled_stages(cfg):
        needed |= set(stage.writes)
    fs, root = resolve(out_uri)
    for path in paths:
        f = join(root, path)
        names = pq.read_schema(f, filesystem=fs).names
        ledger = pq.read_table(f, columns=[c for c in names if c in needed], filesystem=fs).to_pylist()
        out.inputs += len(ledger)
        for r in ledger:
            if same.walk(r).status == schema.KEPT:  # the scores' fate under the thresholds it is decided with now
                out.kept += 1
            _count(r, same, current_rows)
            for decider, c in deciders:
                _count(r, decider, (c,))
            at = order.get(r["stage"], -1)
            for t in out.tables.values():
                if at < order[t.stage] and r["status"] != schema.KEPT and _derived(r, t.column) is None:
                    t.missing += 1
            for p in out.computed.values():
                if at >= order[p.stage]:
                    p.reached += 1
    return out


def _count(row: dict, decider: Decider, rows: Iterable[Candidate]) -> None:
    walk = decider.walk(row)
    if walk.status == schema.KEPT:
        for c in rows:
            c.kept += 1
    elif walk.status == NEEDS:
        for c in rows:
            c.needs += 1
