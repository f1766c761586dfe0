"""Step time of pretraining while a checkpoint is written: an async save (``checkpoint.async_save``) vs a blocking
one vs no save, and the fingerprint's cost per save, side by side in one invocation.

    python benchmarks/bench_checkpoint.py --data out/curated/shards [--size 0.4b] [--workers 2] [--steps 24]
        [--every 8]

Two runs of ``pretrain.train.fit`` on the same config and data, one with blocking saves, one with async saves, each
``--steps`` steps with a checkpoint every ``--every`` (the last one at the end is not timed). The model is the
``--size`` of ``configs/pretrain/sapiens2_0.4b.yaml`` (the checkpoint: its parameters, teacher, decoder and Adam
moments, several GB at 0.4B); views, batch and compilation are cut to what a CPU steps through in seconds, which
leaves the checkpoint's size as it is. Per run, from its own metrics (``log.every=1``):

- no save: the steps with no save in flight (the first step and the one after each blocking save excluded);
- blocking: the step that carries the save (its ``step_s`` holds the whole write and the fingerprint);
- async: the steps from the save's start to the one after its commit (the ``checkpoint`` record's ``at_step``),
  with the time the save held the step path (``stage_s``: the copy into host memory) and what ran beside it
  (``write_s``, ``summary_s``: the fingerprint, on the staged copy).

The fingerprint's cost per save is the ``summary_s`` of both runs (on the step path for a blocking save).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from common.ray_utils import init_ray
from pretrain import data
from pretrain.config import PretrainConfig
from pretrain.train import fit
from training.checkpoint import list_checkpoints
from training.metrics import read_metrics
from training.runner import run_uri_for

CONFIG = Path(__file__).resolve().parents[1] / "configs/pretrain/sapiens2_0.4b.yaml"
CPU = [  # what a CPU steps through; the model (and so the checkpoint) stays the config's
    "precision=fp32",
    "model.compile=false",
    "model.activation_checkpointing=off",
    "objective.views.global_size=[64,48]",
    "objective.views.local_size=[32,32]",
    "objective.views.n_local=2",
    "data.batch_size=1",
    "data.read_segments=1",
    "data.read_cpus=0.5",
    "data.prefetch_batches=2",
    "optim.warmup_steps=1",
    "checkpoint.keep=1",
    "checkpoint.on_preemption=false",
    "log.every=1",
    "log.backends=[]",
    "ray.num_cpus=2",
    "ray.use_gpu=false",
    "ray.cpus_per_worker=0.5",
    "ray.torch_threads=1",
    "ray.max_failures=0",
]


def run(cfg: PretrainConfig, shards: str) -> tuple[list[dict], list[dict], int]:
    """(train records, checkpoint records, bytes of the last checkpoint) of one run in a temporary folder."""
    with tempfile.TemporaryDirectory(dir=Path(shards).parent) as root:
        run_uri = run_uri_for(root, "bench")
        Path(run_uri).mkdir(parents=True)
        data.ensure_index(shards, run_uri)
        fit(cfg, root, "bench")
        size = sum(p.stat().st_size for p in Path(list_checkpoints(run_uri)[-1][1]).rglob("*") if p.is_file())
        return read_metrics(run_uri), read_metrics(run_uri, "checkpoint"), size


def save_step_times(train: list[dict], saves: list[dict], steps: int) -> tuple[list[float], list[float]]:
    """(step times while a save held the step or was written, step times with none) of one run's metrics records
    (``log.every=1``). A save started after step s is committed after step ``at_step`` (s itself when blocking) and
    both land in the windows that follow: steps s + 1 .. at_step + 1. The first step and the save at the end are left
    out."""
    step_s = {r["step"]: r["step_s"] for r in train}
    during: set[int] = set()
    for save in saves:
        if save["step"] < steps:
            during.update(range(save["step"] + 1, save["at_step"] + 2))
    with_save = [step_s[s] for s in sorted(during) if s in step_s]
    return with_save, [t for s, t in step_s.items() if s > 1 and s not in during]


def ms(times: list[float]) -> str:
    if not times:
        return "n/a"
    return (
        f"median {statistics.median(times) * 1000:.0f} ms, mean {statistics.mean(times) * 1000:.0f} ms ({len(times)})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="out/curated/shards", help="curated shards (the curate job's <out>/shards)")
    p.add_argument("--size", default="0.4b", help="model.size")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    p.add_argument("--steps", type=int, default=24, help="steps per run")
    p.add_argument("--every", type=int, default=8, help="steps between checkpoints")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    args = p.parse_args(argv)

    base = [*CPU, f"model.size={args.size}", f"steps={args.steps}", f"checkpoint.every={args.every}"]
    base += [f"ray.workers={args.workers}", *args.overrides]
    init_ray(None, 2)
    timed: dict[str, list[float]] = {"no save": []}
    fingerprint: dict[str, list[float]] = {}
    for mode in ("blocking", "async"):
        cfg = load_config(PretrainConfig, CONFIG, [*base, f"checkpoint.async_save={mode == 'async'}"])
        train, saves, size = run(cfg, args.data)
        timed[mode], without = save_step_times(train, saves, args.steps)
        timed["no save"] += without
        fingerprint[mode] = [r["summary_s"] for r in saves]
        print(f"{mode}: checkpoint {size / 1e9:.2f} GB over {args.workers} workers; per save (rank 0): " + "; ".join(
            f"step {r['step']}: " + ", ".join(f"{k} {r[k]:.2f}" for k in ("stage_s", "write_s", "summary_s") if k in r)
            + (f", committed at step {r['at_step']}" if mode == "async" else "")
            for r in saves
        ))  # fmt: skip
    print(f"model {args.size}, {args.workers} CPU workers, {args.steps} steps, a checkpoint every {args.every}")
    print(f"step time, no save in flight: {ms(timed['no save'])}")
    print(f"step time carrying a blocking save: {ms(timed['blocking'])}")
    print(f"step time while an async save is written: {ms(timed['async'])}")
    for mode, times in fingerprint.items():
        print(f"fingerprint per save ({mode}): {ms(times)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
