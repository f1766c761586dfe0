"""The GPU check's sizes: one run changes a field, or a key of a dict field, and the defaults stay as they are."""

import pytest

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
    assert GPU.pretrain_settings == SMOKE.pretrain_settings  # the same settings measured, eager ones first
    assert not any(compiled for compiled, _ in GPU.pretrain_settings[:2])
    # what --prepare-value-data passes to pretrain_value.Budget with the sizes: each mode names the same keys
    assert set(SMOKE.value_budget) <= set(GPU.value_budget)
