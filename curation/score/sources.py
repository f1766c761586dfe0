"""The names of inputs: the ledger's ``source``, written by the pool's readers and read back by the audit report.

A name is the input's file or URI (no query string, no credentials), and for a part of a container what follows
the container's name after ``#``:

- ``<file.parquet>#row=<i>``: a Parquet row by its index (``<file.parquet>#<value>`` with ``input.source_column``);
- ``<shard.tar>#<member>``: a tar member by its name;
- ``<container>#<from row i>``, ``#<rows i-j>``, ``#<after n members>``: a part of a container that could not be
  read, which names no single input;
- ``<name>#dup=<k>``: the k-th input of a shard with a name seen before in it (tar members, source-column values).

Local names need not be UTF-8: a name is shown with ``\\xNN`` escapes for the bytes that are not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Tar shards, plain or compressed (img2dataset and many mirrors write .tar.gz); tarfile reads each as a stream.
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
PARQUET_SUFFIX = ".parquet"

_ROW = re.compile(r"row=(\d+)")
_UNREAD = re.compile(r"<(?:from row \d+|rows -?\d+--?\d+|after \d+ members)>")
_DUP = re.compile(r"(.*)#dup=(\d+)", re.S)


def path_bytes(path: str) -> bytes:
    """The exact bytes of a path as listed (local names that are not UTF-8 arrive as surrogate escapes)."""
    return path.encode("utf-8", "surrogateescape")


def printable(path: str) -> str:
    """A valid-UTF-8 name for a path whose bytes may not be UTF-8: undecodable bytes become ``\\xNN``."""
    return path_bytes(path).decode("utf-8", "backslashreplace")


def container_kind(path: str) -> str:
    """How a pool file is read by its name: "parquet", "webdataset" (a tar) or "files" (a single input)."""
    lower = path.lower()
    return "parquet" if lower.endswith(PARQUET_SUFFIX) else "webdataset" if lower.endswith(TAR_SUFFIXES) else "files"


def member_name(container: str, member: str) -> str:
    """A tar member, or a Parquet row by the value of ``input.source_column``."""
    return f"{container}#{member}"


def row_name(container: str, index: int) -> str:
    """A Parquet row (of a pool file or a downloader's record) by its index."""
    return f"{container}#row={index}"


def unread_name(container: str, what: str) -> str:
    """The part of a container that could not be read: ``what`` is ``from row i``, ``rows i-j`` or
    ``after n members``."""
    return f"{container}#<{what}>"


class UniqueNames:
    """Unique names within one shard: a repeated name gets ``#dup=<k>``."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, name: str) -> str:
        unique, k = name, 1
        while unique in self.seen:
            k += 1
            unique = f"{name}#dup={k}"
        self.seen.add(unique)
        return unique


@dataclass(frozen=True)
class Source:
    """A ledger ``source`` taken apart."""

    container: str  # the file or URI (the whole name for a loose file)
    kind: str  # container_kind of the container
    part: str | None = None  # what follows the container's ``#`` (no ``#dup=``); None for a whole file
    dup: int = 1  # which of the shard's inputs of this name (``#dup=<k>``)

    @property
    def row(self) -> int | None:
        """The row index a Parquet part names; None where it names the row otherwise or is no Parquet row."""
        found = _ROW.fullmatch(self.part or "") if self.kind == "parquet" else None
        return int(found[1]) if found else None

    @property
    def unread(self) -> bool:
        """Whether the name is of a part of a container that could not be read (no single input)."""
        return self.part is not None and _UNREAD.fullmatch(self.part) is not None

    @property
    def leaf(self) -> str:
        """The last component of the input's own name: a member's or file's base name, a row's ``row=<i>``."""
        return (self.part if self.part is not None else self.container).rstrip("/").rsplit("/", 1)[-1]


def parse_source(source: str) -> Source:
    """A ledger ``source`` taken apart. The container ends at the first ``#`` after a Parquet or tar suffix, so a
    member's name may hold ``#``; a name without one is a whole file, whatever characters it holds."""
    start = 0
    while (cut := source.find("#", start)) >= 0:
        container, part = source[:cut], source[cut + 1 :]
        kind = container_kind(container)
        if kind != "files":
            repeated = _DUP.fullmatch(part)
            if repeated:
                return Source(container, kind, repeated[1], int(repeated[2]))
            return Source(container, kind, part)
        start = cut + 1
    return Source(source, container_kind(source))
