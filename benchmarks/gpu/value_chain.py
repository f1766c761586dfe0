"""Part ``value``: does pretraining give a better backbone? ``benchmarks/pretrain_value.py``'s chain per model size,
each set pretrained in this process on the GPU; and its model-free steps made ahead (``--prepare-value-data``)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu.harness import MARGIN_S, Deadline, PartReport
from benchmarks.gpu.sizes import Sizes
from benchmarks.timing import synchronize


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
        if deadline.left() < MARGIN_S:
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
    from benchmarks import pretrain_value as pv

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
    import torch

    from benchmarks import pretrain_value as pv

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
            if deadline.left() < MARGIN_S:
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
    from benchmarks import pretrain_value as pv

    budget = pv.Budget(**{**sz.value_budget, "workers": os.cpu_count() or 1, "ray_cpus": None, "curate_overrides": ()})
    pv.Chain(folder, budget, data=folder).prepare_data()
    print(f"written: {folder} (pass it as --value-data)")
    return 0
