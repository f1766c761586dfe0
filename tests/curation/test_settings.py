import pytest

from common.config import ConfigError, load_config, settings_fields
from curation.config import CurateConfig
from curation.stages import stage_classes

LITE = "configs/curate/lite.yaml"


def test_lite_profile_loads_with_stage_order(repo_root):
    cfg = load_config(CurateConfig, repo_root / LITE)
    assert cfg.profile == "lite"
    assert cfg.enabled_stages[0] == "decode"
    assert cfg.enabled_stages.index("person") < cfg.enabled_stages.index("text_overlay")


def test_overrides_set_nested_fields_with_yaml_values(repo_root):
    cfg = load_config(
        CurateConfig,
        repo_root / LITE,
        ["filters.min_short_side=512", "stages.text_overlay.enabled=false", "stages.person.actors=[1,4]"],
    )
    assert cfg.filters.min_short_side == 512
    assert "text_overlay" not in cfg.enabled_stages
    assert cfg.stages["person"].actors == (1, 4)


@pytest.mark.parametrize(
    "override, named",
    [
        ("filters.min_short_sid=512", "filters.min_short_sid: unknown key"),
        ("filters.min_short_side=abc", "filters.min_short_side"),
        ("filters.min_quality=1.5", "filters.min_quality"),
        ("stages.person.actors=[3,1]", "stages.person.actors"),
        ("stages.nonsense.batch_size=3", "unknown stage"),
        ("filters", "not of the form key=value"),
    ],
)
def test_bad_override_fails_naming_the_key(repo_root, override, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        load_config(CurateConfig, repo_root / LITE, [override])


def test_a_misspelt_stage_is_one_line_with_the_closest_name_and_no_internal_stage(repo_root, tmp_path):
    lite = (repo_root / LITE).read_text()
    assert "\n  person:" in lite
    (tmp_path / "bad.yaml").write_text(lite.replace("\n  person:", "\n  persn:", 1))  # the stages entry
    with pytest.raises(ConfigError) as raised:
        load_config(CurateConfig, tmp_path / "bad.yaml")
    header, line = str(raised.value).splitlines()
    assert header == f"invalid config ({tmp_path / 'bad.yaml'}):"
    assert line.startswith("  stages: unknown stage 'persn' (did you mean 'person'?); the stages are clip, decode,")
    assert "fault_injection" not in line and "batch_size" not in line  # neither the test stage nor the section


def test_decode_must_stay_first(repo_root):
    with pytest.raises(ConfigError, match="decode"):
        load_config(CurateConfig, repo_root / LITE, ["stages.decode.enabled=false"])


def test_results_hash_tracks_thresholds_not_resources(repo_root):
    base = load_config(CurateConfig, repo_root / LITE)
    more_actors = load_config(CurateConfig, repo_root / LITE, ["stages.person.actors=[2,8]"])
    stricter = load_config(CurateConfig, repo_root / LITE, ["filters.min_short_side=512"])
    assert base.results_hash() == more_actors.results_hash()
    assert base.results_hash() != stricter.results_hash()


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(CurateConfig, tmp_path / "nope.yaml")


def test_a_config_extends_its_base_key_by_key(repo_root, tmp_path):
    from finetune.config import FinetuneConfig

    seg = load_config(FinetuneConfig, repo_root / "configs/finetune/tiny-seg.yaml")
    base = load_config(FinetuneConfig, repo_root / "configs/finetune/tiny.yaml")
    assert seg.head.class_weights == "auto" and seg.steps == 300
    assert seg.head.sigma == base.head.sigma and seg.model == base.model and seg.optim == base.optim
    (tmp_path / "a.yaml").write_text("_base_: b.yaml\nsteps: 3\n")
    (tmp_path / "b.yaml").write_text("_base_: a.yaml\n")
    with pytest.raises(ConfigError, match="its own _base_"):
        load_config(FinetuneConfig, tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("_base_: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing.yaml does not exist"):
        load_config(FinetuneConfig, tmp_path / "c.yaml")


# --- the learning-rate rule: optim.lr is the rate of 256 images per optimiser step ------------------------------------


def test_peak_lr_scales_with_the_global_batch_and_min_lr_does_not():
    from training.config import OptimSettings
    from training.schedules import lr_at, peak_lr

    o = OptimSettings(lr=1e-3, min_lr=1e-5, warmup_steps=10)
    assert peak_lr(o, 256) == 1e-3
    assert peak_lr(o, 64) == pytest.approx(2.5e-4) and peak_lr(o, 1024) == pytest.approx(4e-3)
    for batch in (64, 1024):
        lrs = [lr_at(s, o, 100, batch) for s in range(101)]
        assert max(lrs) == lrs[9] == pytest.approx(peak_lr(o, batch))  # the schedule peaks at the scaled rate
        assert lrs[0] == pytest.approx(peak_lr(o, batch) / 10) and lrs[100] == pytest.approx(1e-5)


def test_global_batch_counts_workers_and_accumulation(repo_root):
    from pretrain.config import PretrainConfig
    from training.schedules import peak_lr

    tiny = repo_root / "configs/pretrain/tiny.yaml"
    one = load_config(PretrainConfig, tiny, ["data.batch_size=8", "ray.workers=1", "optim.grad_accum=1"])
    more = load_config(PretrainConfig, tiny, ["data.batch_size=8", "ray.workers=4", "optim.grad_accum=2"])
    assert (one.samples_per_step(), more.samples_per_step()) == (8, 64)
    assert peak_lr(more.optim, more.samples_per_step()) == pytest.approx(8 * peak_lr(one.optim, one.samples_per_step()))
    assert peak_lr(one.optim, one.samples_per_step()) == pytest.approx(one.optim.lr * 8 / 256)


def test_finetune_schedule_peaks_at_the_scaled_rate_per_world_size(repo_root):
    from finetune import tasks
    from finetune.config import FinetuneConfig
    from finetune.data import LabelInfo
    from finetune.train import build_model, build_optimizer, set_schedule

    cfg = load_config(FinetuneConfig, repo_root / "configs/finetune/tiny.yaml",
                      ["optim.warmup_steps=0", "optim.layer_decay=1.0", "head.class_weights=null"])  # fmt: skip
    info = LabelInfo(parts=("background", "skin"), keypoint_names=("a",), keypoint_sigmas=(0.05,), image_size=(64, 48))
    opt = build_optimizer(build_model(cfg, tasks.make("seg", cfg, info), None), cfg)
    for world in (1, 4):
        lr, _ = set_schedule(opt, cfg, 0, world)
        assert lr == pytest.approx(cfg.optim.lr * cfg.data.batch_size * world / 256)
        assert {g["lr"] for g in opt.param_groups} == {lr}  # layer decay 1: every group at the peak


def test_shipped_tiny_configs_keep_their_effective_rates(repo_root):
    """The tiny configs' rates at their shipped batch and workers, from before optim.lr became the 256-image rate."""
    from finetune.config import FinetuneConfig
    from pretrain.config import PretrainConfig
    from training.schedules import peak_lr

    pre = load_config(PretrainConfig, repo_root / "configs/pretrain/tiny.yaml")
    fine = load_config(FinetuneConfig, repo_root / "configs/finetune/tiny.yaml")
    assert peak_lr(pre.optim, pre.samples_per_step()) == 1e-3  # 4 x 1 x 2 workers
    assert peak_lr(fine.optim, fine.samples_per_step()) == 2e-3  # 8 x 1 worker


def test_a_fused_run_is_one_stage_group_with_its_disabled_stages_left_out(repo_root):
    run = "fused=[[person,head_pose,quality,text_overlay]]"
    cfg = load_config(CurateConfig, repo_root / LITE, [run])
    assert cfg.stage_groups == [
        ("decode",),
        ("person", "head_pose", "quality", "text_overlay"),
        ("nsfw",),
        ("phash",),
        ("embedding",),
    ]
    fewer = load_config(CurateConfig, repo_root / LITE, [run, "stages.head_pose.enabled=false"])
    assert fewer.stage_groups[1] == ("person", "quality", "text_overlay")
    plain = load_config(CurateConfig, repo_root / LITE, ["fused=[]"])
    assert plain.stage_groups == [(name,) for name in plain.enabled_stages]
    assert cfg.results_hash() == plain.results_hash()  # how stages share processes does not change results


@pytest.mark.parametrize(
    "run, named",
    [
        ("[[person,quality]]", "consecutive"),
        ("[[person]]", "at least two"),
        ("[[person,nonsense]]", "not among the configured stages"),
        ("[[person,head_pose],[head_pose,quality]]", "already in another fused run"),
    ],
)
def test_a_fused_run_that_cannot_be_one_step_is_refused(repo_root, run, named):
    with pytest.raises(ConfigError, match=named):
        load_config(CurateConfig, repo_root / LITE, [f"fused={run}"])


def test_every_settings_key_has_a_description():
    """The configuration reference is generated from the settings classes: each key, nested sections and every
    stage's own settings class included, carries its description in its field."""
    keys = {f.key: f.description for f in settings_fields(CurateConfig)}
    for name, stage in stage_classes().items():
        for f in settings_fields(type(stage.default_settings)):
            keys[f"stages.{name}.{f.key} ({type(stage.default_settings).__name__})"] = f.description
    assert len(keys) > 100
    assert not [key for key, description in keys.items() if not (description or "").strip()]
