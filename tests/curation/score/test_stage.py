"""A new stage is one module in curation/stages/ plus its entry in a config: no other file names it."""

import sys

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

import curation.stages
from common import schema
from common.config import ConfigError, load_config
from curation.config import CurateConfig, config_from_json
from curation.score.chain import score_in_process
from curation.score.pool import Pool, list_shards
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


def _added_stage(tmp_path, monkeypatch, name: str, source: str):
    """The stage's module in a folder on curation.stages' path, as if the file had been added to curation/stages/;
    the registry is restored afterwards."""
    folder = tmp_path / "added_stages"
    folder.mkdir()
    (folder / f"{name}.py").write_text(source)
    monkeypatch.setattr(curation.stages, "__path__", [*curation.stages.__path__, str(folder)])
    monkeypatch.setattr(Stage, "registry", dict(Stage.registry))
    yield
    sys.modules.pop(f"curation.stages.{name}", None)


@pytest.fixture
def portrait_filter_module(tmp_path, monkeypatch):
    yield from _added_stage(tmp_path, monkeypatch, "portrait_filter", PORTRAIT_FILTER)


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
        "nsfw",
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
    table = score_in_process(cfg, list_shards(Pool.at(str(tmp_path / "pool")), cfg.input), str(tmp_path / "pool"))
    fates = {
        r["source"].rsplit("/", 1)[-1]: r for r in table.select(["source", "status", "stage", "reason"]).to_pylist()
    }
    assert {name: (r["status"], r["stage"]) for name, r in fates.items()} == {
        "wide.jpg": (schema.KEPT, "portrait_filter"),
        "square.jpg": (schema.KEPT, "portrait_filter"),
        "tall.jpg": (schema.REJECTED, "portrait_filter"),
    }
    assert fates["tall.jpg"]["reason"] == "portrait: 480 > 400"


ASPECT_STAGE = """
import pyarrow as pa
from pydantic import Field

from curation.score.stage import Row, Stage, StageSettings, Update, reject


class AspectSettings(StageSettings):
    max_ratio: float = Field(1.1, gt=0)


class AspectStage(Stage):
    name = "aspect"
    reads = ("width", "height")
    columns = (pa.field("aspect_ratio", pa.float32()),)
    default_settings = AspectSettings(batch_size=2, num_cpus=0.25)

    def process_batch(self, rows: list[Row]) -> list[Update]:
        limit = self.settings.max_ratio
        out = []
        for r in rows:
            ratio = r["width"] / r["height"]
            out.append({"aspect_ratio": ratio, **(reject("too_wide", f"{ratio:.2f}") if ratio > limit else {})})
        return out
"""

ASPECT_CONFIG = """
stages:
  decode: {}
  aspect: {max_ratio: 1.5}
"""


@pytest.fixture
def aspect_module(tmp_path, monkeypatch):
    """A stage that writes a column of its own and has a threshold of its own, added as one file."""
    yield from _added_stage(tmp_path, monkeypatch, "aspect", ASPECT_STAGE)


def test_a_stage_that_writes_a_new_column_is_one_file_plus_its_yaml_entry(tmp_path, aspect_module):
    (tmp_path / "aspect.yaml").write_text(ASPECT_CONFIG)
    cfg = load_config(CurateConfig, tmp_path / "aspect.yaml")

    assert cfg.stages["aspect"].max_ratio == 1.5  # type: ignore[attr-defined]  # the stage's own settings class
    assert config_from_json(cfg.model_dump_json()).stages["aspect"] == cfg.stages["aspect"]  # as Ray tasks get it
    for table in (schema.working_schema(cfg.embedding_dim), schema.scored_schema(cfg.embedding_dim)):
        assert table.field("aspect_ratio").type == pa.float32()
    assert "aspect_ratio" in schema.ledger_schema().names

    _pool(tmp_path / "pool", {"wide.jpg": (640, 400), "square.jpg": (400, 400), "tall.jpg": (400, 480)})
    table = score_in_process(cfg, list_shards(Pool.at(str(tmp_path / "pool")), cfg.input), str(tmp_path / "pool"))
    rows = {r["source"].rsplit("/", 1)[-1]: r for r in table.select(["source", "status", "aspect_ratio"]).to_pylist()}
    assert {name: (r["status"], round(r["aspect_ratio"], 3)) for name, r in rows.items()} == {
        "wide.jpg": (schema.REJECTED, 1.6),
        "square.jpg": (schema.KEPT, 1.0),
        "tall.jpg": (schema.KEPT, 0.833),
    }


def test_a_stages_own_thresholds_change_the_results_hash_and_its_resources_do_not(tmp_path, aspect_module):
    def cfg(entry: str) -> CurateConfig:
        (tmp_path / "c.yaml").write_text(f"stages:\n  decode: {{}}\n  aspect: {entry}\n")
        return load_config(CurateConfig, tmp_path / "c.yaml")

    base = cfg("{max_ratio: 1.5}").results_hash()
    assert cfg("{max_ratio: 1.5, batch_size: 7, num_cpus: 2}").results_hash() == base
    assert cfg("{max_ratio: 2.0}").results_hash() != base
    with pytest.raises(ConfigError, match="max_ratio"):
        cfg("{max_ratio: -1}")


def test_the_stage_columns_keep_the_tables_column_order():
    """The order the tables had when the columns were listed by hand (shards written before read the same), with the
    columns added since where their stages put them (``clip_nsfw_score``, ``realism_prompt``, ``prompt_scores``,
    ``nsfw_score``, ``pdq``, ``pdq_crops``)."""
    assert [f.name for f in schema.stage_columns()] == [
        "persons",
        "faces",
        "person_count",
        "prominent_count",
        "main_person_score",
        "main_person_height_frac",
        "main_person_area_frac",
        "head_yaw_class",
        "head_confidence",
        "quality",
        "quality_parts",
        "aesthetic",
        "realism",
        "clip_nsfw_score",
        "realism_prompt",
        "prompt_scores",
        "text_area_frac",
        "text_boxes",
        "nsfw_score",
        "phash",
        "pdq",
        "pdq_crops",
    ]


def test_every_stage_writes_columns_of_the_tables_and_reads_keys_of_the_config():
    working = schema.working_schema(8).names
    cfg = CurateConfig().model_dump()
    for name, stage in curation.stages.stage_classes().items():
        assert set(stage.writes) <= set(working), name
        for key in stage.config_keys()[1:]:
            section, field = key.split(".")
            assert field in cfg[section], key


def test_two_stages_declaring_one_column_with_two_types_are_refused(monkeypatch):
    monkeypatch.setattr(Stage, "registry", dict(Stage.registry))

    class WidePhash(Stage):
        name = "wide_phash"
        columns = (pa.field("phash", pa.string()),)

    with pytest.raises(TypeError, match="declares column 'phash' as string, stage 'phash' as uint64"):
        schema.stage_columns()


def test_a_stage_naming_a_section_the_config_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(Stage, "registry", dict(Stage.registry))
    with pytest.raises(TypeError, match="no section of models"):

        class Misnamed(Stage):
            name = "misnamed"
            model_section = "text_overlay"
