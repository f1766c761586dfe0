"""What a run says is likely wrong with a pool when one reason dominates its ledger: images downloaded at one small
size, Parquet files whose image column is named otherwise, inputs that are not images. The diagnosis is one
function of the ledger (``likely_causes``); the curate job's summary and the audit report both print it."""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.config import load_config
from curation.config import CurateConfig
from curation.score.ledger import CAUSE_COLUMNS, likely_causes, read_ledger
from curation.score.pool import Pool, list_shards
from curation.score.reader import ShardReader
from curation.score.stage_runner import StageRunner
from curation.stages.decode import DecodeStage

REPO = Path(__file__).resolve().parents[3]
LITE = REPO / "configs/curate/lite.yaml"


def _jpeg(size: tuple[int, int], seed: int) -> bytes:
    """A photo-like gradient of ``size``, different for each seed."""
    w, h = size
    img = Image.linear_gradient("L").resize((w, h)).rotate(seed * 37 % 360).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _folder(root: Path, sizes: list[tuple[int, int]], other: dict[str, bytes] | None = None) -> Path:
    root.mkdir(parents=True)
    for i, size in enumerate(sizes):
        (root / f"{i:06d}.jpg").write_bytes(_jpeg(size, i))
    for name, data in (other or {}).items():
        (root / name).write_bytes(data)
    return root


def decoded_ledger(pool: Path, cfg: CurateConfig) -> pa.Table:
    """The pool read and decoded in this process, as the score phase's ledger holds it after the decode stage."""
    runner = StageRunner(DecodeStage, cfg)
    reader = ShardReader(str(pool), cfg.input, cfg.embedding_dim, cfg.filters.max_file_bytes)
    tables = [runner(reader.read_table(shard)) for shard in list_shards(Pool.at(str(pool)), cfg.input)]
    return pa.concat_tables(tables).select(CAUSE_COLUMNS)


@pytest.fixture(scope="module")
def cfg() -> CurateConfig:
    return load_config(CurateConfig, LITE)


# img2dataset's resize modes: keep_ratio (short side at the size), center_crop and border (square)
AT_256 = [(256, 341), (384, 256), (256, 256), (256, 455), (320, 256), (256, 256), (256, 300), (512, 256)]


def test_a_pool_downloaded_at_256_px_is_named_with_the_fix(tmp_path, cfg):
    causes = likely_causes(decoded_ledger(_folder(tmp_path / "pool", AT_256), cfg), cfg.filters.min_short_side)
    assert causes == [
        "all 8 images are 256 px on the short side: downloaded at 256 px? re-download at >= 384 "
        "(img2dataset --resize_mode no) or set filters.min_short_side"
    ]


def test_nearly_all_at_one_size_is_named_and_small_images_of_many_sizes_are_too(tmp_path, cfg):
    nearly = _folder(tmp_path / "nearly", AT_256 * 2 + [(640, 480)])
    assert likely_causes(decoded_ledger(nearly, cfg), 384) == [
        "16 of 17 images are 256 px on the short side: downloaded at 256 px? re-download at >= 384 "
        "(img2dataset --resize_mode no) or set filters.min_short_side"
    ]
    mixed = _folder(tmp_path / "mixed", [(120, 160), (200, 300), (256, 256), (300, 400), (320, 240)])
    assert likely_causes(decoded_ledger(mixed, cfg), 384) == [
        "all 5 images are under 384 px on the short side (120 to 300 px): find larger copies or set "
        "filters.min_short_side"
    ]


def test_a_parquet_pool_without_an_image_column_names_the_setting(tmp_path, cfg):
    pool = tmp_path / "pool"
    pool.mkdir()
    for k in range(3):  # two binary columns: which holds the images is not for the reader to guess
        jpegs = [_jpeg((400, 500), i) for i in range(4)]
        table = pa.table({"jpg": jpegs, "thumb": jpegs, "url": [f"u{i}" for i in range(4)]})
        pq.write_table(table, pool / f"part-{k}.parquet")
    assert likely_causes(decoded_ledger(pool, cfg), 384) == [
        "3 Parquet files unread: no column 'image' (columns: ['jpg', 'thumb', 'url']); set input.image_column (one of "
        "its binary columns: jpg, thumb)"
    ]
    cfg_jpg = load_config(CurateConfig, LITE, ["input.image_column=jpg"])
    assert likely_causes(decoded_ledger(pool, cfg_jpg), 384) == []


def test_a_pool_of_mostly_other_files_names_their_suffixes(tmp_path, cfg):
    # sidecars of no image (beside an image they would be its metadata, not inputs)
    sidecars = {f"meta-{i}.json": json.dumps({"url": f"u{i}"}).encode() for i in range(3)}
    sidecars |= {f"meta-{i}.txt": b"a caption" for i in range(3)} | {"README": b"crawl of 2024"}
    pool = _folder(tmp_path / "pool", [(400, 500), (640, 480)], sidecars)
    assert likely_causes(decoded_ledger(pool, cfg), 384) == [
        "7 of 9 inputs are not images (.json 3, .txt 3, no suffix 1): --input should hold images, as files, Parquet "
        "files with an image column or WebDataset tars"
    ]


def test_a_pool_where_no_reason_dominates_gets_no_diagnosis(tmp_path, cfg):
    pool = _folder(tmp_path / "pool", [(400, 500), (640, 480), (256, 256), (500, 500)], {"notes.txt": b"notes"})
    assert likely_causes(decoded_ledger(pool, cfg), 384) == []
    assert likely_causes(decoded_ledger(pool, cfg).slice(0, 0), 384) == []


@pytest.mark.slow
def test_the_job_and_the_report_say_the_same(tmp_path, ray_local, capsys):
    """A real run on a pool downloaded at 256 px: the job's summary ends with the diagnosis, and the audit report
    shows the same line."""
    from curation.audit.report import write_report
    from jobs import curate

    pool, out = _folder(tmp_path / "pool", AT_256), tmp_path / "out"
    assert curate.main(["--config", str(LITE), "--input", str(pool), "--output", str(out)]) == 0
    console = capsys.readouterr().out
    cfg = load_config(CurateConfig, LITE)
    (cause,) = likely_causes(read_ledger(str(out), CAUSE_COLUMNS), cfg.filters.min_short_side)
    assert "decode / too_small" in console and f"[curate] likely cause: {cause}\n" in console
    page = Path(write_report(str(out), cfg)).read_text()
    assert f"Likely cause: {html.escape(cause)}" in page
