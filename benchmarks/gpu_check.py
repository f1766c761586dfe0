"""One prepared GPU check: the project's headline figures on one GPU, measured in one run of about 12 minutes.

    bash benchmarks/gpu_check.sh                     # clean checkout, bare GPU machine: install, then measure
    python benchmarks/gpu_check.py [--total-s 720] [--out gpu_check.json] [--budget part=seconds] [--only part]
                                   [--peak-tflops 989]
    python benchmarks/gpu_check.py --size value_budget.steps=1000 --size 'pretrain_sweep.batch=[16]'  # one run's sizes
    python benchmarks/gpu_check.py --cpu-smoke       # the same code paths at tiny sizes on CPU (tests/benchmarks/test_gpu_check.py)
    python benchmarks/gpu_check.py --prepare-value-data DIR   # part 4's renders and curation, made ahead on a CPU machine
    python benchmarks/gpu_check.py --value-data DIR  # ... and used by part 4 (a GPU machine without a package index)

Four parts, each in its own process with its own share of ``--total-s`` and a hard stop at the end of it (the
process group is killed); a part that fails or runs out of time is reported with its error and what it measured so
far, and the next part still runs. This file is the driver; each part is a module of ``benchmarks/gpu/``, named
below, beside the sizes (``sizes.py``), what a part writes as it runs (``harness.py``) and the table
(``results_table.py``). The parts:

1. ``curation`` (``curation_throughput.py``): the full profile's phase 1 on Ray Data
   (``curation.score.phase.ScorePhase``: read and decode on CPU tasks, YOLO11m detection + YOLO11m-pose and OpenCLIP
   ViT-L-14 + the aesthetic head on GPU actors, pHash) over a few thousand images cycled from the package photos,
   re-encoded at web sizes (long side 1024-2048 px). The models are the real architectures with random weights, saved
   into a temporary model store and loaded through the store's loading code (``generators.random_models``), with every
   filter opened so each image does all the work. A sweep over the model stages' batch size; per point images/s per GPU
   once the pipeline runs (from the first result to the last) and from the start (actor start-up included), and the
   GPU's utilisation over the running window. Then where a batch's time goes, in this process on the GPU: decode,
   host-to-device copy and each model's forward (the OCR text-overlay stage is off: it is CPU work, measured by
   bench_curation.py).
2. ``pretrain`` (``pretrain_step.py``): the 0.4B backbone's pretraining step (``pretrain.train``: the joint MAE +
   contrastive objective, FSDP2 over a world of one, bf16, AdamW, EMA teacher) at 1024x768 on in-memory images over
   a sweep of its settings, one axis at a time from the best so far (``Sizes.pretrain_sweep``): eager then
   ``torch.compile``; activation checkpointing full, selective (op-level, as torchtitan's) and off; FSDP2's
   reshard-after-forward always, never and torchtitan's default; prefetch 1 and 2 units; the batch, ascending until
   one runs out of memory. Per setting: step time, images/s, tokens/s, peak memory and MFU (the backbone and MAE decoder FLOP
   count, ``pretrain.train.train_flops_per_image``, against the GPU's dense bf16 peak, ``pretrain.train.PEAK_TFLOPS``;
   the peak used is printed), then the best, which the next part streams with. Then where the step's time goes: a few
   steps of the first eager and the first compiled setting under ``torch.profiler`` (``step_profile.py``), GPU kernel
   time per step and its share by part (attention, SwiGLU, norms, RoPE, FSDP collectives, AdamW, EMA teacher, MAE
   decoder, compiled blocks, other); ``--size profile_steps=0`` leaves it out. The whole sweep (each compiled
   checkpointing mode compiles anew) needs more than the part's share of the default 12 minutes: run it alone for the
   0.4B config's defaults, ``--only pretrain --budget pretrain=560``.
3. ``data_wait`` (``data_wait.py``): the same step streaming real curated shards (the README's lite curation of package
   photos at web sizes) through Ray Data inside a Ray Train run (``pretrain.train.fit``), with the best setting of
   part 2: the share of the step spent waiting for the next batch, from the run's own metrics; where it is over 3%,
   a second run with a wider decode path (``Sizes.data_paths``: 4x the read tasks in flight, twice the prefetch
   depth). Each run then goes on ``Sizes.save_steps`` steps while an async checkpoint of its last timed step
   (``checkpoint.async_save``: staged in pinned host memory, written from a thread) is written: the step time beside
   the write against the timed steps', the seconds the save held the step path, and the step it was committed at.
   What the decode costs per core and how many cores a GPU needs: ``benchmarks/bench_decode_path.py``.
4. ``value`` (``value_chain.py``): does pretraining give a better backbone? ``benchmarks/pretrain_value.py``'s chain
   (``run_chain``: a pool of renders with web junk, its lite curation and its uncurated form, held-out MAE, the positive
   control, labelled renders, frozen-feature probes via ``jobs.probe``, fine-tuning with a recipe chosen per init on
   validation via ``jobs.finetune``, both on the GPU) per model size, each set pretrained in this process
   (``pretrain_in_memory``): the pool decoded once into GPU memory as uint8, the worker's own step (objective,
   schedules, AdamW, EMA teacher, bf16 autocast), student and teacher exported as ``jobs.pretrain`` exports them
   (``pretrain.export.export_objective``). Per size: each init against random per measure, mean ± std over seeds, and
   whether the gain exceeds the seed spread; the control's, the pretraining's and curated-vs-raw verdicts; sizes and
   budget at ``sizes.GPU.value_*``. The model-free steps (renders, their curation, held-out and labelled renders) can be
   made ahead on any machine with ``--prepare-value-data DIR`` and passed with ``--value-data DIR``: the lite profile is
   CPU work, and its runtimes (OpenVINO, LiteRT, RapidOCR) need not be installed where the GPU is.

Goals on one H200: curation >= 150 images/s per GPU, MFU >= 45%, data wait < 3% of the step, and pretrained ahead of
random beyond the seed spread on fine-tuning at 16 and 64 labels (with the positive control ahead of random), and curated
ahead of raw. The figures are printed as one table and written as
JSON (``--out``); each part's log goes beside it (``<out stem>-logs/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.curation_throughput import part_curation
from benchmarks.gpu.data_wait import part_data_wait
from benchmarks.gpu.harness import MARGIN_S, REPO, Deadline, PartReport
from benchmarks.gpu.pretrain_step import AXES, part_pretrain
from benchmarks.gpu.results_table import GOALS, print_table
from benchmarks.gpu.sizes import GPU, SMOKE, Sizes, resized
from benchmarks.gpu.value_chain import part_value, prepare_value_data

PART_FNS = {"curation": part_curation, "pretrain": part_pretrain, "data_wait": part_data_wait, "value": part_value}
PARTS = tuple(PART_FNS)
# of the time left when the part starts: at the default 720 s, 158 / 137 / 94 / 331 s when each part uses all of its own
SHARE = {"curation": 0.22, "pretrain": 0.19, "data_wait": 0.13, "value": 0.46}
_FAILURES = ("raise", "hang")


def run_child(args: argparse.Namespace, sz: Sizes) -> int:
    """One part, in this process, at sizes ``sz``: its results go to ``args.result``."""
    report = PartReport(Path(args.result))
    deadline = Deadline(time.monotonic() + args.budget_s - MARGIN_S)
    if args.cpu_smoke:
        import torch

        torch.set_num_threads(1)  # tiny tensors; a shared machine
    try:
        failure = dict(f.split("=", 1) for f in args.fail).get(args.part)
        if failure == "raise":
            raise RuntimeError(f"failure injected into part {args.part} (--fail)")
        while failure == "hang":
            time.sleep(1)
        PART_FNS[args.part](sz, deadline, report, json.loads(args.context))
    except BaseException as exc:  # noqa: BLE001 - reported, then the next part runs
        traceback.print_exc()
        report.set(status="error", error=f"{type(exc).__name__}: {exc}".strip()[:2000])
        return 1
    report.set(status="ok")
    return 0


# --- the driver -------------------------------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen) -> None:
    """End the part's process and everything it started (its local Ray included): they share its process group."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def run_part(part: str, budget_s: float, args: argparse.Namespace, context: dict, logs: Path) -> dict:
    result = logs / f"{part}.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--part",
        part,
        "--result",
        str(result),
        "--budget-s",
        f"{budget_s:.1f}",
        "--context",
        json.dumps(context),
    ]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    for f in args.fail:
        cmd += ["--fail", f]
    for setting in args.size:
        cmd += ["--size", setting]
    start = time.monotonic()
    with open(logs / f"{part}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            proc.wait(budget_s)
            stopped = False
        except subprocess.TimeoutExpired:
            stopped = True
        stop_group(proc)  # also after a clean exit: Ray processes it left behind
    out = json.loads(result.read_text()) if result.exists() else {"status": "running"}
    out["seconds"] = round(time.monotonic() - start, 1)
    out["budget_s"] = round(budget_s, 1)
    if out["status"] != "ok":
        out["status"] = "error"
        if stopped:
            out["error"] = f"stopped at its time budget ({budget_s:.0f} s)" + (
                f"; {out['error']}" if "error" in out else ""
            )
        elif "error" not in out:
            out["error"] = f"the part's process exited with code {proc.returncode} (log: {logs / f'{part}.log'})"
    out["log"] = str(logs / f"{part}.log")
    return out


def device_name() -> str:
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip():
            names = out.stdout.strip().splitlines()
            return f"{len(names)} x {names[0]}"
    return f"no GPU, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the same code paths in minutes")
    ap.add_argument("--total-s", type=float, default=None, help="seconds for all parts (default 720; smoke 600)")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON results; part logs go to <stem>-logs/")
    ap.add_argument("--only", action="append", choices=PARTS, default=[], help="run only these parts")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="fix a part's time budget")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: by device name)")
    ap.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="change one of the sizes (class Sizes; FIELD.KEY=JSON for a dict's key), e.g. value_budget.steps=1000",
    )
    ap.add_argument("--value-data", help="part value: renders and curated shards made by --prepare-value-data")
    ap.add_argument(
        "--prepare-value-data", metavar="DIR", help="make part value's renders and curated shards in DIR, then exit"
    )
    ap.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="PART=raise|hang",
        help="make a part fail (raise at once, or hang until its hard stop): checks the reporting",
    )
    # one part in a child process (the driver's own use)
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--context", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for f in args.fail:
        part, _, how = f.partition("=")
        if part not in PARTS or how not in _FAILURES:
            ap.error(f"--fail {f!r}: expected PART=raise or PART=hang, PART one of {', '.join(PARTS)}")
    try:
        sizes = resized(SMOKE if args.cpu_smoke else GPU, args.size)
    except ValueError as exc:
        ap.error(str(exc))
    if args.part:
        return run_child(args, sizes)
    if args.prepare_value_data:
        return prepare_value_data(Path(args.prepare_value_data), sizes)
    if args.value_data and not all(
        (Path(args.value_data) / source / "shards" / "manifest.json").exists() for source in ("curated", "raw")
    ):
        ap.error(f"--value-data {args.value_data}: no curated shards there (make them with --prepare-value-data)")

    import torch

    fixed = {p: float(s) for p, s in (b.split("=", 1) for b in args.budget)}
    total = args.total_s or (600.0 if args.cpu_smoke else 720.0)
    out = Path(args.out).resolve()
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    results = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "device": device_name(),
        "torch": torch.__version__,
        "total_s": total,
        "goals": GOALS,
        "parts": {},
    }
    value_data = str(Path(args.value_data).resolve()) if args.value_data else None
    start, context = time.monotonic(), {"peak_tflops": args.peak_tflops, "value_data": value_data}
    todo = [p for p in PARTS if not args.only or p in args.only]
    for i, part in enumerate(todo):
        left = total - (time.monotonic() - start)
        shares = sum(SHARE[p] for p in todo[i:] if p not in fixed)
        budget = fixed.get(part) or max(0.0, left - sum(fixed.get(p, 0) for p in todo[i + 1 :])) * SHARE[part] / shares
        print(f"[gpu_check] {part}: {budget:.0f} s (log {logs / f'{part}.log'})", flush=True)
        results["parts"][part] = r = run_part(part, budget, args, context, logs)
        if part == "pretrain" and r.get("best"):
            context["setting"] = {axis: r["best"][axis] for axis in AXES}
        print(
            f"[gpu_check] {part}: {r['status']} in {r['seconds']} s" + (f": {r['error']}" if "error" in r else ""),
            flush=True,
        )
        out.write_text(json.dumps(results, indent=1))
    print_table(results)
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
