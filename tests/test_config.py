import pytest

from common.config import ConfigError, load_config
from curation.config import CurateConfig

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
