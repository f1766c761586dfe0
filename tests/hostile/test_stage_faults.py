"""Faults a web-scale pool brings: a stage that raises or hangs on one image, and photos that carry a second picture.

The runner must confine a stage that raises or hangs to the image that caused it (an ``error`` row, the rest of the
batch scored), recycle a worker left holding a call it could not stop, and never let it stall or fail the job.
Decode must take a multi-picture JPEG's (MPO's) primary picture and still reject real animations.
"""

import hashlib
import io
import time

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from common import schema
from common.imageio import decode, open_reduced
from curation.config import CurateConfig
from curation.score.chain import stage_runner
from curation.score.ledger import read_ledger
from curation.stages.faults import FaultInjectionStage
from jobs import curate

FAULTS = "fault_injection"


def _jpeg(seed: int, size=(480, 400)) -> bytes:
    """Noise, so that no two test images are near-duplicates."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _mpo(primary_size=(640, 480), second_size=(160, 120)) -> bytes:
    """A phone-style JPEG with a second picture (a gain map or stereo view) after the primary one."""
    primary = Image.new("RGB", primary_size, (210, 40, 40))
    second = Image.new("RGB", second_size, (20, 20, 220))
    buf = io.BytesIO()
    primary.save(buf, "MPO", save_all=True, append_images=[second])
    return buf.getvalue()


def _key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _config(timeout_s: float | None = 0.5, **plan) -> CurateConfig:
    return CurateConfig.model_validate(
        {
            "stages": {"decode": {}, FAULTS: {"timeout_s": timeout_s}},
            "models": {FAULTS: plan},
        }
    )


def _table(images: dict[str, bytes], rejected: tuple[str, ...] = ()) -> pa.Table:
    """Working rows as they reach a stage after decode: pending, with their keys, unless named as rejected."""
    rows = [
        {
            "source": name,
            "key": _key(data),
            "image": {"bytes": data, "path": name},
            "status": schema.REJECTED if name in rejected else schema.PENDING,
        }
        for name, data in images.items()
    ]
    return pa.Table.from_pylist(rows, schema=schema.working_schema(CurateConfig().embedding_dim))


def _fates(table: pa.Table) -> dict[str, dict]:
    return {r["source"]: r for r in table.select(["source", "status", "stage", "reason", "image"]).to_pylist()}


# --- the runner, in this process -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-time-limit", "time-limited"])
def test_a_single_pending_row_that_raises_becomes_an_error_row(timeout_s):
    images = {"bad.jpg": _jpeg(1), "small-a.jpg": _jpeg(2), "small-b.jpg": _jpeg(3)}
    runner = stage_runner(FAULTS, _config(timeout_s, raise_on=[_key(images["bad.jpg"])]))

    fates = _fates(runner(_table(images, rejected=("small-a.jpg", "small-b.jpg"))))

    bad = fates["bad.jpg"]
    assert bad["status"] == schema.ERROR and bad["stage"] == FAULTS and bad["image"] is None
    assert bad["reason"].startswith("stage_error: RuntimeError: injected fault on image"), bad["reason"]
    assert "(at process_batch:" in bad["reason"]
    assert {fates[n]["status"] for n in ("small-a.jpg", "small-b.jpg")} == {schema.REJECTED}


def test_a_python_level_hang_is_stopped_and_the_rest_of_the_batch_is_scored():
    images = {f"img{i}.jpg": _jpeg(10 + i) for i in range(4)}
    plan = dict(hang_on=[_key(images["img2.jpg"])], hang="python", hang_s=600)
    runner = stage_runner(FAULTS, _config(0.5, **plan))

    start = time.monotonic()
    fates = _fates(runner(_table(images)))

    assert time.monotonic() - start < 10  # the batch's 2 s, then each row's 0.5 s: never the 600 s hang
    hung = fates["img2.jpg"]
    assert hung["status"] == schema.ERROR and hung["image"] is None
    assert hung["reason"] == (
        "stage_timeout: stage fault_injection ran past its limit of 0.5 s per image (stages.fault_injection.timeout_s)"
    )
    for name in ("img0.jpg", "img1.jpg", "img3.jpg"):
        assert fates[name]["status"] == schema.PENDING and fates[name]["stage"] == FAULTS
        assert fates[name]["image"]["bytes"] == images[name]
    assert not runner.needs_recycle  # the hanging thread was stopped


def test_a_native_hang_is_an_error_row_and_marks_the_process_for_recycling():
    images = {"native-ok.jpg": _jpeg(20), "native-hang.jpg": _jpeg(21)}
    # time.sleep is one C call: the exception the runner raises into its thread waits until it returns
    plan = dict(hang_on=[_key(images["native-hang.jpg"])], hang="native", hang_s=4)
    cfg = _config(0.5, **plan)
    runner = stage_runner(FAULTS, cfg)

    fates = _fates(runner(_table(images)))

    hung = fates["native-hang.jpg"]
    assert hung["status"] == schema.ERROR
    assert hung["reason"].startswith("stage_timeout: stage fault_injection ran past its limit of 0.5 s per image")
    assert hung["reason"].endswith("it could not be stopped (stuck in native code)")
    assert fates["native-ok.jpg"]["status"] == schema.PENDING
    assert runner.needs_recycle  # in a Ray worker, the next task's first stage call exits the process

    # A runner built later (a restarted worker re-running the batch) does not run the hanging row again.
    start = time.monotonic()
    again = _fates(stage_runner(FAULTS, cfg)(_table(images)))
    assert time.monotonic() - start < 1.0
    assert again["native-hang.jpg"]["status"] == schema.ERROR
    assert again["native-hang.jpg"]["reason"].endswith("stuck in native code earlier in this job, not run again")
    assert again["native-ok.jpg"]["status"] == schema.PENDING

    deadline = time.monotonic() + 10  # once the stuck calls end on their own, nothing needs recycling
    while runner.needs_recycle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not runner.needs_recycle


def test_a_stage_that_cannot_set_up_stops_with_a_clear_error(monkeypatch):
    def setup(self):
        raise FileNotFoundError("weights.pt")

    monkeypatch.setattr(FaultInjectionStage, "setup", setup)
    with pytest.raises(FileNotFoundError, match=r"weights.pt") as failure:
        stage_runner(FAULTS, _config())
    (note,) = failure.value.__notes__
    assert note == "stage 'fault_injection' could not set up, so it cannot score any image: the job stops"


# --- multi-picture JPEGs and animations in decode -----------------------------------------------------------------


def _animations() -> dict[str, bytes]:
    frames = [Image.new("RGB", (480, 400), (40 * i, 90, 200 - 40 * i)) for i in range(3)]
    out = {}
    for fmt, name in (("GIF", "anim.gif"), ("PNG", "anim.png"), ("WEBP", "anim.webp"), ("TIFF", "pages.tiff")):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=100)
        out[name] = buf.getvalue()
    return out


def test_decode_keeps_a_multi_picture_jpeg_and_rejects_real_animations():
    mpo = _mpo(primary_size=(640, 480))
    assert Image.open(io.BytesIO(mpo)).format == "MPO"  # what a phone's second picture looks like to PIL
    images = {"phone.jpg": mpo, **_animations()}
    table = _table(images)
    key = table.schema.get_field_index("key")
    table = table.set_column(key, table.schema.field(key), pa.nulls(len(images), pa.string()))  # decode sets it
    runner = stage_runner("decode", _config())

    rows = {r["source"]: r for r in runner(table).to_pylist()}

    phone = rows["phone.jpg"]
    assert phone["status"] == schema.PENDING, phone["reason"]
    assert (phone["format"], phone["width"], phone["height"]) == ("JPEG", 640, 480)
    assert phone["image"]["bytes"] == mpo and phone["key"] == _key(mpo)  # the original bytes flow on
    for name in ("anim.gif", "anim.png", "anim.webp", "pages.tiff"):
        reason = rows[name]["reason"]
        assert rows[name]["status"] == schema.REJECTED, reason
        assert reason.startswith("animated: ") and "3 frames" in reason, reason


@pytest.mark.parametrize("max_side", [None, 100], ids=["full-size", "reduced"])
def test_later_decodes_take_the_primary_picture(max_side):
    mpo = _mpo(primary_size=(640, 480), second_size=(160, 120))
    pixels = decode(mpo, max_side=max_side)
    assert pixels.shape == ((480, 640, 3) if max_side is None else (75, 100, 3))
    assert np.abs(pixels.reshape(-1, 3).mean(0) - (210, 40, 40)).max() < 8  # the red primary, not the blue second
    if max_side is not None:  # drafted by libjpeg like any JPEG, not decoded at full size first
        assert max(open_reduced(mpo, max_side=max_side).size) < 640


# --- the curate job end to end -------------------------------------------------------------------------------------


@pytest.mark.slow  # a curation run that waits out a hang
def test_curate_job_records_raising_and_hanging_images_as_errors_and_finishes(ray_local, tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    images = {f"{i}-photo.jpg": _jpeg(100 + i) for i in range(5)}
    images["1-hangs.jpg"] = _jpeg(200)  # early in the pool, so later tasks reach the worker it leaves stuck
    images["3-raises.jpg"] = _jpeg(201)
    images["4-phone.jpg"] = _mpo(primary_size=(640, 480))
    for name, data in images.items():
        (pool / name).write_bytes(data)
    config = tmp_path / "faults.yaml"
    config.write_text(
        f"""
stages:
  decode: {{batch_size: 4, num_cpus: 0.5}}
  {FAULTS}: {{batch_size: 1, num_cpus: 0.5, actors: [1, 1], timeout_s: 2}}
  phash: {{batch_size: 8, num_cpus: 0.25}}
  embedding: {{batch_size: 8, num_cpus: 0.5}}
input: {{files_per_shard: 1}}
models:
  {FAULTS}:
    raise_on: [{_key(images["3-raises.jpg"])}]
    hang_on: [{_key(images["1-hangs.jpg"])}]
    hang: native
    hang_s: 600
"""
    )
    out = tmp_path / "out"

    start = time.monotonic()
    assert curate.main(["--config", str(config), "--input", str(pool), "--output", str(out)]) == 0
    assert time.monotonic() - start < 120  # far less than the hang

    ledger = read_ledger(str(out)).to_pylist()
    sources = [r["source"] for r in ledger]
    assert sorted(sources) == sorted(str(pool / name) for name in images)  # every input exactly once
    fates = {r["source"].rsplit("/", 1)[1]: r for r in ledger}
    raised, hung = fates["3-raises.jpg"], fates["1-hangs.jpg"]
    assert (raised["status"], raised["stage"]) == (schema.ERROR, FAULTS)
    assert raised["reason"].startswith("stage_error: RuntimeError: injected fault on image"), raised["reason"]
    assert (hung["status"], hung["stage"]) == (schema.ERROR, FAULTS)
    assert hung["reason"].startswith("stage_timeout: stage fault_injection ran past its limit of 2 s per image"), hung
    others = [r for name, r in fates.items() if name not in ("3-raises.jpg", "1-hangs.jpg")]
    assert all(r["status"] != schema.ERROR for r in others), others
    assert (fates["4-phone.jpg"]["format"], fates["4-phone.jpg"]["width"]) == ("JPEG", 640)
