"""One prepared GPU check: the project's headline figures on one GPU, measured in one run of about 12 minutes.

    bash benchmarks/gpu_check.sh                     # clean checkout, bare GPU machine: install, then measure
    python benchmarks/gpu_check.py [--total-s 720] [--out gpu_check.json] [--budget part=seconds] [--only part]
                                   [--peak-tflops 989]
    python benchmarks/gpu_check.py --size value_budget.steps=1000 --size 'pretrain_settings=[[true,false]]'  # one run's sizes
    python benchmarks/gpu_check.py --cpu-smoke       # the same code paths at tiny sizes on CPU (tests/test_gpu_check.py)
    python benchmarks/gpu_check.py --prepare-value-data DIR   # part 4's renders and curation, made ahead on a CPU machine
    python benchmarks/gpu_check.py --value-data DIR  # ... and used by part 4 (a GPU machine without a package index)

Four parts, each in its own process with its own share of ``--total-s`` and a hard stop at the end of it (the
process group is killed); a part that fails or runs out of time is reported with its error and what it measured so
far, and the next part still runs. The parts:

1. ``curation``: the full profile's phase 1 on Ray Data (``curation.score.phase.ScorePhase``: read and decode on CPU tasks,
   YOLO11m detection + YOLO11m-pose and OpenCLIP ViT-L-14 + the aesthetic head on GPU actors, pHash) over a few
   thousand images cycled from the package photos, re-encoded at web sizes (long side 1024-2048 px). The models are
   the real architectures with random weights, saved into a temporary model store and loaded through the store's
   loading code (``generators.random_models``), with every filter opened so each image does all the work. A sweep over
   the model stages' batch size; per point images/s per GPU once the pipeline runs (from the first result to the
   last) and from the start (actor start-up included), and the GPU's utilisation over the running window. Then
   where a batch's time goes, in this process on the GPU: decode, host-to-device copy and each model's forward
   (the OCR text-overlay stage is off: it is CPU work, measured by bench_curation.py).
2. ``pretrain``: the 0.4B backbone's pretraining step (``pretrain.train``: the joint MAE + contrastive objective,
   FSDP2 over a world of one, bf16, AdamW, EMA teacher) at 1024x768 on in-memory images, eager and under
   ``torch.compile``, each with and without activation checkpointing: step time, images/s, tokens/s, peak memory
   and MFU (the backbone's own FLOP count, ``pretrain.train.train_flops_per_image``, against the GPU's dense bf16
   peak, ``pretrain.train.PEAK_TFLOPS``; the peak used is printed).
3. ``data_wait``: the same step streaming real curated shards (the README's lite curation of package photos at web
   sizes) through Ray Data inside a Ray Train run (``pretrain.train.fit``), with the fastest setting of part 2: the
   share of the step spent waiting for the next batch, from the run's own metrics.
4. ``value``: does pretraining give a better backbone? ``benchmarks/pretrain_value.py``'s chain (``run_chain``:
   a pool of renders with web junk, its lite curation and its uncurated form, held-out MAE, the positive control,
   labelled renders, frozen-feature probes via ``jobs.probe``, fine-tuning with a recipe chosen per init on
   validation via ``jobs.finetune``, both on the GPU) per model size, each set pretrained in this process
   (``pretrain_in_memory``): the pool decoded once into GPU memory as uint8, the worker's own step (objective,
   schedules, AdamW, EMA teacher, bf16 autocast), student and teacher exported as ``jobs.pretrain`` exports them
   (``pretrain.export.export_objective``). Per size: each init against random per measure, mean ± std over seeds,
   and whether the gain exceeds the seed spread; the control's, the pretraining's and curated-vs-raw verdicts;
   sizes and budget at ``GPU.value_*``. The model-free steps (renders, their curation, held-out and labelled
   renders) can be made ahead on any machine with ``--prepare-value-data DIR`` and passed with ``--value-data DIR``:
   the lite profile is CPU work, and its runtimes (OpenVINO, LiteRT, RapidOCR) need not be installed where the GPU
   is.

Goals on one H200: curation >= 150 images/s per GPU, MFU >= 45%, data wait < 3% of the step, and pretrained ahead of
random beyond the seed spread on fine-tuning at 16 and 64 labels (with the positive control ahead of random), and curated
ahead of raw. The figures are printed as one table and written as
JSON (``--out``); each part's log goes beside it (``<out stem>-logs/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.timing import synchronize, timed  # noqa: E402

PARTS = ("curation", "pretrain", "data_wait", "value")
# of the time left when the part starts: at the default 720 s, 158 / 137 / 94 / 331 s when each part uses all of its own
SHARE = {"curation": 0.22, "pretrain": 0.19, "data_wait": 0.13, "value": 0.46}
GOALS = {
    "curation": "images/s per GPU >= 150",
    "pretrain": "MFU >= 45%",
    "data_wait": "data wait < 3% of the step",
    "value": "pretrained ahead of random beyond the seed spread on every fine-tuning cell",
}
_MARGIN_S = 5.0  # a part stops starting new work this long before its hard stop, to write what it has
_FAILURES = ("raise", "hang")


@dataclass(frozen=True)
class Sizes:
    """Everything the two modes differ in; the code paths are the same."""

    # curation
    images: int  # pool size
    long_sides: tuple[int, ...]  # each photo is re-encoded at these long sides (0: as shipped)
    batches: tuple[int, ...]  # model stages' batch sizes swept
    yolo: str
    clip: str
    clip_cfg: dict | None  # None: the tiny OpenCLIP of generators.random_models; {}: the architecture's own
    imgsz: int
    yolo_actors: tuple[int, float, float]  # actors, CPUs and GPU share of each
    clip_actors: tuple[int, float, float]
    ray_cpus: int | None
    receipt_rows: int  # rows per result write (input.files_per_shard): the granularity of the measured rate
    # pretraining
    config: str
    overrides: tuple[str, ...]
    warmup: int
    steps: int
    compile: bool  # also measure under torch.compile (inductor's CPU code generation takes minutes)
    # (compile, activation checkpointing) in the order measured: eager first, a figure even if compiling outlasts the
    # budget; under compile, checkpointing on first (the 0.4B config's setting). Checkpointing is a flag read at each
    # forward, so one model serves both settings of a row pair.
    pretrain_settings: tuple[tuple[bool, bool], ...]
    # data wait
    data_photos: int  # person photos in the pool curated for it (times len(data_sizes))
    data_sizes: tuple[int, ...]
    data_overrides: tuple[str, ...]
    data_warmup: int
    data_steps: int
    # pretrained vs random (benchmarks/pretrain_value.py's chain)
    value_models: tuple[tuple[str, int | None, tuple[str, ...]], ...]  # (model.size, model.patch_size, overrides)
    value_pretrain: tuple[str, ...]  # pretraining overrides of every size
    value_budget: dict  # the rest of pretrain_value.Budget


GPU = Sizes(
    images=2048,
    long_sides=(1024, 1536, 2048),
    batches=(32, 64, 16),
    yolo="yolo11m",
    clip="ViT-L-14",
    clip_cfg={},
    # one GPU's worth of actors (GPU shares sum to 1), each decoding its batch on its CPUs; 3 CPUs left for the
    # read, decode-check, pHash and write tasks
    imgsz=640,
    yolo_actors=(3, 3, 0.2),
    clip_actors=(2, 2, 0.2),
    ray_cpus=None,
    receipt_rows=64,
    config="configs/pretrain/sapiens2_0.4b.yaml",
    overrides=(),
    warmup=3,
    steps=6,
    compile=True,
    pretrain_settings=((False, False), (False, True), (True, True), (True, False)),
    data_photos=4,
    data_sizes=(1280, 1408, 1536, 1664, 1792, 1920, 2048, 2176),
    data_overrides=("ray.cpus_per_worker=4", "log.every=5"),
    data_warmup=5,
    data_steps=15,
    # Part value: the tiny backbone at its configured peak learning rate (1e-3), at a global batch of 128 in one process
    # (a step of the tiny objective is ~12,000 small ATen ops at any batch, so at batch 8 launch overhead sets its
    # time); the warm-up and the frozen prototypes 50 steps (5%, as the config's 5 of 60). Time on one H200 with 16
    # CPUs, measured 2026-12-04 (benchmarks/RESULTS.md) at 64x48: 938 steps at 0.0735 s, probes 3-4 s each,
    # fine-tuning runs 37-45 s each (~35 s of it Ray Train's start).
    value_models=(("tiny", None, ("optim.lr=2e-3",)),),
    value_pretrain=(
        "ray.workers=1",  # one process: the global batch is one batch
        "data.batch_size=128",
        "optim.warmup_steps=50",
        "objective.cl.freeze_prototypes_steps=50",
    ),
    # 5000 renders (30% junk) made ahead on a CPU machine (--prepare-value-data): the lite profile keeps ~24%, so
    # 1000 steps x 128 are ~105 epochs of the ~1200 curated and ~26 of the 5000 raw; 16 and 64 labels, three seeds,
    # three rates chosen per init on val. Not yet run on a GPU: its 70 fine-tuning runs (7 inits x 2 label counts x
    # 5 runs) at ~40 s each are about 47 minutes, so it needs --budget value= of that order, or fewer seeds or rates.
    value_budget=dict(
        pool=5000,
        pretrain_steps=1000,
        labels=(16, 64),
        seeds=(0, 1, 2),
        steps=600,
        lrs=(1.6e-2, 4.8e-2, 1.44e-1),
        val=64,
        test=128,
        heldout=128,
        control=1000,
        control_steps=2000,
        exports=("student", "teacher"),
        probe_iters=20,
        curate_overrides=("stages.person.actors=[6,6]", "stages.person.num_cpus=1"),
        finetune_overrides=("ray.use_gpu=true",),
        workers=14,
        ray_cpus=None,
        probe_threads=None,
    ),
)
SMOKE = Sizes(
    images=8,
    long_sides=(0,),
    batches=(4,),
    yolo="yolo11n",
    clip="ViT-S-32",
    clip_cfg=None,
    imgsz=64,
    yolo_actors=(1, 0.5, 0.0),
    clip_actors=(1, 0.5, 0.0),
    ray_cpus=2,
    receipt_rows=2,
    config="configs/pretrain/tiny.yaml",
    overrides=(
        "objective.views.global_size=[64,48]",
        "objective.views.local_size=[32,32]",
        "data.batch_size=2",
        "ray.torch_threads=1",
    ),
    warmup=1,
    steps=2,
    compile=False,
    pretrain_settings=((False, False), (False, True), (True, True), (True, False)),
    data_photos=4,
    data_sizes=(0,),
    data_overrides=("ray.cpus_per_worker=0.5", "log.every=1", "data.read_cpus=0.5"),
    data_warmup=1,
    data_steps=2,
    value_models=(("tiny", None, ()),),
    value_pretrain=("ray.workers=1", "data.batch_size=4"),
    value_budget=dict(
        pool=60,
        pretrain_steps=4,
        labels=(8,),
        seeds=(0,),
        steps=4,
        lrs=(6.4e-2,),
        val=8,
        test=8,
        heldout=4,
        control=16,
        control_steps=4,
        probe_iters=5,
        workers=2,
        ray_cpus=2,
        probe_threads=1,
    ),
)
PERSON_PHOTOS = ("bus", "zidane", "grace_hopper", "astronaut")  # kept by the lite profile


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def resized(sz: Sizes, settings: list[str]) -> Sizes:
    """``sz`` with ``FIELD=JSON`` or ``FIELD.KEY=JSON`` (a key of a dict field) settings applied, JSON lists as
    tuples: one run's choice of parts of a part (``pretrain_settings=[[true,false]]``, ``value_budget.steps=1000``)."""
    fields = {f.name for f in dataclasses.fields(Sizes)}
    for setting in settings:
        key, sep, text = setting.partition("=")
        name, _, sub = key.partition(".")
        if not sep or name not in fields or (sub and not isinstance(getattr(sz, name), dict)):
            raise ValueError(
                f"--size {setting!r}: expected FIELD=JSON or FIELD.KEY=JSON, FIELD one of {sorted(fields)}"
            )
        try:
            value = _as_tuples(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--size {setting!r}: the value is not JSON ({exc})") from None
        sz = dataclasses.replace(sz, **{name: {**getattr(sz, name), sub: value} if sub else value})
    return sz


# --- what a part writes ----------------------------------------------------------------------------------------------


class PartReport:
    """A part's results, rewritten to its JSON file at every change, so a part stopped mid-way still tells what it
    measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"status": "running"}
        self._lock = threading.Lock()
        self._write()

    def set(self, **values) -> None:
        with self._lock:
            self.data.update(values)
            self._write()

    def append(self, key: str, item: dict) -> None:
        with self._lock:
            self.data.setdefault(key, []).append(item)
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


@dataclass
class Deadline:
    at: float  # time.monotonic()

    def left(self) -> float:
        return self.at - time.monotonic()


class GpuSampler:
    """GPU utilisation (%) and memory in use (MiB), sampled in a thread from nvidia-smi (else torch's NVML
    query); no samples where neither is there."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s, self.samples = every_s, []  # (monotonic time, utilisation %, memory MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def query() -> tuple[float, float] | None:
        if shutil.which("nvidia-smi"):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.returncode == 0 and out.stdout.strip():
                util, mem = out.stdout.strip().splitlines()[0].split(",")
                return float(util), float(mem)
        import torch

        if torch.cuda.is_available():
            try:
                return float(torch.cuda.utilization()), float("nan")
            except Exception:  # noqa: BLE001 - pynvml missing: no utilisation figure
                return None
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = self.query()
            if sample is None:
                return
            self.samples.append((time.monotonic(), *sample))
            self._stop.wait(self.every_s)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def mean_between(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u, _ in self.samples if t0 <= t <= t1]
        return round(statistics.mean(inside), 1) if inside else None


# --- part 1: full-profile curation ----------------------------------------------------------------------------------


def web_sized_photos(names: tuple[str, ...] | None, long_sides: tuple[int, ...]) -> list[bytes]:
    """The package photos (or the named ones) as JPEGs at each long side (0: the shipped bytes)."""
    from PIL import Image

    from generators.sample_pool import load_photos

    photos = load_photos()
    out = []
    for name, photo in photos.items():
        if names is not None and name not in names:
            continue
        for side in long_sides:
            if not side:
                out.append(photo.data)
                continue
            img = photo.image.convert("RGB")
            s = side / max(img.size)
            buf = io.BytesIO()
            img.resize((round(img.width * s), round(img.height * s)), Image.Resampling.BICUBIC).save(
                buf, "JPEG", quality=90
            )
            out.append(buf.getvalue())
    return out


def write_parquet_pool(out: Path, images: list[bytes], n: int, rows_per_file: int = 128) -> None:
    """``n`` images cycled from ``images`` as a Parquet pool (the binary ``image`` column jobs.curate reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True)
    cycled = [images[i % len(images)] for i in range(n)]
    for k, start in enumerate(range(0, n, rows_per_file)):
        pq.write_table(
            pa.table({"image": pa.array(cycled[start : start + rows_per_file], pa.binary())}),
            out / f"pool-{k:05d}.parquet",
        )


def curation_config(store: list[str], sz: Sizes, batch: int):
    from bench_full_profile import FULL, OPEN_FILTERS

    from common.config import load_config
    from curation.config import CurateConfig

    def stage(name: str, actors: tuple[int, float, float]) -> list[str]:
        n, cpus, gpus = actors
        return [
            f"stages.{name}.batch_size={batch}",
            f"stages.{name}.actors=[{n},{n}]",
            f"stages.{name}.num_cpus={cpus}",
            f"stages.{name}.num_gpus={gpus}",
        ]

    overrides = [
        # Random detectors score every anchor alike, at their class prior (detector 1e-5 to 2e-4, pose 1e-3 to 1e-2):
        # candidates from any score on, the 300 highest into NMS (all 8400 a 640-px image has outlasted ultralytics'
        # NMS time limit on an H200, 3.6 s a batch of 32), a few detections kept per image as in real photos
        *store,
        *OPEN_FILTERS,
        "models.yolo.min_candidate_score=0.00001",
        "models.yolo.max_nms=300",
        "models.yolo.max_det=10",
        f"models.yolo.imgsz={sz.imgsz}",
        "stages.text_overlay.enabled=false",
        "input.format=parquet",
        f"input.files_per_shard={sz.receipt_rows}",
        *stage("yolo_person", sz.yolo_actors),
        *stage("clip", sz.clip_actors),
    ]
    if sz.ray_cpus:
        overrides.append(f"ray.num_cpus={sz.ray_cpus}")
    return load_config(CurateConfig, FULL, overrides)


def run_score_phase(cfg, pool: Path, out: Path, sampler: GpuSampler) -> dict:
    """Phase 1 of the curate job over the pool. The running rate is read over the middle half of the images (from
    the result that completes a quarter of them to the one that completes three quarters), where the pipeline is
    full and not yet draining; it is left out when those results came in a burst (under a quarter of the wall
    time: a pool too small to stream, as in the smoke mode)."""
    from curation.score.phase import ScorePhase
    from curation.score.pool import list_shards

    shards = list_shards(str(pool), cfg.input)
    phase = ScorePhase(cfg, str(out), str(pool))
    start, arrivals, rows, kept = time.monotonic(), [], 0, 0  # arrivals: (time, images done)
    for receipt in phase.build(shards).iter_rows():
        rows += receipt["rows"]
        kept += receipt["kept"]
        arrivals.append((time.monotonic(), rows))
    wall = arrivals[-1][0] - start
    t0, n0 = next(a for a in arrivals if a[1] >= rows / 4)
    t1, n1 = next(a for a in arrivals if a[1] >= 3 * rows / 4)
    steady = t1 - t0 >= wall / 4
    return {
        "images": rows,
        "kept": kept,
        "wall_s": round(wall, 2),
        "images_per_s_running": round((n1 - n0) / (t1 - t0), 1) if steady else None,
        "images_per_s_from_start": round(rows / wall, 1),
        "gpu_util_pct": sampler.mean_between(t0, t1) if steady else sampler.mean_between(start, start + wall),
        "gpu_mem_mib_max": max((m for _, _, m in sampler.samples), default=None),
    }


def time_split(cfg, images: list[bytes], batch: int) -> dict[str, float]:
    """Milliseconds per image of each piece of the two model stages' work on a batch, in this process."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    from PIL import Image
    from ultralytics.data.augment import LetterBox

    from common.imageio import decode
    from curation.stages.clip import ClipStage, clip_input
    from curation.stages.yolo import YoloPersonStage

    rows = []
    for i in range(batch):
        data = images[i % len(images)]
        with Image.open(io.BytesIO(data)) as im:
            rows.append({"image": {"bytes": data, "path": f"{i}.jpg"}, "width": im.width, "height": im.height})
    yolo, clip = YoloPersonStage(cfg), ClipStage(cfg)
    yolo.setup()
    clip.setup()
    m, repeats = cfg.models.yolo, 3

    def seconds(fn: Callable[[], object]) -> float:  # median of the repeats after a warm-up call
        return timed(fn, repeats, warmup=1)[0]

    pool = ThreadPoolExecutor(yolo.threads)  # as the stages decode: a thread pool of the stage's CPU share
    decoded = list(pool.map(lambda r: decode(r["image"]["bytes"], max_side=m.imgsz), rows))
    letterbox = LetterBox((m.imgsz, m.imgsz), auto=False, stride=32)
    yolo_host = torch.from_numpy(np.stack([letterbox(image=im) for im in decoded]))
    yolo_in = yolo_host.to(yolo.device).permute(0, 3, 1, 2).to(yolo.dtype).div_(255)

    def clip_decode() -> list:
        return list(
            pool.map(
                lambda r: clip_input(
                    r["image"]["bytes"], r["width"], r["height"], clip.size, clip.resize_mode, clip.interpolation
                ),
                rows,
            )
        )

    clip_host = torch.from_numpy(np.stack(clip_decode()))
    with torch.inference_mode():
        clip_in = ((clip_host.to(clip.device).permute(0, 3, 1, 2).float() - clip.mean) / clip.std).to(clip.dtype)
        emb = torch.nn.functional.normalize(clip.clip.model.encode_image(clip_in).float(), dim=-1)
        parts = {
            "yolo: decode (CPU threads)": seconds(
                lambda: list(pool.map(lambda r: decode(r["image"]["bytes"], max_side=m.imgsz), rows))
            ),
            "yolo: host-to-device copy": seconds(lambda: yolo_host.to(yolo.device)),
            **({"yolo: detector forward": seconds(lambda: yolo.det(yolo_in))} if yolo.det is not None else {}),
            "yolo: pose forward": seconds(lambda: yolo.pose(yolo_in)),
            "yolo: whole stage call": seconds(lambda: yolo.process_batch(rows)),
            "clip: decode + resize (CPU threads)": seconds(clip_decode),
            "clip: host-to-device copy": seconds(lambda: clip_host.to(clip.device)),
            "clip: image tower forward": seconds(lambda: clip.clip.model.encode_image(clip_in)),
            "clip: aesthetic head": seconds(lambda: clip.head(emb)),
            "clip: whole stage call": seconds(lambda: clip.process_batch(rows)),
        }
        if torch.cuda.is_available():  # what pinned host buffers would save on the copies
            for name, host, device in (("yolo", yolo_host, yolo.device), ("clip", clip_host, clip.device)):
                pinned = host.pin_memory()
                parts[f"{name}: host-to-device copy, pinned"] = seconds(
                    lambda pinned=pinned, device=device: pinned.to(device, non_blocking=True)
                )
    return {name: round(1000 * s / batch, 3) for name, s in parts.items()}


def rate(point: dict) -> float:
    return point["images_per_s_running"] or point["images_per_s_from_start"]


def part_curation(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from common.ray_utils import init_ray
    from generators.random_models import build_random_store

    with tempfile.TemporaryDirectory(prefix="gpu-check-curation-") as tmp:
        root = Path(tmp)
        images = web_sized_photos(None, sz.long_sides)
        write_parquet_pool(root / "pool", images, sz.images)
        store = build_random_store(root / "store", yolo=sz.yolo, clip_arch=sz.clip, clip_cfg=sz.clip_cfg)
        report.set(
            pool=f"{sz.images} images cycled from {len(images)} package photos at long sides {sz.long_sides}",
            models=f"{sz.yolo} + {sz.yolo}-pose at {sz.imgsz}, OpenCLIP {sz.clip} + aesthetic MLP (random init)",
            actors=f"yolo_person {sz.yolo_actors[0]} x ({sz.yolo_actors[1]} CPU, {sz.yolo_actors[2]} GPU), "
            f"clip {sz.clip_actors[0]} x ({sz.clip_actors[1]} CPU, {sz.clip_actors[2]} GPU)",
            gpus=torch.cuda.device_count(),
        )
        init_ray(None, sz.ray_cpus)
        best, per_point_s = None, 0.0
        for batch in sz.batches:
            if deadline.left() < per_point_s + _MARGIN_S:
                report.append("skipped", {"batch": batch, "why": f"{deadline.left():.0f} s left"})
                continue
            started = time.monotonic()
            with GpuSampler() as sampler:
                point = run_score_phase(
                    curation_config(store, sz, batch), root / "pool", root / f"out-{batch}", sampler
                )
            per_point_s = time.monotonic() - started
            report.append("sweep", {"batch": batch, **point})
            if best is None or rate(point) > rate(best):
                best = {"batch": batch, **point}
        if best is None:
            raise RuntimeError("no batch size of the sweep ran in the time there was")
        # the actor pools hold one GPU's worth of GPU shares, so the pipeline's rate is the rate per GPU
        report.set(best=best, images_per_s_per_gpu=rate(best))
        if deadline.left() > _MARGIN_S:
            batch = best["batch"]
            report.set(ms_per_image=time_split(curation_config(store, sz, batch), images, batch), split_batch=batch)


# --- part 2: pretraining step ----------------------------------------------------------------------------------------


def pretrain_config(sz: Sizes, context: dict, *extra: str):
    from common.config import load_config
    from pretrain.config import PretrainConfig

    peak = [f"log.peak_tflops={context['peak_tflops']}"] if context.get("peak_tflops") else []
    return load_config(PretrainConfig, REPO / sz.config, ["ray.workers=1", *sz.overrides, *peak, *extra])


def init_single_process_group():
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return device


def set_activation_checkpointing(model, on: bool) -> None:
    for module in model.modules():
        if hasattr(module, "activation_checkpointing"):
            module.activation_checkpointing = on


def measure_steps(cfg, model, device, warmup: int, steps: int, deadline: Deadline) -> dict:
    """Step time of the worker's step (``pretrain.train.Trainer.train_step``: the objective, the learning-rate and
    weight-decay schedules, clipping, AdamW, the EMA teacher) on random uint8 images, median of ``steps`` after
    ``warmup``; throughput, memory and MFU from it."""
    import torch

    from pretrain.train import Trainer, peak_flops, train_flops_per_image

    trainer = Trainer(model, cfg, device)  # one process: the global batch is its optim.grad_accum micro-batches
    images = torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8, device=device)
    micro_batches = [images] * cfg.optim.grad_accum
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(warmup + steps):
        if step > warmup and deadline.left() < _MARGIN_S:
            break  # enough for a figure; the next setting may not fit otherwise
        times.append(timed(lambda step=step: trainer.train_step(step, micro_batches))[0])
    timed_steps = times[warmup:] or times[-1:]
    step_s = statistics.median(timed_steps)
    flops_per_image, tokens_per_image = train_flops_per_image(cfg)
    images_per_s = trainer.global_batch / step_s
    peak = peak_flops(cfg, device)
    return {
        "step_s": round(step_s, 4),
        "first_step_s": round(times[0], 2),
        "timed_steps": len(timed_steps),
        "images_per_s": round(images_per_s, 2),
        "tokens_per_s": round(images_per_s * tokens_per_image),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "mfu": round(images_per_s * flops_per_image / peak, 4) if peak else None,
    }


def part_pretrain(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from pretrain.train import PEAK_TFLOPS, build_model, peak_flops, train_flops_per_image

    device = init_single_process_group()
    cfg = pretrain_config(sz, context)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_flops(cfg, device)
    flops_per_image, tokens_per_image = train_flops_per_image(cfg)
    report.set(
        device=name,
        size=cfg.model.size,
        image=list(cfg.image_size),
        batch=cfg.data.batch_size,
        precision=cfg.precision if device.type == "cuda" else "fp32 (CPU)",
        train_tflop_per_image=round(flops_per_image / 1e12, 4),
        tokens_per_image=tokens_per_image,
        peak_tflops=peak / 1e12 if peak else None,
        peak_source=("--peak-tflops" if cfg.log.peak_tflops else f"pretrain.train.PEAK_TFLOPS for {name!r}")
        if peak
        else f"none for {name!r} (known: {sorted(PEAK_TFLOPS)}; pass --peak-tflops): no MFU",
    )
    model, built = None, None
    for compiled, checkpointing in sz.pretrain_settings:
        setting = {"compile": compiled, "activation_checkpointing": checkpointing}
        if compiled and not sz.compile:
            report.append("skipped", {**setting, "why": "--cpu-smoke: inductor's CPU code generation takes minutes"})
            continue
        if deadline.left() < _MARGIN_S:
            report.append("skipped", {**setting, "why": f"{deadline.left():.0f} s left"})
            continue
        if built != compiled:
            model = None  # the eager model's memory goes before the compiled one is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            cfg = pretrain_config(sz, context, f"model.compile={str(compiled).lower()}")
            model, built = build_model(cfg, device), compiled
        set_activation_checkpointing(model, checkpointing)
        try:
            result = measure_steps(cfg, model, device, sz.warmup, sz.steps, deadline)
        except Exception as exc:  # noqa: BLE001 - out of memory, a compiler error: that setting's row says so
            first_line = (str(exc).splitlines() or [""])[0][:300]
            report.append("runs", {**setting, "error": f"{type(exc).__name__}: {first_line}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        report.append("runs", {**setting, **result})
    runs = [r for r in report.data.get("runs", []) if "step_s" in r]
    if not runs:
        raise RuntimeError("no setting completed a timed step")
    best = min(runs, key=lambda r: r["step_s"])
    report.set(best=best)


# --- part 3: data wait ------------------------------------------------------------------------------------------------


def curate_for_training(root: Path, sz: Sizes) -> Path:
    """Curated shards the way the README makes them: the lite profile's curate job over a folder pool of person
    photos at web sizes (pHash / embedding dedup off: the resized copies are the pool)."""
    from jobs import curate

    pool = root / "pool"
    pool.mkdir()
    for i, data in enumerate(web_sized_photos(PERSON_PHOTOS[: sz.data_photos], sz.data_sizes)):
        (pool / f"{i:05d}.jpg").write_bytes(data)
    out = root / "curated"
    args = [
        "--config",
        str(REPO / "configs/curate/lite.yaml"),
        "--input",
        str(pool),
        "--output",
        str(out),
        "dedup.signals=[]",
        "stages.text_overlay.enabled=false",
    ]
    if sz.ray_cpus:
        args.append(f"ray.num_cpus={sz.ray_cpus}")
    if curate.main(args) != 0:
        raise RuntimeError("the curate job failed (its log says why)")
    return out / "shards"


def part_data_wait(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from common.ray_utils import init_ray
    from pretrain import data
    from pretrain.train import fit
    from training.metrics import read_metrics
    from training.runner import run_uri_for

    setting = context.get("setting") or {"compile": False, "activation_checkpointing": True}
    steps = sz.data_warmup + sz.data_steps
    gpu = torch.cuda.is_available()
    cfg = pretrain_config(
        sz,
        context,
        f"steps={steps}",
        f"checkpoint.every={steps}",
        "checkpoint.on_preemption=false",
        f"ray.use_gpu={str(gpu).lower()}",
        f"model.compile={str(setting['compile']).lower()}",
        f"model.activation_checkpointing={str(setting['activation_checkpointing']).lower()}",
        *sz.data_overrides,
        *([f"ray.num_cpus={sz.ray_cpus}"] if sz.ray_cpus else []),
    )
    root = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    try:
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        shards = curate_for_training(root, sz)
        run_uri = run_uri_for(str(root / "runs"), "gpu-check")
        Path(run_uri).mkdir(parents=True)
        index = data.ensure_index(str(shards), run_uri)
        report.set(
            setting=setting,
            shards_images=index.num_samples,
            batch=cfg.data.batch_size,
            image=list(cfg.image_size),
            warmup_steps=sz.data_warmup,
        )

        def measured() -> bool:
            try:
                records = [r for r in read_metrics(run_uri) if r["step"] > sz.data_warmup]
            except (OSError, ValueError):
                return False
            if not records or records[-1]["step"] < steps:
                return False
            frac = [r["data_wait_frac"] for r in records]
            report.set(
                data_wait_frac_mean=round(statistics.mean(frac), 4),
                data_wait_frac_max=round(max(frac), 4),
                step_s=round(statistics.median(r["step_s"] for r in records), 4),
                images_per_s=round(statistics.median(r["images_per_s"] for r in records), 2),
                mfu=round(statistics.median(r["mfu"] for r in records), 4)
                if all("mfu" in r for r in records)
                else None,
                windows=len(records),
            )
            return True

        def watch() -> None:
            # The run's last metrics line is the measurement: its final checkpoint (GBs for 0.4B) is not waited for.
            while not measured():
                time.sleep(0.5)
            report.set(status="ok")
            shutil.rmtree(root, ignore_errors=True)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
        fit(cfg, str(root / "runs"), "gpu-check")
        if not measured():
            raise RuntimeError("the training run ended without metrics past its warm-up")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- part 4: the value of pretraining ---------------------------------------------------------------------------------


def pretrain_in_memory(cfg, shards: Path, device, deadline: Deadline, record: Callable[[dict], None]):
    """The worker's step (``pretrain.train.Trainer.train_step``: the objective, the learning-rate and weight-decay
    schedules, clipping, AdamW and EMA teacher; bf16 autocast where the config's precision says so) in this process,
    on the curated pool decoded once (``pretrain.data.load_images``) and held in device memory as uint8: no Ray, no
    data wait. The global batch is drawn in epochs of a seeded shuffle and split into ``optim.grad_accum``
    micro-batches. Returns the trained objective; ``record`` gets a line of loss terms (means over the window) 20
    times a run, then the run's speed."""
    import torch

    from pretrain import data
    from pretrain.backbone import build
    from pretrain.objective import TERMS, JointObjective
    from pretrain.train import Trainer, peak_flops, train_flops_per_image

    started = time.monotonic()
    pool = data.load_images(str(shards), cfg.image_size).to(device)
    synchronize()
    decode_s = time.monotonic() - started
    torch.manual_seed(cfg.seed)
    model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps).to(device)
    trainer = Trainer(model, cfg, device)
    batch, order = trainer.global_batch, torch.Generator(device=device).manual_seed(cfg.seed)
    perm, cursor = torch.randperm(len(pool), generator=order, device=device), 0
    every, window = max(1, cfg.steps // 20), []
    warm, warm_at = min(10, cfg.steps - 1), time.monotonic()  # speed from the step after the warm-up ones
    for step in range(cfg.steps):
        if deadline.left() < _MARGIN_S:
            raise TimeoutError(f"out of time at pretraining step {step} of {cfg.steps}")
        if step == warm:
            synchronize()
            warm_at = time.monotonic()
        rows, need = [], batch
        while need:
            if cursor == len(perm):
                perm, cursor = torch.randperm(len(pool), generator=order, device=device), 0
            take = min(need, len(perm) - cursor)
            rows.append(perm[cursor : cursor + take])
            cursor, need = cursor + take, need - take
        terms, update = trainer.train_step(step, pool[torch.cat(rows)].chunk(cfg.optim.grad_accum))
        window.append(terms)
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            means = torch.stack(window).mean(0).tolist()  # the one read-back of the window
            record({"step": step + 1, **{k: round(v, 4) for k, v in zip(TERMS, means)}, "lr": update["lr"]})
            window = []
    synchronize()
    step_s = (time.monotonic() - warm_at) / (cfg.steps - warm)
    flops, _ = train_flops_per_image(cfg)
    peak = peak_flops(cfg, device)
    record(
        {
            "pool_images": len(pool),
            "decode_s": round(decode_s, 2),
            "step_s": round(step_s, 4),
            "images_per_s": round(batch / step_s, 1),
            "mfu": round(batch / step_s * flops / peak, 4) if peak else None,
            "seconds": round(time.monotonic() - started, 1),
        }
    )
    return model


def value_cells(results: dict) -> list[dict]:
    """Per measure and pretrained init: the means and spreads over seeds against random's, and whether the gain
    exceeds the seed spread (``pretrain_value.beats``; None with one seed)."""
    import pretrain_value as pv

    cells = []
    for name, row in results["measures"].items():
        random = [x for x in row[pv.RANDOM] if x is not None]
        for init in results["inits"]:
            if init == pv.RANDOM:
                continue
            values = [x for x in row[init] if x is not None]
            cells.append(
                {
                    "measure": name,
                    "init": init,
                    "random": pv.mean_std(random),
                    "pretrained": pv.mean_std(values),
                    "ahead": bool(values and random and statistics.fmean(values) > statistics.fmean(random)),
                    "beyond_spread": pv.beats(values, random),
                }
            )
    return cells


def part_value(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    """benchmarks/pretrain_value.py's chain (``run_chain``) per model size, pretraining in this process on the GPU
    (``pretrain_in_memory``); renders and curation are made once and shared by the sizes. Each size's table is
    reported when its chain ends; the one running reports its steps as they finish."""
    import pretrain_value as pv
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    root = Path(tempfile.mkdtemp(prefix="gpu-check-value-"))
    data = Path(context["value_data"]) if context.get("value_data") else root / "data"
    peak = [f"log.peak_tflops={context['peak_tflops']}"] if context.get("peak_tflops") else []  # for the MFU
    report.set(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        budget=sz.value_budget,
        pretrain_overrides=[*sz.value_pretrain, *peak],
    )
    try:
        for size, patch, overrides in sz.value_models:
            if deadline.left() < _MARGIN_S:
                report.append("skipped", {"size": size, "why": f"{deadline.left():.0f} s left"})
                continue
            started = time.monotonic()
            current: dict = {
                "size": size,
                "patch_size": patch,
                "running": "start",
                "steps_s": {},
                "pretraining_steps": [],
            }
            report.set(current=current)

            def log(line: str, current: dict = current) -> None:
                # the chain's "=== <step>" as a step starts and "=== <step>: <seconds> s" as it ends
                print(line, flush=True)
                text = line.strip()
                if not text.startswith("=== "):
                    return
                title, sep, took = text[4:].rpartition(": ")
                if sep and took.endswith(" s") and took[:-2].isdigit():
                    current["steps_s"][title] = int(took[:-2])
                    current.pop("running", None)
                else:
                    current["running"] = text[4:]
                report.set(current=current)

            def record(line: dict, current: dict = current) -> None:
                if "step" in line:
                    current["pretraining_steps"].append(line)
                else:
                    current.setdefault("pretrain_run", {})[line["set"]] = line
                report.set(current=current)

            def pretrainer(cfg, shards: Path, record: Callable[[dict], None] = record):
                # the set (curated, raw) is the folder the chain made its shards in
                return pretrain_in_memory(
                    cfg, shards, device, deadline, lambda row: record({"set": shards.parent.name, **row})
                )

            budget = pv.Budget(
                **sz.value_budget,
                size=size,
                patch_size=patch,
                pretrain_overrides=(*sz.value_pretrain, *peak, *overrides),
            )
            cfg = pv.Chain(root / size, budget).pretrain_config()
            results = pv.run_chain(root / size, budget, log, data=data, pretrainer=pretrainer)
            lines = pv.report(results)
            for line in lines:
                print(line, flush=True)
            cells = value_cells(results)
            verdicts = [
                c["beyond_spread"]
                for c in cells
                if c["measure"].startswith("fine-tune") and c["init"] not in (pv.SUPERVISED, f"{pv.RANDOM}-ls1")
            ]
            report.append(
                "models",
                {
                    **current,
                    "patch_size": cfg.model.backbone().patch_size,
                    "pool": budget.pool,
                    "pretraining": results["pretraining"],
                    "pretrain_steps": results["pretrain_steps"],
                    "global_batch": cfg.samples_per_step(),
                    "cells": cells,
                    "verdicts": [line.removeprefix("verdict: ") for line in lines if line.startswith("verdict: ")],
                    # every fine-tuning cell of a pretrained init beyond the seed spread (None: one seed)
                    "goal_met": None if None in verdicts else all(verdicts),
                    "seconds": round(time.monotonic() - started, 1),
                },
            )
            report.set(current=None)
        if not report.data.get("models"):
            raise RuntimeError("no model size finished its chain in the time there was")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def prepare_value_data(folder: Path, sz: Sizes) -> int:
    """Part value's model-free steps for ``sz``'s budget, on this machine's CPUs (the lite profile's own actor
    counts and all cores: the data do not depend on them)."""
    import pretrain_value as pv

    budget = pv.Budget(**{**sz.value_budget, "workers": os.cpu_count() or 1, "ray_cpus": None, "curate_overrides": ()})
    pv.Chain(folder, budget, data=folder).prepare_data()
    print(f"written: {folder} (pass it as --value-data)")
    return 0


PART_FNS = {"curation": part_curation, "pretrain": part_pretrain, "data_wait": part_data_wait, "value": part_value}


def run_child(args: argparse.Namespace, sz: Sizes) -> int:
    """One part, in this process, at sizes ``sz``: its results go to ``args.result``."""
    report = PartReport(Path(args.result))
    deadline = Deadline(time.monotonic() + args.budget_s - _MARGIN_S)
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


def setting_name(s: dict) -> str:
    return f"compile {'on' if s['compile'] else 'off'}, act. ckpt {'on' if s['activation_checkpointing'] else 'off'}"


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def table_rows(parts: dict) -> list[tuple[str, str, str]]:
    """(part, measurement, value) rows of the printed table."""
    rows = []
    for part, r in parts.items():
        if r["status"] != "ok":
            rows.append((part, "ERROR", r.get("error", "")))
        if part == "curation":
            for p in r.get("sweep", []):
                rows.append(
                    (
                        part,
                        f"batch {p['batch']}: images/s running | from start | GPU util %",
                        f"{p['images_per_s_running']} | {p['images_per_s_from_start']} | {p['gpu_util_pct']}",
                    )
                )
            if r.get("images_per_s_per_gpu") is not None:
                how = "running" if r["best"]["images_per_s_running"] else "from the start"
                rows.append(
                    (part, f"images/s per GPU (batch {r['best']['batch']}, {how})", str(r["images_per_s_per_gpu"]))
                )
            for name, ms in r.get("ms_per_image", {}).items():
                rows.append((part, f"ms/image, {name}", f"{ms:.3f}"))
        elif part == "pretrain":
            if r.get("device"):
                peak = (
                    f"{r['peak_tflops']:g} TFLOPS ({r['peak_source']})"
                    if r.get("peak_tflops")
                    else r.get("peak_source")
                )
                rows.append(
                    (
                        part,
                        f"{r.get('size')} at {r.get('image')}, batch {r.get('batch')}, {r.get('device')}",
                        f"peak {peak}",
                    )
                )
            for run in r.get("runs", []):
                name = setting_name(run)
                value = run.get("error") or (
                    f"step {run['step_s']:.3f} s, {run['images_per_s']} img/s, {run['tokens_per_s']:,} tok/s, "
                    f"peak mem {run['peak_mem_gib'] or 'n/a'} GiB, MFU {percent(run['mfu'])}"
                )
                rows.append((part, name, value))
        elif part == "data_wait" and "data_wait_frac_mean" in r:
            rows.append(
                (
                    part,
                    f"{setting_name(r['setting'])}, {r['shards_images']} curated images",
                    f"data wait {r['data_wait_frac_mean']:.2%} of the step (max {r['data_wait_frac_max']:.2%}), "
                    f"step {r['step_s']:.3f} s, MFU {percent(r['mfu'])}",
                )
            )
        elif part == "value":
            rows += value_rows(r)
        rows.append((part, "seconds (budget)", f"{r['seconds']} ({r['budget_s']})"))
    return rows


def value_rows(r: dict) -> list[tuple[str, str, str]]:
    """Per model size: what was trained, then pretrained vs random per measure (mean ± std over seeds, and whether the
    gain exceeds the seed spread), then the goal; for a size cut off mid-chain, the steps it finished."""
    rows = []
    verdict = {True: "yes", False: "no", None: "n/a"}
    for m in r.get("models", []):
        name = f"{m['size']} (patch {m['patch_size']})"
        rows.append(
            (
                "value",
                f"{name}: {m['pool']} renders, {m['pretrain_steps']} steps x {m['global_batch']} on each set",
                f"chain {m['seconds']} s",
            )
        )
        for source, p in m["pretraining"].items():
            run = m.get("pretrain_run", {}).get(source, {})
            rows.append(
                (
                    "value",
                    f"{m['size']}: pretrained on {source}, {p['images']} images ({p['epochs']:.1f} epochs)",
                    f"held-out MAE {p['heldout_mae']['initial']:.4f} at init -> {p['heldout_mae']['pretrained']:.4f}; "
                    f"{run.get('step_s', 'n/a')} s/step, {run.get('images_per_s', 'n/a')} img/s, MFU "
                    f"{percent(run.get('mfu'))}",
                )
            )
        for c in m["cells"]:
            rows.append(
                (
                    "value",
                    f"{m['size']}: {c['measure']}",
                    f"random {c['random']} | {c['init']} {c['pretrained']} | gain > seed spread "
                    f"{verdict[c['beyond_spread']]}",
                )
            )
        beyond = sum(1 for c in m["cells"] if c["beyond_spread"])
        rows.append(
            (
                "value",
                f"{m['size']}: pretrained beyond the seed spread on every fine-tuning cell",
                f"{verdict[m['goal_met']]} ({beyond} of {len(m['cells'])} cells of any init; ahead on "
                f"{sum(1 for c in m['cells'] if c['ahead'])})",
            )
        )
        rows += [("value", f"{m['size']}: verdict", v) for v in m.get("verdicts", [])]
    if r.get("current"):
        c = r["current"]
        done = "; ".join(f"{title} {secs} s" for title, secs in c["steps_s"].items())
        rows.append(("value", f"{c['size']}: unfinished (at: {c.get('running', 'n/a')})", done or "no step done"))
    for s in r.get("skipped", []):
        rows.append(("value", f"{s['size']}: skipped", s["why"]))
    return rows


def print_table(results: dict) -> None:
    rows = table_rows(results["parts"])
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    print(f"\n{results['device']} | torch {results['torch']} | {results['mode']}")
    print(f"{'part':<{widths[0]}}  {'measurement':<{widths[1]}}  value")
    for part, what, value in rows:
        print(f"{part:<{widths[0]}}  {what:<{widths[1]}}  {value}")
    print("goals: " + "; ".join(f"{p}: {g}" for p, g in GOALS.items()))


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
            ap.error(f"--fail {f!r}: expected PART=raise or PART=hang, PART one of {PARTS}")
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
            context["setting"] = {k: r["best"][k] for k in ("compile", "activation_checkpointing")}
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
