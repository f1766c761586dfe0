"""The model store: find a model's weights wherever the cluster keeps them, and load them without running pickled code.

A model reference (a string in the config) is one of:

- a local path (file or folder);
- a URI that pyarrow can open (``s3://bucket/models/x.safetensors``, ``gs://...``, ``file:///...``; query parameters
  such as ``?endpoint_override=...`` pass through): copied once per node into ``models.store.cache_dir`` and reused
  by every actor on the node (a file lock makes concurrent actors wait for the one copy);
- a bare file name (``yolo11m-pose.pt``): looked up under each of ``models.store.roots`` (local folders or URIs);
- ``hf-hub:org/repo`` (a folder) or ``hf-hub:org/repo/path/file``: looked up under the roots as ``org/repo[/path]``
  (an offline mirror of the hub), then fetched from the Hugging Face hub, but only when ``models.store.online``.

A reference found nowhere raises ``ModelNotFoundError`` at stage setup, naming the config key, every place looked
and how to provide the weights. Checkpoints load as safetensors or through ``torch.load(weights_only=True)``;
ultralytics ``.pt`` files pickle whole modules, so their classes are allowed by policy (``nn.Module`` subclasses
defined in ``torch.nn`` or ``ultralytics.nn``, plus a few plain containers), never by running the pickle.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from common.storage import StorageError, resolve, safe_name

if TYPE_CHECKING:
    import torch
    from torch import nn

    from curation.config import ClipModelSettings, ModelStoreSettings, Precision

log = logging.getLogger(__name__)

HUB = "hf-hub:"
_COMPLETE = "_complete.json"  # marks a finished copy in a cache entry
_CHUNK = 16 * 2**20


class ModelNotFoundError(RuntimeError):
    """A model reference resolves nowhere; the message says where it looked and how to provide the weights."""


def _with_path(root: str, rel: str) -> str:
    """``root`` joined with ``rel``, keeping a URI's query string (``s3://b/m?endpoint_override=...``) at the end."""
    base, sep, query = root.partition("?") if "://" in root else (root, "", "")
    return base.rstrip("/") + "/" + rel.strip("/") + (sep + query if sep else "")


@dataclass(frozen=True)
class ModelStore:
    cache_dir: str
    roots: tuple[str, ...] = ()
    online: bool = False

    @classmethod
    def from_settings(cls, s: ModelStoreSettings) -> ModelStore:
        return cls(cache_dir=s.cache_dir, roots=tuple(s.roots), online=s.online)

    @property
    def cache(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir)).resolve()

    def fetch(self, ref: str, what: str, hub_files: Sequence[str] | None = None) -> Path:
        """The local path of the file or folder ``ref`` names. ``what`` is the config key (for messages);
        ``hub_files`` limits which files a hub folder download fetches (glob patterns)."""
        ref = ref.strip()
        looked: list[str] = []
        if ref.startswith(HUB):
            rel = ref[len(HUB):].strip("/")
            if rel.count("/") < 1:
                raise ModelNotFoundError(f"{what}: {ref!r} is not a hub name; write hf-hub:org/repo or hf-hub:org/repo/file")
            found = self._in_roots(rel, looked)
            if found is not None:
                return found
            if self.online:
                return self._from_hub(rel, what, hub_files, looked)
            looked.append("the Hugging Face hub: not tried, models.store.online is false")
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
            "models.store.online=true."
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

    def _from_hub(self, rel: str, what: str, files: Sequence[str] | None, looked: list[str]) -> Path:
        from huggingface_hub import hf_hub_download, snapshot_download

        parts = rel.split("/")
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        cache = self.cache / "hf-hub"
        try:
            if file:
                return Path(hf_hub_download(repo, file, cache_dir=cache))
            return Path(snapshot_download(repo, cache_dir=cache, allow_patterns=list(files) if files else None))
        except Exception as exc:  # noqa: BLE001 - any hub failure becomes the not-found message
            looked.append(f"the Hugging Face hub ({type(exc).__name__}: {exc})")
            raise ModelNotFoundError(self._not_found(HUB + rel, what, looked)) from None


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
    return sorted([f.path[len(path):].lstrip("/"), f.size, f.mtime_ns] for f in files if f.type == pafs.FileType.File)


def _download(fs: pafs.FileSystem, path: str, signature: list[list[Any]], dest: Path) -> None:
    for rel, _, _ in signature:
        src = f"{path.rstrip('/')}/{rel}" if rel else path
        out = dest / rel if rel else dest
        out.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(src) as f, open(out, "wb") as o:
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

    names = {str(k): str(v) for k, v in dict(model.names).items()}
    metadata = {
        "format": YOLO_FORMAT,
        "task": "pose" if isinstance(model, PoseModel) else "detect",
        "yaml": json.dumps(model.yaml),
        "names": json.dumps(names),
    }
    tensors = {k: v.detach().float().contiguous().clone() if v.is_floating_point() else v.detach().contiguous().clone()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata=metadata)


# Globals an ultralytics .pt may name besides nn.Module classes: argument namespaces and numpy scalars in metrics.
_YOLO_EXTRA_GLOBALS = {
    "ultralytics.utils.IterableSimpleNamespace",
    "types.SimpleNamespace",
    "numpy.dtype",
    "numpy.ndarray",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
}
_YOLO_MODULE_PREFIXES = ("torch.nn.modules.", "ultralytics.nn.")


def _allowed_global(name: str) -> Any | None:
    """The object a checkpoint's global ``name`` refers to, when policy allows it; None otherwise. Modules are only
    imported for names under the allowed prefixes, never for arbitrary names a file carries."""
    import torch

    module, _, attr = name.rpartition(".")
    if name in _YOLO_EXTRA_GLOBALS or module.startswith("numpy.dtypes"):
        obj = getattr(importlib.import_module(module), attr, None)
        return obj
    if not name.startswith(_YOLO_MODULE_PREFIXES):
        return None
    obj = getattr(importlib.import_module(module), attr, None)
    return obj if isinstance(obj, type) and issubclass(obj, torch.nn.Module) else None


def _load_ultralytics_pt(path: Path) -> nn.Module:
    import torch

    needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    allowed = {n: _allowed_global(n) for n in needed}
    refused = sorted(n for n, obj in allowed.items() if obj is None)
    if refused:
        raise ValueError(
            f"{path}: refusing to load, the checkpoint names globals outside the safe-loading policy: {refused}. "
            "Convert it once on a trusted machine: curation.models.save_yolo(YOLO(pt).model, 'model.safetensors')"
        )
    with torch.serialization.safe_globals(list(allowed.values())):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = None
    if isinstance(ckpt, dict):
        model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if model is None:
        raise ValueError(f"{path} is not an ultralytics checkpoint (no 'model' entry)")
    return model.float()


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
        model = open_clip.create_model(name, precision=precision, device=device, weights_only=True, require_pretrained=True)
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
