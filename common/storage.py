"""Local paths and object-store URIs behind one small API (pyarrow filesystems).

Everything the project persists — shards, ledgers, commit records, checkpoints' metadata — goes through here so
that a local folder and ``s3://bucket/prefix`` behave the same. Writes are atomic: a temporary ``_tmp-`` name
(ignored by readers, which skip ``_``/``.`` names) is moved into place once complete.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import schema

T = TypeVar("T")


class StorageError(ValueError):
    """A path or URI cannot be used; the message names it and says what to do."""


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and path for a local path (relative allowed) or a URI such as ``s3://bucket/prefix``.

    A URI is parsed once; what its query carries (``?endpoint_override=...``, credentials) lives in the filesystem
    object. Paths of files below it are plain strings: join them to the returned path, never rebuild a URI from
    them (that drops the query and misreads keys holding ``%``, ``#``, ``?`` or spaces).
    """
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    return _from_uri(uri)


@functools.lru_cache(maxsize=32)
def _from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    # cached: an object-store client per file would cost a connection and a credentials lookup each time
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        raise StorageError(
            f"cannot open {redact(uri)!r}: {exc}. Use a local path or a URI pyarrow supports (file://, s3://, gs://, hdfs://)"
        ) from None


def redact(uri: str) -> str:
    """``uri`` without its query string and user info, safe to print or to store as a name."""
    if "://" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    rest = rest.split("?", 1)[0]
    head, sep, tail = rest.partition("/")
    return f"{scheme}://{head.rsplit('@', 1)[-1]}{sep}{tail}"


def display_uri(root_uri: str, path: str) -> str:
    """A readable name for ``path`` (a path on ``root_uri``'s filesystem): the scheme and the path, no query or
    credentials. A name for ledgers and messages only; open the file through ``resolve(root_uri)``'s filesystem."""
    if "://" not in root_uri:
        return path
    return f"{root_uri.split('://', 1)[0]}://{path}"


def path_on_store(uri: str) -> str:
    """The path a (redacted) URI names on its store, to open through the filesystem of another URI of that store:
    how an output names a release it follows, whose query and credentials it never records."""
    return uri.split("://", 1)[1] if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def join(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined with ``/``. A filesystem path (no ``://``) is joined as it is; on a URI the
    parts go before its query (``s3://b/runs/tiny?endpoint_override=...``: after it they would be read as the
    query's last value) and are percent-encoded, as pyarrow decodes a URI's path."""
    if "://" not in base:
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    head, sep, query = base.partition("?")
    return "/".join([head.rstrip("/"), *(quote(p.strip("/"), safe="/") for p in parts)]) + sep + query


def basename(uri: str) -> str:
    """The last part of a path or of a URI's path (its query left out, its percent-encoding decoded)."""
    path = unquote(uri.split("://", 1)[1].partition("?")[0]) if "://" in uri else uri
    return path.rstrip("/").rsplit("/", 1)[-1]


# Query parameters that may carry a secret (pyarrow takes S3 credentials from the user info only; other stores may
# take them in the query).
_SECRET_PARAM = re.compile(r"key|secret|token|password|credential|signature", re.IGNORECASE)


def without_credentials(uri: str) -> str:
    """``uri`` without its user info and any query parameter that could hold a secret, its store settings
    (``endpoint_override``, ``scheme``, ``region``) kept: what reaches the same store again, with the credentials
    of the environment, and is safe to record."""
    if "://" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    rest, _, query = rest.partition("?")
    head, slash, tail = rest.partition("/")
    kept = [p for p in query.split("&") if p and not _SECRET_PARAM.search(p.partition("=")[0])]
    return f"{scheme}://{head.rsplit('@', 1)[-1]}{slash}{tail}" + ("?" + "&".join(kept) if kept else "")


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str, max_len: int = 64) -> str:
    """A file-name-safe token derived from data (paths, keys): no separators, no dot-dot, bounded, unique-ish."""
    cleaned = _UNSAFE.sub("_", text).strip("._") or "x"
    digest = sha256(text.encode()).hexdigest()[:8]
    return f"{cleaned[:max_len]}-{digest}"


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def _tmp_beside(path: str) -> str:
    head, _, name = path.rpartition("/")
    return f"{head}/_tmp-{uuid.uuid4().hex[:8]}-{name}"


@contextlib.contextmanager
def open_output_atomic(fs: pafs.FileSystem, path: str):
    """A stream whose bytes appear at ``path`` only once the block ends without an error (a file too large to hold
    in memory, streamed); on an error the partial temporary is removed."""
    fs.create_dir(path.rpartition("/")[0], recursive=True)
    tmp = _tmp_beside(path)
    try:
        with fs.open_output_stream(tmp) as out:
            yield out
    except BaseException:
        delete_quietly(fs, tmp)
        raise
    fs.move(tmp, path)


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes | pa.Buffer) -> None:
    with open_output_atomic(fs, path) as out:
        out.write(data)


def write_json_atomic(fs: pafs.FileSystem, path: str, obj) -> None:
    write_bytes_atomic(fs, path, json.dumps(obj, indent=1, sort_keys=True).encode())


class DamagedRecordError(StorageError):
    """A JSON record (a commit, done or run record, a manifest, a lease) that cannot be used as it stands: the message
    names the file, what is wrong with it and what to do. ``problem`` and ``what_to_do`` are the two parts alone."""

    def __init__(self, path: str, problem: str, what_to_do: str):
        self.path, self.problem, self.what_to_do = path, problem, what_to_do
        super().__init__(f"damaged record {path}: {problem}. {what_to_do}.")


# Writes are atomic, so a damaged record was changed after it was written (by hand, a tool, a disk or store fault).
DAMAGED_RECORD_ADVICE = "Restore it from a copy, or delete it and rerun the command that wrote it"

FieldTypes = type | tuple[type, ...]


def display_path(fs: pafs.FileSystem, path: str) -> str:
    """A readable name for ``path`` on ``fs`` (the scheme and the path; a filesystem's paths carry no query or
    credentials), for messages."""
    if is_local(fs):
        return path
    scheme = {"gcs": "gs"}.get(fs.type_name, fs.type_name)
    return display_uri(f"{scheme}://", path) if scheme.isalnum() else path


_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, in JSON's terms (one number type)."""
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return _KINDS[type(value)]


def read_json(
    fs: pafs.FileSystem,
    path: str,
    *,
    fields: Mapping[str, FieldTypes] | None = None,
    advice: str = DAMAGED_RECORD_ADVICE,
) -> dict:
    """The JSON object stored at ``path``; every JSON record the project reads back comes through here.

    Raises ``DamagedRecordError`` (naming the file, with ``advice`` as what to do) when the bytes are not UTF-8, not
    JSON, not an object, or lack one of ``fields`` (name -> type(s) its value must have); ``FileNotFoundError`` and
    other ``OSError`` propagate as they are: absent and unreachable are not damaged.
    """
    with fs.open_input_stream(path) as f:
        data = f.read()

    def damaged(problem: str) -> DamagedRecordError:
        return DamagedRecordError(display_path(fs, path), problem, advice)

    if not data.strip():
        raise damaged(f"empty ({len(data)} bytes)")
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise damaged(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise damaged(f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    if not isinstance(record, dict):
        raise damaged(f"holds {_json_kind(record)}, not a JSON object")
    check_fields(fs, path, record, fields or {}, advice)
    return record


def check_fields(
    fs: pafs.FileSystem, path: str, record: dict, fields: Mapping[str, FieldTypes], advice: str, within: str = ""
) -> None:
    """Raise ``DamagedRecordError`` (as ``read_json``) unless ``record`` has each of ``fields`` with a value of its
    type(s); ``within``: the field that holds ``record`` inside the file's object (as ``receipt``), for the message."""
    for name, types in fields.items():
        shown = f"{within}.{name}" if within else name
        if name not in record:
            raise DamagedRecordError(display_path(fs, path), f"has no {shown!r} field", advice)
        value, wanted = record[name], types if isinstance(types, tuple) else (types,)
        # Python counts a JSON true as an int; a record's counts are never booleans
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            expected = "a number" if float in wanted else " or ".join(_KINDS.get(t, t.__name__) for t in wanted)
            problem = f"its {shown!r} field is {_json_kind(value)}, not {expected}"
            raise DamagedRecordError(display_path(fs, path), problem, advice)


def write_parquet_atomic(
    fs: pafs.FileSystem, path: str, table: pa.Table, *, row_group_size: int, compression: str = "zstd"
) -> str:
    """Write ``table`` as one Parquet file; returns the sha256 of the file's bytes."""
    data = encode_parquet(table, row_group_size=row_group_size, compression=compression)
    write_bytes_atomic(fs, path, data)
    return sha256(data).hexdigest()


def file_sha256(fs: pafs.FileSystem, path: str) -> str:
    """The sha256 of a file's bytes, streamed (raises ``FileNotFoundError`` when it is absent)."""
    digest = sha256()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(8 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


def open_parquet(fs: pafs.FileSystem, path: str) -> pq.ParquetFile:
    """A Parquet file to read from ``fs``: its column chunks pre-buffered (coalesced reads) on an object store, read
    as needed on a local disk, where pre-buffering a scored part's 7,000 small chunks took 1.8x as long."""
    return pq.ParquetFile(path, filesystem=fs, pre_buffer=not isinstance(fs, pafs.LocalFileSystem))


def encode_parquet(
    table: pa.Table, *, row_group_size: int, compression: str | dict[str, str] = "zstd", **options: Any
) -> pa.Buffer:
    """The bytes of ``table`` as one Parquet file, in Arrow's buffer, not copied (deterministic: the same table
    gives the same bytes). ``options``: more of ``pq.write_table``'s (``use_dictionary``, ``write_statistics``: all columns, none, or a list of paths);
    by default every column but ``schema.DISTINCT_PER_ROW`` is dictionary-encoded."""
    if "use_dictionary" not in options:
        options["use_dictionary"] = [
            p for p in _leaf_paths(table.schema) if p.split(".")[0] not in schema.DISTINCT_PER_ROW
        ]
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_size, compression=compression, **options)
    return sink.getvalue()


@functools.lru_cache(maxsize=64)
def _leaf_paths(arrow_schema: pa.Schema) -> list[str]:
    """The Parquet column paths of ``arrow_schema``'s leaves (``persons.list.element.x0``), as the writer names them."""
    sink = pa.BufferOutputStream()
    pq.write_table(arrow_schema.empty_table(), sink)
    return [column.path for column in pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema]


_CODEC_NAMES = {"UNCOMPRESSED": "none"}  # the footer's name of a codec where write_table's differs


def parquet_options_like(meta: pq.FileMetaData) -> dict[str, Any]:
    """``encode_parquet``'s options that write a table as the file ``meta`` describes was written: its rows per row
    group, and each column's codec, dictionary and statistics as in its first row group."""
    if not meta.num_row_groups:
        return {"row_group_size": 1}
    group = meta.row_group(0)
    columns = [group.column(i) for i in range(group.num_columns)]

    def each(values: dict[str, Any]) -> Any:  # one value for all columns where they agree, else per column
        distinct = set(values.values())
        if len(distinct) == 1:
            return distinct.pop()
        return values if not distinct <= {True, False} else [path for path, on in values.items() if on]

    return {
        "row_group_size": max(1, group.num_rows),
        "compression": each(
            {c.path_in_schema: _CODEC_NAMES.get(c.compression, c.compression.lower()) for c in columns}
        ),
        "use_dictionary": each({c.path_in_schema: c.has_dictionary_page for c in columns}),
        "write_statistics": each({c.path_in_schema: c.is_stats_set for c in columns}),
    }


def list_files(fs: pafs.FileSystem, path: str, suffix: str = "") -> list[str]:
    """Files under ``path`` (recursive, sorted), skipping ``_``/``.`` names; empty when ``path`` is absent."""
    if not exists(fs, path):
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        rel = info.path[len(path) :].lstrip("/")
        if info.type == pafs.FileType.File and info.path.endswith(suffix) and not _hidden(rel):
            out.append(info.path)
    return sorted(out)


def _hidden(rel: str) -> bool:
    return any(part.startswith(("_", ".")) for part in rel.split("/"))


def remove_temporaries(fs: pafs.FileSystem, folder: str, *, recursive: bool = False) -> None:
    """Delete the ``_tmp-`` files that writes cut short by a kill left in ``folder`` (and below, if ``recursive``).
    Only the run holding the output's lease may call this: another live run's temporaries look the same."""
    if exists(fs, folder):
        for info in fs.get_file_info(pafs.FileSelector(folder, recursive=recursive)):
            if info.type == pafs.FileType.File and info.base_name.startswith("_tmp-"):
                delete_quietly(fs, info.path)


def delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            fs.delete_file(path)
    except (OSError, FileNotFoundError):
        pass


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed object-store or network-disk call is tried again: up to ``retries``
    times, each after a pause drawn uniformly from 0 to ``base_s * 2**n`` capped at ``cap_s`` (exponential backoff
    with full jitter: many workers throttled at once spread out instead of retrying in step). ``setting`` names the
    knob, for the message when the retries run out."""

    retries: int = 3
    base_s: float = 0.2
    cap_s: float = 20.0
    setting: str = "ray.io_retries"

    def delay(self, failures: int) -> float:
        return random.uniform(0.0, min(self.cap_s, self.base_s * 2.0**failures))


class RetriesExhausted(OSError):
    """A call still failed with a transient I/O error after its retries; ``__cause__`` is the last error."""


# What object stores answer when a client sends too many requests (S3 and its clones, GCS, Azure); pyarrow raises them
# as OSError with the store's error code and HTTP status in the message.
_THROTTLED = re.compile(
    r"slow_?down|\b503\b|service.unavailable|throttl|too_?many_?requests|request_?limit_?exceeded", re.IGNORECASE
)
# Answers no retry changes: a missing bucket or key, refused credentials or permissions.
_PERMANENT = re.compile(
    r"access_?denied|no_?such_?(bucket|key)|invalid_?access_?key|signature_?does_?not_?match|invalid_?bucket_?name",
    re.IGNORECASE,
)

_io_lock = threading.Lock()
_io_counts = {"io_retries": 0, "io_throttles": 0}


def io_counts() -> dict[str, int]:
    """This process's retried I/O calls and throttling answers so far (``io_retries``, ``io_throttles``); the
    difference of two readings is what happened between them."""
    with _io_lock:
        return dict(_io_counts)


def _count(name: str) -> None:
    with _io_lock:
        _io_counts[name] += 1


def is_throttled(exc: BaseException) -> bool:
    """Whether ``exc`` is a store asking its client to slow down (SlowDown, 503, TooManyRequests, ...)."""
    return isinstance(exc, OSError) and bool(_THROTTLED.search(str(exc)))


def is_transient(exc: BaseException) -> bool:
    """Whether another try of the call that raised ``exc`` may succeed: a plain ``OSError`` (pyarrow's store and
    network errors, a local EIO), a dropped connection or a timeout, unless the store refused for good. A missing
    file, a permission error, a damaged archive (``BadGzipFile``) and exhausted retries are not."""
    if isinstance(exc, RetriesExhausted) or not (
        type(exc) is OSError or isinstance(exc, ConnectionError | TimeoutError)
    ):
        return False
    return is_throttled(exc) or not _PERMANENT.search(str(exc))


# A store or the network failing, as pyarrow words it (the AWS SDK's error codes, curl, an HTTP 5xx), as opposed to an
# error about the bytes read (a damaged Parquet footer is an OSError too).
_STORE_FAILURE = re.compile(
    r"AWS Error|curlCode|HTTP status 5\d\d|connection (reset|refused|aborted|closed)|timed out", re.IGNORECASE
)


def is_store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an object store or the network failing for now (throttling, a 5xx, a dropped connection)
    rather than a fact about the data: a reader of inputs lets it propagate, to be retried, instead of recording
    the input as unreadable."""
    if not is_transient(exc):
        return False
    return is_throttled(exc) or isinstance(exc, ConnectionError | TimeoutError) or bool(_STORE_FAILURE.search(str(exc)))


def _retry_after(exc: OSError, failures: int, policy: RetryPolicy, what: str) -> bool:
    """Count ``exc`` and sleep before the next try; False when it is not worth one (the caller re-raises it).
    Raises ``RetriesExhausted`` naming ``what`` once ``policy.retries`` are spent."""
    throttled = is_throttled(exc)
    if throttled:
        _count("io_throttles")
    if not is_transient(exc):
        return False
    if failures >= policy.retries:
        cause = "the store kept throttling it" if throttled else "the error persisted"
        raise RetriesExhausted(
            f"{what} failed {failures + 1} times in a row ({cause}); the last error: {exc}. Check that the store is "
            f"reachable and not overloaded, then rerun, or allow more retries ({policy.setting}={policy.retries})"
        ) from exc
    _count("io_retries")
    time.sleep(policy.delay(failures))
    return True


def _policy(retries: int | RetryPolicy) -> RetryPolicy:
    return retries if isinstance(retries, RetryPolicy) else RetryPolicy(retries)


def retry_io(call: Callable[[], T], retries: int | RetryPolicy, what: str = "an I/O call") -> T:
    """``call()``, called again after a transient I/O error (``is_transient``: a flaky or throttling object store,
    a network disk) up to ``retries`` times (a count or a ``RetryPolicy``), with jittered exponential backoff.
    Other errors propagate at once; after the last retry ``RetriesExhausted`` names ``what`` and the last error.
    Retries and throttling answers are counted in ``io_counts``."""
    policy = _policy(retries)
    failures = 0
    while True:
        try:
            return call()
        except OSError as exc:
            if not _retry_after(exc, failures, policy, what):
                raise
            failures += 1


def retry_io_stream(
    open_stream: Callable[[], Iterator[T]], retries: int | RetryPolicy, what: str = "an I/O stream"
) -> Iterator[T]:
    """The items of ``open_stream()``; after a transient I/O error the stream is opened again and the items already
    yielded are skipped (so it must yield the same items in the same order each time), up to ``retries`` times in a
    row without a new item, as ``retry_io`` does."""
    policy = _policy(retries)
    yielded, failures, at_last_failure = 0, 0, 0
    while True:
        try:
            for position, item in enumerate(open_stream()):
                if position >= yielded:
                    yielded += 1
                    yield item
            return
        except OSError as exc:
            if yielded > at_last_failure:  # it got further this time: a new run of failures
                failures, at_last_failure = 0, yielded
            if not _retry_after(exc, failures, policy, what):
                raise
            failures += 1


def fixed_tarinfo(name: str, size: int) -> tarfile.TarInfo:
    """A tar member header with a fixed owner, mode and time: headers otherwise carry the writer's clock and user,
    and the same members would give other bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
    return info
