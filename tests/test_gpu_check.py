"""The prepared GPU check (benchmarks/gpu_check.py) in its --cpu-smoke mode: the same code paths as on a GPU, at
tiny sizes on CPU, so the script cannot rot before GPU time comes. Every part must come back with figures, and a
part that fails (raises, or hangs past its hard stop) must be reported while the others still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run_check(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "check.json"
    # A generous total: the parts' shares of it are their hard stops, and a shared CI machine can be slow.
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--total-s", "600", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def errors(parts: dict) -> dict:
    return {name: (p.get("error"), p["log"]) for name, p in parts.items() if p["status"] != "ok"}


def test_every_part_measures(tmp_path):
    results, printed = run_check(tmp_path)
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
    eager = {r["activation_checkpointing"]: r for r in pretrain["runs"] if not r["compile"]}
    assert set(eager) == {False, True}
    for run in eager.values():
        assert run["step_s"] > 0 and run["timed_steps"] >= 1
        # both rounded from the same unrounded rate: within one token/s
        assert abs(run["tokens_per_s"] - run["images_per_s"] * pretrain["tokens_per_image"]) <= 1
        assert run["mfu"] is None  # no GPU, no peak to measure against
    assert pretrain["train_tflop_per_image"] > 0 and "no MFU" in pretrain["peak_source"]
    assert {(s["compile"], s["activation_checkpointing"]) for s in pretrain["skipped"]} == {(True, True), (True, False)}

    wait = parts["data_wait"]
    assert wait["shards_images"] >= wait["batch"] and wait["windows"] >= 1
    assert 0 <= wait["data_wait_frac_mean"] <= wait["data_wait_frac_max"] < 1 and wait["step_s"] > 0
    # the fastest setting of the pretraining part is the one streamed
    best = pretrain["best"]
    assert wait["setting"] == {"compile": best["compile"], "activation_checkpointing": best["activation_checkpointing"]}
    assert "data wait" in printed and "ms/image, clip: image tower forward" in printed


def test_a_failing_part_is_reported_and_the_others_run(tmp_path):
    results, printed = run_check(
        tmp_path,
        "--fail",
        "curation=raise",
        "--fail",
        "data_wait=hang",
        "--budget",
        "data_wait=10",
    )
    parts = results["parts"]
    assert parts["curation"]["status"] == "error"
    assert "failure injected into part curation" in parts["curation"]["error"]
    assert parts["pretrain"]["status"] == "ok" and all(r["step_s"] > 0 for r in parts["pretrain"]["runs"])
    assert parts["data_wait"]["status"] == "error"
    assert parts["data_wait"]["error"].startswith("stopped at its time budget (10 s)")
    assert "failure injected" in printed and "stopped at its time budget" in printed
