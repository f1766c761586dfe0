"""A new stage is one module in curation/stages/ plus its entry in a config: no other file names it."""

import sys

import numpy as np
import pytest
from PIL import Image

import curation.stages
from common import schema
from common.config import ConfigError, load_config
from curation.config import CurateConfig
from curation.score.phase import score_in_process
from curation.score.pool import list_shards
from curation.score.stage import Stage

PORTRAIT_FILTER = """
from curation.score.stage import Row, Stage, StageSettings, Update, reject


class PortraitFilterStage(Stage):
    name = "portrait_filter"
    reads = ("width", "height")
    default_settings = StageSettings(batch_size=3, num_cpus=0.25)

    def process_batch(self, rows: list[Row]) -> list[Update]:
        return [reject("portrait", f"{r['height']} > {r['width']}") if r["height"] > r["width"] else {} for r in rows]
"""

CONFIG = """
stages:
  decode: {}
  portrait_filter: {batch_size: 2}
"""


@pytest.fixture
def portrait_filter_module(tmp_path, monkeypatch):
    """The stage's module in a folder on curation.stages' path, as if the file had been added to curation/stages/;
    the registry is restored afterwards."""
    folder = tmp_path / "added_stages"
    folder.mkdir()
    (folder / "portrait_filter.py").write_text(PORTRAIT_FILTER)
    monkeypatch.setattr(curation.stages, "__path__", [*curation.stages.__path__, str(folder)])
    monkeypatch.setattr(Stage, "registry", dict(Stage.registry))
    yield
    sys.modules.pop("curation.stages.portrait_filter", None)


def _pool(folder, sizes: dict[str, tuple[int, int]]) -> None:
    folder.mkdir()
    for name, size in sizes.items():
        pixels = np.random.default_rng(len(name)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name, "JPEG", quality=90)


def test_default_stage_order_is_the_lite_profiles():
    assert list(CurateConfig().stages) == [
        "decode",
        "person",
        "head_pose",
        "quality",
        "text_overlay",
        "phash",
        "embedding",
    ]


def test_a_stage_module_alone_makes_a_stage_the_config_accepts_and_the_runner_runs(tmp_path, request):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    with pytest.raises(ConfigError, match="unknown stage"):
        load_config(CurateConfig, tmp_path / "tiny.yaml")
    request.getfixturevalue("portrait_filter_module")

    cfg = load_config(CurateConfig, tmp_path / "tiny.yaml")

    assert cfg.enabled_stages == ["decode", "portrait_filter"]
    settings = cfg.stages["portrait_filter"]
    assert (settings.batch_size, settings.num_cpus) == (2, 0.25)  # the entry's field, then the class's defaults
    _pool(tmp_path / "pool", {"wide.jpg": (480, 400), "square.jpg": (400, 400), "tall.jpg": (400, 480)})
    table = score_in_process(cfg, list_shards(str(tmp_path / "pool"), cfg.input), str(tmp_path / "pool"))
    fates = {
        r["source"].rsplit("/", 1)[-1]: r for r in table.select(["source", "status", "stage", "reason"]).to_pylist()
    }
    assert {name: (r["status"], r["stage"]) for name, r in fates.items()} == {
        "wide.jpg": (schema.KEPT, "portrait_filter"),
        "square.jpg": (schema.KEPT, "portrait_filter"),
        "tall.jpg": (schema.REJECTED, "portrait_filter"),
    }
    assert fates["tall.jpg"]["reason"] == "portrait: 480 > 400"
