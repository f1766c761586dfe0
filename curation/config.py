"""The curation config a job loads: the sections of ``curation.settings`` plus which stages run in which order,
each stage's entry checked against the stage registry (``curation.stages``) and filled in from its class's defaults.
"""

from __future__ import annotations

import difflib
import functools

from pydantic import Field, field_validator, model_validator

from curation.score.stage import Stage
from curation.settings import CurationSettings, StageSettings
from curation.stages import stage_classes


def _default_stages() -> dict[str, StageSettings]:
    """The stages that declare a ``default_order``, in that order, with their declared settings."""
    order = {s: s.default_order for s in stage_classes().values() if s.default_order is not None}
    ordered = sorted(order, key=order.__getitem__)
    return {stage.name: stage.default_settings.model_copy() for stage in ordered}


class CurateConfig(CurationSettings):
    stages: dict[str, StageSettings] = Field(default_factory=_default_stages)  # run in this order

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_defaults_under_entries(cls, stages: object) -> object:
        """A stage's entry states only what differs from the settings its class declares."""
        if not isinstance(stages, dict):
            return stages
        known = stage_classes()
        if unknown := [name for name in stages if name not in known]:
            raise ValueError(unknown_stages(unknown, known))
        return {
            name: {**known[name].default_settings.model_dump(), **given}
            if name in known and isinstance(given, dict)
            else given
            for name, given in stages.items()
        }

    @model_validator(mode="after")
    def _decode_first(self) -> CurateConfig:
        if next(iter(self.stages), None) != "decode" or not self.stages["decode"].enabled:
            raise ValueError("the first stage must be 'decode' and it cannot be disabled")
        return self


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
