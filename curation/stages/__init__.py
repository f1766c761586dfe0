"""Registry of curation stages by name (the names configs use): every module of this package that defines a ``Stage``
subclass with a ``name`` registers it (``Stage.__init_subclass__``), so a new stage is a new module here plus its
entry under ``stages`` in a config. The columns the stages declare are the stage columns of every table
(``common.schema``): importing this package installs their assembly there."""

import importlib
import pkgutil

import pyarrow as pa

from common import schema
from curation.score.stage import Stage


def stage_classes() -> dict[str, type[Stage]]:
    """Every stage class by name. Imports each module of this package; a module already imported costs a lookup."""
    for module in pkgutil.iter_modules(__path__, f"{__name__}."):
        importlib.import_module(module.name)
    return dict(Stage.registry)


def stage_columns() -> list[pa.Field]:
    """The columns every stage declares, each once, ordered by the stages' ``column_order`` (else ``default_order``,
    else after the others), then by stage name."""

    def place(stage: type[Stage]) -> tuple[bool, int, str]:
        order = stage.column_order if stage.column_order is not None else stage.default_order
        return order is None, order or 0, stage.name

    fields: dict[str, pa.Field] = {}
    declared_by: dict[str, str] = {}
    for stage in sorted(stage_classes().values(), key=place):
        for field in stage.columns:
            known = fields.setdefault(field.name, field)
            declared_by.setdefault(field.name, stage.name)
            if not known.equals(field):
                raise TypeError(
                    f"stage {stage.name!r} declares column {field.name!r} as {field.type}, "
                    f"stage {declared_by[field.name]!r} as {known.type}"
                )
    return list(fields.values())


schema.use_stage_columns(stage_columns)
