"""Registry of curation stages by name (the names configs use): every module of this package that defines a ``Stage``
subclass with a ``name`` registers it (``Stage.__init_subclass__``), so a new stage is a new module here plus its
entry under ``stages`` in a config."""

import importlib
import pkgutil

from curation.score.stage import Stage


def stage_classes() -> dict[str, type[Stage]]:
    """Every stage class by name. Imports each module of this package; a module already imported costs a lookup."""
    for module in pkgutil.iter_modules(__path__, f"{__name__}."):
        importlib.import_module(module.name)
    return dict(Stage.registry)
