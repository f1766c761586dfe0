"""The curation config: which stages run in which order, their resources, the filter thresholds, model settings.

Shipped profiles live in ``configs/curate/*.yaml``; every field has a default here so a profile only states what
it changes. Thresholds that decide a rejection live under ``filters``; knobs of a model family under ``models``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.config import Strict, config_hash


class StageSettings(Strict):
    enabled: bool = True
    batch_size: int = Field(16, ge=1)
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    # (min, max) actors for model stages; task stages ignore it.
    actors: tuple[int, int] = (1, 2)

    @field_validator("actors")
    @classmethod
    def _actors_ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1]:
            raise ValueError("actors must be [min, max] with 1 <= min <= max")
        return v


class InputSettings(Strict):
    # auto: a folder of image files, *.parquet files or *.tar WebDataset shards, told by the files found.
    format: Literal["auto", "folder", "parquet", "webdataset"] = "auto"
    files_per_shard: int = Field(64, ge=1)  # folder pools: files per input shard (the unit of resume)
    image_column: str = "image"  # parquet pools: binary column, or struct with a 'bytes' field
    source_column: str | None = None  # parquet pools: column naming each image (default: file#row=N)


class OutputSettings(Strict):
    row_group_size: int = Field(100, ge=1)  # small row groups keep readers' memory low
    compression: str = "zstd"


class Filters(Strict):
    min_short_side: int = Field(384, ge=1)
    max_pixels: int = Field(120_000_000, ge=1)  # declared size above this is a decompression bomb
    max_aspect_ratio: float = Field(3.0, ge=1.0)  # long side / short side
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1)
    reject_animated: bool = True
    # "at least one prominent person": score and (height or area) fraction of the image
    person_min_score: float = Field(0.5, ge=0, le=1)
    person_min_height_frac: float = Field(0.4, ge=0, le=1)
    person_min_area_frac: float = Field(0.08, ge=0, le=1)
    min_quality: float = Field(0.35, ge=0, le=1)
    max_text_area_frac: float = Field(0.03, ge=0, le=1)


class PersonModelSettings(Strict):
    """OpenCV HOG people detector + Haar face cascades (lite person detection and head pose)."""

    hog_max_side: int = Field(640, ge=64)
    face_max_side: int = Field(640, ge=64)


class QualityModelSettings(Strict):
    max_side: int = Field(512, ge=64)


class OcrModelSettings(Strict):
    max_side: int = Field(960, ge=64)


class EmbeddingModelSettings(Strict):
    name: str = "lite-colour-gradient-v1"
    dim: int = Field(384, ge=8)


class PhashSettings(Strict):
    draft_side: int = Field(256, ge=32)  # decode JPEGs at about this size before hashing


class ModelSettings(Strict):
    person: PersonModelSettings = PersonModelSettings()
    quality: QualityModelSettings = QualityModelSettings()
    ocr: OcrModelSettings = OcrModelSettings()
    embedding: EmbeddingModelSettings = EmbeddingModelSettings()
    phash: PhashSettings = PhashSettings()


def _default_stages() -> dict[str, StageSettings]:
    return {
        "decode": StageSettings(batch_size=32, num_cpus=0.5),
        "person": StageSettings(batch_size=8, num_cpus=1.0, actors=(1, 2)),
        "head_pose": StageSettings(batch_size=16, num_cpus=0.25, actors=(1, 1)),
        "quality": StageSettings(batch_size=16, num_cpus=0.5),
        "text_overlay": StageSettings(batch_size=8, num_cpus=1.0, actors=(1, 2)),
        "phash": StageSettings(batch_size=32, num_cpus=0.25),
        "embedding": StageSettings(batch_size=32, num_cpus=0.5),
    }


class RaySettings(Strict):
    address: str | None = None  # None: join RAY_ADDRESS if set, else start a local Ray
    num_cpus: int | None = None  # local Ray only


class CurateConfig(Strict):
    profile: Literal["lite", "full"] = "lite"
    stages: dict[str, StageSettings] = Field(default_factory=_default_stages)  # run in this order
    filters: Filters = Filters()
    models: ModelSettings = ModelSettings()
    input: InputSettings = InputSettings()
    output: OutputSettings = OutputSettings()
    ray: RaySettings = RaySettings()

    @model_validator(mode="after")
    def _known_stages(self) -> CurateConfig:
        from curation.stages import STAGES

        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known: {sorted(STAGES)}")
        if next(iter(self.stages), None) != "decode" or not self.stages["decode"].enabled:
            raise ValueError("the first stage must be 'decode' and it cannot be disabled")
        return self

    @property
    def enabled_stages(self) -> list[str]:
        return [name for name, s in self.stages.items() if s.enabled]

    @property
    def embedding_dim(self) -> int:
        return self.models.embedding.dim

    def results_hash(self) -> str:
        """Hash of what changes results (stage list, thresholds, models), not of resources or paths."""
        return config_hash(
            self.model_copy(update={"stages": {n: StageSettings() for n in self.enabled_stages}}),
            exclude={"input", "output", "ray"},
        )
