"""The GPU check's table: a row per measurement of each part, an error first, and how far a part cut off got."""

from benchmarks.gpu.results_table import GOALS, table_rows

EAGER = {"compile": False, "activation_checkpointing": "full", "reshard_after_forward": "always", "prefetch": 1,
         "batch": 2}  # fmt: skip
COMPILED = {"compile": True, "activation_checkpointing": "off", "reshard_after_forward": "never", "prefetch": 2,
            "batch": 4}  # fmt: skip


def test_the_value_rows_tell_each_cell_and_how_far_a_cut_off_chain_got():
    cell = {"measure": "probe mIoU", "init": "student", "random": "0.1000 ± 0.0100", "pretrained": "0.2000 ± 0.0100"}
    finished = {
        "size": "tiny", "patch_size": 8, "pool": 400, "pretrain_steps": 938, "global_batch": 128, "seconds": 90.0,
        "pretraining": {"curated": {"images": 160, "epochs": 750.4,
                                    "heldout_mae": {"initial": 1.3, "pretrained": 0.9}}},
        "pretrain_run": {"curated": {"step_s": 0.025, "images_per_s": 5120.0, "mfu": None}},
        "cells": [{**cell, "ahead": True, "beyond_spread": True}, {**cell, "measure": "k-NN", "ahead": False,
                                                                    "beyond_spread": False}],
        "verdicts": ["control: supervised ahead of random on 1/1, beyond the seed spread on 1"],
        "goal_met": False,
    }  # fmt: skip
    report = {
        "status": "error", "seconds": 331.0, "budget_s": 331.0, "error": "stopped at its time budget (331 s)",
        "models": [finished],
        "current": {"size": "0.1b", "running": "probe student, colour, seed 1",
                    "steps_s": {"pretrain in this process, 938 steps": 61}},
    }  # fmt: skip
    rows = {what: value for part, what, value in table_rows({"value": report}) if part == "value"}
    assert rows["ERROR"] == "stopped at its time budget (331 s)"
    assert rows["tiny (patch 8): 400 renders, 938 steps x 128 on each set"] == "chain 90.0 s"
    head = "tiny: pretrained on curated, 160 images (750.4 epochs)"
    assert rows[head].startswith("held-out MAE 1.3000 at init -> 0.9000; 0.025 s/step")
    assert rows["tiny: probe mIoU"].endswith("student 0.2000 ± 0.0100 | gain > seed spread yes")
    assert rows["tiny: k-NN"].endswith("gain > seed spread no")
    assert rows["tiny: pretrained beyond the seed spread on every fine-tuning cell"].startswith("no (1 of 2 cells")
    assert rows["tiny: verdict"].startswith("control: supervised ahead of random")
    assert rows["0.1b: unfinished (at: probe student, colour, seed 1)"] == "pretrain in this process, 938 steps 61 s"
    assert rows["seconds (budget)"] == "331.0 (331.0)"
    assert "every fine-tuning cell" in GOALS["value"]


def test_the_rows_of_the_first_three_parts_tell_their_figures():
    sweep = {"batch": 4, "images_per_s_running": None, "images_per_s_from_start": 3.5, "gpu_util_pct": None}
    parts = {
        "curation": {"status": "ok", "seconds": 40.0, "budget_s": 132.0, "sweep": [sweep], "best": sweep,
                     "images_per_s_per_gpu": 3.5, "ms_per_image": {"clip: aesthetic head": 0.01234}},
        "pretrain": {"status": "ok", "seconds": 20.0, "budget_s": 114.0, "device": "CPU", "size": "tiny",
                     "image": [64, 48], "peak_source": "none for 'CPU': no MFU",
                     "runs": [{**EAGER, "step_s": 0.5, "images_per_s": 4.0, "tokens_per_s": 1234,
                               "peak_mem_gib": None, "mfu": None},
                              {**COMPILED, "error": "OutOfMemoryError: x"}],
                     "best": {**EAGER, "step_s": 0.5, "images_per_s": 4.0}},
        "data_wait": {"status": "error", "seconds": 10.0, "budget_s": 10.0, "error": "stopped at its time budget"},
    }  # fmt: skip
    rows = {(part, what): value for part, what, value in table_rows(parts)}
    assert rows["curation", "batch 4: images/s running | from start | GPU util %"] == "None | 3.5 | None"
    assert rows["curation", "images/s per GPU (batch 4, from the start)"] == "3.5"
    assert rows["curation", "ms/image, clip: aesthetic head"] == "0.012"
    assert rows["pretrain", "tiny at [64, 48], CPU"] == "peak none for 'CPU': no MFU"
    eager = "eager, ckpt full, reshard always, prefetch 1, batch 2"
    assert rows["pretrain", eager] == "step 0.500 s, 4.0 img/s, 1,234 tok/s, peak mem n/a GiB, MFU n/a"
    assert rows["pretrain", "compiled, ckpt off, reshard never, prefetch 2, batch 4"] == "OutOfMemoryError: x"
    assert rows["pretrain", "best setting"] == eager
    assert rows["data_wait", "ERROR"] == "stopped at its time budget"
    assert [what for part, what, _ in table_rows(parts) if part == "data_wait"] == ["ERROR", "seconds (budget)"]


def test_a_profiled_setting_has_a_row_per_part_and_a_skipped_one_says_why():
    profiled = {**EAGER, "steps": 2, "step_ms": 120.0,
                "clock": "GPU kernel time", "total_ms": 80.5, "events": 1000, "profile_s": 3.0,
                "parts": [{"part": "attention", "ms": 20.125, "share": 0.25, "cpu_ms": 3.5},
                          {"part": "other", "ms": 60.375, "share": 0.75, "cpu_ms": 9.0}],
                "other_top": [{"name": "aten::copy_", "ms": 40.0}, {"name": "train_step", "ms": 1.5}]}  # fmt: skip
    skipped = {**COMPILED, "skipped": "12 s left, 30 s needed"}
    pretrain = {"status": "ok", "seconds": 20.0, "budget_s": 114.0, "breakdowns": [profiled, skipped]}  # fmt: skip
    rows = {what: value for _, what, value in table_rows({"pretrain": pretrain})}
    name = "breakdown, eager, ckpt full, reshard always, prefetch 1, batch 2"
    assert rows[name] == (
        "GPU kernel time: 80.5 ms/step summed over 2 profiled steps (120.0 ms/step wall under the profiler)"
    )
    assert rows[f"{name}: attention"] == "20.12 ms/step, 25.0%, host 3.50 ms"
    assert rows[f"{name}: other"] == "60.38 ms/step, 75.0%, host 9.00 ms"
    assert rows[f"{name}: other, by event (ms/step)"] == "aten::copy_ 40.00, train_step 1.50"
    assert (
        rows["breakdown, compiled, ckpt off, reshard never, prefetch 2, batch 4"] == "skipped: 12 s left, 30 s needed"
    )


def test_each_decode_path_of_the_data_wait_has_its_row():
    run = {"data_wait_frac_mean": 0.051, "data_wait_frac_max": 0.2, "step_s": 0.8, "mfu": 0.31}
    data_wait = {"status": "ok", "seconds": 60.0, "budget_s": 94.0, "setting": EAGER, "shards_images": 32,
                 "runs": [{**run, "decode_path": []},
                          {**run, "decode_path": ["data.read_segments=2", "data.prefetch_batches=8"],
                           "data_wait_frac_mean": 0.012}],
                 "skipped": [{"decode_path": ["data.read_cpus=2"], "why": "40 s left"}]}  # fmt: skip
    rows = [(what, value) for _, what, value in table_rows({"data_wait": data_wait})]
    name = "eager, ckpt full, reshard always, prefetch 1, batch 2, 32 curated images, decode path"
    assert rows[:3] == [
        (f"{name} the config's", "data wait 5.10% of the step (max 20.00%), step 0.800 s, MFU 31.0%"),
        (f"{name} data.read_segments=2 data.prefetch_batches=8",
         "data wait 1.20% of the step (max 20.00%), step 0.800 s, MFU 31.0%"),
        ("decode path data.read_cpus=2", "skipped: 40 s left"),
    ]  # fmt: skip
