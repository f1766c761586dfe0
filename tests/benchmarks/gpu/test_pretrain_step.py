"""Part pretrain of the GPU check: the config it measures, and checkpointing switched on one built model."""

import torch

from benchmarks.gpu.pretrain_step import pretrain_config, set_activation_checkpointing
from benchmarks.gpu.sizes import SMOKE


def test_the_config_is_one_process_at_the_modes_sizes_with_the_peak_given():
    cfg = pretrain_config(SMOKE, {"peak_tflops": 123.0}, "steps=7")
    assert cfg.ray.workers == 1 and cfg.steps == 7 and cfg.data.batch_size == 2
    assert cfg.log.peak_tflops == 123.0
    assert pretrain_config(SMOKE, {}).log.peak_tflops is None  # the peak by device name (pretrain.train.PEAK_TFLOPS)


def test_checkpointing_is_set_on_every_module_that_has_it():
    class Block(torch.nn.Module):
        activation_checkpointing = False

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2), torch.nn.Sequential(Block()))
    set_activation_checkpointing(model, True)
    assert [m.activation_checkpointing for m in model.modules() if isinstance(m, Block)] == [True, True]
    assert not hasattr(model[1], "activation_checkpointing")
