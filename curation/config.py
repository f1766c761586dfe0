"""The curation config a job loads: the sections of ``curation.settings`` plus which stages run in which order,
each stage's entry checked against the stage registry (``curation.stages``) and filled in from its class's defaults.
"""

from __future__ import annotations

import difflib
import functools

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from curation.score.stage import Stage
from curation.settings import CurationSettings, StageSettings
from curation.stages import stage_classes


def _default_stages() -> dict[str, StageSettings]:
    """The stages that declare a ``default_order``, in that order, with their declared settings."""
    order = {s: s.default_order for s in stage_classes().values() if s.default_order is not None}
    ordered = sorted(order, key=order.__getitem__)
    return {stage.name: stage.default_settings.model_copy() for stage in ordered}


class CurateConfig(CurationSettings):
    """The curation config a job loads: every section of ``CurationSettings``, the stage list checked against the
    stage registry, and the stages fused into one actor pool."""

    stages: dict[str, SerializeAsAny[StageSettings]] = Field(
        default_factory=_default_stages,
        description="The stages that score each image, by name, run in this order (decode first); an entry states "
        "only what differs from its stage's declared settings. Default: the stages that declare a default order.",
    )
    fused: list[list[str]] = Field(
        default_factory=list,
        description="Runs of consecutive stages that one Ray actor pool runs, each actor calling the stages in turn "
        "on its batch: fewer processes, queues and hand-offs between them where a node has few cores. Each stage "
        "keeps its own time limit and ledger reasons, so results do not change. The pool has its first stage's "
        "batch_size, num_cpus, num_gpus and actors. Empty: none.",
    )

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_defaults_under_entries(cls, stages: object) -> object:
        """A stage's entry states only what differs from the settings its class declares, and is of their class."""
        if not isinstance(stages, dict):
            return stages
        known = stage_classes()
        if unknown := [name for name in stages if name not in known]:
            raise ValueError(unknown_stages(unknown, known))
        out = {}
        for name, given in stages.items():
            defaults = known[name].default_settings
            out[name] = (
                type(defaults).model_validate({**defaults.model_dump(), **given}) if isinstance(given, dict) else given
            )
        return out

    @model_validator(mode="after")
    def _decode_first(self) -> CurateConfig:
        if next(iter(self.stages), None) != "decode" or not self.stages["decode"].enabled:
            raise ValueError("the first stage must be 'decode' and it cannot be disabled")
        return self

    @model_validator(mode="after")
    def _blocklists_hashed(self) -> CurateConfig:
        if self.filters.blocklists and not (self.stages.get("phash") and self.stages["phash"].enabled):
            raise ValueError("filters.blocklists are applied by the phash stage: enable stages.phash or drop the lists")
        return self

    @model_validator(mode="after")
    def _fused_runs_consecutive(self) -> CurateConfig:
        order = list(self.stages)
        seen: set[str] = set()
        for group in self.fused:
            where = f"fused entry {group}"
            if len(group) < 2:
                raise ValueError(f"{where}: a fused run names at least two stages")
            if missing := [n for n in group if n not in order]:
                raise ValueError(f"{where}: {missing} not among the configured stages {order}")
            if again := [n for n in group if n in seen]:
                raise ValueError(f"{where}: {again} already in another fused run")
            seen.update(group)
            start = order.index(group[0])
            if order[start : start + len(group)] != group:
                raise ValueError(f"{where}: the stages must be consecutive and in the stage order {order}")
        return self

    @property
    def stage_groups(self) -> list[tuple[str, ...]]:
        """The enabled stages as the score chain runs them: one group a stage, or a fused run (less its disabled
        stages) as one group, run by one actor pool."""
        enabled = set(self.enabled_stages)
        group_of = {}
        for fused in self.fused:
            run = tuple(n for n in fused if n in enabled)
            group_of.update(dict.fromkeys(run, run))
        groups: list[tuple[str, ...]] = []
        for name in self.enabled_stages:
            group = group_of.get(name, (name,))
            if not groups or groups[-1] != group:
                groups.append(group)
        return groups


def unknown_stages(unknown: list[str], known: dict[str, type[Stage]]) -> str:
    """One line naming each unknown stage, the closest name a config may use and every such name (stages for tests
    of the runner left out)."""
    offered = sorted(name for name, stage in known.items() if not stage.internal)
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, offered, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown stage {', '.join(named)}; the stages are {', '.join(offered)}"


@functools.lru_cache(maxsize=8)
def config_from_json(cfg_json: str) -> CurateConfig:
    """The config a job hands its Ray tasks as JSON, parsed once per worker process rather than once per batch.
    Callers share the object: read it, never assign to it."""
    return CurateConfig.model_validate_json(cfg_json)
