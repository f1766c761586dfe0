"""Part pretrain of the GPU check: the config it measures, checkpointing switched on one built model, and the
profiled breakdown of a step by part."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from benchmarks.gpu.harness import MARGIN_S, Deadline
from benchmarks.gpu.pretrain_step import (
    PROFILE_READ_S,
    StepProbe,
    breakdown_in_time,
    pretrain_config,
    set_activation_checkpointing,
    setting_overrides,
    sweep,
)
from benchmarks.gpu.sizes import SMOKE
from benchmarks.gpu.step_profile import PARTS, breakdown, label_events, profile_steps
from pretrain.backbone import SIZES, Block, grid_coords, rope_tables, step_part
from pretrain.train import Trainer, build_model


def test_the_config_is_one_process_at_the_modes_sizes_with_the_peak_given():
    cfg = pretrain_config(SMOKE, {"peak_tflops": 123.0}, "steps=7")
    assert cfg.ray.workers == 1 and cfg.steps == 7 and cfg.data.batch_size == 2
    assert cfg.log.peak_tflops == 123.0
    assert pretrain_config(SMOKE, {}).log.peak_tflops is None  # the peak by device name (pretrain.train.PEAK_TFLOPS)


def test_checkpointing_is_set_on_every_module_that_has_it():
    class Block(torch.nn.Module):
        activation_checkpointing = "off"

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2), torch.nn.Sequential(Block()))
    set_activation_checkpointing(model, "selective")
    assert [m.activation_checkpointing for m in model.modules() if isinstance(m, Block)] == ["selective"] * 2
    assert not hasattr(model[1], "activation_checkpointing")


def test_a_setting_is_its_config_overrides():
    setting = {"compile": True, "activation_checkpointing": "selective", "reshard_after_forward": "never",
               "prefetch": 2, "batch": 4}  # fmt: skip
    cfg = pretrain_config(SMOKE, {}, *setting_overrides(setting))
    assert (cfg.model.compile, cfg.model.activation_checkpointing) == (True, "selective")
    assert (cfg.fsdp.reshard_after_forward, cfg.fsdp.prefetch, cfg.data.batch_size) == ("never", 2, 4)


def test_the_sweep_takes_one_axis_at_a_time_from_the_best_so_far():
    axes = {"compile": (False, True), "activation_checkpointing": ("full", "off"), "batch": (2, 4, 8, 16)}
    speed = {(False, "full"): 1.0, (True, "full"): 3.0, (True, "off"): 2.0, (False, "off"): 9.0}  # 9: never measured
    measured = []

    def measure(setting: dict) -> dict | None:
        measured.append(dict(setting))
        if setting["batch"] >= 8:
            return {**setting, "error": "OutOfMemoryError: CUDA out of memory"}
        return {
            **setting,
            "images_per_s": speed[setting["compile"], setting["activation_checkpointing"]] * setting["batch"],
        }

    best = sweep(axes, measure)
    assert best == {"compile": True, "activation_checkpointing": "full", "batch": 4}
    assert [(m["compile"], m["activation_checkpointing"], m["batch"]) for m in measured] == [
        (False, "full", 2), (True, "full", 2),  # compile: the faster one is kept
        (True, "off", 2),  # checkpointing: (True, full, 2) is not measured twice
        (True, "full", 4), (True, "full", 8),  # batch: the first out of memory ends the axis (16 not tried)
    ]  # fmt: skip


def test_a_setting_not_measured_leaves_its_axis_at_the_best_so_far():
    axes = {"compile": (False, True), "batch": (2, 4)}
    best = sweep(axes, lambda s: None if s["compile"] else {"images_per_s": s["batch"]})  # compile skipped
    assert best == {"compile": False, "batch": 4}


@pytest.fixture
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_backward_work_takes_the_part_of_the_forward_op_it_differentiates():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)

    def mlp(x):
        with step_part("mlp"):
            return (x @ w).relu()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        # recomputed under checkpointing: the forward runs again inside the backward pass
        y = checkpoint(mlp, x, use_reentrant=False)
        (y @ w).sum().backward()
    parts: dict[str, list[str]] = {}
    for evt, part in label_events(prof.events()):
        parts.setdefault(evt.name, []).append(part)
    assert parts["ReluBackward0"] == ["mlp"] and parts["aten::threshold_backward"] == ["mlp"]
    assert sorted(parts["MmBackward0"]) == ["mlp", "other"]  # the second matmul is outside the range
    assert parts["aten::relu"] == ["mlp", "mlp"]  # the forward and its recomputation
    assert parts["aten::sum"] == ["other"]


def test_the_profiled_step_gives_each_part_its_time_and_the_shares_sum_to_one(one_process):
    cfg = pretrain_config(SMOKE, {})
    model = build_model(cfg, one_process)
    trainer = Trainer(model, cfg, one_process)
    images = [torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8)]
    trainer.train_step(0, images)  # warm
    b = profile_steps(trainer, images, first_step=1, steps=2, device=one_process)
    parts = {p["part"]: p for p in b["parts"]}
    assert list(parts) == list(PARTS) and b["clock"] == "CPU time, all threads" and b["steps"] == 2
    for name in ("attention", "mlp", "norm", "rope", "fsdp", "optimizer", "ema_teacher", "mae_decoder", "other"):
        assert parts[name]["ms"] > 0, name
    assert parts["compiled_blocks"]["ms"] == 0  # eager: no compiled region
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1, abs=2e-3)
    assert sum(p["ms"] for p in parts.values()) == pytest.approx(b["total_ms"], rel=1e-3)
    top = b["other_top"]
    assert 0 < len(top) <= 8 and top == sorted(top, key=lambda e: -e["ms"]) and top[0]["ms"] <= parts["other"]["ms"]
    # one thread runs the forward, the backward and the optimiser: the summed self time is the step's wall time
    assert 0.8 * b["step_ms"] < b["total_ms"] < 1.05 * b["step_ms"]


def test_a_compiled_block_is_one_part_forward_and_backward():
    cfg = SIZES["tiny"]
    block = torch.compile(Block(cfg, cfg.heads), backend="aot_eager", fullgraph=True)  # the ranges do not break it
    # a batch big enough that the block outweighs the fixed glue around it (the cache lookup, the sum, AccumulateGrad)
    x = torch.randn(32, 15, cfg.width)
    rope = rope_tables(grid_coords(2, 3), cfg.head_dim, cfg.rope_base, 1 + cfg.num_registers)
    block(x, rope).sum().backward()  # compiled before the profiled pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x, rope).sum().backward()
    b = breakdown(prof.events(), 1, device_time=False)
    shares = {p["part"]: p["share"] for p in b["parts"]}
    assert shares["compiled_blocks"] > 0.8  # the sum, its backward and the glue are the rest
    assert not [e["name"] for e in b["other_top"] if any(k in e["name"] for k in ("mm", "softmax", "attention"))]
    assert shares["attention"] == shares["mlp"] == shares["norm"] == 0  # dynamo drops the ranges inside the graph


def test_the_profile_runs_only_where_the_deadline_leaves_room_and_its_error_is_reported():
    def profile(n: int) -> dict:
        raise RuntimeError(f"CUPTI unavailable for {n} steps")

    need = MARGIN_S + PROFILE_READ_S + 3 * 2 * 1.0  # the steps under the profiler, then reading its events
    soon, later = Deadline(time.monotonic() + need - 3), Deadline(time.monotonic() + need + 60)
    assert breakdown_in_time(profile, 2, step_s=1.0, deadline=soon)["skipped"].endswith(f"{need:.0f} s needed")
    assert breakdown_in_time(profile, 2, 1.0, later) == {"error": "RuntimeError: CUPTI unavailable for 2 steps"}
    assert breakdown_in_time(lambda n: {"steps": n}, 2, 1.0, later) == {"steps": 2}


def test_the_flash_probe_runs_a_step_on_the_flash_kernel_alone_and_says_why_not(one_process):
    cfg = pretrain_config(SMOKE, {})
    trainer = Trainer(build_model(cfg, one_process), cfg, one_process)
    images = [torch.randint(0, 256, (cfg.data.batch_size, 3, *cfg.image_size), dtype=torch.uint8)]
    probe = StepProbe(trainer, images, next_step=0, device=one_process)
    assert probe.flash_only() == "every call" and probe.next_step == 1  # the CPU's flash kernel

    class Refused:  # what PyTorch raises where a call's mask, dtype or head size rules the kernel out
        def train_step(self, step, micro_batches):
            raise RuntimeError("No available kernel. Aborting execution.\nmore")

    probe = StepProbe(Refused(), images, next_step=3, device=one_process)
    assert probe.flash_only() == "not every call: No available kernel. Aborting execution." and probe.next_step == 4
