"""jobs.audit on a real curated output: a sound run passes, each kind of damage is caught and located; the HTML
report renders in headless Chromium with only local resources; other Parquet readers load the shards."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from common import schema
from common.config import load_config
from common.layout import LAYOUT
from curation.audit.charts import score_histogram
from curation.audit.report import _NOT_REOPENED, write_report
from curation.audit.report_data import SCORES, ReportOptions
from curation.audit.thumbnails import Thumbnails, Tile
from curation.audit.verify import audit, funnel_key
from curation.audit.verify_shards import Problem
from curation.config import CurateConfig
from curation.score.ledger import committed_files, read_ledger, reason_code
from jobs import audit as audit_job
from tests.chromium import Chromium, chromium
from tests.docs_text import section as docs_section

LITE = "configs/curate/lite.yaml"
SECTIONS = {
    "integrity": "Integrity",
    "funnel": "Funnel per phase and stage",
    "scores": "Score histograms and thresholds",
    "rejected": "Rejected images per stage and reason",
    "kept": "Kept images",
    "duplicates": "Duplicate groups",
    "clusters": "Clusters before and after balanced sampling",
    "people": "Head pose and person scale",
    "run": "Run config and timings",
}


@pytest.fixture
def out(curated_run, tmp_path) -> Path:
    """A private copy of the session's curated output, free to damage."""
    dst = tmp_path / "out"
    shutil.copytree(curated_run, dst)
    return dst


@pytest.fixture(scope="session")
def lite() -> CurateConfig:
    return load_config(CurateConfig, Path(__file__).resolve().parents[3] / LITE)


def _manifest(out: Path) -> dict:
    return json.loads((out / LAYOUT.manifest).read_text())


def _shard(out: Path, k: int) -> tuple[Path, str]:
    """The k-th shard the manifest lists: its path, and its name relative to the output root."""
    name = _manifest(out)["shards"][k]["file"]
    return out / "shards" / name, f"shards/{name}"


def _rewrite(path: Path, table: pa.Table) -> None:
    """Write a table back as a valid Parquet file (schema and file metadata kept)."""
    pq.write_table(table, path, row_group_size=100, compression="zstd")


def _refresh_manifest(out: Path) -> None:
    """Make the manifest describe the shard files as they now are: only row-level checks can then object."""
    manifest = _manifest(out)
    for entry in manifest["shards"]:
        data = (out / "shards" / entry["file"]).read_bytes()
        entry.update(
            bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            rows=pq.ParquetFile(out / "shards" / entry["file"]).metadata.num_rows,
        )
    manifest["totals"].update(
        rows=sum(e["rows"] for e in manifest["shards"]), bytes=sum(e["bytes"] for e in manifest["shards"])
    )
    (out / LAYOUT.manifest).write_text(json.dumps(manifest))


def _where(problems: list[Problem], file: str, row: int | None = None, text: str = "") -> list[Problem]:
    return [p for p in problems if p.file == file and (row is None or p.row == row) and text in p.what]


# --- verify ---------------------------------------------------------------------------------------------------


def test_sound_run_passes(curated_run, sample_pool, capsys):
    result = audit(str(curated_run))
    assert result.ok, result.summary()
    manifest = _manifest(curated_run)
    inputs = len((sample_pool / "_manifest.jsonl").read_text().splitlines())
    assert len(manifest["shards"]) >= 2  # keys must be unique across shards, not only inside one
    assert result.counts == {
        "shards": len(manifest["shards"]),
        "shard_rows": manifest["totals"]["rows"],
        "images_decoded": manifest["totals"]["rows"],
        "inputs": inputs,
        "ledger_rows": inputs,
    }
    assert audit_job.main([str(curated_run)]) == 0
    assert "sound" in capsys.readouterr().out


def test_funnel_key_matches_the_manifest(curated_run):
    ledger = read_ledger(str(curated_run), ["stage", "status", "reason"]).to_pylist()
    funnel = Counter(funnel_key(r["stage"], r["status"], r["reason"]) for r in ledger)
    assert dict(funnel) == _manifest(curated_run)["funnel"]


def test_deleted_shard(out, capsys):
    gone, rel = _shard(out, 1)
    sources = set(pq.read_table(gone, columns=["source"]).column("source").to_pylist())
    gone.unlink()
    result = audit(str(out))
    assert _where(result.problems, rel, None, "listed in the manifest but missing")
    # its images are still kept in the ledger: each is named, in its own ledger file and row
    orphans = [p for p in result.problems if p.what.endswith(" is kept but no readable shard row holds it")]
    assert {p.what.split(" is kept")[0] for p in orphans} == sources
    assert all(p.file.startswith("final_ledger/") and p.row is not None for p in orphans)
    assert audit_job.main([str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"{rel}: listed in the manifest but missing" in printed


def test_truncated_shard(out):
    path, rel = _shard(out, 0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    problems = audit(str(out)).problems
    assert _where(problems, rel, None, f"{len(data) // 2} bytes, the manifest says {len(data)}")
    assert _where(problems, rel, None, "sha256")
    assert _where(problems, rel, None, "not a readable Parquet file")


def test_flipped_byte(out):
    path, rel = _shard(out, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = audit(str(out)).problems
    assert _where(problems, rel, None, "differs from the manifest's")
    assert not _where(problems, rel, None, "bytes, the manifest says")  # same size


def test_damaged_image_is_located_by_row(out):
    """An image cut short inside a well-formed shard (manifest updated to match): found at its row."""
    path, rel = _shard(out, 0)
    table = pq.read_table(path)
    images = table.column("image").to_pylist()
    images[2] = {**images[2], "bytes": images[2]["bytes"][: len(images[2]["bytes"]) // 3]}
    _rewrite(
        path,
        table.set_column(
            table.schema.get_field_index("image"), table.schema.field("image"), pa.array(images, schema.IMAGE_TYPE)
        ),
    )
    _refresh_manifest(out)
    problems = audit(str(out)).problems
    assert {p.row for p in problems} == {2} and {p.file for p in problems} == {rel}
    assert _where(problems, rel, 2, "sha256 of the image bytes")
    assert _where(problems, rel, 2, "image does not decode")


def test_shard_without_datasets_features(out):
    """A shard rewritten without the huggingface metadata (manifest updated): datasets would not decode it."""
    path, rel = _shard(out, 0)
    table = pq.read_table(path)
    meta = {k: v for k, v in table.schema.metadata.items() if k != schema.HF_METADATA_KEY}
    _rewrite(path, table.replace_schema_metadata(meta))
    _refresh_manifest(out)
    problems = audit(str(out)).problems
    assert [(p.file, p.row) for p in problems] == [(rel, None)]
    assert "file metadata huggingface is missing" in problems[0].what


def test_extra_file(out):
    shutil.copy(_shard(out, 0)[0], out / "shards" / "part-00099.parquet")
    problems = audit(str(out)).problems
    assert [(p.file, p.row) for p in problems] == [("shards/part-00099.parquet", None)]
    assert "not in the manifest" in problems[0].what


def test_duplicated_key(out):
    first_path, first_rel = _shard(out, 0)
    first = pq.read_table(first_path)
    last_path = out / "shards" / sorted(e["file"] for e in _manifest(out)["shards"])[-1]
    last = pq.read_table(last_path)
    _rewrite(last_path, pa.concat_tables([last, first.slice(0, 1)]))
    _refresh_manifest(out)
    problems = audit(str(out)).problems
    rel = f"shards/{last_path.name}"
    key = first.column("key")[0].as_py()
    hit = _where(problems, rel, last.num_rows, f"is not unique: also at {first_rel} row 0")
    assert any(p.what.startswith(f"key {key[:16]}") for p in hit)
    assert not _where(problems, rel, None, "sha256")  # the shard itself is intact


def test_ledger_row_removed(out):
    path = next(p for p in sorted((out / "final_ledger").glob("*.parquet")) if pq.ParquetFile(p).metadata.num_rows > 3)
    table = pq.read_table(path)
    removed = table.slice(2, 1).to_pylist()[0]
    _rewrite(path, pa.concat_tables([table.slice(0, 2), table.slice(3)]))
    problems = audit(str(out)).problems
    rel = f"final_ledger/{path.name}"
    assert _where(problems, rel, None, f"no row for input {removed['source']} (ledger/")
    assert _where(problems, rel, None, f"{table.num_rows - 1} rows for {table.num_rows} inputs")
    key = funnel_key(removed["stage"], removed["status"], removed["reason"])
    assert _where(problems, LAYOUT.manifest, None, f"funnel {key}:")


def test_missing_output_is_a_problem_not_a_crash(tmp_path):
    result = audit(str(tmp_path / "nothing"))
    assert not result.ok
    assert _where(result.problems, LAYOUT.manifest, None, "missing")


def test_audit_and_report_on_s3(curated_run, lite, s3):
    """The same checks through pyarrow's S3 filesystem (a local moto server), and a report written back to S3."""
    import pyarrow.fs as pafs

    fs, query = s3
    pafs.copy_files(
        str(curated_run),
        "curated/out",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=fs,
        use_threads=False,
    )
    uri = f"s3://curated/out{query}"
    result = audit(uri)
    assert result.ok, result.summary()
    assert result.counts["shard_rows"] == _manifest(curated_run)["totals"]["rows"]
    index = write_report(uri, lite, result)
    assert index == "curated/out/report/index.html"
    assert fs.get_file_info(index).size > 0
    rel = _shard(curated_run, 1)[1]
    fs.delete_file(f"curated/out/{rel}")
    assert _where(audit(uri).problems, rel, None, "missing")


# --- report ---------------------------------------------------------------------------------------------------


class _Page(HTMLParser):
    """The bits of the report the tests look at: images, links, sections, tiles."""

    def __init__(self):
        super().__init__()
        self.imgs, self.hrefs, self.sections, self.tiles = [], [], [], []
        self._stack: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a["src"])
        if "href" in a:
            self.hrefs.append(a["href"])
        if tag == "section":
            self.sections.append(a["id"])
        if tag == "figure" and "tile" in a.get("class", ""):
            self.tiles.append(
                {
                    "class": a["class"],
                    "source": a["title"],
                    "section": self.sections[-1],
                    "img": None,
                    "placeholder": None,
                }
            )
        if tag == "img" and self.tiles and self.tiles[-1]["img"] is None and self._open_tile():
            self.tiles[-1]["img"] = a["src"]
        self._stack.append({"tag": tag, "class": a.get("class", "")})

    def _open_tile(self) -> bool:
        return any(e["tag"] == "figure" for e in self._stack)

    def handle_endtag(self, tag):
        while self._stack and self._stack.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        if self._stack and self._stack[-1]["class"] == "placeholder" and self.tiles:
            self.tiles[-1]["placeholder"] = data


@pytest.fixture(scope="module")
def reported(curated_run, lite, tmp_path_factory) -> Path:
    """A copy of the output with its report, made through the command line."""
    dst = tmp_path_factory.mktemp("reported") / "out"
    shutil.copytree(curated_run, dst)
    assert audit_job.main([str(dst), "--report", "--config", str(Path(__file__).resolve().parents[3] / LITE)]) == 0
    return dst


def test_report_is_self_contained_and_shows_every_section(reported, lite):
    page = _Page()
    page.feed((reported / "report" / "index.html").read_text())
    assert page.sections == list(SECTIONS)
    assert page.imgs and all(
        not re.match(r"^[a-z]+:|^/", src) for src in page.imgs + page.hrefs if not src.startswith("#")
    )
    for src in page.imgs:
        assert (reported / "report" / src).is_file(), src
    thumbs = {src for src in page.imgs if src.startswith("thumbs/")}
    for src in thumbs:
        with Image.open(reported / "report" / src) as im:
            assert max(im.size) <= ReportOptions.thumb_side and im.format == "JPEG"
        assert (reported / "report" / src).stat().st_size < 20_000
    ledger = read_ledger(str(reported)).to_pylist()
    # a histogram for every score the run computed
    for spec in SCORES:
        computed = spec.column in ("short_side", "aspect_ratio") or any(r.get(spec.column) is not None for r in ledger)
        assert (f"charts/hist_{spec.column}.png" in page.imgs) == computed, spec.column
    # a contact sheet per (stage, reason) that rejected something, decode failures as placeholders saying why
    html_text = (reported / "report" / "index.html").read_text()
    for stage, code in {(r["stage"], reason_code(r["reason"])) for r in ledger if r["status"] == schema.REJECTED}:
        assert f"<h3>{stage} · {code} (" in html_text, (stage, code)
    rejected_tiles = [t for t in page.tiles if t["section"] == "rejected"]
    by_source = {r["source"]: r for r in ledger}
    for t in rejected_tiles:
        code = reason_code(by_source[t["source"]]["reason"])
        if by_source[t["source"]]["stage"] == "decode" and code in _NOT_REOPENED:
            assert t["placeholder"] == _NOT_REOPENED[code] and t["img"] is None
    assert any(t["img"] for t in rejected_tiles)  # readable rejected sources are shown from their bytes
    # duplicate groups: the kept image first and marked, each dropped one a duplicate of it
    dups = {d["source"]: d for d in pq.read_table(reported / "dedup" / "decisions").to_pylist()}
    group_tiles = [t for t in page.tiles if t["section"] == "duplicates"]
    keepers = [t for t in group_tiles if "kept" in t["class"].split()]
    assert (
        len(keepers)
        == html_text.count('<div class="group">')
        == min(ReportOptions.dup_groups, len({d["duplicate_of"] for d in dups.values()}))
    )
    keeper = None
    for t in group_tiles:
        if "kept" in t["class"].split():
            keeper = by_source[t["source"]]
            assert keeper["status"] in (schema.KEPT, schema.UNSAMPLED)
        else:
            assert "dropped" in t["class"] and dups[t["source"]]["duplicate_of"] == keeper["key"]
    # a grid per cluster: every image left after dedup (the pool's clusters fit the grids), unsampled ones marked
    sample = pq.read_table(reported / "sample" / "decisions").to_pylist()
    sizes = Counter(d["cluster_ids"][0] for d in sample)
    assert len(sizes) <= ReportOptions.clusters and max(sizes.values()) <= ReportOptions.per_cluster
    cluster_tiles = [t for t in page.tiles if t["section"] == "clusters"]
    assert sorted(t["source"] for t in cluster_tiles) == sorted(d["source"] for d in sample)
    selected = {d["source"]: d["selected"] for d in sample}
    assert all(("unsampled" in t["class"]) == (not selected[t["source"]]) for t in cluster_tiles)
    kept_tiles = [t for t in page.tiles if t["section"] == "kept"]
    assert {t["source"] for t in kept_tiles} <= {r["source"] for r in ledger if r["status"] == schema.KEPT}
    assert lite.results_hash() in html_text and "match" in html_text


_EXPLORER_ROW = re.compile(
    r'<tr(?: class="current")?><td class="n">([^<]*)</td><td class="n">(\d+)</td><td class="n">[^<]*</td>'
    r'<td class="n">(\d+)</td></tr>'
)


def _explorer_tables(html_text: str) -> dict[str, list[tuple[str, int, int]]]:
    """Score column -> the explorer's rows: (value as shown, kept, need model work)."""
    return {
        column: [(v, int(kept), int(needs)) for v, kept, needs in _EXPLORER_ROW.findall(body)]
        for column, body in re.findall(r'<table class="explorer" id="explore-(\w+)">(.*?)</table>', html_text, re.S)
    }


def test_threshold_explorer_counts_phase_one(reported, lite):
    html_text = (reported / "report" / "index.html").read_text()
    tables = _explorer_tables(html_text)
    # every decided threshold of the lite stages has a table; the person thresholds a note instead
    assert set(tables) == {"short_side", "aspect_ratio", "quality", "text_area_frac", "nsfw_score"}
    assert "person_min_height_frac is computed with, not decided" in html_text
    ledger = pa.concat_tables(
        pq.read_table(reported / f) for f in committed_files(str(reported), LAYOUT.ledger)
    ).to_pylist()
    kept = [r for r in ledger if r["status"] == schema.KEPT]
    for column, rows in tables.items():
        assert 2 <= len(rows) <= 7, (column, rows)
        values = [float(v.split()[0]) for v, *_ in rows]
        assert values == sorted(values) and len(set(values)) == len(values), column
        current = [r for r in rows if r[0].endswith("(configured)")]
        assert len(current) == 1 and current[0][1] == len(kept) and current[0][2] == 0, (column, current)
    # quality: at any value phase 1 keeps the kept inputs scoring at or above it; a lower one sends the inputs it no
    # longer rejects on to the later stages (model work)
    low = [r for r in ledger if r["stage"] == "quality" and reason_code(r["reason"]) == "low_quality"]
    assert low and any(r[0].split()[0] != f"{lite.filters.min_quality:g}" for r in tables["quality"])
    for shown, n_kept, needs in tables["quality"]:
        v = float(shown.split()[0])
        assert n_kept == sum(r["quality"] >= v for r in kept), shown
        assert needs == sum(r["quality"] >= v for r in low), shown
    # the inputs without a quality score: stopped (rejected or failed) before the quality stage
    order = {name: i for i, name in enumerate(lite.enabled_stages)}
    before = sum(
        r["quality"] is None and r["status"] != schema.KEPT and order.get(r["stage"], -1) < order["quality"]
        for r in ledger
    )
    assert before and f"{before} inputs have no quality: the cascade stopped them before stage quality." in html_text
    assert "--what-if filters.min_quality=" in html_text


def test_threshold_explorer_counts_the_same_in_ray_tasks(reported, lite, ray_local, monkeypatch):
    from curation.audit import explorer
    from curation.audit.report_data import SCORES, ReportOptions, gather

    data = gather(str(reported), lite.filters.min_short_side, ReportOptions())
    specs = [s for s in SCORES if data.scores[s.column].n]
    here = explorer.explore(str(reported), lite, specs, data.scores)
    monkeypatch.setattr(explorer, "TASKS_FROM_FILES", 0)
    monkeypatch.setattr(explorer, "FILES_PER_TASK", 1)  # a task per file, more of them than the window
    in_tasks = explorer.explore(str(reported), lite, specs, data.scores)
    assert in_tasks == here and here.inputs and here.tables["quality"].missing


def test_threshold_explorer_needs_the_config_phase_one_scored_with(reported, lite, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reported, out)
    other = lite.model_copy(update={"filters": lite.filters.model_copy(update={"min_quality": 0.6})})
    html_text = (out / "report" / "index.html").read_text() if write_report(str(out), other) else ""
    assert not _explorer_tables(html_text)
    assert "The config shown is not the one phase 1 scored with" in html_text


def test_histogram_draws_the_configured_threshold(curated_run, lite):
    ledger = read_ledger(str(curated_run), ["quality", "status", "stage"]).to_pylist()
    got = [r for r in ledger if r["quality"] is not None]
    values = np.asarray([r["quality"] for r in got])
    rejected = np.asarray([r["status"] == schema.REJECTED and r["stage"] == "quality" for r in got])
    assert rejected.any() and (~rejected).any()
    fig = score_histogram(values, rejected, lite.filters.min_quality, title="quality")
    ax = fig.axes[0]
    vertical = [line for line in ax.lines if len(set(line.get_xdata())) == 1]
    assert [line.get_xdata()[0] for line in vertical] == [lite.filters.min_quality]
    heights = [sum(p.get_height() for p in container) for container in ax.containers]
    assert heights == [(~rejected).sum(), rejected.sum()]  # stacked: passed, then rejected; every image counted once
    # every image the quality stage rejected lies below the threshold, every one it passed at or above
    assert values[rejected].max() < lite.filters.min_quality <= values[~rejected].min()


def test_thumbnails_are_made_once(reported, lite, caplog):
    thumbs = reported / "report" / "thumbs"
    before = {p.name: p.stat().st_mtime_ns for p in thumbs.iterdir()}
    assert before
    caplog.set_level(logging.INFO, logger="curation")
    write_report(str(reported), lite)
    assert {p.name: p.stat().st_mtime_ns for p in thumbs.iterdir()} == before
    assert any(" 0 new thumbnails" in line for line in caplog.messages)


def _photo_bytes() -> list[bytes]:
    from skimage import data as skdata

    out = []
    for arr in (skdata.astronaut(), skdata.chelsea()):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def test_thumbnail_placeholders_say_why(tmp_path, lite):
    a, b = _photo_bytes()
    (tmp_path / "a.jpg").write_bytes(a)
    (tmp_path / "changed.jpg").write_bytes(b)
    key = hashlib.sha256(a).hexdigest()
    tiles = [
        Tile(str(tmp_path / "a.jpg"), key, "s", False, "a.jpg"),
        Tile(str(tmp_path / "changed.jpg"), hashlib.sha256(b"what was curated").hexdigest(), "s", False, "changed.jpg"),
        Tile(str(tmp_path / "gone.jpg"), hashlib.sha256(b"gone").hexdigest(), "s", False, "gone.jpg"),
        Tile(str(tmp_path / "a.jpg"), key, "s", False, "again"),  # the same image twice: one thumbnail
    ]
    thumbs = Thumbnails(str(tmp_path / "out"), lite, ReportOptions(thumb_side=96))
    thumbs.fill(tiles)
    assert thumbs.made == 1 and tiles[0].thumb == tiles[3].thumb == Thumbnails.name(key)
    with Image.open(tmp_path / "out" / "report" / tiles[0].thumb) as im:
        assert max(im.size) == 96 and im.size[0] == im.size[1]  # astronaut is square
    assert tiles[1].thumb is None and "source changed since curation" in tiles[1].why
    assert tiles[2].thumb is None and "missing" in tiles[2].why


# --- headless Chromium ----------------------------------------------------------------------------------------


def test_report_renders_in_headless_chromium(reported, tmp_path):
    exe = chromium()
    index = (reported / "report" / "index.html").resolve()
    browser = Chromium(exe, tempfile.mkdtemp(dir=tmp_path))
    try:
        browser.load(index.as_uri())
        images = browser.evaluate(
            "[...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth])"
        )
        headings = browser.evaluate(
            "[...document.querySelectorAll('section > h2')].map(h => { const r = document.createRange();"
            " r.selectNodeContents(h); const b = r.getBoundingClientRect();"
            " return [h.parentElement.id, h.textContent, b.left + scrollX, b.top + scrollY, b.width, b.height]; })"
        )
        explorer = browser.evaluate(
            "[...document.querySelectorAll('table.explorer')].map(t => [t.id, t.caption && t.caption.textContent,"
            " t.rows.length, t.getBoundingClientRect().height])"
        )
        shot = browser.screenshot()
    finally:
        browser.close()
    shot.save(tmp_path / "report.png")
    methods = Counter(e.get("method") for e in browser.events)
    failed = [e["params"] for e in browser.events if e.get("method") == "Network.loadingFailed"]
    assert not failed, failed
    errors = [
        e["params"]
        for e in browser.events
        if e.get("method") in ("Runtime.exceptionThrown",)
        or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning", "assert"))
        or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))
    ]
    assert not errors, errors
    urls = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
    report_dir = index.parent.as_uri()
    assert methods["Network.requestWillBeSent"] > 10
    assert all(u.startswith(report_dir + "/") for u in urls), [u for u in urls if not u.startswith(report_dir)]
    assert images and all(width > 0 for _, width in images), [src for src, w in images if not w]
    assert len({u for u in urls if u.endswith((".png", ".jpg"))}) == len({src for src, _ in images})
    # the threshold explorer's tables are laid out under their histograms
    shown = {tid: (caption, n, height) for tid, caption, n, height in explorer}
    assert "explore-quality" in shown, explorer
    caption, n, height = shown["explore-quality"]
    assert caption.startswith("filters.min_quality") and n >= 3 and height > 0
    # the screenshot shows every section: read each heading back from the pixels
    assert [h[0] for h in headings] == list(SECTIONS)
    from rapidocr import RapidOCR

    ocr = RapidOCR(params={"Global.use_det": False, "Global.use_cls": False, "Global.log_level": "error"})
    assert shot.size[1] > 3000 and np.asarray(shot).std() > 20
    for sid, text, x, y, w, h in headings:
        crop = shot.crop((int(x) - 4, int(y) - 4, int(x + w) + 8, int(y + h) + 4))
        read = " ".join(ocr(np.asarray(crop), use_det=False, use_cls=False).txts or ())
        assert _squash(read) == _squash(SECTIONS[sid]) == _squash(text), (sid, read)


def _squash(text: str) -> str:
    return re.sub(r"[^a-z]", "", text.lower())


# --- other readers: the README's examples, run as written --------------------------------------------------------


def _readme_examples() -> str:
    section = docs_section("Auditing curated shards")
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the Auditing section has no python example"
    return "\n".join(blocks)


def test_readme_reader_examples_load_the_shards(curated_run, tmp_path):
    """Hugging Face datasets (images decoded), DuckDB and pyarrow.dataset read the shards, as the README shows."""
    (tmp_path / "out").mkdir()
    shutil.copytree(curated_run, tmp_path / "out" / "curated")
    check = """
import hashlib, json
from datasets import Image
raw = hf.cast_column("image", Image(decode=False))
print(json.dumps({
    "hf_rows": len(hf), "hf_image": type(first_image).__module__.split(".")[0], "hf_size": list(first_image.size),
    "hf_key_ok": all(hashlib.sha256(r["image"]["bytes"]).hexdigest() == r["key"] for r in raw),
    "hf_keys": list(hf["key"]), "by_pose": [list(r) for r in by_pose], "arrow_rows": table.num_rows,
    "arrow_keys": table.column("key").to_pylist(),
}))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _readme_examples() + check],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    truth = pa.concat_tables(
        [
            pq.read_table(p, columns=["key", "head_yaw_class", "image"])
            for p in sorted((curated_run / "shards").glob("*.parquet"))
        ]
    )
    keys = truth.column("key").to_pylist()
    assert got["hf_rows"] == got["arrow_rows"] == len(keys) == _manifest(curated_run)["totals"]["rows"]
    assert sorted(got["hf_keys"]) == sorted(got["arrow_keys"]) == sorted(keys)
    assert got["hf_image"] == "PIL" and got["hf_key_ok"]
    with Image.open(io.BytesIO(truth.column("image")[keys.index(got["hf_keys"][0])].as_py()["bytes"])) as im:
        assert got["hf_size"] == list(ImageOps.exif_transpose(im).size)  # datasets turns by the EXIF orientation
    assert {pose: n for pose, n, _ in got["by_pose"]} == dict(Counter(truth.column("head_yaw_class").to_pylist()))
