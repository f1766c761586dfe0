"""WebDataset tar shards (plain or compressed) read as ledger rows, as a stream: never extracted, never read whole.

Members are inputs, links and special members included (``not_a_file``); sidecars (``SIDECAR_SUFFIXES``) are the
metadata of their sample's pictures. What a member's header claims is checked against what the file can hold: a
member that declares more bytes than the file has left is one row, and the tar is read no further; what was read
before it stands.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from common.imageio import safe_error
from curation.score.inputs import InputShard, PoolAccess, input_row, is_sidecar, with_metadata
from curation.score.metadata import InputMetadata, sample_key
from curation.score.sources import member_name, printable, unread_name

_SKIP_CHUNK = 1 << 20
# DEFLATE's largest expansion is 1032:1, so a gzip'ed member larger than that times what is left is a lie.
_GZIP_MAX_RATIO = 1032


class TarReading(PoolAccess):
    """The reader of tar shards."""

    def _tar(self, shard: InputShard) -> Iterator[dict]:
        """Members are read as a stream; what a header claims is checked against what the file can hold. A sample's
        rows wait for its last part (sidecars may follow the image), then leave with the sample's metadata."""
        (path,) = shard.paths
        uri = self.name(path)
        members = 0
        sample: tuple[str | None, list[dict], InputMetadata] = (None, [], self._metadata())
        try:
            size = self._size(path)
            with self._open(path) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
                comptype = getattr(tar.fileobj, "comptype", "tar")
                for member in tar:
                    if member.isdir():
                        continue
                    key, extension = sample_key(member.name)
                    if key != sample[0]:
                        yield from with_metadata(sample[1], sample[2])
                        sample = (key, [], self._metadata())
                    held, meta = sample[1], sample[2]
                    sidecar = member.isfile() and is_sidecar(member.name)
                    source = member_name(uri, printable(member.name))
                    if not sidecar:
                        members += 1
                        if not member.isfile():
                            held.append(input_row(source, None, f"not_a_file: a {_member_kind(member)} in the tar; only "
                                                           "regular members are read (links are not followed)"))  # fmt: skip
                            continue
                    room = _room_left(member, comptype, size, stream.tell())
                    if room is not None and member.size > room:
                        if sidecar:  # the sidecar has no row of its own: its sample's rows say it
                            meta.note(f"sidecar {printable(member.name)} declares more bytes than the tar holds")
                            source = unread_name(uri, f"after {members} members")
                        held.append(input_row(source, None, f"unreadable: the member's header declares {member.size} "
                                                       f"bytes, more than the file can hold after it ({room}); the "
                                                       "tar is read no further"))  # fmt: skip
                        yield from with_metadata(held, meta)
                        return
                    limit = (meta.limit if meta.enabled else 0) if sidecar else self.max_file_bytes
                    try:
                        data = _read_member(tar, member, limit)
                    except Exception as exc:  # noqa: BLE001 - the member's own row says why; nothing after it is read
                        self._store_failed(exc, uri)
                        if sidecar:
                            source = unread_name(uri, f"after {members} members")
                        held.append(
                            input_row(source, None, f"unreadable: {safe_error(exc)}; the tar is read no further")
                        )
                        yield from with_metadata(held, meta)
                        return
                    if sidecar:
                        if meta.enabled:
                            meta.add_sidecar(printable(member.name), extension, data, member.size)
                    elif data is None:
                        held.append(
                            input_row(
                                source, None, f"file_too_large: {member.size} bytes > {self.max_file_bytes}, not read"
                            )
                        )
                    else:
                        held.append(input_row(source, data))
                yield from with_metadata(sample[1], sample[2])
                sample = (None, [], self._metadata())
                cut = _archive_cut(tar, comptype, size)
                if cut:
                    raise tarfile.ReadError(cut)
        except Exception as exc:  # noqa: BLE001 - a damaged tar keeps what was read plus one row for the rest
            self._store_failed(exc, uri)
            yield from with_metadata(sample[1], sample[2])
            yield input_row(
                unread_name(uri, f"after {members} members"),
                None,
                f"unreadable: tar shard unreadable from here: {safe_error(exc)}",
            )


def _room_left(member: tarfile.TarInfo, comptype: str, size: int | None, raw_offset: int) -> int | None:
    """The most bytes a member's data can have, given what is left of the file; None where no bound holds (bz2 and
    xz can expand past any ratio: there the stream's end tells)."""
    if size is None:
        return None
    if comptype == "tar":
        return size - member.offset_data
    if comptype == "gz":
        return (size - raw_offset) * _GZIP_MAX_RATIO
    return None


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes | None:
    """A regular member's bytes; None when it is over ``limit`` (its data skipped). Raises when the archive ends
    before the member does: tarfile's own skip would read on at the end of the stream, forever for a lying size."""
    member_file = tar.extractfile(member)
    assert member_file is not None  # a regular member
    data = member_file.read(limit + 1) if member.size > limit else member_file.read(member.size)
    got, keep = len(data), member.size <= limit
    while got < member.size and len(data) > 0:
        data = member_file.read(min(member.size - got, _SKIP_CHUNK))
        got += len(data)
    if got < member.size:
        raise tarfile.ReadError(f"member {printable(member.name)} cut off at {got} of its {member.size} bytes")
    return data if keep else None


def _archive_cut(tar: tarfile.TarFile, comptype: str, size: int | None) -> str | None:
    """Why a tar that ended quietly is incomplete (tarfile stops without a word at a cut-off header); None when it
    ended as a complete archive does."""
    if comptype == "tar":  # two zero blocks end a complete archive
        if size is not None and size - tar.offset < 2 * tarfile.BLOCKSIZE:
            return f"archive cut off at byte {size} (no end-of-archive marker)"
        return None
    stream = tar.fileobj  # a compressed stream: read past the archive's end (its padding) to the stream's own end
    for _ in range(64):
        if not stream.read(_SKIP_CHUNK):
            break
    decompressor = getattr(stream, "cmp", None)
    if decompressor is not None and not getattr(decompressor, "eof", True):
        return f"the {comptype} stream is cut off (it ends before its end marker)"
    return None


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.isfifo():
        return "FIFO"
    if member.ischr() or member.isblk():
        return "device"
    return f"member of type {member.type!r}"
