"""Takedown lists and their records: what a list names, how rows are matched to it, and the lists recorded on an
output (read by the write phase, the audit, blocklists and a running pretraining).

A list names images by key (the sha256 of their bytes), ledger source, or the pool's ``url`` metadata field, one a
line; or by what they look like: ``pdq:<64 hex>`` names every image whose PDQ hash (``common.pdq``, the phash stage's ``pdq``
column) is within the list's ``distance`` of it, so re-encoded, resized, lightly cropped and watermarked copies of a
reported picture go with it. The distance is part of the list's identity. Chance matches: PDQ distances between
unrelated real photos are 127.9 +- 8.2 bits (``benchmarks/bench_pdq.py``, 530 photos); the normal fitted to them puts
one comparison within 31 bits at ~2e-32, so the 398 lines ``--images`` writes per picture name ~7e-21 unrelated
images at 10^9 (the pairs of those photos that do come within 31 bits are pictures derived from one another: a
filter's result beside its input, keypoints drawn on it). Shards written before the ``pdq`` column are hashed from
their image bytes where a list holds hashes (``pdq_column``: a one-off cost of ~10 ms per image, said in the log).

Sizes: matching a row against a list's L hashes is one search of faiss's flat binary index (~1 ns a hash); the ~400
lines a reported picture lists cost ~0.4 us an image, 1,000 reported pictures ~0.4 ms an image (at 10^9 images ~110
core-hours, in the phash stage for blocklists or the takedown's scan); exact entries are a hash-set lookup.

A takedown (``curation.phases.write.takedown_run``) records each list it ran, with the list's entries and distance
beside it: ``_state/takedown/<list id>.json``; ``takedown_records`` and ``recorded_entries`` read them back.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from functools import cached_property
from hashlib import sha256

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.layout import LAYOUT
from common.storage import StorageError, join, list_files, read_json, redact, resolve

URL_FIELD = "url"  # the pool's metadata field that names where an image came from (img2dataset's)
PDQ_PREFIX = "pdq:"
PDQ_DISTANCE = 31  # of 256 bits: the match threshold PDQ's authors give, and hash-sharing programmes use
_PDQ_LINE = re.compile(r"pdq:[0-9a-f]{64}")

log = logging.getLogger(__name__)

record_path, entries_path = LAYOUT.takedown_record, LAYOUT.takedown_entries


class TakedownError(ValueError):
    """The list or the output cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Listing:
    """What a list names, ready to match rows: exact values (keys, sources, URLs) and PDQ hashes within
    ``distance``."""

    entries: tuple[str, ...]
    distance: int = PDQ_DISTANCE

    @cached_property
    def exact(self) -> pa.Array:
        return pa.array([e for e in self.entries if not e.startswith(PDQ_PREFIX)], pa.string())

    @cached_property
    def hashed(self) -> tuple[str, ...]:
        return tuple(e for e in self.entries if e.startswith(PDQ_PREFIX))

    @cached_property
    def _index(self):
        import faiss

        index = faiss.IndexBinaryFlat(256)
        if self.hashed:
            codes = b"".join(bytes.fromhex(e[len(PDQ_PREFIX) :]) for e in self.hashed)
            index.add(np.frombuffer(codes, np.uint8).reshape(-1, 32))
        return index

    def nearest(self, pdq: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Per row of a ``pdq`` column (null: no hash): the index of the nearest listed hash within the distance
        (-1: none) and its distance."""
        n = len(pdq)
        found, dist = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        valid = np.flatnonzero(~np.asarray(pdq.is_null().to_numpy(zero_copy_only=False), bool))
        if not self.hashed or not len(valid):
            return found, dist
        codes = np.frombuffer(b"".join(pdq.take(pa.array(valid)).to_pylist()), np.uint8).reshape(-1, 32)
        d, i = self._index.search(codes, 1)
        near = d[:, 0] <= self.distance
        found[valid[near]], dist[valid[near]] = i[near, 0], d[near, 0]
        return found, dist

    def named_by(self, table: pa.Table) -> list[str | None]:
        """Per row, the entry that names it (None: none): its key, source or url, or the listed PDQ hash within the
        distance of its ``pdq`` (``pdq_column``)."""
        out: list[str | None] = [None] * table.num_rows
        if len(self.exact):  # the first of source, key and url that a line names (the urls parsed only then)
            for column in _identities(table):
                hit = pc.fill_null(pc.is_in(column, value_set=self.exact), False)
                for row in pc.indices_nonzero(hit).to_pylist():
                    if out[row] is None:
                        out[row] = column[row].as_py()
        if self.hashed:
            pdq = pdq_column(table)
            if pdq is not None:
                found, dist = self.nearest(pdq)
                for row in np.flatnonzero(found >= 0).tolist():
                    if out[row] is None:
                        out[row] = f"{self.hashed[found[row]]} (distance {dist[row]})"
        return out

    def rows(self, table: pa.Table) -> np.ndarray:
        """Which rows of ``table`` the list names (a boolean array)."""
        return np.array([e is not None for e in self.named_by(table)], bool)


def pdq_column(table: pa.Table) -> pa.Array | None:
    """The rows' PDQ hashes: the ``pdq`` column, else (a table written before it) hashed from the ``image`` column;
    None when neither is there."""
    if "pdq" in table.column_names:
        return table.column("pdq").combine_chunks()
    if "image" not in table.column_names:
        return None
    from common.pdq import pdq_of

    log.info(f"[takedown] {table.num_rows} images stored before the pdq column: hashing them (~10 ms each)")
    images = table.column("image").to_pylist()
    return pa.array([pdq_of(im["bytes"])[0] if im and im.get("bytes") else None for im in images], pa.binary(32))


@dataclass(frozen=True)
class TakedownList:
    name: str  # the list's URI, without query or credentials
    entries: tuple[str, ...]  # sorted, unique
    sha256: str
    distance: int = PDQ_DISTANCE  # of the ``pdq:`` lines

    @property
    def id(self) -> str:
        return self.sha256[:16]

    @property
    def listing(self) -> Listing:
        return Listing(self.entries, self.distance)


def make_list(name: str, lines: list[str], distance: int = PDQ_DISTANCE) -> TakedownList:
    """A list from its lines (``#`` lines and blank ones skipped); ``pdq:`` lines are checked and lower-cased."""
    entries = set()
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower().startswith(PDQ_PREFIX):
            line = line.split("#", 1)[0].strip().lower()  # a hash line may end in a comment (what it hashes)
            if not _PDQ_LINE.fullmatch(line):
                raise TakedownError(f"{name}: line {number} is not pdq:<64 hex digits>: {line[:80]!r}")
        entries.add(line)
    if not entries:
        raise TakedownError(f"{name}: the list holds no entries (keys, sources, URLs or pdq:<hex>, one a line)")
    ordered = tuple(sorted(entries))
    if not 0 <= distance <= 256:
        raise TakedownError(f"{name}: a PDQ distance is 0-256 bits, not {distance}")
    text = "\n".join(ordered)
    # the distance changes what a list with hashes removes: part of its identity (lists without hashes keep theirs)
    if any(e.startswith(PDQ_PREFIX) for e in ordered):
        text += f"\n#distance {distance}"
    return TakedownList(name, ordered, sha256(text.encode()).hexdigest(), distance)


def read_list(uri: str, distance: int = PDQ_DISTANCE) -> TakedownList:
    """Entries one a line; blank lines and lines starting with ``#`` are skipped."""
    fs, path = resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise TakedownError(f"{redact(uri)}: no such list; give a file of keys, sources or URLs, one a line") from None
    except UnicodeDecodeError:
        raise TakedownError(f"{redact(uri)}: not UTF-8 text; give keys, sources or URLs, one a line") from None
    return make_list(redact(uri), text.splitlines(), distance)


def picture_lines(uris: list[str]) -> list[str]:
    """``pdq:`` lines from the pictures at ``uris`` (files, or folders read recursively): each picture's hash and
    its windows' (``common.pdq.pdq_report``), each line followed by a comment naming the file; a file that is no
    picture, or too flat to hash reliably, is a ``TakedownError`` naming it."""
    from common.pdq import PDQ_MIN_QUALITY, pdq_report

    lines = []
    for uri in uris:
        fs, path = resolve(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise TakedownError(f"{redact(uri)}: no such picture or folder")
        files = (
            sorted(f.path for f in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if f.is_file)
            if info.type == pafs.FileType.Directory
            else [path]
        )
        for file in files:
            with fs.open_input_stream(file) as f:
                data = f.read()
            try:
                hashes = pdq_report(data)
            except Exception as exc:  # noqa: BLE001 - any undecodable file: name it
                raise TakedownError(f"{file}: not a picture that decodes ({exc}); give the reported images") from None
            if hashes[0][1] < PDQ_MIN_QUALITY:
                raise TakedownError(
                    f"{file}: PDQ quality {hashes[0][1]} < {PDQ_MIN_QUALITY} (a flat or tiny picture matches "
                    "unrelated ones); list it by key or URL instead"
                )
            # a window too flat to hash reliably is left out; the picture's own hash always stays
            lines += [f"{PDQ_PREFIX}{d.hex()}  # {file}: {what}" for d, q, what in hashes if q >= PDQ_MIN_QUALITY]
    return lines


def save_list(uri: str, lst: TakedownList) -> None:
    """The list's entries as a list file (with its distance as a comment), for ``--list`` or a blocklist."""
    from common.storage import write_bytes_atomic

    fs, path = resolve(uri)
    text = f"# PDQ distance {lst.distance}\n" + "".join(f"{e}\n" for e in lst.entries)
    write_bytes_atomic(fs, path, text.encode())


def blocklist(uri: str, distance: int = PDQ_DISTANCE) -> list[tuple[Listing, str]]:
    """What a blocklist names, as (listing, name) pairs: a list file (its ``pdq:`` lines at ``distance``), or a
    curated output (a release), whose recorded takedowns are each applied at their own distance."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        return [
            (
                Listing(tuple(recorded_entries(fs, path, r).to_pylist()), r.get("distance", PDQ_DISTANCE)),
                f"{redact(uri)} takedown {r['id']}",
            )
            for r in takedown_records(fs, path)
        ]
    lst = read_list(uri, distance)
    return [(lst.listing, lst.name)]


def check_list_uri(uri: str) -> None:
    try:
        resolve(uri)
    except StorageError as exc:
        raise TakedownError(str(exc)) from None


def _identities(table: pa.Table) -> list:
    """The columns an exact entry may name a row by: its source, key, and the pool's url (where the table has them)."""
    columns = [table.column("source")] + ([table.column("key")] if "key" in table.column_names else [])
    urls = _urls(table)
    return columns + ([urls] if urls is not None else [])


def _urls(table: pa.Table) -> pa.Array | None:
    """The pool's url of each row: the typed metadata field, else the one in metadata_json."""
    has_typed = "metadata" in table.column_names and table.schema.field("metadata").type.get_field_index(URL_FIELD) >= 0
    typed = pc.struct_field(table.column("metadata"), URL_FIELD) if has_typed else None
    if "metadata_json" not in table.column_names:
        return typed
    rest = [
        json.loads(t).get(URL_FIELD) if t and URL_FIELD in t else None
        for t in table.column("metadata_json").to_pylist()
    ]
    from_json = pa.array([u if isinstance(u, str) else None for u in rest], pa.string())
    return from_json if typed is None else pc.coalesce(typed, from_json)


def takedown_records(fs, root: str) -> list[dict]:
    """Every takedown recorded on the output, oldest first."""
    records = [read_json(fs, p) for p in list_files(fs, join(root, LAYOUT.takedowns), ".json")]
    return sorted(records, key=lambda r: (r["at"], r["id"]))


def recorded_entries(fs, root: str, record: dict) -> pa.Array:
    return pq.read_table(join(root, entries_path(record["id"])), filesystem=fs).column("entry").combine_chunks()
