"""The tables every part of the project reads and writes: one definition, shared by curation and training.

- ``WORKING``: the row that flows through the scoring stages (a superset of the two tables below).
- ``SCORED``: survivors of phase 1, with the original encoded bytes, every score, boxes, pHash and embedding.
- ``LEDGER``: exactly one row per input, with its fate, the deciding stage, the reason and every score computed
  before the decision (no image bytes, no embedding).

The image column follows Hugging Face's ``Image`` feature (a struct of ``bytes`` and ``path``), and the final
shards carry ``datasets``' own ``huggingface`` schema metadata (``hf_metadata``), so ``datasets`` loads them as
images with no cast. Bytes are the original encoded bytes, never re-encoded; ``key`` is their sha256.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable

import pyarrow as pa

# 2: the pool's metadata (metadata_json, metadata_note; typed metadata in final shards); 3: encoding_quality
SCHEMA_VERSION = "3"

# Status values in the working table and the ledger.
PENDING = "pending"  # still flowing through the stages
KEPT = "kept"  # passed every phase-1 stage
REJECTED = "rejected"  # a stage decided against it (see stage + reason)
ERROR = "error"  # a stage raised on this image; reason holds the exception
DUPLICATE = "duplicate"  # phase 2: a near-duplicate of the image named in duplicate_of
UNSAMPLED = "unsampled"  # phase 3: not selected by balanced sampling (cluster_ids say where it fell)
TAKEN_DOWN = "taken_down"  # removed from the published shards on request (jobs.takedown; reason names the list)

HEAD_YAW_CLASSES = ("frontal", "left_profile", "right_profile", "not_visible")

IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

# columns whose values differ from row to row: a Parquet dictionary of them only costs (a scored part of 10,000 rows
# wrote 1.9x as fast and 16% smaller without; benchmarks/RESULTS.md, "Bytes once, and the write phase's encoding")
DISTINCT_PER_ROW = frozenset({"key", "source", "uid", "image", "embedding", "pdq", "pdq_crops", "phash"})

PERSON_TYPE = pa.struct(
    [
        # box in pixels of the oriented image
        ("x0", pa.float32()),
        ("y0", pa.float32()),
        ("x1", pa.float32()),
        ("y1", pa.float32()),
        ("score", pa.float32()),  # detector confidence in [0, 1]
        ("detector", pa.string()),  # which detector produced it ("openpose" in lite, "yolo" in full)
        ("height_frac", pa.float32()),  # box height / image height
        ("area_frac", pa.float32()),  # box area / image area
        ("prominent", pa.bool_()),
        # head pose of this person (prominent persons only); degrees are null where no face is visible
        ("head_yaw_class", pa.string()),
        ("head_confidence", pa.float32()),
        ("head_yaw", pa.float32()),
        ("head_pitch", pa.float32()),
        ("head_roll", pa.float32()),
        # pose-model keypoints of this person (null where the pose model missed the person), the 17 COCO
        # keypoints in COCO order, flattened as x, y, confidence per keypoint (0: not found), pixels of the
        # oriented image
        ("keypoints", pa.list_(pa.float32())),
    ]
)

FACE_TYPE = pa.struct(
    [
        ("x0", pa.float32()),
        ("y0", pa.float32()),
        ("x1", pa.float32()),
        ("y1", pa.float32()),
        ("score", pa.float32()),
        ("view", pa.string()),  # "frontal", "left_profile", "right_profile"
    ]
)

QUALITY_PARTS_TYPE = pa.struct(
    [
        ("sharpness", pa.float32()),
        ("exposure", pa.float32()),
        ("contrast", pa.float32()),
        ("colourfulness", pa.float32()),
        ("noise", pa.float32()),
    ]
)

# Columns that identify an input and record what decode learned about it.
_IDENTITY = [
    pa.field("key", pa.string()),  # sha256 hex of the original bytes; null when the bytes could not be read
    pa.field("source", pa.string(), nullable=False),  # URI of the input (member after '#' for tar/parquet pools)
    pa.field("shard_id", pa.string(), nullable=False),  # the input shard it came from
    pa.field("file_size", pa.int64()),
    pa.field("format", pa.string()),  # PIL format name of the original bytes
    pa.field("mode", pa.string()),  # PIL mode of the original bytes (before normalisation to RGB)
    pa.field("width", pa.int32()),  # after EXIF orientation (as stored for a declared bomb: its EXIF is not read)
    pa.field("height", pa.int32()),
    pa.field("orientation", pa.int8()),  # EXIF orientation tag (1 when absent or malformed, null when not read)
    # 1-100, from the header (common.encoding.encoding_quality): a JPEG's IJG quality, 100 lossless; null unknown
    pa.field("encoding_quality", pa.int8()),
    # The pool's metadata of the input (WebDataset sidecars, a Parquet pool's other columns) as one JSON object; in
    # final shards only the fields that are not typed columns of ``metadata`` (see metadata_struct). Null: none.
    pa.field("metadata_json", pa.string()),
    pa.field("metadata_note", pa.string()),  # why some of the input's metadata was dropped or altered; null: none was
]

# The columns the scoring stages write are declared by the stages themselves (each stage class's ``columns``, in
# curation/stages/), and the stage package installs their assembly here when it is imported. A process that builds a
# table's schema before importing it (a takedown rewriting a card, a verify) has it imported by name: common imports
# no module of curation otherwise. All nullable: a rejected image keeps only the scores computed before.
STAGE_REGISTRY = "curation.stages"
_stage_columns: Callable[[], list[pa.Field]] | None = None


def use_stage_columns(assemble: Callable[[], list[pa.Field]]) -> None:
    """Take the stages' columns from ``assemble`` (called each time a table's schema is built)."""
    global _stage_columns
    _stage_columns = assemble


def stage_columns() -> list[pa.Field]:
    """Every column a scoring stage may write, in the tables' order."""
    if _stage_columns is None:
        importlib.import_module(STAGE_REGISTRY)  # installs them
    if _stage_columns is None:
        raise RuntimeError(f"{STAGE_REGISTRY} was imported but installed no stage columns")
    return _stage_columns()


_FATE = [
    pa.field("status", pa.string(), nullable=False),
    pa.field("stage", pa.string()),  # the stage that decided (the last stage for kept images)
    pa.field("reason", pa.string()),
]

# Written by the global phases (dedup, sample); null in phase 1.
_GLOBAL = [
    pa.field("duplicate_of", pa.string()),  # key of the image kept in its duplicate group
    pa.field("duplicate_signal", pa.string()),  # "phash" or "embedding": which signal linked it
    pa.field("cluster_ids", pa.list_(pa.int32())),  # balanced-sampling cluster per level, leaf first
]


def embedding_type(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


def image_field() -> pa.Field:
    return pa.field("image", IMAGE_TYPE)


def working_schema(embedding_dim: int) -> pa.Schema:
    return pa.schema(
        [
            *_IDENTITY,
            pa.field(
                "shard_size", pa.int32()
            ),  # rows of the shard, on its last chunk only: tells the driver it is complete
            image_field(),
            *stage_columns(),
            pa.field("embedding", embedding_type(embedding_dim)),
            *_FATE,
            *_GLOBAL,
        ]
    )


def scored_schema(embedding_dim: int) -> pa.Schema:
    return pa.schema(
        [*_IDENTITY, image_field(), *stage_columns(), pa.field("embedding", embedding_type(embedding_dim))]
    )


# Field metadata of a working stage column: data the global phases read from the scored parts (the sub-crop hashes),
# neither a score to audit an input's fate by nor a column of the dataset; kept once per survivor, in the scored
# parts only (not in the ledgers, not in the final shards: 256 GB less in each at 10^9).
WORKING_ONLY = {b"humans1b.working": b"only"}


def published_stage_columns() -> list[pa.Field]:
    """The stage columns the ledgers and the final shards hold (all but the working ones)."""
    return [f for f in stage_columns() if (f.metadata or {}).get(b"humans1b.working") != b"only"]


def ledger_schema() -> pa.Schema:
    return pa.schema([*_FATE, *_IDENTITY, *published_stage_columns(), *_GLOBAL])


def curated_schema(embedding_dim: int | None, metadata_fields: dict[str, str] | None = None) -> pa.Schema:
    """Final curated shards: scored rows plus cluster ids; the pool's metadata fields that have one type across the
    run as the struct column ``metadata`` (``metadata_fields``: name -> type, as ``typed_metadata_fields`` gives;
    none: no such column); the embedding only when asked for."""
    typed = [pa.field("metadata", metadata_struct(metadata_fields))] if metadata_fields else []
    embedding = [pa.field("embedding", embedding_type(embedding_dim))] if embedding_dim else []
    return pa.schema([*_IDENTITY, *typed, image_field(), *published_stage_columns(), _GLOBAL[2], *embedding])


# --- the pool's metadata --------------------------------------------------------------------------------------------
# Phase 1 carries each input's metadata as JSON text, so that no two shards need agree on anything. The writers record
# which JSON types each field took (``metadata_types``); the write phase makes a field whose values share one type
# across the run a typed field of the final shards' ``metadata`` struct (what datasets, DuckDB and pyarrow read as
# columns), and leaves the others (types that disagree, lists, objects) in ``metadata_json``.

METADATA_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "string": pa.string()}
MAX_TYPED_METADATA_FIELDS = 64  # more distinct fields than this (a pool of free-form JSON): the rest stay JSON


def json_type(value: object) -> str:
    """The JSON type name of a parsed value: bool, int, float, string, null or nested."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "nested"


def typed_metadata_fields(types: dict[str, list[str]]) -> dict[str, str]:
    """Fields whose non-null values have one scalar type (ints and floats together: float), name -> type name."""
    typed = {}
    for name in sorted(types):
        kinds = set(types[name]) - {"null"}
        if kinds == {"int", "float"}:
            kinds = {"float"}
        if len(kinds) == 1 and (kind := next(iter(kinds))) in METADATA_TYPES:
            typed[name] = kind
        if len(typed) == MAX_TYPED_METADATA_FIELDS:
            break
    return typed


def metadata_struct(fields: dict[str, str] | None) -> pa.DataType:
    return pa.struct([pa.field(name, METADATA_TYPES[kind]) for name, kind in sorted((fields or {}).items())])


def with_metadata(schema: pa.Schema, *, table: str, config_hash: str, extra: dict | None = None) -> pa.Schema:
    """Attach the file-level metadata every shard carries: which table, schema version, producing config."""
    meta = {
        b"humans1b.table": table.encode(),
        b"humans1b.schema_version": SCHEMA_VERSION.encode(),
        b"humans1b.config_hash": config_hash.encode(),
    }
    if extra:
        meta[b"humans1b.extra"] = json.dumps(extra, sort_keys=True).encode()
    return schema.with_metadata(meta)


# --- Hugging Face features ----------------------------------------------------------------------------------------
# ``datasets`` stores a table's features as JSON under the ``huggingface`` schema metadata key and in a dataset
# card's ``dataset_info.features``. Both are derived here from the arrow schema, in the exact form ``datasets``
# writes them (a test compares them with ``datasets.Features.from_arrow_schema`` plus ``Image()``), so writers need
# no ``datasets`` import. The ``image`` column becomes an ``Image`` feature, every other column its plain feature.

HF_METADATA_KEY = b"huggingface"
_HF_DTYPES = {"float": "float32", "double": "float64", "halffloat": "float16"}  # arrow names datasets spells otherwise


def _hf_feature(name: str | None, dtype: pa.DataType) -> dict:
    if name == "image" and dtype == IMAGE_TYPE:
        return {"_type": "Image"}
    if pa.types.is_struct(dtype):
        return {f.name: _hf_feature(f.name, f.type) for f in dtype}
    if pa.types.is_fixed_size_list(dtype):
        return {"feature": _hf_feature(None, dtype.value_type), "length": dtype.list_size, "_type": "List"}
    if pa.types.is_list(dtype):
        return {"feature": _hf_feature(None, dtype.value_type), "_type": "List"}
    if pa.types.is_nested(dtype):  # large lists, maps: not in our tables, and datasets spells them otherwise
        raise TypeError(f"no Hugging Face feature for {dtype}")
    return {"dtype": _HF_DTYPES.get(str(dtype), str(dtype)), "_type": "Value"}


def hf_features(schema: pa.Schema) -> dict:
    """The table's ``datasets`` features as ``Features.to_dict()`` gives them."""
    return {f.name: _hf_feature(f.name, f.type) for f in schema}


def hf_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """The ``huggingface`` schema metadata ``datasets`` writes into its own Parquet files."""
    return {HF_METADATA_KEY: json.dumps({"info": {"features": hf_features(schema)}}).encode()}


def _card_entry(feature: dict) -> dict:
    """One feature as a dataset card lists it (``Features._to_yaml_list``)."""
    kind = feature.get("_type")
    if kind == "List":
        inner = _card_entry(feature["feature"])
        # a list of one dtype or of a struct is written as that dtype or that struct's fields
        item = inner[next(iter(inner))] if list(inner) in (["dtype"], ["struct"]) else inner
        return {"list": item, **({"length": feature["length"]} if "length" in feature else {})}
    if kind == "Value":
        return {"dtype": feature["dtype"]}
    if kind:
        return {"dtype": kind.lower()}  # Image -> image
    return {"struct": [{"name": name, **_card_entry(sub)} for name, sub in feature.items()]}


def hf_card_features(schema: pa.Schema) -> list[dict]:
    """The table's features as a dataset card's ``dataset_info.features`` lists them."""
    return [{"name": name, **_card_entry(feature)} for name, feature in hf_features(schema).items()]


def read_metadata(schema: pa.Schema) -> dict:
    """The humans1b.* file metadata as plain strings (extra decoded from JSON)."""
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items() if k.startswith(b"humans1b.")}
    out = {k.removeprefix("humans1b."): v for k, v in meta.items()}
    if "extra" in out:
        out["extra"] = json.loads(out["extra"])
    return out


# --- labelled shards (fine-tuning) ------------------------------------------------------------------------------
# One row per image with the labels of any of the five tasks (a column is null where a row lacks that label).
# Dense labels are encoded arrays, never pickles: PNG for 8-bit maps, ``.npy`` (numpy's own header + raw data,
# read with allow_pickle=False) for float maps. File metadata ``humans1b.extra`` names the label vocabulary:
# ``parts`` (class names, index = label value), ``keypoint_names``, ``keypoint_sigmas`` (OKS), ``image_size``.

LABELLED_TABLE = "labelled"

CAMERA_TYPE = pa.struct([("fx", pa.float32()), ("fy", pa.float32()), ("cx", pa.float32()), ("cy", pa.float32())])


def labelled_schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),  # sha256 hex of the image bytes
            pa.field("source", pa.string()),  # where the row came from (e.g. synthetic:<seed>:<split>:<index>)
            image_field(),
            pa.field("width", pa.int32()),
            pa.field("height", pa.int32()),
            pa.field("mask", pa.binary()),  # PNG L: 255 where the dense labels are defined (the person)
            pa.field("parts", pa.binary()),  # PNG L: body-part class per pixel (0 background)
            pa.field("pointmap", pa.binary()),  # .npy float16 [H, W, 3]: camera-frame point (x right, y down, z fwd)
            pa.field("normal", pa.binary()),  # .npy float16 [H, W, 3]: unit normal, camera frame
            pa.field("albedo", pa.binary()),  # PNG RGB: diffuse albedo
            pa.field("keypoints", pa.list_(pa.list_(pa.float32(), 2))),  # [K] x (x, y) pixels, pixel centres at ints
            pa.field("keypoint_visibility", pa.list_(pa.uint8())),  # COCO: 0 not labelled, 1 occluded, 2 visible
            pa.field("area", pa.float32()),  # person area in pixels (OKS scale)
            pa.field("camera", CAMERA_TYPE),  # pinhole intrinsics of the pointmap
        ]
    )
