"""Hostile model files: checkpoints whose unpickling would run code, files that are not the ones the config pins,
hub downloads without a pinned revision. Payloads, when they run, create a marker file; every test that refuses a
file checks the marker is absent."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from curation import models
from curation.config import CurateConfig
from curation.models import yolo as yolo_models

FULL = Path(__file__).resolve().parents[2] / "configs" / "curate" / "full.yaml"


def _ultralytics():
    models.import_ultralytics()  # keeps PIL's Image.open
    import ultralytics

    return ultralytics


class Payload:
    """Unpickled with full pickle, runs code: here it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


class LoadsAnotherFile:
    """Pickles as ``AutoBackend(second)``: AutoBackend's constructor loads ``second`` with full pickle."""

    def __init__(self, second: Path) -> None:
        self.second = str(second)

    def __reduce__(self):
        from ultralytics.nn.autobackend import AutoBackend

        return AutoBackend, (self.second,)


class CallsAllowedLayer:
    """Pickles as ``DetectionModel({...})``, a class every YOLO checkpoint names: its constructor evals the dict's
    activation string."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg

    def __reduce__(self):
        from ultralytics.nn.tasks import DetectionModel

        return DetectionModel, (self.cfg,)


def _evil_yaml(marker: Path) -> dict:
    return {
        "nc": 1,
        "activation": f"open({str(marker)!r}, 'w').close() or nn.SiLU()",
        "backbone": [[-1, 1, "Conv", [16, 3, 2]]],
        "head": [[[0], 1, "Detect", ["nc"]]],
    }


@pytest.fixture(scope="module")
def yolo_pts(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Random-init YOLO11n detector and pose model saved the way ultralytics saves its .pt files."""
    out = tmp_path_factory.mktemp("yolo_pt")
    saved = {}
    for name in ("yolo11n", "yolo11n-pose"):
        model = _ultralytics().YOLO(f"{name}.yaml")
        model.save(out / f"{name}.pt")
        saved[name] = (out / f"{name}.pt", model.model)
    return saved


# --- pickled code in .pt files -----------------------------------------------------------------------------------


def test_pt_that_builds_autobackend_on_a_second_pickle_is_refused_and_the_payload_never_runs(tmp_path):
    _ultralytics()
    from ultralytics.nn.autobackend import AutoBackend

    second = tmp_path / "weights.pt"
    torch.save({"model": Payload(tmp_path / "pwned")}, second)
    with pytest.raises(Exception):  # noqa: B017 - whatever the payload's object breaks; the attack is real: AutoBackend unpickles the second file, running the payload
        AutoBackend(str(second))
    assert (tmp_path / "pwned").exists()

    (tmp_path / "pwned").unlink()
    evil = tmp_path / "yolo11m-pose.pt"
    torch.save({"model": LoadsAnotherFile(second), "ema": None}, evil)
    with pytest.raises(ValueError, match=r"refusing to load.*ultralytics\.nn\.autobackend\.AutoBackend.*safetensors"):
        models.load_yolo(evil)
    assert not (tmp_path / "pwned").exists()


def test_pt_that_calls_an_allowed_layer_class_is_refused_before_its_constructor_runs(tmp_path):
    _ultralytics()
    from ultralytics.nn.tasks import DetectionModel

    DetectionModel(_evil_yaml(tmp_path / "pwned"), verbose=False)  # the attack is real: the constructor runs it
    assert (tmp_path / "pwned").exists()

    (tmp_path / "pwned").unlink()
    evil = tmp_path / "detector.pt"
    torch.save({"model": CallsAllowedLayer(_evil_yaml(tmp_path / "pwned")), "ema": None}, evil)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(evil)) == ["ultralytics.nn.tasks.DetectionModel"]
    with pytest.raises(ValueError, match=r"refusing to load.*calls ultralytics\.nn\.tasks\.DetectionModel\(\.\.\.\)"):
        models.load_yolo(evil)
    assert not (tmp_path / "pwned").exists()


def test_safetensors_whose_architecture_would_run_code_is_refused(yolo_pts, tmp_path):
    _, model = yolo_pts["yolo11n"]
    good = tmp_path / "det.safetensors"
    models.save_yolo(model, good)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(good))
    meta = {"format": models.YOLO_FORMAT, "task": "detect", "names": json.dumps({"0": "person"})}
    for cfg, named in (
        (_evil_yaml(tmp_path / "pwned"), "activation"),
        ({**model.yaml, "head": [[-1, 1, "attempt_load_weights", [str(tmp_path / "x.pt")]]]}, "attempt_load_weights"),
    ):
        save_file(tensors, str(tmp_path / "evil.safetensors"), metadata={**meta, "yaml": json.dumps(cfg)})
        with pytest.raises(ValueError, match=f"refusing to build the architecture.*{named}"):
            models.load_yolo(tmp_path / "evil.safetensors")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", ["yolo11n", "yolo11n-pose"])
def test_random_init_yolo_checkpoints_load_through_the_real_loader(yolo_pts, name):
    path, saved = yolo_pts[name]
    loaded = models.load_yolo(path)
    assert type(loaded) is type(saved)
    for module in loaded.modules():  # every layer is its own class again, not the unpickler's stand-in
        assert not isinstance(type(module), yolo_models._NotCallable)
    for a, b in zip(loaded.state_dict().values(), saved.state_dict().values(), strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)  # .pt files store fp16
    with torch.inference_mode():
        assert loaded(torch.zeros(1, 3, 64, 64)) is not None


def test_pose_checkpoint_of_older_ultralytics_loads(tmp_path):
    """Their pose head keeps ``Detect.forward``, which the pickle reaches through ``builtins.getattr``."""
    from ultralytics.nn.modules.head import Detect

    model = _ultralytics().YOLO("yolo11n-pose.yaml")
    model.model.model[-1].detect = Detect.forward
    model.save(tmp_path / "pose.pt")
    assert "builtins.getattr" in torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "pose.pt"))
    assert models.load_yolo(tmp_path / "pose.pt").model[-1].detect is Detect.forward


# --- sha256 pins ---------------------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sha256_pin_accepts_the_pinned_file_and_refuses_another_naming_both_digests(tmp_path):
    weights = tmp_path / "pose.pt"
    weights.write_bytes(b"genuine weights")
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"))
    cfg = load_config(CurateConfig, FULL, [f"models.yolo.pose={{ref: {weights}, sha256: {_digest(weights)}}}"])
    assert store.fetch(cfg.models.yolo.pose, "models.yolo.pose") == weights

    pinned = _digest(weights)
    weights.write_bytes(b"swapped weights")
    with pytest.raises(models.ModelIntegrityError) as err:
        store.fetch(cfg.models.yolo.pose, "models.yolo.pose")
    message = str(err.value)
    assert str(weights) in message and pinned in message and _digest(weights) in message
    assert "models.yolo.pose.sha256" in message


def test_sha256_pin_is_checked_on_the_node_copy_of_a_uri(tmp_path):
    from curation.models.settings import PinnedModel

    remote = tmp_path / "bucket" / "head.pth"
    remote.parent.mkdir()
    remote.write_bytes(b"other bytes")
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"))
    ref = PinnedModel(ref=remote.as_uri(), sha256=hashlib.sha256(b"pinned bytes").hexdigest())
    copy = re.escape(str(tmp_path / "cache"))
    with pytest.raises(models.ModelIntegrityError, match=rf"{copy}.*head\.pth has sha256 {_digest(remote)}"):
        store.fetch(ref, "models.clip.aesthetic_head")


def test_folder_pin_needs_every_file_pinned(tmp_path):
    from curation.models.settings import PinnedModel

    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text("{}")
    (folder / "open_clip_model.safetensors").write_bytes(b"w")
    pins = {p.name: _digest(p) for p in folder.iterdir()}
    store = models.ModelStore(cache_dir=str(tmp_path / "cache"))
    assert store.fetch(PinnedModel(ref=str(folder), sha256=pins), "models.clip.checkpoint") == folder
    (folder / "open_clip_pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(models.ModelIntegrityError, match=r"unpinned \['open_clip_pytorch_model\.bin'\]"):
        store.fetch(PinnedModel(ref=str(folder), sha256=pins), "models.clip.checkpoint")


# --- hub revisions -------------------------------------------------------------------------------------------------


@pytest.fixture()
def hub_calls(monkeypatch, tmp_path) -> list[dict]:
    """Stands in for the Hugging Face hub: records each download and returns a local file."""
    import huggingface_hub

    calls: list[dict] = []
    (tmp_path / "downloaded.pt").write_bytes(b"w")

    def download(repo, file, **kwargs):
        calls.append({"repo": repo, "file": file, **kwargs})
        return str(tmp_path / "downloaded.pt")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return calls


def test_hub_source_without_a_revision_is_refused_unless_opted_in(tmp_path, hub_calls):
    from curation.models.settings import PinnedModel

    ref = "hf-hub:Ultralytics/YOLO11/yolo11m-pose.pt"
    online = models.ModelStore(cache_dir=str(tmp_path / "cache"), online=True)
    refusal = r"(?s)without a pinned revision.*models\.store\.allow_unpinned_hub"
    with pytest.raises(models.ModelIntegrityError, match=refusal):
        online.fetch(ref, "models.yolo.pose")
    assert hub_calls == []

    commit = "0123456789abcdef0123456789abcdef01234567"
    online.fetch(PinnedModel(ref=ref, revision=commit), "models.yolo.pose")
    assert hub_calls[-1]["revision"] == commit

    opted_in = models.ModelStore(cache_dir=str(tmp_path / "cache"), online=True, allow_unpinned_hub=True)
    opted_in.fetch(ref, "models.yolo.pose")
    assert hub_calls[-1]["revision"] is None and len(hub_calls) == 2


def test_config_refuses_a_branch_as_a_hub_revision():
    with pytest.raises(ConfigError, match=r"models\.yolo\.pose.*revision"):
        load_config(CurateConfig, FULL, ["models.yolo.pose={ref: 'hf-hub:org/repo/pose.pt', revision: main}"])
