"""The GPU check's sizes: one run changes a field, or a key of a dict field, and the defaults stay as they are."""

import pytest

from benchmarks.gpu.pretrain_step import AXES
from benchmarks.gpu.sizes import GPU, SMOKE, Sizes, resized


def test_one_run_changes_sizes_by_field_or_dict_key():
    sz = resized(GPU, ['value_models=[["tiny", null, ["optim.lr=2e-3"]]]', "value_budget.steps=1000"])
    assert sz.value_models == (("tiny", None, ("optim.lr=2e-3",)),)
    assert sz.value_budget["steps"] == 1000 and GPU.value_budget["steps"] == 600  # the default is untouched
    assert {k: v for k, v in sz.value_budget.items() if k != "steps"} == {
        k: v for k, v in GPU.value_budget.items() if k != "steps"
    }
    for bad in ("budget_steps=1000", "images.x=1", "images=ten", "images"):
        with pytest.raises(ValueError, match="--size"):
            resized(GPU, [bad])


def test_the_two_modes_differ_in_sizes_only_and_smoke_skips_compiling():
    assert isinstance(GPU, Sizes) and isinstance(SMOKE, Sizes)
    assert GPU.compile and not SMOKE.compile  # inductor's CPU code generation takes minutes
    # the same axes swept, eager first; only the batch sizes differ
    assert {k: v for k, v in GPU.pretrain_sweep.items() if k != "batch"} == {
        k: v for k, v in SMOKE.pretrain_sweep.items() if k != "batch"
    }
    assert list(GPU.pretrain_sweep) == list(AXES) and GPU.pretrain_sweep["compile"][0] is False
    for sz in (GPU, SMOKE):
        assert list(sz.pretrain_sweep["batch"]) == sorted(sz.pretrain_sweep["batch"])  # the first OOM ends the axis
    # what --prepare-value-data passes to pretrain_value.Budget with the sizes: each mode names the same keys
    assert set(SMOKE.value_budget) <= set(GPU.value_budget)
