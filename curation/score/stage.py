"""The one Stage abstraction every curation filter and scorer uses.

A stage declares its name, the columns it reads and writes, its default resources and its place in the default
stage list; defining it in a module of curation/stages/ registers it. ``setup()`` loads models once per Ray actor
(or once per worker process for task stages) and ``process_batch()`` scores a batch of rows, one update per row (its
new column values; ``reject(...)`` to reject it for what the image is: unreadable, no person found). A threshold on a
score is applied apart, by ``decide()`` on the stored values, so that it can be changed later without the models. The
runner around it (``curation.score.stage_runner``) is what Ray
Data calls.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pyarrow as pa

from curation.settings import CurationSettings, Filters, ModelSettings, StageSettings

REJECT = "reject"  # key of an update dict that rejects the row; its value is "reason_code: detail"

Row = dict[str, Any]
Update = dict[str, Any]


class Stage:
    """Base class. Subclasses set the class attributes and implement ``process_batch``; one that sets ``name``
    registers itself, so a module in curation/stages/ defining it is all the registry needs."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ("image",)
    writes: ClassVar[tuple[str, ...]] = ()
    # Model stages run in a Ray actor pool (setup once per actor); cheap stateless stages run as tasks.
    uses_actors: ClassVar[bool] = False
    # Settings where the config names none: the fields a config's entry for the stage leaves out.
    default_settings: ClassVar[StageSettings] = StageSettings()
    # Place in the stage list of a config that lists none (the lite profile); None: runs only where a config lists it.
    default_order: ClassVar[int | None] = None
    # A stage for tests of the runner (fault injection): a config may list it, but no message offers it as a choice.
    internal: ClassVar[bool] = False
    # The columns the stage adds to the tables, with their Arrow types (common.schema assembles the tables from
    # every stage's); two stages may declare one column with one type. ``writes`` defaults to their names.
    columns: ClassVar[tuple[pa.Field, ...]] = ()
    # Where its columns sit among the stages' columns (ties by stage name); None: at its default_order, and a stage
    # with neither after the others.
    column_order: ClassVar[int | None] = None
    # What it reads of the config besides its ``stages.<name>`` entry (whose class is default_settings' class: a
    # stage's own model references and thresholds are fields of a StageSettings subclass): the shared sections of
    # the stages that predate that, its model family under ``models`` and the ``filters`` deciding its rejections.
    model_section: ClassVar[str | None] = None
    thresholds: ClassVar[tuple[str, ...]] = ()
    # The thresholds ``decide`` reads, and the reason codes it gives: a decision over the row's stored columns, re-taken
    # from stored scores with no model call (``curation.score.redecide``). The stage's other thresholds change what it
    # computes (which persons are prominent, which frames are read): changing one means running the stage again.
    decided: ClassVar[tuple[str, ...]] = ()
    decision_codes: ClassVar[tuple[str, ...]] = ()
    # Every named stage class by name, filled as their modules are imported; curation.stages imports them all.
    registry: ClassVar[dict[str, type[Stage]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # a base for other stages, not a stage of its own
        if "writes" not in cls.__dict__ and "columns" in cls.__dict__:
            cls.writes = tuple(f.name for f in cls.columns)
        where = f"stage {cls.name!r} ({cls.__module__}.{cls.__qualname__})"
        if cls.model_section is not None and cls.model_section not in ModelSettings.model_fields:
            raise TypeError(f"{where}: model_section {cls.model_section!r} is no section of models")
        if unknown := [t for t in cls.thresholds if t not in Filters.model_fields]:
            raise TypeError(f"{where}: thresholds {unknown} are no fields of filters")
        if undeclared := [t for t in cls.decided if t not in cls.thresholds]:
            raise TypeError(f"{where}: decided {undeclared} are not among its thresholds")
        known = Stage.registry.get(cls.name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"stage name {cls.name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                f"{known.__module__}.{known.__qualname__}"
            )
        Stage.registry[cls.name] = cls

    def __init__(self, cfg: CurationSettings):
        self.cfg = cfg
        self.settings = cfg.stages[self.name]

    @classmethod
    def config_keys(cls) -> list[str]:
        """Every key of a config the stage reads: its entry, its model family, its thresholds."""
        models = [f"models.{cls.model_section}"] if cls.model_section else []
        return [f"stages.{cls.name}", *models, *(f"filters.{t}" for t in cls.thresholds)]

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        """The rejection (``"reason_code: detail"``) of a row the stage scored and let pass, from its stored columns
        and the ``decided`` thresholds alone; None: it passes. A run and a re-decide both call it on the values as
        stored (cast to their columns' types), so the two agree to the bit."""
        return None

    @classmethod
    def computed_settings(cls, filters: Filters) -> dict[str, Any]:
        """What of ``filters`` changes what the stage computes, not only what it decides: a change reruns it."""
        return {t: _plain(getattr(filters, t)) for t in cls.thresholds if t not in cls.decided}

    def setup(self) -> None:
        """Load models and other per-process state. Called once before the first batch."""

    def process_batch(self, rows: list[Row]) -> list[Update]:
        """Return one update per row: column -> value for columns in ``writes``, plus ``REJECT`` to reject."""
        raise NotImplementedError

    @property
    def threads(self) -> int:
        """Threads a stage's native libraries may use: its CPU share, at least one."""
        return max(1, round(self.settings.num_cpus))


def _plain(value: Any) -> Any:
    """A settings value as plain data (a submodel as its dict), for comparing two configs."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def reject(code: str, detail: str = "") -> Update:
    """An update that rejects a row; ``code`` is stable (summaries group by it), ``detail`` is for people."""
    return {REJECT: f"{code}: {detail}" if detail else code}
