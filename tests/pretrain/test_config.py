"""The model settings of pretraining and fine-tuning (pretrain/config.py): activation checkpointing's modes, and the
flag it was before, in configs and in recorded runs."""

from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from finetune.config import FinetuneConfig
from pretrain.config import ModelSettings, PretrainConfig
from training.runner import check_run, claim_run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "pretrain/tiny.yaml"


@pytest.mark.parametrize(
    ("given", "mode"), [("true", "full"), ("false", "off"), ("off", "off"), ("selective", "selective")]
)
def test_checkpointing_overrides_name_a_mode_and_a_yaml_bool_the_mode_it_stood_for(given, mode):
    cfg = load_config(PretrainConfig, TINY, [f"model.activation_checkpointing={given}"])  # YAML reads `off` as false
    assert cfg.model.activation_checkpointing == mode
    assert cfg.model.backbone().activation_checkpointing == mode


def test_the_shipped_configs_checkpoint_fully_and_an_unknown_mode_is_refused():
    assert load_config(PretrainConfig, CONFIGS / "pretrain/sapiens2_0.4b.yaml").model.activation_checkpointing == "full"
    assert load_config(FinetuneConfig, CONFIGS / "finetune/sapiens2_0.4b.yaml").model.activation_checkpointing == "full"
    assert ModelSettings().activation_checkpointing == "off"
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(PretrainConfig, TINY, ["model.activation_checkpointing=some"])


def test_a_run_recorded_with_the_flag_reads_back_and_resumes_with_a_mode(tmp_path):
    recorded = load_config(PretrainConfig, TINY).model_dump(mode="json")
    recorded["model"]["activation_checkpointing"] = True  # a checkpoint's config from when the setting was a flag
    old = PretrainConfig.model_validate(recorded)
    assert old.model.activation_checkpointing == "full"
    run, identity = str(tmp_path / "run"), {"model_hash": old.model_hash()}
    claim_run(run, identity, old.result_settings())
    # how the blocks recompute is not part of the run: a resume may change it
    for mode in ("full", "selective", "off"):
        now = load_config(PretrainConfig, TINY, [f"model.activation_checkpointing={mode}"])
        assert now.model_hash() == old.model_hash() and check_run(run, identity, now.result_settings()) == {}


def test_a_global_batch_splits_among_the_workers_or_names_the_counts_that_fit():
    cfg = load_config(PretrainConfig, TINY, ["data.global_batch=32", "data.batch_size=8"])
    assert [cfg.split(w) for w in (1, 2, 4, 8, 32)] == [(8, 4), (8, 2), (8, 1), (4, 1), (1, 1)]
    assert all(cfg.samples_per_step(w) == 32 for w in (1, 2, 4))
    resolved = cfg.for_workers(2)
    assert (resolved.data.batch_size, resolved.optim.grad_accum, resolved.samples_per_step()) == (8, 2, 32)
    assert "ray.workers" not in cfg.result_settings() and cfg.result_settings()["data.global_batch"] == 32
    with pytest.raises(ConfigError, match=r"global_batch=32 does not divide among 3 workers: it fits 1, 2, 4, 8"):
        cfg.split(3)
    with pytest.raises(ConfigError, match=r"optim\.grad_accum is derived from data\.global_batch"):
        load_config(PretrainConfig, TINY, ["data.global_batch=32", "optim.grad_accum=2"])
    plain = load_config(PretrainConfig, TINY, ["data.batch_size=4", "optim.grad_accum=2"])
    assert plain.for_workers(2) is plain and plain.split(2) == (4, 2) and "ray.workers" in plain.result_settings()
