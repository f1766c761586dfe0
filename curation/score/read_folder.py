"""Loose files of a folder pool read as ledger rows; the sidecars of a sample (files sharing its key, as in a tar)
are its pictures' metadata.

Names are bytes on a local disk: a name that is not valid UTF-8 is opened by its bytes. A symbolic link is read
when it resolves inside the pool root; one that leads outside, dangles or loops, a link to a folder and a special
file each get a row saying why and are never read. Sizes are checked before anything is read.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator

from common.imageio import safe_error
from common.storage import is_local
from curation.score.inputs import InputShard, PoolAccess, input_row, inside, is_sidecar, with_metadata
from curation.score.metadata import InputMetadata, sample_key
from curation.score.sources import path_bytes, printable

_PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096


class FolderReading(PoolAccess):
    """The reader of loose files."""

    def _files(self, shard: InputShard) -> Iterator[dict]:
        """Loose files; the sidecars of a sample (files sharing its key, as in a tar) are its pictures' metadata."""
        sizes = shard.sizes or (None,) * len(shard.paths)
        for _, parts in itertools.groupby(zip(shard.paths, sizes), key=lambda part: sample_key(part[0])[0]):
            files = list(parts)
            # a regular file of a sidecar's name: links out of the pool and special files stay inputs, with their row
            sidecars = [(p, s) for p, s in files if is_sidecar(p) and (s is None or s >= 0)]
            pictures = [(p, s) for p, s in files if (p, s) not in sidecars]
            if not pictures:  # no picture beside them: stray files, read as inputs
                yield from (self._read_file(p, s) for p, s in files)
                continue
            meta = self._metadata()
            for path, size in sidecars if meta.enabled else ():
                self._read_sidecar(path, size, meta)
            yield from with_metadata([self._read_file(p, s) for p, s in pictures], meta)

    def _read_sidecar(self, path: str, listed_size: int | None, meta: InputMetadata) -> None:
        """A sidecar file into its sample's metadata, under the limit a tar's sidecar has; one that cannot be read
        is a note on its sample's rows."""
        name, extension = printable(path.rpartition("/")[2]), sample_key(path)[1]
        if not meta.parses(extension):
            return  # binary parts are not metadata: never read
        try:
            size = self._size(path) if listed_size is None or listed_size < 0 else listed_size
            data = None
            if size is None or size <= meta.limit:
                with self._open(path) as f:
                    data = f.read(meta.limit + 1)  # bounded even if the file grew since it was listed
                size = len(data)
            meta.add_sidecar(name, extension, data if size <= meta.limit else None, size)
        except Exception as exc:  # noqa: BLE001 - the picture goes on; its row says what was lost
            self._store_failed(exc, self.name(path))
            meta.note(f"sidecar {name} unreadable: {safe_error(exc)}")

    def _read_file(self, path: str, listed_size: int | None) -> dict:
        source = self.name(path)
        try:
            if is_local(self.fs):
                if len(path_bytes(path)) >= _PATH_MAX:
                    return input_row(
                        source, None, f"unreadable: the path is {len(path_bytes(path))} bytes, longer than this "
                        f"system's PATH_MAX ({_PATH_MAX}); move the file to a shorter path",
                    )  # fmt: skip
                refused = self._local_refusal(path)
                if refused:
                    return input_row(source, None, refused)
            size = self._size(path) if listed_size is None or listed_size < 0 else listed_size
            if size is not None and size > self.max_file_bytes:
                return input_row(source, None, f"file_too_large: {size} bytes > {self.max_file_bytes}, not read")
            with self._open(path) as f:
                data = f.read(self.max_file_bytes + 1)  # bounded even if the file grew since it was listed
            if len(data) > self.max_file_bytes:
                return input_row(source, None, f"file_too_large: more than {self.max_file_bytes} bytes, not read")
            return input_row(source, data)
        except Exception as exc:  # noqa: BLE001 - any read failure becomes a ledger reason
            self._store_failed(exc, source)
            return input_row(source, None, f"unreadable: cannot read the file: {safe_error(exc)}")

    def _local_refusal(self, path: str) -> str | None:
        """Why a local path is not read (links leading out, folder links, special files); None to read it."""
        if os.path.islink(path):
            if not os.path.exists(path):
                return "unreadable: broken or looping symbolic link"
            if os.path.isdir(path):
                return "linked_folder: a symbolic link to a folder; links to folders are not followed"
            assert self.real_root is not None  # set for a local pool, the only kind this checks
            if not inside(os.path.realpath(path), self.real_root):
                return "link_outside_pool: a symbolic link to a file outside the pool root; not followed"
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO or device would block or never end
            kind = "fifo" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
            return f"not_a_file: a {kind}; only regular files are read"
        return None
