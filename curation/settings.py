"""The sections of the curation config: input, filter thresholds, model settings, the global phases, resources,
and the hashes of what changes a phase's results.

``curation.config.CurateConfig`` is the config a job loads (these sections plus the stage list, checked against the
stage registry). Shipped profiles live in ``configs/curate/*.yaml``; every field has a default here so a profile only
states what it changes. Thresholds that decide a rejection live under ``filters``; knobs of a model family under
``models``, each family's class in ``curation.models.settings`` beside the code that loads its models.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from common.config import Strict, hash_json
from common.storage import RetryPolicy
from common.watchdog import WatchdogSettings
from curation.models.settings import (
    ClipModelSettings,
    EmbeddingModelSettings,
    FaultInjectionModelSettings,
    HeadPoseModelSettings,
    ModelStoreSettings,
    NsfwModelSettings,
    OcrModelSettings,
    PersonModelSettings,
    PhashModelSettings,
    QualityModelSettings,
    YoloModelSettings,
)
from curation.phases.dedup.chance import RANDOM_PAIRS
from curation.phases.dedup.link_rule import LinkRule


class StageSettings(Strict):
    """A stage's entry under ``stages``: its resources. A stage with model references or thresholds of its own
    declares them as fields of a subclass (the class of its ``default_settings``); its entry then takes them too."""

    enabled: bool = True
    batch_size: int = Field(16, ge=1)
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    # (min, max) actors for model stages; task stages ignore it.
    actors: tuple[int, int] = (1, 2)
    # Time limit per image of a stage call (a batch of n rows gets n times this); a row past it is an error row
    # (stage_timeout). None: no limit.
    timeout_s: float | None = Field(60.0, gt=0)

    def without_resources(self) -> StageSettings:
        """These settings with the resource fields at their defaults: what of them changes a stage's results."""
        return type(self).model_validate(self.model_dump(exclude=set(StageSettings.model_fields)))

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
    # parquet pools: binary column, or struct with a 'bytes' field; a file without it is read from its one binary
    # column (img2dataset's jpg, png or webp)
    image_column: str = "image"
    source_column: str | None = None  # parquet pools: column naming each image (default: file#row=N)
    # Parquet files and tars stream in chunks of about this size: a 50 GB shard never sits in memory whole.
    read_chunk_mb: int = Field(64, ge=1)
    # Parquet's reader holds a row group's image column whole (about twice its uncompressed size, whatever the batch
    # size): a row group whose footer says it holds more is not read, and its row says to rewrite it smaller.
    max_row_group_mb: int = Field(1024, ge=1)
    # Memory (MiB) each process of the score phase (the reader, every stage's tasks and actors, the writer) requests
    # of Ray, so a node runs no more of them at once than fit. None: what bounds one process's data
    # (CurateConfig.task_memory_mb); model stages hold their models on top, so raise it for large models.
    task_memory_mb: int | None = Field(None, ge=64)
    # The pool's own metadata kept with each image: WebDataset sidecars (a .json's fields; .txt, .cls, ... as fields
    # named by their extension) and a Parquet pool's other columns. "*" keeps every field; [] none.
    metadata: list[str] = Field(default_factory=lambda: ["*"])
    # per input, the metadata's JSON size (and each sidecar's): beyond it the field or sidecar is dropped with a note
    max_metadata_kb: int = Field(64, ge=1)

    def metadata_hash_part(self) -> dict:
        """The input settings that change phase-1 results (what metadata the ledger and shards carry)."""
        return {"metadata": self.metadata, "max_metadata_kb": self.max_metadata_kb}


class OutputSettings(Strict):
    row_group_size: int = Field(100, ge=1)  # scored parts' rows per row group: small ones keep readers' memory low
    # final shards' rows per row group, sized for training reads: a row group is read whole, so one that divides
    # the images a training worker takes per step is read once (pretrain/data.py); 16 fits any multiple of 16
    shard_row_group_size: int = Field(16, ge=1)
    # final shards' codec: at their row groups' size zstd's set-up per page costs more than it saves (JPEG bytes do
    # not compress); snappy writes them ~3x faster (curation.phases.write.shards.shard_encoding)
    shard_compression: str = "snappy"
    # ledger rows carry no image (~1 KB each): small row groups would make writing them several times slower
    ledger_row_group_size: int = Field(10_000, ge=1)
    compression: str = "zstd"


class PromptFilter(Strict):
    """A zero-shot CLIP filter: softmax over the prompts of two sets (named in ``models.clip.prompt_sets``); the
    image is rejected when the probability mass on the ``reject`` set exceeds ``max_reject``."""

    keep: str
    reject: str
    max_reject: float = Field(0.5, ge=0, le=1)


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
    min_quality: float = Field(0.5, ge=0, le=1)  # see curation/stages/quality.py for the scale
    max_text_area_frac: float = Field(0.03, ge=0, le=1)
    # open_nsfw's nsfw probability (curation/stages/nsfw.py): above this is rejected. Set for that model: another
    # classifier's scores are on another scale. Yahoo's guidance: below 0.2 likely safe, above 0.8 likely NSFW.
    nsfw_max_score: float = Field(0.8, ge=0, le=1)
    # Lists whose images never enter an output, rejected in phase 1 (reason ``blocklisted``) by the phash stage: list
    # files in the takedown format (keys, sources, URLs, ``pdq:<64 hex>``), or a curated output, whose recorded
    # takedowns apply (jobs.curate --against adds the release's). ``blocklist_distance``: for the lists' pdq lines.
    blocklists: list[str] = []
    blocklist_distance: int = Field(31, ge=0, le=256)
    # Full profile (curation/stages/clip.py); None or empty turns a filter off.
    min_aesthetic: float | None = None  # LAION aesthetic predictor scale, about 1..10
    min_realism: float | None = Field(None, ge=0, le=1)  # probability of the photo prompts
    # LAION's CLIP NSFW head (models.clip.nsfw_head): P(NSFW) on its own scale, not open_nsfw's; above is rejected
    clip_nsfw_max_score: float | None = Field(None, ge=0, le=1)
    prompt_filters: dict[str, PromptFilter] = {}  # name -> filter; rejects with reason code prompt_<name>


class ModelSettings(Strict):
    """The ``models`` section: one entry per model family, and the store their references resolve in."""

    person: PersonModelSettings = PersonModelSettings()
    head_pose: HeadPoseModelSettings = HeadPoseModelSettings()
    quality: QualityModelSettings = QualityModelSettings()
    ocr: OcrModelSettings = OcrModelSettings()
    nsfw: NsfwModelSettings = NsfwModelSettings()
    embedding: EmbeddingModelSettings = EmbeddingModelSettings()
    phash: PhashModelSettings = PhashModelSettings()
    store: ModelStoreSettings = ModelStoreSettings()
    yolo: YoloModelSettings = YoloModelSettings()
    clip: ClipModelSettings = ClipModelSettings()
    fault_injection: FaultInjectionModelSettings = FaultInjectionModelSettings()


class LinkRegionSettings(Strict):
    """One region of the link rule (``curation.phases.dedup.link_rule``): a pair within ``radius`` bits of pHash
    (of PDQ crop distance with ``crops``) and, when ``min_cosine`` is set, at or above that embedding cosine is linked
    as a copy."""

    # Hamming distance over the pHash's 64 bits (PDQ's 256 with crops): the most; the run may lower it (fit_radii)
    radius: int = Field(ge=0, le=256)
    min_cosine: float | None = Field(None, ge=-1, le=1)  # None: the pHash alone, searched over the whole pool
    # Measure the PDQ crop distance instead of the pHash distance: the least distance between either image's PDQ and
    # the other's PDQ or the PDQs of its sub-crops (finds light crops; needs min_cosine)
    crops: bool = False

    @model_validator(mode="after")
    def _searchable(self) -> LinkRegionSettings:
        if self.min_cosine is None and self.radius > 32:
            raise ValueError("a pHash-alone region (no min_cosine) searches the whole pool: radius <= 32")
        if self.crops and self.min_cosine is None:
            raise ValueError("a region with crops: true is searched inside the embedding clusters: set min_cosine")
        if not self.crops and self.radius > 64:
            raise ValueError(f"radius {self.radius}: a pHash has 64 bits (only a crops: true region counts PDQ's 256)")
        return self


class DedupSettings(Strict):
    """Phase 2: near-duplicates by pHash distance and embedding similarity; one image kept per group."""

    # A pair is linked when it falls in any region. Measured on real photos and their copies
    # (benchmarks/dedup_truth.py): re-encodes, resizes, tone and colour changes stay within a few pHash bits and above
    # ~0.85 cosine; light crops move 10-20 pHash bits and stay above ~0.89 (of PDQ crop distance, 30 of 256 bits at the
    # median, 58 at the 99th percentile). An empty list turns dedup off.
    links: list[LinkRegionSettings] = [
        LinkRegionSettings(radius=3),  # the pHash alone
        LinkRegionSettings(radius=12, min_cosine=0.80),  # pHash-led, confirmed by the embedding
        LinkRegionSettings(radius=24, min_cosine=0.95),  # embedding-led, confirmed by the pHash
        LinkRegionSettings(radius=72, min_cosine=0.80, crops=True),  # PDQ crop-led, confirmed by the embedding
    ]
    # Expected chance links (unrelated pairs linked) per survivor at most, estimated from the run's own sample
    # (curation.phases.dedup.chance); at least half a link in the whole run.
    max_chance_fraction: float = Field(1e-4, gt=0)
    # Lower each region's radius to what the pool's N allows (true), or use the radii as configured and stop the phase
    # when their estimate exceeds the bound (false) unless allow_chance (the excess is recorded in the summary and card).
    fit_radii: bool = True
    allow_chance: bool = False
    chance_pairs: int = Field(RANDOM_PAIRS, ge=1000)  # random pairs the estimate measures the pHash distances of
    embedding_k: int = Field(16, ge=1)  # neighbours examined per image
    # keep rule: highest of the first score column that is set (aesthetic on the full profile, quality on lite),
    # then larger resolution, then smaller key
    keep_score: list[str] = ["aesthetic", "quality"]
    # Survivors per partition of the global phases: a task's memory scales with it, never with the pool.
    rows_per_partition: int = Field(100_000, ge=1)
    # Survivors per k-means cluster of the embedding search (None: chosen from the pool size); clusters several
    # times larger are split inside their task.
    cluster_size: int | None = Field(None, ge=2)
    # A survivor near a cluster boundary is also searched in up to max_probes neighbouring clusters, those within
    # probe_z of the expected offset of a near-duplicate (curation.phases.dedup.embedding_pairs.ProbeRule): more finds more
    # pairs across boundaries and writes more rows.
    max_probes: int = Field(7, ge=0)
    probe_z: float = Field(1.0, gt=0)

    def rule(self) -> LinkRule:
        return LinkRule.of([(r.radius, r.min_cosine, r.crops) for r in self.links])


class SampleSettings(Strict):
    """Phase 3: hierarchical k-means on the embeddings, then a balanced selection to a target size."""

    target_count: int | None = Field(None, ge=0)
    target_fraction: float | None = Field(None, gt=0, le=1)  # used when target_count is not set; default 1.0
    clusters: list[int] | None = None  # per level, fine to coarse; default about sqrt(N), then a tenth of that
    mode: Literal["random", "closest"] = "closest"
    balance_key: str | None = "head_yaw_class"  # a scored column to spread picks over inside each cluster
    seed: int = 0
    # The leaf k-means trains on this many points per leaf (faiss's own range: 39 to 256 by default). Its time grows
    # linearly with it; 64 places the centroids well enough to balance on and takes a quarter of 256's time.
    training_points_per_cluster: int = Field(64, ge=39)
    # Most clusters one k-means task fits (the children of a group of parents), and so the most centroids an item is
    # compared with per level: bounds every task's work whatever the pool's size. Levels are added to the hierarchy
    # where a parent would otherwise need more children (at 10^9 items: 31.6k leaves under 3.2k under 25).
    max_fanout: int = Field(256, ge=4)


class WriteSettings(Strict):
    """Phase 4: final curated shards."""

    rows_per_shard: int = Field(1000, ge=1)
    include_embedding: bool = False
    ledger_rows_per_task: int = Field(100_000, ge=1)  # inputs whose final ledger one task writes


class RaySettings(Strict):
    address: str | None = None  # None: join RAY_ADDRESS if set, else start a local Ray
    num_cpus: int | None = None  # local Ray only
    # Reads of input shards and writes of results that fail with a transient I/O error (an object store's hiccup or
    # throttling, a network disk) are retried this many times in a row before the job stops; both are idempotent.
    # Each retry waits a random time up to io_backoff_s x 2^n, at most io_backoff_max_s (exponential backoff with
    # full jitter: workers throttled together do not retry in step). Lost actors and nodes are retried by Ray Data.
    io_retries: int = Field(3, ge=0)
    io_backoff_s: float = Field(0.2, gt=0)
    io_backoff_max_s: float = Field(20.0, gt=0)

    def io_retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.io_retries, self.io_backoff_s, self.io_backoff_max_s)


_WORKER_MB = 256  # a Ray worker process with pyarrow, numpy and Pillow loaded, before any data


class CurationSettings(Strict):
    """Every section of the curation config. ``CurateConfig`` adds what needs the stage registry (the default stage
    list, the checks on stage names); stages and models are typed against this class, so they never import the
    registry that imports them."""

    profile: Literal["lite", "full"] = "lite"
    # run in this order; an entry is of its stage's own settings class (serialised with its own fields)
    stages: dict[str, SerializeAsAny[StageSettings]] = {}
    filters: Filters = Filters()
    models: ModelSettings = ModelSettings()
    input: InputSettings = InputSettings()
    output: OutputSettings = OutputSettings()
    dedup: DedupSettings = DedupSettings()
    sample: SampleSettings = SampleSettings()
    write: WriteSettings = WriteSettings()
    ray: RaySettings = RaySettings()
    watchdog: WatchdogSettings = WatchdogSettings()

    @model_validator(mode="after")
    def _full_profile_consistent(self) -> CurationSettings:
        # Checked when the config loads, so a typo fails the job at start rather than in a stage actor mid-run.
        sets = self.models.clip.prompt_sets
        named = {
            f"filters.prompt_filters.{n}.{side}": getattr(pf, side)
            for n, pf in self.filters.prompt_filters.items()
            for side in ("keep", "reject")
        }
        named |= {
            f"models.clip.realism.{side}": getattr(self.models.clip.realism, side) for side in ("photo", "not_photo")
        }
        for where, name in named.items():
            if not sets.get(name):
                raise ValueError(
                    f"{where} names prompt set {name!r}, which models.clip.prompt_sets does not define "
                    f"(or defines empty); defined: {sorted(sets)}"
                )
        bad = [n for n in self.filters.prompt_filters if not n.isidentifier()]
        if bad:
            raise ValueError(f"filters.prompt_filters names must be identifiers (they become reason codes): {bad}")
        writers = [s for s in ("embedding", "clip") if s in self.enabled_stages]
        if len(writers) > 1:
            raise ValueError(f"stages {writers} both write the embedding column; enable one")
        return self

    @property
    def enabled_stages(self) -> list[str]:
        return [name for name, s in self.stages.items() if s.enabled]

    @property
    def embedding_dim(self) -> int:
        return self.models.embedding.dim

    @property
    def task_memory_mb(self) -> int:
        """``input.task_memory_mb``, or by default what bounds a score process: the Python worker with its libraries,
        a read chunk held as rows, as an Arrow table and as the block handed on, and one image of
        ``filters.max_pixels`` decoded whole (a format with no reduced decode) in its own mode (at most 4 bytes a
        pixel) next to its RGB copy (3). The defaults give 1250 MiB."""
        if self.input.task_memory_mb is not None:
            return self.input.task_memory_mb
        return _WORKER_MB + 3 * self.input.read_chunk_mb + math.ceil(7 * self.filters.max_pixels / 2**20)

    def results_hash(self) -> str:
        """Hash of what changes phase-1 results (stage list, thresholds, models), not of resources or paths.

        The global phases hash their own sections (``phase_hash``), so they can be re-tuned without re-scoring.
        """
        scoring = self.model_copy(
            update={"stages": {n: self.stages[n].without_resources() for n in self.enabled_stages}}
        )
        exclude = {"input", "output", "ray", "dedup", "sample", "write", "watchdog", "fused"}
        return hash_json({**scoring.model_dump(mode="json", exclude=exclude), "input": self.input.metadata_hash_part()})

    def phase_hash(self, phase: str) -> str:
        """Hash of a global phase's settings and of every phase before it."""
        upto = {"dedup": ("dedup",), "sample": ("dedup", "sample"), "write": ("dedup", "sample", "write", "output")}
        sections = {name: getattr(self, name).model_dump(mode="json") for name in upto[phase]}
        return hash_json({"score": self.results_hash(), **sections})
