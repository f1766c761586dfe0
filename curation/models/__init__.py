"""Models the curation stages run: where their weights come from and how they load without running pickled code.

``store`` finds a model reference wherever the cluster keeps it (local, object store, hub mirror, package index via
``packages``) and checks its pins; ``weights`` loads plain state dicts safely; ``yolo`` and ``clip`` are one file per
model family. The names below are the public surface the stages and tools use.
"""

from curation.models.clip import (
    NSFW_HEAD_KEYS,
    LoadedClip,
    aesthetic_head_from_state_dict,
    head_input_dim,
    load_clip,
    nsfw_head_from_state_dict,
)
from curation.models.errors import ModelIntegrityError, ModelNotFoundError
from curation.models.packages import parse_package_ref, project_of
from curation.models.store import ModelStore
from curation.models.weights import device_and_dtype, load_state_dict
from curation.models.yolo import YOLO_FORMAT, import_ultralytics, load_yolo, save_yolo

__all__ = [
    "NSFW_HEAD_KEYS",
    "YOLO_FORMAT",
    "LoadedClip",
    "ModelIntegrityError",
    "ModelNotFoundError",
    "ModelStore",
    "aesthetic_head_from_state_dict",
    "device_and_dtype",
    "head_input_dim",
    "import_ultralytics",
    "load_clip",
    "load_state_dict",
    "load_yolo",
    "nsfw_head_from_state_dict",
    "parse_package_ref",
    "project_of",
    "save_yolo",
]
