"""Where a pretraining step's time goes: ``torch.profiler`` over a few warm steps, its events' self time summed by
part of the step (attention, SwiGLU, norms, RoPE, FSDP, AdamW, the EMA teacher, the MAE decoder, other).

The parts are the ``step:<part>`` ranges the model and trainer open (``pretrain.backbone.step_part``), FSDP2's own
``FSDP::`` ranges (its all-gathers, reduce-scatters and their copies) and, under ``torch.compile``, the compiled
regions, inside which dynamo drops the ranges. The profiler's times are inflated by its own per-op cost; read the
shares, and the unprofiled step time of the run beside them."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch.autograd.profiler_util import FunctionEvent

from benchmarks.timing import synchronize
from pretrain.backbone import STEP_PART

PARTS = (
    "attention",
    "mlp",
    "norm",
    "rope",
    "fsdp",
    "optimizer",
    "ema_teacher",
    "mae_decoder",
    "compiled_blocks",
    "other",
)
OTHER_TOP = 8  # the events named under "other"
_BACKWARD_FUNCTION = 1  # RecordScope.BACKWARD_FUNCTION: the event of an autograd node run by the engine
_EVALUATE = "autograd::engine::evaluate_function: "  # the engine's range around a node (its gradient sums too)


def range_part(name: str) -> str | None:
    """The part a range of this name opens, or None for an event that is not such a range."""
    if name.startswith(STEP_PART):
        return name[len(STEP_PART) :]
    if name.startswith("FSDP::"):
        return "fsdp"
    if name.startswith(("Torch-Compiled Region", "CompiledFunction")):
        return "compiled_blocks"
    return None


def _enclosing(evt: FunctionEvent | None, forward: dict[tuple[int, int | None], str]) -> tuple[str | None, bool]:
    """(the part of the innermost range around ``evt`` or of the forward op its backward node came from, else
    None; whether a backward node encloses it)."""
    in_backward = False
    while evt is not None:
        part = range_part(evt.name)
        if part is not None:
            return part, in_backward
        if evt.scope == _BACKWARD_FUNCTION or evt.name.startswith(_EVALUATE):
            in_backward = True
            part = forward.get((evt.sequence_nr, evt.fwd_thread))
            if part is not None:
                return part, True
        evt = evt.cpu_parent
    return None, in_backward


def label_events(events: Sequence[FunctionEvent]) -> list[tuple[FunctionEvent, str]]:
    """Every host-side event with its part.

    An event belongs to the innermost named range around it. The backward pass runs in the autograd engine, outside
    the forward's ranges, so a backward node's work takes the part of the forward op that created the node: the
    profiler gives both the same sequence number, the node also its forward op's thread (the pairing torch's own
    ``EventList._set_backward_stacktraces`` uses). That holds for any module, with or without activation
    checkpointing (recomputed forwards open their ranges again inside the backward node) and needs no hooks on the
    backward. Time under no part is "other"."""
    host = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: (e.time_range.start, -e.time_range.end),
    )
    forward: dict[tuple[int, int | None], str] = {}
    for evt in host:
        if evt.sequence_nr >= 0:
            part, in_backward = _enclosing(evt, {})
            if not in_backward:
                forward.setdefault((evt.sequence_nr, evt.thread), part or "other")  # the outermost op of the number
    return [(evt, _enclosing(evt, forward)[0] or "other") for evt in host]


def breakdown(events: Sequence[FunctionEvent], steps: int, device_time: bool) -> dict:
    """Per part: ms per step and share of the summed self time. Self times add up to the whole profiled time without
    counting anything twice (a range's own self time is the Python between its ops), so the shares sum to 1. On a GPU
    the shares are of kernel time (each kernel counted on the host op that launched it), with the host time beside
    them; on a CPU of host time over all threads."""
    host_us: dict[str, float] = defaultdict(float)
    device_us: dict[str, float] = defaultdict(float)
    other_us: dict[str, float] = defaultdict(float)  # by event name: what "other" is made of
    labelled = label_events(events)
    for evt, part in labelled:
        host_us[part] += evt.self_cpu_time_total
        if device_time:
            device_us[part] += evt.self_device_time_total
        if part == "other":
            other_us[evt.name] += evt.self_device_time_total if device_time else evt.self_cpu_time_total
    main = device_us if device_time else host_us
    total = sum(main.values()) or 1.0
    parts = []
    for part in (*PARTS, *sorted(set(host_us) - set(PARTS))):  # a new step_part name shows up as its own row
        row = {"part": part, "ms": round(main[part] / 1e3 / steps, 3), "share": round(main[part] / total, 4)}
        if device_time:
            row["cpu_ms"] = round(host_us[part] / 1e3 / steps, 3)
        parts.append(row)
    return {
        "clock": "GPU kernel time" if device_time else "CPU time, all threads",
        "total_ms": round(sum(main.values()) / 1e3 / steps, 3),
        "events": len(labelled),
        "parts": parts,
        "other_top": [
            {"name": name, "ms": round(us / 1e3 / steps, 3)}
            for name, us in sorted(other_us.items(), key=lambda kv: -kv[1])[:OTHER_TOP]
        ],
    }


def profile_steps(trainer, micro_batches: Iterable[torch.Tensor], first_step: int, steps: int, device) -> dict:
    """``steps`` of ``trainer.train_step`` (warm already) under the profiler, CPU and, on a GPU, CUDA activity, then
    ``breakdown``; the trace itself is not kept. Adds the profiled wall time per step and the seconds it all took."""
    from torch.profiler import ProfilerActivity, profile

    micro_batches = list(micro_batches)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        synchronize()
        t0 = time.perf_counter()
        for step in range(first_step, first_step + steps):
            with torch.profiler.record_function("train_step"):  # its self time: the Python between the ops (other)
                trainer.train_step(step, micro_batches)
        synchronize()
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
    result = breakdown(prof.events(), steps, device_time=cuda)
    return {"steps": steps, "step_ms": round(step_ms, 2), **result, "profile_s": round(time.perf_counter() - start, 1)}
