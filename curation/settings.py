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

    enabled: bool = Field(
        True, description="Whether the stage runs; false skips it. The decode stage cannot be disabled."
    )
    batch_size: int = Field(
        16,
        ge=1,
        description="Rows per batch that Ray Data hands each task or actor of the stage; a fused run uses its first "
        "stage's.",
    )
    num_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs Ray reserves for each task or actor of the stage (fractions allowed); rounded, at least 1, "
        "it is also the number of threads the stage's native libraries may use.",
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs Ray reserves for each task or actor of the stage (a fraction shares a GPU); 0 asks for none.",
    )
    actors: tuple[int, int] = Field(
        (1, 2),
        description="(min, max) actors in the Ray actor pool of a model stage; task stages ignore it.",
    )
    timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Time limit in seconds per image of a stage call (a batch of n rows gets n times this); a row "
        "past it becomes an error row (stage_timeout). None: no limit.",
    )

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
    """The ``input`` section: how the input pool is read."""

    format: Literal["auto", "folder", "parquet", "webdataset"] = Field(
        "auto",
        description="The pool's layout: a folder of image files, *.parquet files or *.tar WebDataset shards; auto "
        "tells them by the files found.",
    )
    files_per_shard: int = Field(
        64, ge=1, description="Folder pools: image files per input shard (the unit of resume)."
    )
    image_column: str = Field(
        "image",
        description="Parquet pools: the image column, binary or a struct with a 'bytes' field; a file without it is "
        "read from its one binary column (img2dataset's jpg, png or webp).",
    )
    source_column: str | None = Field(
        None, description="Parquet pools: the column naming each image. None: each image is named file#row=N."
    )
    read_chunk_mb: int = Field(
        64,
        ge=1,
        description="Parquet files and tars are read in chunks of about this many MiB, so a 50 GB shard never sits "
        "in memory whole.",
    )
    max_row_group_mb: int = Field(
        1024,
        ge=1,
        description="Largest Parquet row group read, in MiB as its footer states: the reader holds a row group's "
        "image column whole (about twice its uncompressed size, whatever the batch size), so a larger one is not "
        "read and its row says to rewrite it smaller.",
    )
    task_memory_mb: int | None = Field(
        None,
        ge=64,
        description="Memory in MiB that each process of the score phase (the reader, every stage's tasks and actors, "
        "the writer) requests of Ray, so a node runs no more of them at once than fit. None: what bounds one "
        "process's data (CurateConfig.task_memory_mb); model stages hold their models on top, so raise it for large "
        "models.",
    )
    metadata: list[str] = Field(
        default_factory=lambda: ["*"],
        description="The pool's own metadata fields kept with each image: WebDataset sidecars (a .json's fields; "
        '.txt, .cls, ... as fields named by their extension) and a Parquet pool\'s other columns. "*" keeps every '
        "field; [] none.",
    )
    max_metadata_kb: int = Field(
        64,
        ge=1,
        description="Largest JSON size in KiB of an input's metadata (and of each sidecar); a field or sidecar "
        "beyond it is dropped with a note.",
    )

    def metadata_hash_part(self) -> dict:
        """The input settings that change phase-1 results (what metadata the ledger and shards carry)."""
        return {"metadata": self.metadata, "max_metadata_kb": self.max_metadata_kb}


class OutputSettings(Strict):
    """The ``output`` section: how the Parquet files a job writes are laid out and compressed."""

    row_group_size: int = Field(
        100, ge=1, description="Scored parts' rows per row group; small row groups keep readers' memory low."
    )
    shard_row_group_size: int = Field(
        16,
        ge=1,
        description="Final shards' rows per row group, sized for training reads: a row group is read whole, so one "
        "that divides the images a training worker takes per step is read once (pretrain/data.py); 16 fits any "
        "multiple of 16.",
    )
    shard_compression: str = Field(
        "snappy",
        description="Parquet codec of the final shards. At their row groups' size zstd's set-up per page costs more "
        "than it saves (JPEG bytes do not compress); snappy writes them about 3x faster.",
    )
    ledger_row_group_size: int = Field(
        10_000,
        ge=1,
        description="Ledger rows per row group; ledger rows carry no image (about 1 KB each), and small row groups "
        "would make writing them several times slower.",
    )
    compression: str = Field(
        "zstd",
        description="Parquet codec of the other files the job writes: scored parts and their image files, and the "
        "ledgers.",
    )


class PromptFilter(Strict):
    """A zero-shot CLIP filter: softmax over the prompts of two sets (named in ``models.clip.prompt_sets``); the
    image is rejected when the probability mass on the ``reject`` set exceeds ``max_reject``."""

    keep: str = Field(description="Name of the prompt set (in models.clip.prompt_sets) that describes images to keep.")
    reject: str = Field(
        description="Name of the prompt set (in models.clip.prompt_sets) that describes images to reject."
    )
    max_reject: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Largest probability mass (0 to 1) on the reject set's prompts that an image may have; above it "
        "the image is rejected.",
    )


class Filters(Strict):
    """The ``filters`` section: the thresholds that decide a rejection. An image is kept only with at least one
    prominent person: one whose score reaches ``person_min_score`` and whose height or area fraction of the image
    reaches ``person_min_height_frac`` or ``person_min_area_frac``."""

    min_short_side: int = Field(
        384,
        ge=1,
        description="Smallest short side in pixels (of the EXIF-oriented image); smaller images are rejected.",
    )
    max_pixels: int = Field(
        120_000_000,
        ge=1,
        description="Largest declared size in pixels (width x height, of the image and of every picture or frame "
        "inside the file); above it the file is rejected as a decompression bomb before it is decoded.",
    )
    max_aspect_ratio: float = Field(
        3.0, ge=1.0, description="Largest ratio of long side to short side; more elongated images are rejected."
    )
    max_file_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="Largest input file in bytes; a larger one is rejected (file_too_large) without being opened.",
    )
    reject_animated: bool = Field(
        True, description="Reject images with more than one frame (animated GIF, PNG or WebP, multi-page TIFF)."
    )
    person_min_score: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Prominent-person rule: the least person detection score (0 to 1) a prominent person has.",
    )
    person_min_height_frac: float = Field(
        0.4,
        ge=0,
        le=1,
        description="Prominent-person rule: a person whose box is at least this fraction of the image's height is "
        "large enough (or one that reaches person_min_area_frac).",
    )
    person_min_area_frac: float = Field(
        0.08,
        ge=0,
        le=1,
        description="Prominent-person rule: a person whose box covers at least this fraction of the image's area is "
        "large enough (or one that reaches person_min_height_frac).",
    )
    min_quality: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Least technical quality score (0 to 1, the lite profile's quality stage; see "
        "curation/stages/quality.py for the scale); lower is rejected.",
    )
    max_text_area_frac: float = Field(
        0.03,
        ge=0,
        le=1,
        description="Largest fraction of the image's area that detected text lines may cover; more is rejected as a "
        "text overlay.",
    )
    nsfw_max_score: float = Field(
        0.8,
        ge=0,
        le=1,
        description="open_nsfw's NSFW probability (curation/stages/nsfw.py): above this is rejected. Set for that "
        "model: another classifier's scores are on another scale. Yahoo's guidance: below 0.2 likely safe, above 0.8 "
        "likely NSFW.",
    )
    blocklists: list[str] = Field(
        [],
        description="Lists whose images never enter an output, rejected in phase 1 (reason blocklisted) by the "
        "phash stage: list files in the takedown format (keys, sources, URLs, pdq:<64 hex>), or a curated output, "
        "whose recorded takedowns apply (jobs.curate --against adds the release's). Empty: none.",
    )
    blocklist_distance: int = Field(
        31,
        ge=0,
        le=256,
        description="For the pdq: lines of the blocklists' files: an image whose PDQ hash is within this many bits "
        "(of 256) of a listed hash is blocklisted. A curated output's takedowns keep their own distances.",
    )
    min_aesthetic: float | None = Field(
        None,
        description="Full profile (curation/stages/clip.py): least LAION aesthetic predictor score (about 1 to 10); "
        "lower is rejected. None: no aesthetic filter.",
    )
    min_realism: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Full profile: least realism, the probability (0 to 1) of the photo prompts against the "
        "not-photo prompts (models.clip.realism); lower is rejected. None: no realism filter.",
    )
    clip_nsfw_max_score: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Full profile: LAION's CLIP NSFW head (models.clip.nsfw_head) gives P(NSFW) on its own scale, "
        "not open_nsfw's; above this is rejected. None: no such filter.",
    )
    prompt_filters: dict[str, PromptFilter] = Field(
        {},
        description="Full profile: zero-shot CLIP filters by name; each rejects with reason code prompt_<name>. "
        "Empty: none.",
    )


class ModelSettings(Strict):
    """The ``models`` section: one entry per model family, and the store their references resolve in."""

    person: PersonModelSettings = Field(
        PersonModelSettings(), description="Lite profile person detection (the person stage)."
    )
    head_pose: HeadPoseModelSettings = Field(
        HeadPoseModelSettings(), description="Lite profile head pose (the head_pose stage)."
    )
    quality: QualityModelSettings = Field(
        QualityModelSettings(), description="Technical quality score (the quality stage)."
    )
    ocr: OcrModelSettings = Field(OcrModelSettings(), description="Text detection (the text_overlay stage).")
    nsfw: NsfwModelSettings = Field(NsfwModelSettings(), description="open_nsfw safety classifier (the nsfw stage).")
    embedding: EmbeddingModelSettings = Field(
        EmbeddingModelSettings(),
        description="The image embedding that dedup and sampling read (written by the embedding or clip stage).",
    )
    phash: PhashModelSettings = Field(PhashModelSettings(), description="Perceptual hashing (the phash stage).")
    store: ModelStoreSettings = Field(
        ModelStoreSettings(), description="The model store: where model references are looked up and cached."
    )
    yolo: YoloModelSettings = Field(
        YoloModelSettings(), description="Full profile person detection and head pose (the yolo_person stage)."
    )
    clip: ClipModelSettings = Field(
        ClipModelSettings(),
        description="Full profile OpenCLIP embedding, aesthetic, NSFW and realism heads and prompt sets (the clip "
        "stage).",
    )
    fault_injection: FaultInjectionModelSettings = Field(
        FaultInjectionModelSettings(), description="Test only: the images the fault_injection stage fails on."
    )


class LinkRegionSettings(Strict):
    """One region of the link rule (``curation.phases.dedup.link_rule``): a pair within ``radius`` bits of pHash
    (of PDQ crop distance with ``crops``) and, when ``min_cosine`` is set, at or above that embedding cosine is linked
    as a copy."""

    radius: int = Field(
        ge=0,
        le=256,
        description="Largest Hamming distance in bits over the pHash's 64 (PDQ's 256 with crops) of a linked pair; "
        "the run may lower it (dedup.fit_radii). At most 32 without min_cosine, 64 without crops.",
    )
    min_cosine: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="Least embedding cosine similarity of a linked pair. None: the pHash alone, searched over the "
        "whole pool.",
    )
    crops: bool = Field(
        False,
        description="Measure the PDQ crop distance instead of the pHash distance: the least distance between either "
        "image's PDQ and the other's PDQ or the PDQs of its sub-crops (finds light crops; needs min_cosine).",
    )

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

    links: list[LinkRegionSettings] = Field(
        [
            LinkRegionSettings(radius=3),  # the pHash alone
            LinkRegionSettings(radius=12, min_cosine=0.80),  # pHash-led, confirmed by the embedding
            LinkRegionSettings(radius=24, min_cosine=0.95),  # embedding-led, confirmed by the pHash
            LinkRegionSettings(radius=72, min_cosine=0.80, crops=True),  # PDQ crop-led, confirmed by the embedding
        ],
        description="The link rule's regions: a pair is linked as copies when it falls in any of them. Measured on "
        "real photos and their copies (benchmarks/dedup_truth.py): re-encodes, resizes, tone and colour changes stay "
        "within a few pHash bits and above about 0.85 cosine; light crops move 10-20 pHash bits and stay above about "
        "0.89 (of PDQ crop distance, 30 of 256 bits at the median, 58 at the 99th percentile). An empty list turns "
        "dedup off.",
    )
    max_chance_fraction: float = Field(
        1e-4,
        gt=0,
        description="Most expected chance links (unrelated pairs linked) per survivor, estimated from the run's own "
        "sample (curation.phases.dedup.chance); at least half a link in the whole run is allowed.",
    )
    fit_radii: bool = Field(
        True,
        description="Lower each region's radius to what the pool's size allows under max_chance_fraction (true), or "
        "use the radii as configured and stop the phase when their estimate exceeds the bound (false) unless "
        "allow_chance.",
    )
    allow_chance: bool = Field(
        False,
        description="With fit_radii false: go on when the configured radii's chance estimate exceeds "
        "max_chance_fraction instead of stopping; the excess is recorded in the dedup summary and the dataset card.",
    )
    chance_pairs: int = Field(
        RANDOM_PAIRS,
        ge=1000,
        description="Random pairs of survivors whose pHash distances the chance estimate measures.",
    )
    embedding_k: int = Field(16, ge=1, description="Nearest neighbours examined per image in the embedding search.")
    keep_score: list[str] = Field(
        ["aesthetic", "quality"],
        description="Which image of a duplicate group is kept: the highest of the first of these score columns that "
        "is set (aesthetic on the full profile, quality on lite), then the larger resolution, then the smaller key.",
    )
    rows_per_partition: int = Field(
        100_000,
        ge=1,
        description="Survivors per partition of the global phases: a task's memory scales with it, never with the "
        "pool.",
    )
    cluster_size: int | None = Field(
        None,
        ge=2,
        description="Survivors per k-means cluster of the embedding search; clusters several times larger are split "
        "inside their task. None: chosen from the pool size.",
    )
    max_probes: int = Field(
        7,
        ge=0,
        description="A survivor near a cluster boundary is also searched in up to this many neighbouring clusters "
        "(those within probe_z): more finds more pairs across boundaries and writes more rows. 0: its own cluster "
        "only.",
    )
    probe_z: float = Field(
        1.0,
        gt=0,
        description="A neighbouring cluster is probed when it lies within this many times the expected offset of a "
        "near-duplicate past the home cluster (curation.phases.dedup.embedding_clusters.ProbeRule); larger probes "
        "more clusters.",
    )

    def rule(self) -> LinkRule:
        return LinkRule.of([(r.radius, r.min_cosine, r.crops) for r in self.links])


class SampleSettings(Strict):
    """Phase 3: hierarchical k-means on the embeddings, then a balanced selection to a target size."""

    target_count: int | None = Field(
        None,
        ge=0,
        description="Images to select (all of them when fewer survive). None: target_fraction of the survivors.",
    )
    target_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of the survivors to select, used when target_count is not set. None: 1.0 (all).",
    )
    clusters: list[int] | None = Field(
        None,
        description="k-means clusters per level, fine to coarse. None: about sqrt(N) leaves, then a tenth of that.",
    )
    mode: Literal["random", "closest"] = Field(
        "closest",
        description="Which images a cluster's budget picks: those closest to its centroid, or random ones (a fixed "
        "hash of each image and the seed).",
    )
    balance_key: str | None = Field(
        "head_yaw_class",
        description="A scored column whose values each cluster's picks are spread evenly over. None: no balancing.",
    )
    seed: int = Field(
        0,
        description="Seed of the sampling's k-means, random picks and tie-breaks, and of the dedup phase's embedding "
        "clusters and chance sample.",
    )
    training_points_per_cluster: int = Field(
        64,
        ge=39,
        description="Points per leaf the leaf k-means trains on (faiss's own range: 39 to 256 by default). Its time "
        "grows linearly with it; 64 places the centroids well enough to balance on and takes a quarter of 256's "
        "time.",
    )
    max_fanout: int = Field(
        256,
        ge=4,
        description="Most clusters one k-means task fits (the children of a group of parents), and so the most "
        "centroids an item is compared with per level: bounds every task's work whatever the pool's size. Levels are "
        "added to the hierarchy where a parent would otherwise need more children (at 10^9 items: 31.6k leaves under "
        "3.2k under 25).",
    )


class WriteSettings(Strict):
    """Phase 4: final curated shards."""

    rows_per_shard: int = Field(1000, ge=1, description="Selected images per final shard.")
    include_embedding: bool = Field(
        False, description="Write each image's embedding (models.embedding.dim values) into the final shards."
    )
    ledger_rows_per_task: int = Field(100_000, ge=1, description="Inputs whose final ledger rows one task writes.")


class RaySettings(Strict):
    """The ``ray`` section: which Ray cluster a job uses, and how its reads and writes retry transient I/O errors
    (lost actors and nodes are retried by Ray Data)."""

    address: str | None = Field(
        None,
        description="Address of the Ray cluster to join (auto: one started on this machine). None: join RAY_ADDRESS "
        "if set, else start a local Ray.",
    )
    num_cpus: int | None = Field(
        None, description="CPUs a local Ray may use; ignored when joining a cluster. None: all of the machine's."
    )
    io_retries: int = Field(
        3,
        ge=0,
        description="Times in a row a read of an input shard or a write of results that fails with a transient I/O "
        "error (an object store's hiccup or throttling, a network disk) is retried before the job stops; both are "
        "idempotent. 0: no retry.",
    )
    io_backoff_s: float = Field(
        0.2,
        gt=0,
        description="Base wait in seconds before an I/O retry: retry n waits a random time up to io_backoff_s x 2^n "
        "(exponential backoff with full jitter, so workers throttled together do not retry in step).",
    )
    io_backoff_max_s: float = Field(20.0, gt=0, description="Longest wait in seconds before one I/O retry.")

    def io_retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.io_retries, self.io_backoff_s, self.io_backoff_max_s)


_WORKER_MB = 256  # a Ray worker process with pyarrow, numpy and Pillow loaded, before any data


class CurationSettings(Strict):
    """Every section of the curation config. ``CurateConfig`` adds what needs the stage registry (the default stage
    list, the checks on stage names); stages and models are typed against this class, so they never import the
    registry that imports them."""

    profile: Literal["lite", "full"] = Field(
        "lite",
        description="The profile's name, lite (CPU models) or full (YOLO and CLIP models): recorded with the output, "
        "and a lite run's audit report says which models stood in. It does not choose the stages (stages does).",
    )
    stages: dict[str, SerializeAsAny[StageSettings]] = Field(
        {},
        description="The stages that score each image, by name, run in this order; an entry is of its stage's own "
        "settings class (serialised with its own fields).",
    )
    filters: Filters = Field(Filters(), description="The thresholds that decide a rejection.")
    models: ModelSettings = Field(ModelSettings(), description="Settings of each model family, and the model store.")
    input: InputSettings = Field(InputSettings(), description="How the input pool is read.")
    output: OutputSettings = Field(OutputSettings(), description="Row groups and compression of the files written.")
    dedup: DedupSettings = Field(DedupSettings(), description="Phase 2: near-duplicate removal.")
    sample: SampleSettings = Field(SampleSettings(), description="Phase 3: balanced sampling to a target size.")
    write: WriteSettings = Field(WriteSettings(), description="Phase 4: the final curated shards.")
    ray: RaySettings = Field(RaySettings(), description="The Ray cluster and I/O retries.")
    watchdog: WatchdogSettings = Field(
        WatchdogSettings(), description="The watchdog that reports where a job stops moving."
    )

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
