"""Metrics backends (training/metrics_sinks.py): TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import tensorboard_scalars

from common.config import ConfigError, load_config
from pretrain.config import PretrainConfig
from training.metrics_sinks import Sinks, scalars

REPO = Path(__file__).resolve().parents[2]


def test_records_become_grouped_scalars_and_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    def record(step: int, attempt: int) -> dict:
        return {"kind": "train", "step": step, "epoch": 0, "loss": step + attempt / 10, "lr": 0.1,
                "images_per_s": 5.0, "teacher_entropy": 1.5, "collapse": None,
                "data_wait_frac": float("nan")}  # fmt: skip

    groups = {"teacher_entropy": "contrastive"}
    first = Sinks(["tensorboard"], str(tmp_path), 0, {"steps": 8}, groups)
    for step in range(1, 7):
        first.log(record(step, 0))
        if step == 4:
            first.checkpoint()
    first.log({"kind": "checkpoint", "step": 4, "uri": "x"})  # not a metrics record: no scalar
    first.log({"kind": "eval", "step": 6, "mIoU": 0.25})  # past the checkpoint: the resume's purge drops it
    # killed after step 6 without closing; the resume starts from the checkpoint at step 4
    second = Sinks(["tensorboard"], str(tmp_path), 4, {"steps": 8}, groups)
    for step in range(5, 9):
        second.log(record(step, 1))
    second.log({"kind": "eval", "step": 8, "mIoU": 0.5, "IoU": [0.5, 0.5]})
    second.close()

    got = tensorboard_scalars(tmp_path)
    assert set(got) == {"loss/loss", "optim/lr", "perf/images_per_s", "contrastive/teacher_entropy", "eval/mIoU"}
    assert got["loss/loss"] == pytest.approx({s: s + (0.1 if s > 4 else 0.0) for s in range(1, 9)})
    assert got["eval/mIoU"] == {8: 0.5}
    assert scalars(record(3, 0), groups) == {"loss/loss": 3.0, "optim/lr": 0.1, "perf/images_per_s": 5.0,
                                             "contrastive/teacher_entropy": 1.5}  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="mlflow is installed")
def test_a_backend_that_is_not_installed_is_refused_when_the_config_is_read():
    with pytest.raises(ConfigError, match="pip install mlflow"):
        load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", ["log.backends=[tensorboard,mlflow]"])
    with pytest.raises(ConfigError, match=r"log.backends"):
        load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", ["log.backends=[neptune]"])
    assert load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml").log.backends == ["tensorboard"]
