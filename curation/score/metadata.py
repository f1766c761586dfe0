"""The pool's own metadata of each input: sidecars (in a WebDataset tar or beside a file of a folder) and a Parquet
pool's other columns.

What img2dataset, and most crawls, write beside an image — its URL, caption, licence, original size — is what a
published dataset must keep to be cited, filtered or taken down. Readers gather it per input (``InputMetadata``) and
it flows through phase 1 as one JSON object (``metadata_json``); a field or sidecar that cannot be kept (not JSON,
not UTF-8, over ``input.max_metadata_kb``) is dropped or altered with a ``metadata_note``, and the image goes on.
The writers record each field's JSON types (``metadata_types``); the write phase makes the fields of one type typed
columns of the final shards (``split_metadata``), the rest stays JSON.

Sizes at 1B inputs: a row carries at most ``input.max_metadata_kb`` of metadata; a commit record and the driver's
merge hold one entry per distinct field name, at most ``MAX_TRACKED_FIELDS``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from common import schema

# Sidecars that are text, kept as a field named by their extension (as webdataset names a sample's parts); binary
# ones (.npy, .pth, pickles) are never parsed: a pickle is code.
TEXT_SIDECARS = (
    "txt", "caption", "url", "cls", "cls2", "key", "id", "idx", "index", "meta", "xml", "yaml", "yml", "csv", "tsv",
    "md5", "sha1", "sha256",
)  # fmt: skip
_INT_SIDECARS = ("cls", "cls2", "idx", "index")  # webdataset decodes these as integers
MAX_FIELDS_PER_INPUT = 256
MAX_FIELD_NAME = 128
MAX_TRACKED_FIELDS = 1024  # per commit record and in the write phase's merge
_NOTE_LIMIT = 300

# A WebDataset sample's parts share the member name up to the first dot of its file name (webdataset's rule).
_SAMPLE_PART = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


def sample_key(member: str) -> tuple[str, str]:
    """(sample key, extension) of a tar member, as webdataset groups them; no dot: the whole name, no extension."""
    match = _SAMPLE_PART.match(member)
    return (match.group(1), match.group(2).lower()) if match else (member, "")


def _plain(value: Any) -> Any:
    """A value as JSON holds it: NaN and infinities become null, bytes are not kept (None), the rest as str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return None
    return str(value)  # timestamps, decimals, dates


class InputMetadata:
    """One input's metadata as the reader finds it; ``result()`` gives (metadata_json, metadata_note)."""

    def __init__(self, fields: list[str], max_kb: int):
        self.wanted = None if "*" in fields else set(fields)
        self.limit = max_kb * 1024
        self.fields: dict[str, Any] = {}
        self.notes: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.wanted is None or bool(self.wanted)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def add(self, name: str, value: Any) -> None:
        if name.startswith("__") or (self.wanted is not None and name not in self.wanted):
            return  # webdataset's own __key__ / __url__; fields not asked for
        if len(name) > MAX_FIELD_NAME:
            self.note(f"a field name of {len(name)} characters dropped (over {MAX_FIELD_NAME})")
            return
        self.fields[name] = _plain(value)

    @staticmethod
    def parses(extension: str) -> bool:
        """Whether a sidecar of this extension is metadata: JSON or text (binary parts never are)."""
        return extension == "json" or extension in TEXT_SIDECARS

    def add_sidecar(self, member: str, extension: str, data: bytes | None, size: int) -> None:
        """A sidecar member's bytes (None: over the size limit, unread)."""
        if not self.parses(extension):
            return
        if data is None:
            self.note(f"sidecar {member} is {size} bytes, over input.max_metadata_kb ({self.limit // 1024}); dropped")
            return
        if extension == "json":
            try:
                value = json.loads(data)
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                self.note(f"sidecar {member} is not valid JSON ({type(exc).__name__} at byte {_where(exc)}); dropped")
                return
            if isinstance(value, dict):
                for name, item in value.items():
                    self.add(name, item)
            else:
                self.add("json", value)
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", "backslashreplace")
            self.note(f"sidecar {member} is not UTF-8; its undecodable bytes are kept as \\xNN escapes")
        if extension in _INT_SIDECARS and text.strip().lstrip("-").isdigit() and len(text.strip()) < 19:
            self.add(extension, int(text.strip()))
        else:
            self.add(extension, text)

    def result(self) -> tuple[str | None, str | None]:
        fields = self.fields
        if len(fields) > MAX_FIELDS_PER_INPUT:
            dropped = sorted(fields)[MAX_FIELDS_PER_INPUT:]
            fields = {k: fields[k] for k in sorted(fields)[:MAX_FIELDS_PER_INPUT]}
            self.note(f"{len(dropped)} fields over the first {MAX_FIELDS_PER_INPUT} (by name) dropped")
        text = json.dumps(fields, sort_keys=True, ensure_ascii=False) if fields else None
        if text is not None and len(text.encode()) > self.limit:
            sizes = {k: len(json.dumps(v, ensure_ascii=False).encode()) for k, v in fields.items()}
            dropped = []
            for name in sorted(sizes, key=lambda k: (-sizes[k], k)):  # largest first, until it fits
                del fields[name]
                dropped.append(name)
                text = json.dumps(fields, sort_keys=True, ensure_ascii=False) if fields else None
                if text is None or len(text.encode()) <= self.limit:
                    break
            self.note(
                f"field(s) {', '.join(dropped[:5])}{' ...' if len(dropped) > 5 else ''} dropped: the metadata is over "
                f"input.max_metadata_kb ({self.limit // 1024})"
            )
        note = "; ".join(self.notes)
        return text, (note[: _NOTE_LIMIT - 3] + "..." if len(note) > _NOTE_LIMIT else note) or None


def _where(exc: Exception) -> int:
    return getattr(exc, "pos", None) or getattr(exc, "start", 0) or 0


# --- types: recorded by the writers, merged by the write phase -------------------------------------------------------


def metadata_types(texts: Iterable[str | None]) -> dict[str, list[str]]:
    """The JSON types each field takes in ``texts`` (metadata_json values), at most MAX_TRACKED_FIELDS fields."""
    types: dict[str, set[str]] = {}
    for text in texts:
        if text is None:
            continue
        for name, value in json.loads(text).items():
            if name in types:
                types[name].add(schema.json_type(value))
            elif len(types) < MAX_TRACKED_FIELDS:
                types[name] = {schema.json_type(value)}
    return {name: sorted(kinds) for name, kinds in sorted(types.items())}


def merge_types(into: dict[str, list[str]], more: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """``into`` with ``more``'s types added (fields past MAX_TRACKED_FIELDS are not tracked)."""
    for name, kinds in more.items():
        if name in into:
            into[name] = sorted(set(into[name]) | set(kinds))
        elif len(into) < MAX_TRACKED_FIELDS:
            into[name] = sorted(kinds)
    return into


def merge_all(summaries: Iterable[Mapping[str, list[str]]]) -> dict[str, list[str]]:
    """The types of many summaries (commit records, receipts) merged."""
    merged: dict[str, list[str]] = {}
    for summary in summaries:
        merge_types(merged, summary)
    return merged


def split_metadata(texts: list[str | None], typed: dict[str, str]) -> tuple[pa.Array | None, list[str | None]]:
    """The final shards' ``metadata`` struct (None when no field is typed) and ``metadata_json`` (the other fields)
    of rows whose phase-1 metadata is ``texts``. A value that does not fit its field's type (a field past the
    tracked ones) stays in the JSON rest."""
    rows: list[dict[str, Any] | None] = []
    rest: list[str | None] = []
    for text in texts:
        fields = json.loads(text) if text is not None else {}
        row: dict[str, Any] = {}
        for name, kind in typed.items():
            value = fields.get(name)
            if value is None:
                fields.pop(name, None)
                continue
            found = schema.json_type(value)
            if found == kind or (kind == "float" and found == "int"):
                row[name] = float(value) if kind == "float" else value
                del fields[name]
        rows.append(row or None)
        rest.append(json.dumps(fields, sort_keys=True, ensure_ascii=False) if fields else None)
    if not typed:
        return None, rest
    return pa.array(rows, type=schema.metadata_struct(typed)), rest


# Sidecars written back as members of their own on export: the caption and the class, as img2dataset and webdataset's
# classification sets write them. Other text sidecars (.url, .caption) share names with the JSON fields crawlers
# write (img2dataset's url, caption), so they stay fields of the sample's .json.
WRITE_BACK_SIDECARS = ("txt", "cls")


def sidecars_of(metadata: Mapping[str, Any]) -> dict[str, bytes]:
    """The ``.txt`` / ``.cls`` sidecars of a sample with this metadata, to write back beside its image."""
    return {ext: str(metadata[ext]).encode() for ext in WRITE_BACK_SIDECARS if metadata.get(ext) is not None}
