"""The prepared GPU check (benchmarks/gpu_check.py) in its --cpu-smoke mode: the same code paths as on a GPU, at
tiny sizes on CPU, so the script cannot rot before GPU time comes. Every part must come back with figures, and a
part that fails (raises, or hangs past its hard stop) must be reported while the others still run. The value part
(a whole pretrained-vs-random chain, several minutes on 2 CPUs) has a test of its own; the parts' own pieces are
tested beside it, in gpu/."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.pretrain_step import AXES
from benchmarks.gpu.sizes import SMOKE

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
FIRST_THREE = ("--only", "curation", "--only", "pretrain", "--only", "data_wait")


def run_check(tmp_path: Path, *args: str, total_s: int = 600, env: dict | None = None) -> tuple[dict, str]:
    out = tmp_path / "check.json"
    # A generous total: the parts' shares of it are their hard stops, and a shared CI machine can be slow.
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--total-s", str(total_s), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=total_s + 300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def errors(parts: dict) -> dict:
    return {name: (p.get("error"), p["log"]) for name, p in parts.items() if p["status"] != "ok"}


@pytest.mark.slow
def test_every_part_measures(tmp_path):
    results, printed = run_check(tmp_path, *FIRST_THREE)
    parts = results["parts"]
    assert list(parts) == ["curation", "pretrain", "data_wait"]
    assert not errors(parts)

    curation = parts["curation"]
    # every filter open: each image passes both model stages, so the rate is one of the whole work
    assert curation["sweep"] and all(
        p["images"] == p["kept"] == 8 and p["images_per_s_from_start"] > 0 for p in curation["sweep"]
    )
    assert curation["images_per_s_per_gpu"] > 0
    split = curation["ms_per_image"]
    assert all(
        split[k] > 0
        for k in (
            "yolo: detector forward",
            "yolo: pose forward",
            "clip: image tower forward",
            "clip: decode + resize (CPU threads)",
            "yolo: whole stage call",
        )
    )
    assert split["yolo: whole stage call"] >= split["yolo: pose forward"]

    pretrain = parts["pretrain"]
    runs = pretrain["runs"]
    assert all("error" not in r for r in runs)
    for run in runs:
        assert run["step_s"] > 0 and run["timed_steps"] >= 1
        # both rounded from the same unrounded rate: within one token/s
        assert abs(run["tokens_per_s"] - run["images_per_s"] * pretrain["tokens_per_image"]) <= 1
        assert run["mfu"] is None  # no GPU, no peak to measure against
    # every value of every axis but compile (skipped in this mode) measured once, one axis at a time
    assert not any(r["compile"] for r in runs) and [s["compile"] for s in pretrain["skipped"]] == [True]
    settings = [tuple(r[axis] for axis in AXES) for r in runs]
    assert (
        len(set(settings))
        == len(settings)
        == 1 + sum(len(v) - 1 for k, v in SMOKE.pretrain_sweep.items() if k != "compile")
    )
    for axis, values in SMOKE.pretrain_sweep.items():
        assert axis == "compile" or {r[axis] for r in runs} == set(values)
    best = pretrain["best"]
    assert best["images_per_s"] == max(r["images_per_s"] for r in runs)  # each axis starts from the best so far
    assert pretrain["train_tflop_per_image"] > 0 and "no MFU" in pretrain["peak_source"]

    wait = parts["data_wait"]
    # both decode paths measured (the smoke mode retries at any wait)
    assert [r["decode_path"] for r in wait["runs"]] == [list(p) for p in SMOKE.data_paths]
    assert wait["shards_images"] >= wait["batch"] and wait["windows"] >= 1
    for run in wait["runs"]:
        assert 0 <= run["data_wait_frac_mean"] <= run["data_wait_frac_max"] < 1 and run["step_s"] > 0
        assert run["step_s_during_async_save"] > 0  # the steps beside the async checkpoint of the last timed one
    assert wait["data_wait_frac_mean"] == min(r["data_wait_frac_mean"] for r in wait["runs"])
    # the fastest setting of the pretraining part is the one streamed
    assert wait["setting"] == {axis: best[axis] for axis in AXES}
    assert wait["batch"] == best["batch"]
    assert "data wait" in printed and "ms/image, clip: image tower forward" in printed


@pytest.mark.slow
def test_a_failing_part_is_reported_and_the_others_run(tmp_path):
    results, printed = run_check(
        tmp_path,
        "--fail",
        "curation=raise",
        "--fail",
        "data_wait=hang",
        "--fail",
        "value=raise",
        "--budget",
        "data_wait=10",
        "--size",
        "pretrain_sweep=" + json.dumps({**{k: v[:1] for k, v in SMOKE.pretrain_sweep.items()}, "batch": [3]}),
    )  # the sizes travel to the part's own process
    parts = results["parts"]
    assert list(parts) == ["curation", "pretrain", "data_wait", "value"]
    assert parts["curation"]["status"] == "error"
    assert "failure injected into part curation" in parts["curation"]["error"]
    assert parts["pretrain"]["status"] == "ok" and all(r["step_s"] > 0 for r in parts["pretrain"]["runs"])
    assert [r["batch"] for r in parts["pretrain"]["runs"]] == [3]
    assert "skipped" not in parts["pretrain"]
    assert parts["data_wait"]["status"] == "error"
    assert parts["data_wait"]["error"].startswith("stopped at its time budget (10 s)")
    assert parts["value"]["status"] == "error" and "failure injected into part value" in parts["value"]["error"]
    assert "failure injected" in printed and "stopped at its time budget" in printed


def test_a_size_that_is_no_field_is_refused_at_the_command_line():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "no_such_field=1"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2 and "FIELD one of" in proc.stderr


# What a GPU machine running on benchmarks/offline_site.py's archive lacks: the lite runtimes, ultralytics' polars.
LITE_RUNTIMES = ("openvino", "ai_edge_litert", "rapidocr", "polars")


def without_modules(tmp_path: Path, names: tuple[str, ...]) -> dict:
    """An environment whose Python processes (Ray's workers too) cannot import ``names``."""
    site = tmp_path / "blocked"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({names!r}))\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_the_value_part_runs_the_chain_with_pretraining_in_memory(tmp_path):
    """On data made ahead (--prepare-value-data), on a machine where the lite profile's runtimes do not import."""
    data = tmp_path / "value-data"
    prepared = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--prepare-value-data", str(data)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    assert (data / "curated/shards/manifest.json").exists() and (data / "raw/shards/manifest.json").exists()
    assert (data / "labelled-8/test/manifest.json").exists() and (data / "control/val/manifest.json").exists()
    shutil.rmtree(data / "pool")  # what is curated need not travel with it

    env = without_modules(tmp_path, LITE_RUNTIMES)
    blocked = subprocess.run([sys.executable, "-c", "import openvino"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "ModuleNotFoundError" in blocked.stderr
    results, _ = run_check(tmp_path, "--only", "value", "--value-data", str(data), total_s=900, env=env)
    parts = results["parts"]
    assert list(parts) == ["value"] and not errors(parts)
    value = parts["value"]
    (m,) = value["models"]  # the smoke mode's one size
    assert not any(t.startswith(("curate", "pool", "labelled")) for t in m["steps_s"])  # made ahead, not here
    assert m["size"] == "tiny" and m["patch_size"] == 8 and m["pretrain_steps"] == 4 and m["global_batch"] == 4
    # the in-memory pretraining of each set: its whole pool on the device, one record per step at this length
    assert set(m["pretrain_run"]) == set(m["pretraining"]) == {"curated", "raw"}
    for source, run in m["pretrain_run"].items():
        assert run["pool_images"] == m["pretraining"][source]["images"] >= m["global_batch"] and run["step_s"] > 0
        assert run["mfu"] is None and m["pretraining"][source]["heldout_mae"]["step"] == 4
        assert [r["step"] for r in m["pretraining_steps"] if r["set"] == source] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["mae"] > 0 for r in m["pretraining_steps"])
    assert m["pretraining"]["raw"]["images"] > m["pretraining"]["curated"]["images"]  # the curation drops junk
    assert sum(title.startswith("pretrain on") and title.endswith("in this process") for title in m["steps_s"]) == 2
    # the probes (colour only) and fine-tuning: one cell per measure and init other than random
    inits = ["random-ls1", "supervised", "curated", "raw"]
    measures = ["probe mIoU (tokens, best layer), 8 labels, colour", "k-NN mIoU (tokens, best layer), 8 labels, colour",
                "left/right bal. acc, 8 labels, colour", "fine-tune mIoU, 8 labels (recipe on val)"]  # fmt: skip
    assert [(c["measure"], c["init"]) for c in m["cells"]] == [(x, i) for x in measures for i in inits]
    # one seed: no spread to beat, so no verdict
    assert all(c["beyond_spread"] is None for c in m["cells"]) and m["goal_met"] is None
    assert any(v.startswith("control: supervised") for v in m["verdicts"])
    assert value["current"] is None and not value.get("skipped")
