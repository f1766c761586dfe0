"""The threshold explorer of the report's score histograms: what phase 1 would keep at other values of a threshold.

For each histogram whose threshold an enabled stage decides on stored values (``Stage.decided``), a handful of
candidate values (the configured one and quantiles of the sampled scores) each get a ``Decider`` from the config to
the config with that value, built once. Phase 1's committed ledger is then read a file at a time, each row walked
against every decider, and only counters are held: per candidate the inputs kept and the inputs that would need model
work, per score the inputs the cascade stopped before its stage. The candidates come from the histogram samples
``report_data.gather`` collects, so this is a second pass over ledger files (gather's pass may read the final ledger,
whose fates are the global phases'; the walk needs phase 1's).

A threshold a stage computes with (which persons are prominent) is not decided: changing it reruns that stage for
every input that reached it, which the explorer counts instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from common import schema
from common.storage import join, resolve
from curation.audit.report_data import ScoreSpec, ScoreValues
from curation.config import CurateConfig
from curation.score.redecide import NEEDS, Decider, enabled_stages, scores_files
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
    kept: int = 0  # phase 1's kept inputs, as the ledger says
    tables: dict[str, Explored] = field(default_factory=dict)  # by score column
    computed: dict[str, Computed] = field(default_factory=dict)


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
    """The explorer's counts for ``specs`` over ``out_uri``'s phase-1 ledger; ``cfg`` must be the config it was
    scored with. ``sampled``: the histograms' values, where the candidates come from."""
    out = Exploration()
    order = {n: i for i, n in enumerate(cfg.enabled_stages)}
    deciders: list[tuple[Decider, Candidate]] = []
    same = Decider(cfg, cfg)  # the configured values: one walk serves every table's current row
    current_rows: list[Candidate] = []
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
        for c in rows:
            if c.current:
                current_rows.append(c)
            else:
                deciders.append((Decider(cfg, _with(cfg, threshold, c.value)), c))
    if not out.tables and not out.computed:
        return out
    needed = {*_FATE, "width", "height"}
    for stage in enabled_stages(cfg):
        needed |= set(stage.writes)
    fs, root = resolve(out_uri)
    for path in scores_files(out_uri):
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
