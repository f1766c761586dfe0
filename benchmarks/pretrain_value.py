"""Does pretraining on curated shards give a better backbone? Pretrained vs random init, read out early and late.

    python benchmarks/pretrain_value.py --quick            # <= 15 min on 2 CPUs: 1 seed, 2 learning rates
    python benchmarks/pretrain_value.py                    # the full experiment (about 3 hours on 2 quiet CPUs)
    python benchmarks/pretrain_value.py --work out/pv --pool 4000 --pretrain-epochs 20 --seeds 0,1,2 --both-exports

The full preset pretrains on a pool of 3000 renders (about 1200 curated) for 10 epochs of the curated set (about
3000 steps at the tiny config's global batch of 4: ~25 minutes on 2 CPUs); the quick one on 300 renders for 150
steps. ``--pretrain-steps`` and ``--pretrain-epochs`` set the budget either way.

The real chain, every step a job a user runs (``run_chain``; a GPU script calls it with a larger ``Budget``):

1. ``jobs.make_synthetic --unlabelled``: an unlabelled pool of JPEG renders at 512x384, and a held-out pool of
   other figures (another seed) that pretraining never sees.
2. ``jobs.curate`` with the lite profile: the person, quality, dedup and sampling filters keep what they keep.
3. ``jobs.pretrain`` with ``configs/pretrain/tiny.yaml`` for ``--pretrain-steps``, or ``--pretrain-epochs`` passes
   over the curated set; exports the student (``--both-exports``: also the EMA teacher). A caller of ``run_chain``
   may pretrain in its own process instead (``pretrainer``: benchmarks/gpu_check.py trains on the GPU with the pool
   in GPU memory); the same files are exported from the objective it returns.
4. Held-out MAE (``pretrain.evaluate``): the objective's MAE term on the held-out renders, for the last checkpoint's
   student + decoder and for the run's initial weights, on the same views and masks.
5. ``jobs.make_synthetic``: labelled renders at 128x96 that the pools never hold, with ``val`` and ``test`` splits;
   the ``--labels`` sets are prefixes of one another and share both.
6. ``jobs.probe`` (frozen features, ``finetune.frozen_eval``) of every init, in colour and in grayscale, at every
   label count, scored on ``test``: the best layer's linear-probe mIoU, k-NN mIoU and left / right accuracy. The
   random init is drawn per seed (the fine-tuning runs' random inits); the seed also draws the probes' hold-out.
7. ``jobs.finetune`` for every init x label count x seed x learning rate of ``--lrs``, scored on ``val``; per init
   and label count the rate with the best mean validation mIoU is taken and its runs are scored on ``test``
   (``finetune.train.evaluate_finetuned``). Same seed = same head, data order and augmentation draws for all inits.

Prints one table (rows: measures; columns: random / student [/ teacher] as mean +- std over seeds, and whether the
gain over random exceeds the seed spread), then one last line ``summary: ...``. Every step reuses what an earlier
run left under ``--work`` (jobs resume), so a rerun only does what is missing; a ``--work`` whose runs used other
settings is refused. Everything measured is also in ``<work>/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import load_config  # noqa: E402
from common.ray_utils import init_ray  # noqa: E402
from finetune.config import FinetuneConfig  # noqa: E402
from finetune.frozen_eval import ProbeSettings  # noqa: E402
from finetune.train import FINETUNED_FILE, METRICS_FILE, evaluate_finetuned  # noqa: E402
from jobs import curate, make_synthetic, probe  # noqa: E402
from jobs import finetune as finetune_job  # noqa: E402
from jobs import pretrain as pretrain_job  # noqa: E402
from pretrain.config import PretrainConfig  # noqa: E402
from pretrain.data import decode_crop  # noqa: E402
from pretrain.evaluate import heldout_mae, initial_objective, load_objective  # noqa: E402
from pretrain.export import EXPORT_FILES, export_backbone, export_objective  # noqa: E402
from pretrain.objective import JointObjective  # noqa: E402
from training.checkpoint import latest_committed, read_safetensors, step_of  # noqa: E402

POOL_SHARD = 50  # renders per pool tar shard: one shard is one unit of curation work and of its resume
RANDOM = "random"
COLOURS = {"colour": False, "grayscale": True}
# (row label, key of a probe result's label-count entry, score inside it)
PROBE_MEASURES = (
    ("probe mIoU (tokens, best layer)", "probe_best", "miou"),
    ("k-NN mIoU (tokens, best layer)", "knn_best", "miou"),
    ("left/right bal. acc", "left_right_best", "balanced_acc"),
)
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(pool=300, pretrain_steps=150, pretrain_epochs=None, labels="16,64", seeds="0", steps=80,
                  lrs="6.4e-2,1.28e-1", val=32, test=64, heldout=32),
    # 3000 renders -> about 1200 curated; 10 epochs of them = about 3000 steps at global batch 4, ~25 min here
    "full": dict(pool=3000, pretrain_steps=None, pretrain_epochs=10.0, labels="16,64", seeds="0,1,2", steps=500,
                 lrs="3.2e-2,6.4e-2,1.28e-1", val=64, test=128, heldout=128),
}  # fmt: skip
# Pretraining in this process instead of jobs.pretrain: (the run's config, its steps set; the curated shards) -> the
# trained objective. The chain exports its backbones and reads its held-out MAE as it would a job's last checkpoint.
Pretrainer = Callable[[PretrainConfig, Path], JointObjective]


@dataclass
class Budget:
    """Everything the chain's cost and outcome depend on."""

    pool: int  # unlabelled renders before curation
    pretrain_steps: int | None  # optimiser steps; None: from pretrain_epochs
    pretrain_epochs: float | None  # passes over the curated set (steps = epochs x curated / global batch)
    labels: tuple[int, ...]  # labelled training set sizes (prefixes of one another)
    seeds: tuple[int, ...]
    steps: int  # fine-tuning steps of every run
    lrs: tuple[float, ...]  # fine-tuning optim.lr grid (the base rate per 256 images)
    val: int  # validation renders: choose the fine-tuning learning rate
    test: int  # test renders: every reported probe and fine-tuning score
    heldout: int  # held-out unlabelled renders for the MAE term
    exports: tuple[str, ...] = ("student",)  # pretrained backbones compared with random init
    size: str | None = None  # model.size of both configs (None: the configs')
    patch_size: int | None = None  # model.patch_size of both configs (None: the configs')
    pretrain_config: str = str(REPO / "configs/pretrain/tiny.yaml")
    pretrain_overrides: tuple[str, ...] = ()
    finetune_config: str = str(REPO / "configs/finetune/tiny.yaml")
    finetune_overrides: tuple[str, ...] = ()
    curate_overrides: tuple[str, ...] = ()  # of the lite profile (e.g. more actors on a larger machine)
    colours: tuple[str, ...] = tuple(COLOURS)  # probe inputs, keys of COLOURS
    image_size: tuple[int, int] = (128, 96)  # labelled renders (H, W)
    pool_size: tuple[int, int] = (512, 384)  # unlabelled renders (H, W): curation's person stage wants large people
    workers: int = 2  # rendering processes
    ray_cpus: int | None = 2  # CPUs of the local Ray (None: all)
    probe_threads: int | None = 1  # torch threads of the in-process probes (1: no oversubscription of shared CPUs)
    probe_iters: int = ProbeSettings.iters  # L-BFGS iterations per probe fit
    max_yaw: float = 1.2  # the pools' views; the labelled renders come from any direction

    def model_overrides(self) -> list[str]:
        return ([f"model.size={self.size}"] if self.size else []) + (
            [f"model.patch_size={self.patch_size}"] if self.patch_size else []
        )


@dataclass
class Chain:
    work: Path
    budget: Budget
    log: Callable[[str], None] = print
    timings: dict[str, float] = field(default_factory=dict)
    data: Path | None = None  # renders and curation (no model in them, so chains of other sizes can share them)
    pretrainer: Pretrainer | None = None  # None: jobs.pretrain
    trained: tuple[JointObjective, PretrainConfig, int] | None = None  # the pretrainer's objective, config, steps

    @property
    def data_dir(self) -> Path:
        return self.data or self.work

    def step(self, title: str, fn: Callable[[list[str]], int], argv: list[str]) -> None:
        start = time.monotonic()
        self.log(f"\n=== {title}")
        if fn(argv) != 0:
            raise SystemExit(f"{title} failed: {' '.join(argv)}")
        self.timings[title] = time.monotonic() - start
        self.log(f"=== {title}: {self.timings[title]:.0f} s")

    def render_pool(self, out: Path, n: int, seed: int) -> None:
        h, w = self.budget.pool_size
        last_shard = out / f"pool-{math.ceil(n / POOL_SHARD) - 1:05d}.tar"
        if not last_shard.exists():
            self.step(f"pool: {n} unlabelled renders (seed {seed})", make_synthetic.main,
                      ["--out", str(out), "--n", str(n), "--unlabelled", "--height", str(h), "--width", str(w),
                       "--max-yaw", str(self.budget.max_yaw), "--rows-per-shard", str(POOL_SHARD), "--seed", str(seed),
                       "--workers", str(self.budget.workers)])  # fmt: skip

    def curated(self) -> tuple[Path, int]:
        pool, out = self.data_dir / "pool", self.data_dir / "curated"
        manifest = out / "shards" / "manifest.json"
        if not manifest.exists():  # once curated, the pool itself is not needed (nor carried to a GPU machine)
            self.render_pool(pool, self.budget.pool, seed=0)
            self.step("curate (lite)", curate.main,
                      ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(pool), "--output", str(out),
                       *self.budget.curate_overrides])  # fmt: skip
        return out / "shards", sum(s["rows"] for s in json.loads(manifest.read_text())["shards"])

    def prepare_data(self) -> None:
        """The steps with no model in them: the pool's renders and their curation, the held-out renders and the
        labelled sets. Made ahead on a CPU machine, they let a machine without the lite profile's runtimes (a GPU
        machine with no package index, say) run the rest of the chain."""
        self.curated()
        self.render_pool(self.data_dir / "heldout", self.budget.heldout, seed=1)
        self.labelled()

    def pretrain_config(self, steps: int | None = None) -> PretrainConfig:
        b = self.budget
        extra = [f"steps={steps}"] if steps is not None else []
        return load_config(PretrainConfig, b.pretrain_config, [*b.model_overrides(), *b.pretrain_overrides, *extra])

    def pretrain(self, shards: Path, kept: int) -> tuple[int, dict[str, Path], Path]:
        """(steps, exported backbone per name, the run folder)."""
        b = self.budget
        per_step = self.pretrain_config().samples_per_step()
        if kept < per_step:
            raise SystemExit(f"curation kept {kept} images, fewer than a global batch of {per_step}: raise --pool")
        steps = b.pretrain_steps or math.ceil((b.pretrain_epochs or 1.0) * kept / per_step)
        run = self.work / "runs" / "pretrain"
        files = {which: run / EXPORT_FILES[which] for which in b.exports}
        for f in files.values():
            if f.exists() and int(read_safetensors(str(f))[1]["step"]) != steps:
                raise SystemExit(f"{f} was pretrained for another number of steps; give another --work")
        missing = [which for which, f in files.items() if not f.exists()]
        if self.pretrainer is not None:
            if missing or not self.heldout_done(steps):  # the held-out MAE needs the trained objective
                self.step(f"pretrain in this process, {steps} steps ({steps * per_step / kept:.1f} epochs) on {kept} "
                          "curated images", lambda _: self.pretrain_here(shards, steps, files), [])  # fmt: skip
            return steps, files, run
        latest = latest_committed(str(run))
        if missing and latest is not None and step_of(latest) == steps:  # a finished run: export what is missing
            for which in missing:
                export_backbone(latest, str(files[which]), which)
        elif missing:
            self.step(f"pretrain, {steps} steps ({steps * per_step / kept:.1f} epochs) on {kept} curated images",
                      pretrain_job.main,
                      ["--config", b.pretrain_config, "--data", str(shards), "--storage", str(run.parent),
                       "--name", run.name, "--export", ",".join(b.exports), f"steps={steps}", *b.model_overrides(),
                       *b.pretrain_overrides])  # fmt: skip
        return steps, files, run

    def pretrain_here(self, shards: Path, steps: int, files: dict[str, Path]) -> int:
        """The pretrainer's run, exported as jobs.pretrain exports its last checkpoint."""
        assert self.pretrainer is not None
        cfg = self.pretrain_config(steps)
        objective = self.pretrainer(cfg, shards).cpu()  # held-out MAE is read on the CPU, as from a checkpoint
        for which, f in files.items():
            f.parent.mkdir(parents=True, exist_ok=True)
            export_objective(objective, cfg.model, steps, str(f), which)
        self.trained = (objective, cfg, steps)
        return 0

    def heldout_done(self, steps: int) -> bool:
        done = self.work / "heldout_mae.json"
        return done.exists() and json.loads(done.read_text())["step"] == steps

    def heldout_images(self, size: tuple[int, int]) -> torch.Tensor:
        folder = self.data_dir / "heldout"
        self.render_pool(folder, self.budget.heldout, seed=1)  # another seed: figures the pool never holds
        images = []
        for tar_path in sorted(folder.glob("pool-*.tar")):
            with tarfile.open(tar_path) as tar:
                for member in tar.getmembers():
                    data = tar.extractfile(member)
                    assert data is not None  # every member of a pool tar is a file
                    row = {"image": {"bytes": data.read()}}
                    images.append(torch.from_numpy(decode_crop(row, size, person_crop=False)).permute(2, 0, 1))
        return torch.stack(images)

    def heldout_mae(self, run: Path, steps: int) -> dict:
        done = self.work / "heldout_mae.json"
        if self.heldout_done(steps):
            return json.loads(done.read_text())
        start = time.monotonic()
        if self.trained is not None:
            objective, cfg, step = self.trained
        else:
            latest = latest_committed(str(run))
            assert latest is not None  # the pretraining run above finished
            objective, cfg, step = load_objective(latest)
        images = self.heldout_images(cfg.image_size)
        result = {
            "step": step,
            "images": len(images),
            "pretrained": heldout_mae(objective, images, step=step),
            "initial": heldout_mae(initial_objective(cfg), images, step=step),  # the same views and masks
        }
        done.write_text(json.dumps(result, indent=1))
        self.timings["held-out MAE"] = time.monotonic() - start
        return result

    def labelled(self) -> dict[int, Path]:
        b, sets = self.budget, {}
        h, w = b.image_size
        for n in b.labels:
            folder = self.data_dir / f"labelled-{n}"
            if not (folder / "test" / "manifest.json").exists():
                self.step(f"labelled renders: {n} train + {b.val} val + {b.test} test", make_synthetic.main,
                          ["--out", str(folder), "--n", str(n), "--val", str(b.val), "--test", str(b.test),
                           "--height", str(h), "--width", str(w), "--keypoints", "17", "--seed", "1",
                           "--workers", str(b.workers)])  # fmt: skip
            sets[n] = folder
        return sets

    def probe(self, init: str, backbone: Path | None, colour: str, seed: int, data: Path, steps: int) -> dict:
        b = self.budget
        out = self.work / "probes" / f"{init}-{colour}-s{seed}.json"
        if out.exists():  # an earlier result counts if it probed these label counts of this backbone
            found = json.loads(out.read_text())
            c = found["config"]
            same = c["labels"] == list(b.labels) and c["eval_images"] == b.test and c["iters"] == b.probe_iters
            if same and (backbone is None or c["pretrain_step"] == steps):
                return found
        argv = ["--data", str(data / "train"), "--val-data", str(data / "test"), "--backbone", str(backbone or probe.RANDOM),
                "--out", str(out), "--config", b.finetune_config, "--labels", ",".join(map(str, b.labels)),
                "--seed", str(seed), "--iters", str(b.probe_iters), *(["--grayscale"] if COLOURS[colour] else []),
                *(["--threads", str(b.probe_threads)] if b.probe_threads else []),
                *b.model_overrides(), *b.finetune_overrides]  # fmt: skip
        self.step(f"probe {init}, {colour}, seed {seed}", probe.main, argv)
        return json.loads(out.read_text())

    def finetune(self, init: str, backbone: Path | None, n: int, data: Path, seed: int, lr: float) -> dict:
        """{"val": validation mIoU, "test": test mIoU} of one fine-tuning run (run, or read back)."""
        b = self.budget
        runs = self.work / "runs"
        run = runs / f"ft-{init}-{n}-s{seed}-lr{lr:g}"
        overrides = [*b.model_overrides(), *b.finetune_overrides, f"seed={seed}", f"steps={b.steps}",
                     f"optim.lr={lr}", "eval.every=0", "eval.max_samples=null", "eval.visualise=0"]  # fmt: skip
        done = run / METRICS_FILE
        if done.exists():  # an earlier run's result counts only if it ran these settings
            ran = json.loads(done.read_text())["config"]
            wanted = load_config(FinetuneConfig, b.finetune_config, overrides).model_dump(mode="json")
            if ran != wanted:
                differ = sorted(k for k in wanted if ran.get(k) != wanted[k])
                raise SystemExit(f"{run} ran with other settings ({', '.join(differ)}); give another --work")
        else:
            extra = ["--backbone", str(backbone)] if backbone else []
            self.step(f"fine-tune {init}, {n} labels, seed {seed}, lr {lr:g}", finetune_job.main,
                      ["--task", "seg", "--config", b.finetune_config, "--data", str(data), "--storage", str(runs),
                       "--name", run.name, *extra, *overrides])  # fmt: skip
        scored = run / "test_metrics.json"
        if not scored.exists():
            metrics = evaluate_finetuned(str(run / FINETUNED_FILE), str(data / "test"))
            scored.write_text(json.dumps({"mIoU": metrics["mIoU"], "aAcc": metrics["aAcc"]}))
        return {"val": json.loads(done.read_text())["metrics"]["mIoU"], "test": json.loads(scored.read_text())["mIoU"]}


def choose_lr(grid: dict[float, list[dict]]) -> float:
    """The learning rate whose runs (one per seed) have the best mean validation mIoU; their test scores are the ones
    reported, so the test split never takes part in the choice."""
    return max(grid, key=lambda lr: statistics.fmean(run["val"] for run in grid[lr]))


def run_chain(
    work: Path, budget: Budget, log: Callable[[str], None] = print, *, data: Path | None = None,
    pretrainer: Pretrainer | None = None,
) -> dict:  # fmt: skip
    """The whole chain under ``work`` at ``budget``; returns (and writes to ``<work>/results.json``) every measure.
    ``data``: where the renders and curated shards go (default ``work``); ``pretrainer``: pretrain in this process
    (default: ``jobs.pretrain`` on Ray Train)."""
    batch = load_config(FinetuneConfig, budget.finetune_config, list(budget.finetune_overrides)).samples_per_step()
    if min(budget.labels) < batch:
        raise SystemExit(f"--labels {min(budget.labels)} is smaller than a fine-tuning batch of {batch} images")
    if not budget.colours or any(c not in COLOURS for c in budget.colours):
        raise SystemExit(f"colours {budget.colours}: one or more of {sorted(COLOURS)}")
    work.mkdir(parents=True, exist_ok=True)
    init_ray(None, budget.ray_cpus)
    started = time.monotonic()
    chain = Chain(work, budget, log, data=data, pretrainer=pretrainer)
    shards, kept = chain.curated()
    steps, backbones, run = chain.pretrain(shards, kept)
    mae = chain.heldout_mae(run, steps)
    sets = chain.labelled()
    inits: dict[str, Path | None] = {RANDOM: None, **backbones}
    measures: dict[str, dict[str, list[float | None]]] = {}
    biggest = sets[max(budget.labels)]  # its training set's prefixes are the smaller sets'
    for colour in budget.colours:
        for init, backbone in inits.items():
            for seed in budget.seeds:
                result = chain.probe(init, backbone, colour, seed, biggest, steps)
                for n in budget.labels:
                    for label, key, score in PROBE_MEASURES:
                        row = measures.setdefault(f"{label}, {n} labels, {colour}", {})
                        row.setdefault(init, []).append(result["results"][str(n)][key][score])
    chosen: dict[str, dict[str, float]] = {}
    for n in budget.labels:
        for init, backbone in inits.items():
            grid = {lr: [chain.finetune(init, backbone, n, sets[n], s, lr) for s in budget.seeds] for lr in budget.lrs}
            lr = choose_lr(grid)
            chosen.setdefault(str(n), {})[init] = lr
            row = measures.setdefault(f"fine-tune mIoU, {n} labels (LR on val)", {})
            row[init] = [x["test"] for x in grid[lr]]
    per_step = chain.pretrain_config().samples_per_step()
    results = {
        "budget": dataclasses.asdict(budget),
        "curated": kept,
        "pretrain_steps": steps,
        "pretrain_epochs": steps * per_step / kept,
        "heldout_mae": mae,
        "inits": list(inits),
        "measures": measures,
        "finetune_lr": chosen,
        "timings_s": chain.timings,
        "elapsed_s": time.monotonic() - started,
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
    }
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return results


# --- the report ---------------------------------------------------------------------------------------------------


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def beats(pretrained: list[float], random: list[float]) -> bool | None:
    """The mean gain over random exceeds the larger of the two seed spreads; None without a spread to compare with
    (a measure missing, or a single seed)."""
    if min(len(pretrained), len(random)) < 2:
        return None
    spread = max(statistics.stdev(pretrained), statistics.stdev(random))
    return statistics.fmean(pretrained) - statistics.fmean(random) > spread


def report(results: dict) -> list[str]:
    """The table and the summary line."""
    b, mae = results["budget"], results["heldout_mae"]
    others = [i for i in results["inits"] if i != RANDOM]
    lines = [
        f"{b['pool']} unlabelled renders -> {results['curated']} curated (lite) -> pretrained "
        f"{results['pretrain_steps']} steps ({results['pretrain_epochs']:.1f} epochs); held-out MAE (student + "
        f"decoder) on {mae['images']} other renders: {mae['initial']:.4f} at init -> {mae['pretrained']:.4f}; "
        f"fine-tuning {b['steps']} steps, LR of {list(b['lrs'])} chosen per init on {b['val']} val renders; every "
        f"score on {b['test']} test renders; seeds {list(b['seeds'])}; {results['machine']}, "
        f"{results['elapsed_s']:.0f} s",
        "| measure | random | " + " | ".join(f"{i} | gain > seed spread" for i in others) + " |",
        "|---|---|" + "---|---|" * len(others),
    ]
    wins: dict[str, list[str]] = {i: [] for i in others}
    ahead: dict[str, int] = dict.fromkeys(others, 0)
    for name, row in results["measures"].items():
        random = [x for x in row[RANDOM] if x is not None]
        cells = [mean_std(random)]
        for init in others:
            values = [x for x in row[init] if x is not None]
            verdict = beats(values, random)
            if verdict:
                wins[init].append(name)
            if values and random and statistics.fmean(values) > statistics.fmean(random):
                ahead[init] += 1
            cells += [mean_std(values), {True: "yes", False: "no", None: "n/a"}[verdict]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    total, seeds = len(results["measures"]), len(b["seeds"])
    n = max(b["labels"])
    ft = results["measures"][f"fine-tune mIoU, {n} labels (LR on val)"]
    parts = []
    for init in others:
        beyond = (
            f"beyond the seed spread on {len(wins[init])}" + (f" ({'; '.join(wins[init])})" if wins[init] else "")
            if seeds > 1
            else "no seed spread to beat with one seed"
        )
        parts.append(f"{init} ahead of random on {ahead[init]}/{total} measures, {beyond}")
    parts.append(
        f"fine-tune mIoU at {n} labels: "
        + ", ".join(f"{i} {statistics.fmean(ft[i]):.4f}" for i in others)
        + f" vs random {statistics.fmean(ft[RANDOM]):.4f}"
    )
    lines.append("summary: " + "; ".join(parts))
    return lines


# --- the command line ---------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: list[str] | None = None) -> tuple[Path, Budget]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small preset (<= 15 min on 2 CPUs)")
    p.add_argument("--work", default=None, help="folder for every artefact (default out/pretrain_value[_quick])")
    p.add_argument("--pool", type=int, help="unlabelled renders in the pool before curation")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--pretrain-steps", type=int, help="pretraining optimiser steps")
    budget.add_argument("--pretrain-epochs", type=float, help="pretraining passes over the curated set")
    p.add_argument("--labels", help="labelled training set sizes, comma-separated (prefixes of one another)")
    p.add_argument("--seeds", help="seeds (random inits, fine-tuning, probe hold-outs), comma-separated")
    p.add_argument("--steps", type=int, help="fine-tuning steps of every run")
    p.add_argument("--lrs", help="fine-tuning optim.lr values to choose from on val, comma-separated")
    p.add_argument("--val", type=int, help="validation renders (choose the fine-tuning LR)")
    p.add_argument("--test", type=int, help="test renders (every reported score)")
    p.add_argument("--heldout", type=int, help="held-out unlabelled renders for the MAE term")
    p.add_argument("--export", default="student", help="pretrained backbones to compare: student, teacher or both")
    p.add_argument("--both-exports", action="store_true", help="compare the student and the EMA teacher")
    p.add_argument("--size", default=None, help="model.size of pretraining and fine-tuning (default: the configs')")
    p.add_argument("--patch-size", type=int, default=None, help="model.patch_size of both")
    p.add_argument("--pretrain-override", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    p.add_argument("--finetune-override", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    if args.pretrain_steps is None and args.pretrain_epochs is None:
        args.pretrain_steps, args.pretrain_epochs = preset["pretrain_steps"], preset["pretrain_epochs"]
    for key, value in preset.items():
        if key not in ("pretrain_steps", "pretrain_epochs") and getattr(args, key) is None:
            setattr(args, key, value)
    exports = ("student", "teacher") if args.both_exports else tuple(args.export.split(","))
    if any(e not in EXPORT_FILES for e in exports):
        p.error(f"--export: of {sorted(EXPORT_FILES)}")
    work = Path(args.work or f"out/pretrain_value{'_quick' if args.quick else ''}").resolve()
    return work, Budget(
        pool=args.pool, pretrain_steps=args.pretrain_steps, pretrain_epochs=args.pretrain_epochs,
        labels=_ints(args.labels), seeds=_ints(args.seeds), steps=args.steps,
        lrs=tuple(float(x) for x in args.lrs.split(",")), val=args.val, test=args.test, heldout=args.heldout,
        exports=exports, size=args.size, patch_size=args.patch_size,
        pretrain_overrides=tuple(args.pretrain_override), finetune_overrides=tuple(args.finetune_override),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    work, budget = parse_args(argv)
    results = run_chain(work, budget)
    print()
    for line in report(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
