"""The sizes the GPU check runs at: ``GPU`` on one GPU, ``SMOKE`` for ``--cpu-smoke``, and ``--size`` changes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


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
    # The step's settings, swept one axis at a time in this order (``pretrain_step.sweep``): each axis's values are
    # measured with the best value (most images/s) of every axis before it and the first value of every axis after
    # it; a setting measured once is not measured again. Eager first: a figure even if compiling outlasts the budget.
    # Batch sizes ascending: the axis ends at the first that runs out of memory.
    pretrain_sweep: dict
    # steps profiled (benchmarks/gpu/step_profile.py) after the timed ones, on the first setting of each built model
    # (eager, then compiled); 0: none
    profile_steps: int
    # data wait
    data_photos: int  # person photos in the pool curated for it (times len(data_sizes))
    data_sizes: tuple[int, ...]
    data_overrides: tuple[str, ...]
    data_warmup: int
    data_steps: int
    # decode paths (config overrides) measured in order, the next only while the wait is over the threshold
    data_paths: tuple[tuple[str, ...], ...]
    data_wait_retry_above: float
    # steps after the timed ones, while an async checkpoint (checkpoint.async_save) of the last timed one is written
    save_steps: int
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
    pretrain_sweep=dict(
        compile=(False, True),
        activation_checkpointing=("full", "selective", "off"),
        reshard_after_forward=("always", "never", "default"),
        prefetch=(1, 2),
        batch=(16, 24, 32),
    ),
    profile_steps=1,  # a GPU step varies little; its events (~200,000 at 0.4B) take tens of seconds to read
    data_photos=4,
    data_sizes=(1280, 1408, 1536, 1664, 1792, 1920, 2048, 2176),
    data_overrides=("ray.cpus_per_worker=4", "log.every=5"),
    data_warmup=5,
    data_steps=15,
    # the 0.4B config's path (read tasks of 8 segments, 4 batches prefetched), then one with 4x the read tasks in
    # flight and twice the prefetch depth
    data_paths=((), ("data.read_segments=2", "data.prefetch_batches=8")),
    data_wait_retry_above=0.03,
    save_steps=10,
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
    pretrain_sweep=dict(
        compile=(False, True),
        activation_checkpointing=("full", "selective", "off"),
        reshard_after_forward=("always", "never", "default"),
        prefetch=(1, 2),
        batch=(2, 4),
    ),
    profile_steps=2,
    data_photos=4,
    data_sizes=(0,),
    data_overrides=("ray.cpus_per_worker=0.5", "log.every=1", "data.read_cpus=0.5"),
    data_warmup=1,
    data_steps=2,
    data_paths=((), ("data.read_segments=1", "data.prefetch_batches=4")),
    data_wait_retry_above=0.0,  # both paths run: the second one's code is checked too
    save_steps=2,
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


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


def resized(sz: Sizes, settings: list[str]) -> Sizes:
    """``sz`` with ``FIELD=JSON`` or ``FIELD.KEY=JSON`` (a key of a dict field) settings applied, JSON lists as
    tuples: one run's choice of parts of a part (``pretrain_sweep.batch=[16]``, ``value_budget.steps=1000``)."""
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
