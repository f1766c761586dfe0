"""Registry of curation stages by name (the names configs use)."""

from curation.stages.clip import ClipStage
from curation.stages.decode import DecodeStage
from curation.stages.embedding import EmbeddingStage
from curation.stages.faults import FaultInjectionStage
from curation.stages.people import HeadPoseStage, PersonStage
from curation.stages.phash import PhashStage
from curation.stages.quality import QualityStage
from curation.stages.text_overlay import TextOverlayStage
from curation.stages.yolo import YoloPersonStage

STAGES = {
    stage.name: stage
    for stage in (
        DecodeStage,
        PersonStage,
        HeadPoseStage,
        QualityStage,
        TextOverlayStage,
        PhashStage,
        EmbeddingStage,
        YoloPersonStage,  # full profile
        ClipStage,  # full profile
        FaultInjectionStage,  # tests only
    )
}
