"""Does pretraining give a better backbone? Random init, a positive control and backbones pretrained on a curated
and on a raw pool, read out by frozen probes and by fine-tuning with a recipe chosen per init on validation.

    python benchmarks/pretrain_value.py                    # the CPU preset: about 50 min on 2 CPUs
    python benchmarks/pretrain_value.py --quick            # the whole path at a small size (about 10 min)
    python benchmarks/pretrain_value.py --work out/pv --pool 5000 --pretrain-steps 3000 --labels 16,64 --both-exports
    python benchmarks/pretrain_value.py --work out/pv-seed1 --data out/pretrain_value --pretrain-override seed=1

The chain, every step a job a user runs (``run_chain``; the GPU check calls it with a larger ``Budget``):

1. ``jobs.make_synthetic --unlabelled --junk F``: a pool of JPEG renders at 512x384 from any direction, a fraction F
   of it web junk (frames with no person, near-duplicates, text overlays, images under 384 px); and held-out renders
   of other figures (another seed, no junk) that pretraining never sees.
2. Two pretraining sets from that one pool: ``jobs.curate`` with the lite profile (``curated``), and with
   ``configs/curate/uncurated.yaml``, every image that decodes (``raw``).
3. ``jobs.pretrain`` with ``configs/pretrain/tiny.yaml``, the same steps on each set, at the read-outs' resolution
   (the global views are the labelled renders' size, so pretraining and read-out see one token grid); the student
   is exported, and with ``--both-exports`` the EMA teacher beside it. A caller may pretrain in its own process
   instead (``pretrainer``: the GPU check trains with the pool in GPU memory).
4. Held-out MAE (``pretrain.evaluate``) of each run's last student + decoder and of its initial weights, on the
   same views and masks.
5. The positive control: ``jobs.finetune`` seg on ``--control`` labelled renders of other figures (another seed);
   its ``finetuned.safetensors`` starts the read-outs through the same ``--backbone`` path as a pretrained
   backbone. A backbone that knows body parts: if it does not beat random by far, the read-out is at fault.
6. ``jobs.make_synthetic``: labelled renders at 128x96 from any direction with ``val`` and ``test`` splits; the
   ``--labels`` sets are prefixes of one another and share both.
7. ``jobs.probe`` (frozen features) of every init at every label count, scored on ``test``: the best layer's
   linear-probe mIoU, k-NN mIoU and left / right accuracy. A random init is drawn per seed; the seed also draws the
   probes' hold-out.
8. ``jobs.finetune`` for every init x label count: every recipe of the grid (``--lrs`` x ``--layer-decays`` x
   ``--probe-steps``, with drop path and a warm-up) on the first seed, scored on ``val``; the recipe with the best
   validation mIoU is then run with every seed and scored on ``test`` (``finetune.train.evaluate_finetuned``). The
   same seed gives every init the same head, data order and augmentation draws.

The inits: ``random`` (the fine-tuning config's backbone from the seed: LayerScale 1e-4, so each block starts
close to the identity and the model close to a head on the patch embedding), ``random-ls1`` (the same at the
pretrained backbones' LayerScale 1.0: the control that tells a pretrained backbone's LayerScale from what it
learnt), ``supervised`` (the positive control), then one per pretraining set and export (``curated``, ``raw``,
``curated-teacher``, ...).

Prints the table (rows: measures; columns: each init as mean +- std over seeds, and whether its gain over random
exceeds the seed spread), the fine-tuning validation curves, the verdicts (control, pretraining, curated vs raw) and
one last line ``summary: ...``. Every step reuses what an earlier run left under ``--work`` (jobs resume), so a
stopped run goes on where it was; a ``--work`` whose runs used other settings is refused. Everything measured is
also in ``<work>/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
from training.metrics import latest_per_step, read_metrics  # noqa: E402

POOL_SHARD = 50  # renders per pool tar shard: one shard is one unit of curation work and of its resume
RANDOM = "random"
SUPERVISED = "supervised"
COLOURS = {"colour": False, "grayscale": True}
# The pretraining sets: the curation config that makes each from the one pool.
SOURCES = {"curated": "configs/curate/lite.yaml", "raw": "configs/curate/uncurated.yaml"}
# (row label, key of a probe result's label-count entry, score inside it)
PROBE_MEASURES = (
    ("probe mIoU (tokens, best layer)", "probe_best", "miou"),
    ("k-NN mIoU (tokens, best layer)", "knn_best", "miou"),
    ("left/right bal. acc", "left_right_best", "balanced_acc"),
)
PRESETS: dict[str, dict[str, Any]] = {
    # about 50 min on 2 quiet CPUs: 1500 renders (30% junk; 7 min) -> 363 curated and 1500 raw (1 min); 800
    # pretraining steps of each at a global batch of 8 (0.4 s a step at 128x96: 5.5 min each); the control's 2000
    # steps on 1000 renders (4 min); 15 probes (5 s each); fine-tuning 300 steps at 16 labels: 3 rates on seed 0,
    # then seeds 1 and 2 at the chosen one, for 5 inits (25 runs of ~47 s)
    "cpu": dict(pool=1500, junk=0.3, pretrain_steps=800, labels="16,64", finetune_labels="16", seeds="0,1,2", steps=300,
                lrs="4.8e-2,1.44e-1,4.32e-1", layer_decays="0.85", probe_steps="0", val=64, test=128, heldout=64,
                control=1000, control_steps=2000),
    # the same path at a size that shows it runs (about 10 min), not what it measures
    "quick": dict(pool=150, junk=0.3, pretrain_steps=60, labels="16", seeds="0,1", steps=60,
                  lrs="4.8e-2,1.44e-1",
                  layer_decays="0.85", probe_steps="0", val=32, test=32, heldout=16, control=200, control_steps=100),
}  # fmt: skip
# Pretraining in this process instead of jobs.pretrain: (the run's config, its steps set; the shards) -> the trained
# objective. The chain exports its backbones and reads its held-out MAE as it would a job's last checkpoint.
Pretrainer = Callable[[PretrainConfig, Path], JointObjective]


@dataclass
class Budget:
    """Everything the chain's cost and outcome depend on."""

    pool: int  # renders in the pool before curation (junk included)
    pretrain_steps: int  # optimiser steps of every pretraining run
    labels: tuple[int, ...]  # labelled training set sizes (prefixes of one another), probed
    seeds: tuple[int, ...]  # the first one chooses the fine-tuning recipe
    steps: int  # fine-tuning steps of every run
    lrs: tuple[float, ...]  # fine-tuning optim.lr grid (the base rate per 256 images)
    val: int  # validation renders: choose the fine-tuning recipe
    test: int  # test renders: every reported probe and fine-tuning score
    heldout: int  # held-out unlabelled renders for the MAE term
    finetune_labels: tuple[int, ...] | None = None  # those of ``labels`` fine-tuned on (None: all)
    layer_decays: tuple[float, ...] = (0.85,)  # fine-tuning optim.layer_decay grid
    probe_steps: tuple[int, ...] = (0,)  # LP-FT grid: head-only steps before the backbone trains (0: plain)
    drop_path: float = 0.1  # fine-tuning model.drop_path (stochastic depth, as MAE fine-tunes)
    warmup: float = 0.1  # fine-tuning warm-up, a fraction of its steps
    junk: float = 0.3  # fraction of the pool that is web junk (make_synthetic --junk)
    control: int = 1000  # labelled renders of other figures the positive control is trained on
    control_steps: int = 2000
    control_lr: float = 1.44e-1  # the positive control's optim.lr (what random init chooses at this size)
    sources: tuple[str, ...] = tuple(SOURCES)  # pretraining sets, keys of SOURCES
    exports: tuple[str, ...] = ("student",)  # pretrained backbones compared with random init
    size: str | None = None  # model.size of both configs (None: the configs')
    patch_size: int | None = None  # model.patch_size of both configs (None: the configs')
    pretrain_config: str = str(REPO / "configs/pretrain/tiny.yaml")
    pretrain_overrides: tuple[str, ...] = ()
    finetune_config: str = str(REPO / "configs/finetune/tiny.yaml")
    finetune_overrides: tuple[str, ...] = ()
    curate_overrides: tuple[str, ...] = ()  # of both curation configs (e.g. more actors on a larger machine)
    colours: tuple[str, ...] = ("colour",)  # probe inputs, keys of COLOURS
    image_size: tuple[int, int] = (128, 96)  # labelled renders and pretraining's global views (H, W)
    pool_size: tuple[int, int] = (512, 384)  # unlabelled renders (H, W): curation keeps a short side >= 384
    workers: int = 2  # rendering processes
    ray_cpus: int | None = 2  # CPUs of the local Ray (None: all)
    probe_threads: int | None = 1  # torch threads of the in-process probes (1: no oversubscription of shared CPUs)
    probe_iters: int = ProbeSettings.iters  # L-BFGS iterations per probe fit

    def model_overrides(self) -> list[str]:
        return ([f"model.size={self.size}"] if self.size else []) + (
            [f"model.patch_size={self.patch_size}"] if self.patch_size else []
        )

    def view_overrides(self) -> list[str]:
        """Pretraining at the read-outs' resolution: global views of the labelled renders' size (one token grid for
        pretraining, probes and fine-tuning), local crops of half their width, square."""
        h, w = self.image_size
        return [f"objective.views.global_size=[{h},{w}]", f"objective.views.local_size=[{w // 2},{w // 2}]"]

    def tuned(self) -> tuple[int, ...]:
        """The label counts fine-tuned on."""
        return self.labels if self.finetune_labels is None else self.finetune_labels

    def recipes(self) -> list[dict[str, float | int]]:
        """The fine-tuning grid every init chooses from on validation."""
        return [
            {"lr": lr, "layer_decay": ld, "probe_steps": ps}
            for lr, ld, ps in itertools.product(self.lrs, self.layer_decays, self.probe_steps)
        ]


def recipe_name(recipe: dict) -> str:
    return f"lr{recipe['lr']:g}-ld{recipe['layer_decay']:g}-lp{recipe['probe_steps']}"


@dataclass
class Chain:
    work: Path
    budget: Budget
    log: Callable[[str], None] = print
    timings: dict[str, float] = field(default_factory=dict)
    data: Path | None = None  # renders and curation (no model in them, so chains of other sizes can share them)
    pretrainer: Pretrainer | None = None  # None: jobs.pretrain
    trained: dict[str, tuple[JointObjective, PretrainConfig, int]] = field(default_factory=dict)  # per source

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

    # --- data -----------------------------------------------------------------------------------------------------

    def render_pool(self, out: Path, n: int, seed: int, junk: float) -> None:
        h, w = self.budget.pool_size
        last_shard = out / f"pool-{math.ceil(n / POOL_SHARD) - 1:05d}.tar"
        if not last_shard.exists():
            self.step(f"pool: {n} unlabelled renders (seed {seed}, {junk:.0%} junk)", make_synthetic.main,
                      ["--out", str(out), "--n", str(n), "--unlabelled", "--height", str(h), "--width", str(w),
                       "--junk", str(junk), "--rows-per-shard", str(POOL_SHARD), "--seed", str(seed),
                       "--workers", str(self.budget.workers)])  # fmt: skip

    def pretraining_set(self, source: str) -> tuple[Path, int]:
        """(shards, rows) of one pretraining set, curated from the pool by ``SOURCES[source]``."""
        b, out = self.budget, self.data_dir / source
        manifest, made_from = out / "shards" / "manifest.json", out / "pool.json"
        pool = {"renders": b.pool, "junk": b.junk, "size": list(b.pool_size)}
        if made_from.exists() and json.loads(made_from.read_text()) != pool:
            raise SystemExit(f"{out} was made from another pool ({made_from.read_text()}); give another --work")
        if not manifest.exists():  # once made, the pool itself is not needed (nor carried to a GPU machine)
            self.render_pool(self.data_dir / "pool", b.pool, seed=0, junk=b.junk)
            self.step(f"curate ({source}: {Path(SOURCES[source]).name})", curate.main,
                      ["--config", str(REPO / SOURCES[source]), "--input", str(self.data_dir / "pool"),
                       "--output", str(out), *b.curate_overrides])  # fmt: skip
            made_from.write_text(json.dumps(pool))
        return out / "shards", sum(s["rows"] for s in json.loads(manifest.read_text())["shards"])

    def labelled_renders(self, folder: Path, n: int, val: int, test: int, seed: int, title: str) -> Path:
        h, w = self.budget.image_size
        last = folder / ("test" if test else "val") / "manifest.json"
        if not last.exists():
            self.step(title, make_synthetic.main,
                      ["--out", str(folder), "--n", str(n), "--val", str(val), "--test", str(test), "--height", str(h),
                       "--width", str(w), "--keypoints", "17", "--seed", str(seed),
                       "--workers", str(self.budget.workers)])  # fmt: skip
        return folder

    def labelled(self) -> dict[int, Path]:
        b, sets = self.budget, {}
        for n in b.labels:
            title = f"labelled renders: {n} train + {b.val} val + {b.test} test"
            sets[n] = self.labelled_renders(self.data_dir / f"labelled-{n}", n, b.val, b.test, seed=1, title=title)
        return sets

    def control_data(self) -> Path:
        """The positive control's training renders: other figures (seed 2) than every labelled set's (seed 1)."""
        n = self.budget.control
        return self.labelled_renders(self.data_dir / "control", n, 16, 0, seed=2,
                                     title=f"labelled renders for the positive control: {n}")  # fmt: skip

    def prepare_data(self) -> None:
        """The steps with no model in them: the pool's renders and both pretraining sets, the held-out renders and
        the labelled sets. Made ahead on a CPU machine, they let a machine without the lite profile's runtimes (a
        GPU machine with no package index, say) run the rest of the chain."""
        for source in self.budget.sources:
            self.pretraining_set(source)
        self.render_pool(self.data_dir / "heldout", self.budget.heldout, seed=1, junk=0.0)
        self.labelled()
        self.control_data()

    # --- pretraining ----------------------------------------------------------------------------------------------

    def pretrain_config(self, steps: int | None = None) -> PretrainConfig:
        b = self.budget
        extra = [f"steps={steps}"] if steps is not None else []
        overrides = [*b.model_overrides(), *b.view_overrides(), *b.pretrain_overrides, *extra]
        return load_config(PretrainConfig, b.pretrain_config, overrides)

    def pretrain(self, source: str, shards: Path, kept: int) -> tuple[dict[str, Path], Path]:
        """(exported backbone per export, the run folder) of pretraining on one set."""
        b, steps = self.budget, self.budget.pretrain_steps
        per_step = self.pretrain_config().samples_per_step()
        if kept < per_step:
            raise SystemExit(f"{source}: {kept} images, fewer than a global batch of {per_step}: raise --pool")
        run = self.work / "runs" / f"pretrain-{source}"
        files = {which: run / EXPORT_FILES[which] for which in b.exports}
        for f in files.values():
            if f.exists() and int(read_safetensors(str(f))[1]["step"]) != steps:
                raise SystemExit(f"{f} was pretrained for another number of steps; give another --work")
        missing = [which for which, f in files.items() if not f.exists()]
        title = f"pretrain on {source}, {steps} steps ({steps * per_step / kept:.1f} epochs of {kept} images)"
        if self.pretrainer is not None:
            if missing or not self.heldout_done(source):  # the held-out MAE needs the trained objective
                self.step(f"{title}, in this process", lambda _: self.pretrain_here(source, shards, files), [])
            return files, run
        latest = latest_committed(str(run))
        if missing and latest is not None and step_of(latest) == steps:  # a finished run: export what is missing
            for which in missing:
                export_backbone(latest, str(files[which]), which)
        elif missing:
            self.step(title, pretrain_job.main,
                      ["--config", b.pretrain_config, "--data", str(shards), "--storage", str(run.parent),
                       "--name", run.name, "--export", ",".join(b.exports), f"steps={steps}", *b.model_overrides(),
                       *b.view_overrides(), *b.pretrain_overrides])  # fmt: skip
        return files, run

    def pretrain_here(self, source: str, shards: Path, files: dict[str, Path]) -> int:
        """The pretrainer's run, exported as jobs.pretrain exports its last checkpoint."""
        assert self.pretrainer is not None
        steps = self.budget.pretrain_steps
        cfg = self.pretrain_config(steps)
        objective = self.pretrainer(cfg, shards).cpu()  # held-out MAE is read on the CPU, as from a checkpoint
        for which, f in files.items():
            f.parent.mkdir(parents=True, exist_ok=True)
            export_objective(objective, cfg.model, steps, str(f), which)
        self.trained[source] = (objective, cfg, steps)
        return 0

    def heldout_done(self, source: str) -> bool:
        done = self.work / f"heldout_mae-{source}.json"
        return done.exists() and json.loads(done.read_text())["step"] == self.budget.pretrain_steps

    def heldout_images(self, size: tuple[int, int]) -> torch.Tensor:
        folder = self.data_dir / "heldout"
        self.render_pool(folder, self.budget.heldout, seed=1, junk=0.0)  # another seed: figures the pool never holds
        images = []
        for tar_path in sorted(folder.glob("pool-*.tar")):
            with tarfile.open(tar_path) as tar:
                for member in tar.getmembers():
                    data = tar.extractfile(member)
                    assert data is not None  # every member of a pool tar is a file
                    row = {"image": {"bytes": data.read()}}
                    images.append(torch.from_numpy(decode_crop(row, size, person_crop=False)).permute(2, 0, 1))
        return torch.stack(images)

    def heldout_mae(self, source: str, run: Path) -> dict:
        done = self.work / f"heldout_mae-{source}.json"
        if self.heldout_done(source):
            return json.loads(done.read_text())
        start = time.monotonic()
        if source in self.trained:
            objective, cfg, step = self.trained[source]
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
        self.timings[f"held-out MAE ({source})"] = time.monotonic() - start
        return result

    # --- read-outs ------------------------------------------------------------------------------------------------

    def run_tag(self, init: str) -> str:
        """An init's name in its runs' and probes' file names: the control's carries its settings, so a control
        trained otherwise is read out anew rather than taken from an earlier run."""
        b = self.budget
        return f"{init}-n{b.control}-s{b.control_steps}" if init == SUPERVISED else init

    def init_overrides(self, init: str) -> list[str]:
        return ["model.layer_scale_init=1.0"] if init == f"{RANDOM}-ls1" else []

    def probe(self, init: str, backbone: Path | None, colour: str, seed: int, data: Path) -> dict:
        b = self.budget
        out = self.work / "probes" / f"{self.run_tag(init)}-{colour}-s{seed}.json"
        if out.exists():  # an earlier result counts if it probed these label counts
            found = json.loads(out.read_text())
            c = found["config"]
            if c["labels"] == list(b.labels) and c["eval_images"] == b.test and c["iters"] == b.probe_iters:
                return found
        argv = ["--data", str(data / "train"), "--val-data", str(data / "test"), "--backbone", str(backbone or probe.RANDOM),
                "--out", str(out), "--config", b.finetune_config, "--labels", ",".join(map(str, b.labels)),
                "--seed", str(seed), "--iters", str(b.probe_iters), *(["--grayscale"] if COLOURS[colour] else []),
                *(["--threads", str(b.probe_threads)] if b.probe_threads else []),
                *b.model_overrides(), *b.finetune_overrides, *self.init_overrides(init)]  # fmt: skip
        self.step(f"probe {init}, {colour}, seed {seed}", probe.main, argv)
        return json.loads(out.read_text())

    def finetune_overrides(self, init: str, seed: int, recipe: dict, steps: int | None = None) -> list[str]:
        b = self.budget
        steps = steps or b.steps
        return [*b.model_overrides(), *b.finetune_overrides, *self.init_overrides(init), f"seed={seed}",
                f"steps={steps}", f"optim.lr={recipe['lr']}", f"optim.layer_decay={recipe['layer_decay']}",
                f"optim.probe_steps={recipe['probe_steps']}", f"optim.warmup_steps={round(b.warmup * steps)}",
                f"model.drop_path={b.drop_path}", f"eval.every={max(1, steps // 5)}", "eval.max_samples=null",
                "eval.visualise=0"]  # fmt: skip

    def finetune(self, init: str, backbone: Path | None, n: int, data: Path, seed: int, recipe: dict) -> dict:
        """{"val": validation mIoU, "test": test mIoU, "curve": [(step, val mIoU)]} of one run (run, or read back)."""
        runs = self.work / "runs"
        run = runs / f"ft-{self.run_tag(init)}-{n}-s{seed}-{recipe_name(recipe)}"
        overrides = self.finetune_overrides(init, seed, recipe)
        self.run_finetune(run, f"fine-tune {init}, {n} labels, seed {seed}, {recipe_name(recipe)}", data, backbone,
                          overrides)  # fmt: skip
        scored = run / "test_metrics.json"
        if not scored.exists():
            metrics = evaluate_finetuned(str(run / FINETUNED_FILE), str(data / "test"))
            scored.write_text(json.dumps({"mIoU": metrics["mIoU"], "aAcc": metrics["aAcc"]}))
        done = json.loads((run / METRICS_FILE).read_text())
        return {
            "val": done["metrics"]["mIoU"],
            "test": json.loads(scored.read_text())["mIoU"],
            "curve": [(c["step"], c["mIoU"]) for c in done["curve"]],
        }

    def run_finetune(self, run: Path, title: str, data: Path, backbone: Path | None, overrides: list[str]) -> None:
        b = self.budget
        done = run / METRICS_FILE
        if done.exists():  # an earlier run's result counts only if it ran these settings
            ran = json.loads(done.read_text())["config"]
            wanted = load_config(FinetuneConfig, b.finetune_config, overrides).model_dump(mode="json")
            ran_from = json.loads(done.read_text())["backbone"]
            if ran != wanted or ran_from != (str(backbone) if backbone else None):
                differ = sorted(k for k in wanted if ran.get(k) != wanted[k]) or ["--backbone"]
                raise SystemExit(f"{run} ran with other settings ({', '.join(differ)}); give another --work")
            return
        extra = ["--backbone", str(backbone)] if backbone else []
        self.step(title, finetune_job.main,
                  ["--task", "seg", "--config", b.finetune_config, "--data", str(data), "--storage", str(run.parent),
                   "--name", run.name, *extra, *overrides])  # fmt: skip

    def supervised(self) -> Path:
        """The positive control: a seg model fine-tuned from random init on the control renders; its
        ``finetuned.safetensors`` is a backbone that knows body parts."""
        b = self.budget
        run = self.work / "runs" / f"control-n{b.control}-s{b.control_steps}"
        recipe = {"lr": b.control_lr, "layer_decay": 1.0, "probe_steps": 0}
        overrides = [*self.finetune_overrides(RANDOM, 0, recipe, b.control_steps), "eval.every=0"]
        self.run_finetune(run, f"positive control: seg on {b.control} other renders, {b.control_steps} steps",
                          self.control_data(), None, overrides)  # fmt: skip
        return run / FINETUNED_FILE


def pretraining_curve(run: Path) -> list[dict]:
    """The run's loss terms at its logged steps (the newest line per step), from ``<run>/metrics/*.jsonl``; empty
    for a run trained in another process."""
    if not (run / "metrics").is_dir():
        return []
    keys = ("step", "loss", "mae", "cl", "teacher_entropy")
    rows = latest_per_step(read_metrics(str(run)))
    return [{k: rows[s][k] for k in keys if k in rows[s]} for s in sorted(rows)]


def choose(grid: dict[str, dict]) -> str:
    """The recipe whose run has the best validation mIoU; the test split never takes part in the choice."""
    return max(grid, key=lambda name: grid[name]["val"])


def run_chain(
    work: Path, budget: Budget, log: Callable[[str], None] = print, *, data: Path | None = None,
    pretrainer: Pretrainer | None = None,
) -> dict:  # fmt: skip
    """The whole chain under ``work`` at ``budget``; returns (and writes to ``<work>/results.json``) every measure.
    ``data``: where the renders and curated shards go (default ``work``); ``pretrainer``: pretrain in this process
    (default: ``jobs.pretrain`` on Ray Train)."""
    batch = load_config(FinetuneConfig, budget.finetune_config, list(budget.finetune_overrides)).samples_per_step()
    if min(budget.tuned()) < batch:
        raise SystemExit(f"--labels {min(budget.tuned())} is smaller than a fine-tuning batch of {batch} images")
    if not set(budget.tuned()) <= set(budget.labels):
        raise SystemExit(f"--finetune-labels {budget.tuned()}: of --labels {budget.labels}")
    if not budget.colours or any(c not in COLOURS for c in budget.colours):
        raise SystemExit(f"colours {budget.colours}: one or more of {sorted(COLOURS)}")
    if not budget.sources or any(s not in SOURCES for s in budget.sources):
        raise SystemExit(f"sources {budget.sources}: one or more of {sorted(SOURCES)}")
    work.mkdir(parents=True, exist_ok=True)
    init_ray(None, budget.ray_cpus)
    started = time.monotonic()
    chain = Chain(work, budget, log, data=data, pretrainer=pretrainer)
    pretrained: dict[str, Path] = {}
    pretraining: dict[str, dict] = {}
    per_step = chain.pretrain_config().samples_per_step()
    for source in budget.sources:
        shards, kept = chain.pretraining_set(source)
        files, run = chain.pretrain(source, shards, kept)
        pretraining[source] = {
            "images": kept,
            "epochs": budget.pretrain_steps * per_step / kept,
            "heldout_mae": chain.heldout_mae(source, run),
            "curve": pretraining_curve(run),
        }
        pretrained |= {source + ("" if which == "student" else f"-{which}"): f for which, f in files.items()}
    inits: dict[str, Path | None] = {RANDOM: None, f"{RANDOM}-ls1": None, SUPERVISED: chain.supervised(), **pretrained}
    sets = chain.labelled()
    measures: dict[str, dict[str, list[float | None]]] = {}
    biggest = sets[max(budget.labels)]  # its training set's prefixes are the smaller sets'
    for colour in budget.colours:
        for init, backbone in inits.items():
            for seed in budget.seeds:
                result = chain.probe(init, backbone, colour, seed, biggest)
                for n in budget.labels:
                    for label, key, score in PROBE_MEASURES:
                        row = measures.setdefault(f"{label}, {n} labels, {colour}", {})
                        row.setdefault(init, []).append(result["results"][str(n)][key][score])
    chosen: dict[str, dict[str, str]] = {}
    curves: dict[str, dict[str, list]] = {}
    first, *others = budget.seeds
    recipes = {recipe_name(r): r for r in budget.recipes()}
    for n in budget.tuned():
        for init, backbone in inits.items():
            grid = {name: chain.finetune(init, backbone, n, sets[n], first, r) for name, r in recipes.items()}
            name = choose(grid)
            runs = [grid[name], *(chain.finetune(init, backbone, n, sets[n], s, recipes[name]) for s in others)]
            chosen.setdefault(str(n), {})[init] = name
            measures.setdefault(f"fine-tune mIoU, {n} labels (recipe on val)", {})[init] = [r["test"] for r in runs]
            curves.setdefault(str(n), {})[init] = [r["curve"] for r in runs]
    results = {
        "budget": dataclasses.asdict(budget),
        "pretraining": pretraining,
        "pretrain_steps": budget.pretrain_steps,
        "inits": list(inits),
        "measures": measures,
        "finetune_recipe": chosen,
        "finetune_curves": curves,
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


def beats(ours: list[float], theirs: list[float]) -> bool | None:
    """The mean gain exceeds the larger of the two seed spreads; None without a spread to compare with (a measure
    missing, or a single seed)."""
    if min(len(ours), len(theirs)) < 2:
        return None
    spread = max(statistics.stdev(ours), statistics.stdev(theirs))
    return statistics.fmean(ours) - statistics.fmean(theirs) > spread


def _scores(row: dict, init: str) -> list[float]:
    return [x for x in row.get(init, []) if x is not None]


def compare(results: dict, init: str, against: str, only: Callable[[str], bool] = lambda _: True) -> dict:
    """How ``init`` fares against ``against`` over the measures ``only`` keeps: measures ahead in the mean, and
    those where the gain exceeds the seed spread."""
    names = [name for name in results["measures"] if only(name)]
    ahead, beyond = [], []
    for name in names:
        ours, theirs = _scores(results["measures"][name], init), _scores(results["measures"][name], against)
        if ours and theirs and statistics.fmean(ours) > statistics.fmean(theirs):
            ahead.append(name)
        if beats(ours, theirs):
            beyond.append(name)
    return {"measures": len(names), "ahead": ahead, "beyond": beyond}


def _verdict(results: dict, init: str, against: str, only: Callable[[str], bool]) -> str:
    c = compare(results, init, against, only)
    if len(results["budget"]["seeds"]) < 2:
        return f"{init} ahead of {against} on {len(c['ahead'])}/{c['measures']} (one seed: no spread to beat)"
    return (
        f"{init} ahead of {against} on {len(c['ahead'])}/{c['measures']}, beyond the seed spread on "
        f"{len(c['beyond'])}" + (f" ({'; '.join(c['beyond'])})" if c["beyond"] else "")
    )


def report(results: dict) -> list[str]:
    """The table, the fine-tuning curves, the verdicts and the summary line."""
    b = results["budget"]
    others = [i for i in results["inits"] if i != RANDOM]
    sets = "; ".join(
        f"{source}: {p['images']} images ({p['epochs']:.1f} epochs), held-out MAE {p['heldout_mae']['initial']:.4f} "
        f"at init -> {p['heldout_mae']['pretrained']:.4f}"
        for source, p in results["pretraining"].items()
    )
    lines = [
        f"{b['pool']} renders ({b['junk']:.0%} junk) -> pretrained {results['pretrain_steps']} steps at "
        f"{b['image_size'][0]}x{b['image_size'][1]} on each set: {sets}; positive control: seg on {b['control']} other "
        f"renders, {b['control_steps']} steps; fine-tuning {b['steps']} steps, recipe of {len(b['lrs'])} rates x "
        f"{len(b['layer_decays'])} layer decays x {len(b['probe_steps'])} LP-FT chosen per init on {b['val']} val "
        f"renders (seed {b['seeds'][0]}); every score on {b['test']} test renders; seeds {list(b['seeds'])}; "
        f"{results['machine']}, {results['elapsed_s']:.0f} s",
        "| measure | random | " + " | ".join(f"{i} | > spread" for i in others) + " |",
        "|---|---|" + "---|---|" * len(others),
    ]
    for name, row in results["measures"].items():
        random = _scores(row, RANDOM)
        cells = [mean_std(random)]
        for init in others:
            verdict = beats(_scores(row, init), random)
            cells += [mean_std(_scores(row, init)), {True: "yes", False: "no", None: "n/a"}[verdict]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for n, per_init in results["finetune_curves"].items():
        lines.append(f"fine-tuning validation mIoU by step, {n} labels (mean over seeds, chosen recipe):")
        for init, runs in per_init.items():
            steps = [step for step, _ in runs[0]]
            means = [statistics.fmean(run[k][1] for run in runs) for k in range(len(steps))]
            recipe = results["finetune_recipe"][n][init]
            lines.append(f"  {init:>16} ({recipe}): " + "  ".join(f"{s}: {m:.4f}" for s, m in zip(steps, means)))
    for source, p in results["pretraining"].items():
        curve = p.get("curve", [])
        shown = sorted({*range(0, len(curve), max(1, len(curve) // 8)), len(curve) - 1} - {-1})
        course = "  ".join(f"{curve[i]['step']}: mae {curve[i]['mae']:.3f} cl {curve[i]['cl']:.2f}" for i in shown)
        if course:
            lines.append(f"pretraining on {source} by step: {course}")
    tuned = b.get("finetune_labels") or b["labels"]
    fewest = min(tuned)

    def fine_tune(name: str) -> bool:
        return name.startswith("fine-tune")

    def probe_or_fewest(name: str) -> bool:
        return name.startswith(("probe mIoU", f"fine-tune mIoU, {fewest} "))

    pretrained = [i for i in others if i not in (f"{RANDOM}-ls1", SUPERVISED)]
    verdicts = [f"control: {_verdict(results, SUPERVISED, RANDOM, fine_tune)} on fine-tuning"]
    verdicts += [
        f"{_verdict(results, i, RANDOM, probe_or_fewest)} on the probe and {fewest}-label fine-tuning"
        for i in pretrained
    ]
    if "curated" in results["inits"] and "raw" in results["inits"]:
        verdicts.append(f"{_verdict(results, 'curated', 'raw', lambda _: True)}")
    lines += [f"verdict: {v}" for v in verdicts]
    parts = []
    for n in tuned:
        ft = results["measures"][f"fine-tune mIoU, {n} labels (recipe on val)"]
        parts.append(
            f"fine-tune mIoU at {n} labels: "
            + ", ".join(f"{i} {statistics.fmean(ft[i]):.4f}" for i in results["inits"])
        )
    lines.append("summary: " + "; ".join(parts))
    return lines


# --- the command line ---------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def parse_args(argv: list[str] | None = None) -> tuple[Path, Budget, Path | None]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the whole path at a small size (about 10 min on 2 CPUs)")
    p.add_argument("--work", default=None, help="folder for every artefact (default out/pretrain_value[_quick])")
    p.add_argument("--data", default=None, help="folder of the renders and pretraining sets (default --work): chains "
                   "of other settings (another pretraining seed, say) share them")  # fmt: skip
    p.add_argument("--pool", type=int, help="renders in the pool before curation (junk included)")
    p.add_argument("--junk", type=float, help="fraction of the pool that is web junk")
    p.add_argument("--pretrain-steps", type=int, help="pretraining optimiser steps, on each set")
    p.add_argument("--labels", help="labelled training set sizes, comma-separated (prefixes of one another)")
    p.add_argument("--finetune-labels", help="those of --labels to fine-tune on, comma-separated (the presets: 16)")
    p.add_argument("--seeds", help="seeds (random inits, fine-tuning, probe hold-outs), comma-separated; the first "
                   "chooses the fine-tuning recipe")  # fmt: skip
    p.add_argument("--steps", type=int, help="fine-tuning steps of every run")
    p.add_argument("--lrs", help="fine-tuning optim.lr values to choose from on val, comma-separated")
    p.add_argument("--layer-decays", help="fine-tuning optim.layer_decay values to choose from, comma-separated")
    p.add_argument("--probe-steps", help="LP-FT: head-only steps to choose from, comma-separated (0: plain)")
    p.add_argument("--val", type=int, help="validation renders (choose the fine-tuning recipe)")
    p.add_argument("--test", type=int, help="test renders (every reported score)")
    p.add_argument("--heldout", type=int, help="held-out unlabelled renders for the MAE term")
    p.add_argument("--control", type=int, help="labelled renders the positive control is trained on")
    p.add_argument("--control-steps", type=int, help="the positive control's fine-tuning steps")
    p.add_argument("--export", default="student", help="pretrained backbones to compare: student, teacher or both")
    p.add_argument("--both-exports", action="store_true", help="compare the student and the EMA teacher")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"pretraining sets, of {sorted(SOURCES)}")
    p.add_argument("--grayscale", action="store_true", help="probe grayscale inputs too")
    p.add_argument("--size", default=None, help="model.size of pretraining and fine-tuning (default: the configs')")
    p.add_argument("--patch-size", type=int, default=None, help="model.patch_size of both")
    p.add_argument("--pretrain-override", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    p.add_argument("--finetune-override", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "cpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    exports = ("student", "teacher") if args.both_exports else tuple(args.export.split(","))
    if any(e not in EXPORT_FILES for e in exports):
        p.error(f"--export: one or more of {', '.join(sorted(EXPORT_FILES))}, comma-separated")
    sources = tuple(args.sources.split(","))
    if any(s not in SOURCES for s in sources):
        p.error(f"--sources: one or more of {', '.join(sorted(SOURCES))}, comma-separated")
    work = Path(args.work or f"out/pretrain_value{'_quick' if args.quick else ''}").resolve()
    data = Path(args.data).resolve() if args.data else None
    return work, Budget(
        pool=args.pool, junk=args.junk, pretrain_steps=args.pretrain_steps, labels=_ints(str(args.labels)),
        finetune_labels=_ints(args.finetune_labels) if args.finetune_labels else None,
        seeds=_ints(str(args.seeds)), steps=args.steps, lrs=_floats(str(args.lrs)),
        layer_decays=_floats(str(args.layer_decays)), probe_steps=_ints(str(args.probe_steps)), val=args.val,
        test=args.test, heldout=args.heldout, control=args.control, control_steps=args.control_steps,
        exports=exports, sources=sources, colours=("colour", "grayscale") if args.grayscale else ("colour",),
        size=args.size, patch_size=args.patch_size, pretrain_overrides=tuple(args.pretrain_override),
        finetune_overrides=tuple(args.finetune_override),
    ), data  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    work, budget, data = parse_args(argv)
    results = run_chain(work, budget, data=data)
    print()
    for line in report(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
