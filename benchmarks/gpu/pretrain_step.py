"""Part ``pretrain``: the backbone's pretraining step in one process over a sweep of its settings (eager or compiled,
activation checkpointing off / full / selective, FSDP2's reshard-after-forward and prefetch, the batch): step time,
throughput, peak memory and MFU of each, and the best; and where the step's time goes, from a few profiled steps of
the first setting of each built model (``step_profile.py``)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu.harness import MARGIN_S, REPO, Deadline, PartReport
from benchmarks.gpu.sizes import Sizes
from benchmarks.gpu.step_profile import profile_steps
from benchmarks.timing import timed

# Reading the profiler's events back after the profiled steps, a guess for one 0.4B step on a GPU: the tiny step's
# 14,500 CPU events took ~1.3 s on 2 vCPUs; 0.4B has 6x the blocks, and CUDA adds launches and kernels
PROFILE_READ_S = 30.0


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


def set_activation_checkpointing(model, mode: str) -> None:
    """Every block's checkpointing mode (``off``, ``full``, ``selective``): a flag read at each forward."""
    for module in model.modules():
        if hasattr(module, "activation_checkpointing"):
            module.activation_checkpointing = mode


@dataclass
class StepProbe:
    """More of a measured setting's steps, to take once its figures are reported; it holds the trainer."""

    trainer: Any
    micro_batches: list
    next_step: int
    device: Any

    def profile(self, steps: int) -> dict:
        """``steps`` steps under ``torch.profiler``: the breakdown by part (``step_profile.profile_steps``)."""
        self.next_step += steps
        return profile_steps(self.trainer, self.micro_batches, self.next_step - steps, steps, self.device)

    def flash_only(self) -> str:
        """One step with scaled-dot-product attention held to the flash kernel: whether every attention call of the
        step can take it (a mask, a dtype or a head size it lacks makes PyTorch refuse the call)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                self.trainer.train_step(self.next_step, self.micro_batches)
        except RuntimeError as exc:
            return f"not every call: {(str(exc).splitlines() or [''])[0][:200]}"
        finally:
            self.next_step += 1
        return "every call"


def measure_steps(cfg, model, device, warmup: int, steps: int, deadline: Deadline) -> tuple[dict, StepProbe]:
    """Step time of the worker's step (``pretrain.train.Trainer.train_step``: the objective, the learning-rate and
    weight-decay schedules, clipping, AdamW, the EMA teacher) on random uint8 images, median of ``steps`` after
    ``warmup``; throughput, memory and MFU from it. Also returns the probe that takes more of the same steps."""
    import torch

    from pretrain.train import Trainer, peak_flops, train_flops_per_image

    trainer = Trainer(model, cfg, device)  # one process: the global batch is its optim.grad_accum micro-batches
    images = torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8, device=device)
    micro_batches = [images] * cfg.optim.grad_accum
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(warmup + steps):
        if step > warmup and deadline.left() < MARGIN_S:
            break  # enough for a figure; the next setting may not fit otherwise
        times.append(timed(lambda step=step: trainer.train_step(step, micro_batches))[0])
    timed_steps = times[warmup:] or times[-1:]
    step_s = statistics.median(timed_steps)
    flops_per_image, tokens_per_image = train_flops_per_image(cfg)
    images_per_s = trainer.global_batch / step_s
    peak = peak_flops(cfg, device)
    result = {
        "step_s": round(step_s, 4),
        "first_step_s": round(times[0], 2),
        "timed_steps": len(timed_steps),
        "images_per_s": round(images_per_s, 2),
        "tokens_per_s": round(images_per_s * tokens_per_image),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "mfu": round(images_per_s * flops_per_image / peak, 4) if peak else None,
    }
    return result, StepProbe(trainer, micro_batches, len(times), device)


def breakdown_in_time(profile: Callable[[int], dict], steps: int, step_s: float, deadline: Deadline) -> dict:
    """``profile(steps)`` where the deadline leaves room for it, else why not; its error, not a raise."""
    need = MARGIN_S + PROFILE_READ_S + 3 * steps * step_s  # the profiler slows the steps down
    if deadline.left() < need:
        return {"skipped": f"{deadline.left():.0f} s left, {need:.0f} s needed"}
    try:
        return profile(steps)
    except Exception as exc:  # noqa: BLE001 - the timed figures stand without it
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


# A setting's axes and the config key each one sets: one model serves every setting of the same ``compile`` (the
# others change at run time: checkpointing is read at each forward, FSDP2's settings apply to the built model, the
# batch is the next step's input).
AXES = {
    "compile": "model.compile",
    "activation_checkpointing": "model.activation_checkpointing",
    "reshard_after_forward": "fsdp.reshard_after_forward",
    "prefetch": "fsdp.prefetch",
    "batch": "data.batch_size",
}


def setting_overrides(setting: dict) -> list[str]:
    """The config overrides that make ``setting`` the run's (also the data-wait part's run)."""
    return [f"{AXES[axis]}={json.dumps(value)}" for axis, value in setting.items()]


def sweep(axes: dict, measure: Callable[[dict], dict | None]) -> dict:
    """One axis at a time in ``axes``' order: each value of the axis with the best of the axes before it (and the
    first value of those after it); ``measure(setting)`` returns the measured row (``images_per_s`` where it ran),
    or None where the setting was not measured. Along ``batch`` (ascending) the first that runs out of memory ends
    the axis. Returns the best setting."""
    best = {axis: values[0] for axis, values in axes.items()}
    rows: dict[str, dict | None] = {}
    for axis, values in axes.items():
        measured = []
        for value in values:
            setting = {**best, axis: value}
            key = json.dumps(setting, sort_keys=True)
            if key not in rows:
                rows[key] = measure(setting)
            row = rows[key]
            if row and "images_per_s" in row:
                measured.append((row["images_per_s"], setting))
            elif axis == "batch" and row and "OutOfMemoryError" in row.get("error", ""):
                break
        if measured:
            best = max(measured, key=lambda m: m[0])[1]
    return best


def part_pretrain(sz: Sizes, deadline: Deadline, report: PartReport, context: dict) -> None:
    import torch

    from pretrain.train import PEAK_TFLOPS, build_model, fsdp_chains, peak_flops, train_flops_per_image
    from training.sharding import configure_fsdp

    device = init_single_process_group()
    cfg = pretrain_config(sz, context)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_flops(cfg, device)
    flops_per_image, tokens_per_image = train_flops_per_image(cfg)
    report.set(
        device=name,
        size=cfg.model.size,
        image=list(cfg.image_size),
        precision=cfg.precision if device.type == "cuda" else "fp32 (CPU)",
        train_tflop_per_image=round(flops_per_image / 1e12, 4),
        tokens_per_image=tokens_per_image,
        peak_tflops=peak / 1e12 if peak else None,
        peak_source=("--peak-tflops" if cfg.log.peak_tflops else f"pretrain.train.PEAK_TFLOPS for {name!r}")
        if peak
        else f"none for {name!r} (known: {sorted(PEAK_TFLOPS)}; pass --peak-tflops): no MFU",
        axes={axis: list(values) for axis, values in sz.pretrain_sweep.items()},
    )
    model, built, profiled = None, None, set[bool]()

    def measure(setting: dict) -> dict | None:
        nonlocal model, built
        if setting["compile"] and not sz.compile:
            report.append("skipped", {**setting, "why": "--cpu-smoke: inductor's CPU code generation takes minutes"})
            return None
        if deadline.left() < MARGIN_S:
            report.append("skipped", {**setting, "why": f"{deadline.left():.0f} s left"})
            return None
        cfg = pretrain_config(sz, context, *setting_overrides(setting))
        try:
            if built != setting["compile"]:
                model = None  # the eager model's memory goes before the compiled one is built
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                model, built = build_model(cfg, device), setting["compile"]
            set_activation_checkpointing(model, cfg.model.activation_checkpointing)
            configure_fsdp(fsdp_chains(model), cfg.fsdp)
            result, probe = measure_steps(cfg, model, device, sz.warmup, sz.steps, deadline)
        except Exception as exc:  # noqa: BLE001 - out of memory, a compiler error: that setting's row says so
            first_line = (str(exc).splitlines() or [""])[0][:300]
            row = {**setting, "error": f"{type(exc).__name__}: {first_line}"}
            report.append("runs", row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return row
        row = {**setting, **result}
        report.append("runs", row)  # before the profile: a part stopped in it keeps the figures
        if setting["compile"] not in profiled:  # the first setting of each built model
            profiled.add(setting["compile"])
            if not setting["compile"] and "flash_attention" not in report.data:
                report.set(flash_attention=probe.flash_only())
            if sz.profile_steps:
                breakdown = breakdown_in_time(probe.profile, sz.profile_steps, result["step_s"], deadline)
                report.append("breakdowns", {**setting, **breakdown})
        del probe  # the trainer's optimiser state goes before the next setting's
        return row

    best = sweep(sz.pretrain_sweep, measure)
    runs = [r for r in report.data.get("runs", []) if "step_s" in r]
    if not runs:
        raise RuntimeError("no setting completed a timed step")
    report.set(best=next(r for r in runs if all(r[axis] == value for axis, value in best.items())))
