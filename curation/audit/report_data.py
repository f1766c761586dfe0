"""What an audit report shows, gathered from a curated output one file at a time: counts, bounded samples and the
few rows its sheets show.

The ledger and the dedup and sample decisions are read file by file (batch by batch) and folded into counters, so
the driver's memory follows the report's size, not the output's: per stage and reason a count and the tiles shown,
per score at most ``SCORE_SAMPLE`` values, one count per duplicate group and per leaf cluster, and the rows of the
groups and clusters shown.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.acero as ac
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from common import schema
from common.layout import LAYOUT, PHASES
from common.storage import exists, join, resolve
from curation.records import read_done, read_manifest, read_run_record
from curation.score.ledger import CAUSE_COLUMNS, CauseCounts, iter_ledger, reason_code, stopped_by_stage

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
    "nsfw_score",
    "clip_nsfw_score",
    "duplicate_of",
    "duplicate_signal",
]
# What a tile needs of its ledger row: where its bytes are, its outcome, and the scores written under it.
TILE_COLUMNS = (
    "source", "shard_id", "key", "status", "stage", "reason", "quality", "aesthetic", "main_person_height_frac",
    "head_yaw_class",
)  # fmt: skip
SURVIVED_SCORING = (schema.KEPT, schema.DUPLICATE, schema.UNSAMPLED)
AFTER_DEDUP = (schema.KEPT, schema.UNSAMPLED)
POPULATIONS = {"after scoring": SURVIVED_SCORING, "after dedup": AFTER_DEDUP, "final shards": (schema.KEPT,)}
# Person-scale histograms: (column, threshold in filters) on fixed bins, so each file's counts add up.
SCALE_COLUMNS = (
    ("main_person_height_frac", "person_min_height_frac"),
    ("main_person_area_frac", "person_min_area_frac"),
)
SCALE_POPULATIONS = ("after scoring", "final shards")
SCALE_EDGES = np.linspace(0, 1, 21)
SCORE_SAMPLE = 1 << 18  # values per score histogram: every one up to this many, a uniform sample past it


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
    threshold: str | None  # field of CurateConfig.filters (its value may be None: off), None when nothing filters on it
    keep: str  # "min": values at or above the threshold pass; "max": at or below


SCORES = (
    ScoreSpec("short_side", "decode", "min_short_side", "min"),
    ScoreSpec("aspect_ratio", "decode", "max_aspect_ratio", "max"),
    ScoreSpec("main_person_score", "person", "person_min_score", "min"),
    ScoreSpec("main_person_height_frac", "person", "person_min_height_frac", "min"),
    ScoreSpec("main_person_area_frac", "person", "person_min_area_frac", "min"),
    ScoreSpec("head_confidence", "head_pose", None, "min"),
    ScoreSpec("quality", "quality", "min_quality", "min"),
    ScoreSpec("aesthetic", "clip", "min_aesthetic", "min"),
    ScoreSpec("realism", "clip", "min_realism", "min"),
    ScoreSpec("text_area_frac", "text_overlay", "max_text_area_frac", "max"),
    ScoreSpec("nsfw_score", "nsfw", "nsfw_max_score", "max"),
    ScoreSpec("clip_nsfw_score", "clip", "clip_nsfw_max_score", "max"),
)


class Picks:
    """At most ``k`` of the rows offered, chosen uniformly at random (those of the lowest random priority), and how
    many were offered. Every row is kept while there are at most ``k``."""

    def __init__(self, k: int, rng: np.random.Generator):
        self.k, self.rng, self.n = k, rng, 0
        self._heap: list[tuple[float, int, dict]] = []  # (-priority, arrival, row): the highest priority on top

    def offer(self, row: dict) -> None:
        self.n += 1
        item = (-float(self.rng.random()), self.n, row)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, item)
        elif item[0] > self._heap[0][0]:
            heapq.heapreplace(self._heap, item)

    def rows(self) -> list[dict]:
        """The rows kept, by source."""
        return sorted((row for *_, row in self._heap), key=lambda r: r["source"])


class ScoreValues:
    """One score's values and whether its stage rejected each image: all of them up to ``cap``, a uniform sample
    past it (reservoir sampling), and the count of all."""

    def __init__(self, cap: int, rng: np.random.Generator):
        self.cap, self.rng, self.n = cap, rng, 0
        self.values: list[float] = []
        self.rejected: list[bool] = []

    def add(self, value: float, rejected: bool) -> None:
        self.n += 1
        if len(self.values) < self.cap:
            self.values.append(value)
            self.rejected.append(rejected)
        elif (j := int(self.rng.integers(self.n))) < self.cap:
            self.values[j], self.rejected[j] = value, rejected

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.values, np.float64), np.asarray(self.rejected, bool)


@dataclass
class Duplicates:
    dropped: int = 0  # near-duplicates dropped (rows of the dedup decisions)
    groups: int = 0  # their groups, one per kept image
    by_signal: Counter = field(default_factory=Counter)
    shown: list[tuple[str, list[dict]]] = field(default_factory=list)  # (kept key, its duplicates by source)


@dataclass
class Clusters:
    images: int = 0  # images with a sample decision
    count: int = 0  # leaf clusters
    levels: int = 0
    sizes: list[tuple[int, int, int]] = field(default_factory=list)  # (leaf, images, selected), largest first
    shown: dict[int, list[dict]] = field(default_factory=dict)  # leaf -> decisions on its grid, selected first


@dataclass
class ReportData:
    total: int = 0
    kept: int = 0
    stopped: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    causes: list[str] = field(default_factory=list)
    scores: dict[str, ScoreValues] = field(default_factory=dict)
    rejected: dict[tuple[str, str, str], Picks] = field(default_factory=dict)  # (stage, status, code) -> picks
    kept_rows: Picks | None = None
    yaw: dict[str, Counter] = field(default_factory=lambda: {name: Counter() for name in POPULATIONS})
    scale: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # (column, population) -> bin counts
    scale_n: Counter = field(default_factory=Counter)  # (column, population) -> images with the value
    duplicates: Duplicates = field(default_factory=Duplicates)
    clusters: Clusters = field(default_factory=Clusters)
    by_source: dict[str, dict] = field(default_factory=dict)  # the rows the groups and grids show
    keepers: dict[str, dict] = field(default_factory=dict)  # key -> the row kept of a group shown
    state: dict[str, dict | None] = field(default_factory=dict)  # run record and phases' done records
    manifest: dict | None = None


def gather(out_uri: str, min_short_side: int, options: ReportOptions) -> ReportData:
    """Everything the report shows, read from ``out_uri`` one file at a time."""
    fs, root = resolve(out_uri)
    rng = np.random.default_rng(options.seed)
    data = ReportData(kept_rows=Picks(2 * options.per_sheet, rng))
    data.state, data.manifest = _records(fs, root)
    data.duplicates = _duplicates(_decisions(fs, join(root, LAYOUT.dedup_decisions)), options.dup_groups)
    data.clusters = _clusters(_decisions(fs, join(root, LAYOUT.sample_decisions)), options)
    wanted = {d["source"] for _, group in data.duplicates.shown for d in group}
    wanted |= {d["source"] for grid in data.clusters.shown.values() for d in grid}
    keys = {key for key, _ in data.duplicates.shown}
    causes = CauseCounts()
    scores_rng = np.random.default_rng(options.seed + 1)
    data.scores = {spec.column: ScoreValues(SCORE_SAMPLE, scores_rng) for spec in SCORES}
    for table in iter_ledger(out_uri, LEDGER_COLUMNS):
        causes.add(table.select(CAUSE_COLUMNS))
        _add_rows(data, table.to_pylist(), wanted, keys, options, rng)
    data.causes = causes.causes(min_short_side)
    return data


def _add_rows(
    data: ReportData, rows: list[dict], wanted: set[str], keys: set[str], options: ReportOptions, rng
) -> None:
    """One ledger file's rows folded into ``data``."""
    data.total += len(rows)
    for stage, counts in stopped_by_stage(rows).items():
        data.stopped[stage].update(counts)
    assert data.kept_rows is not None
    for r in rows:
        w, h = r["width"], r["height"]
        r["short_side"] = min(w, h) if w and h else None
        r["aspect_ratio"] = max(w, h) / min(w, h) if w and h else None
        status = r["status"]
        for spec in SCORES:
            if (value := r.get(spec.column)) is not None:
                data.scores[spec.column].add(value, status == schema.REJECTED and r["stage"] == spec.stage)
        tile = {c: r[c] for c in TILE_COLUMNS}
        if status in (schema.REJECTED, schema.ERROR):
            group = (r["stage"], status, reason_code(r["reason"]))
            data.rejected.setdefault(group, Picks(options.per_sheet, rng)).offer(tile)
        elif status == schema.KEPT:
            data.kept += 1
            data.kept_rows.offer(tile)
        if r["source"] in wanted:
            data.by_source[r["source"]] = tile
        if r["key"] in keys and status in AFTER_DEDUP:
            held = data.keepers.get(r["key"])
            if held is None or held["source"] < r["source"]:  # one row per key: the last by source, as ever
                data.keepers[r["key"]] = tile
        for name, statuses in POPULATIONS.items():
            if status not in statuses:
                continue
            data.yaw[name][str(r["head_yaw_class"])] += 1
            if name not in SCALE_POPULATIONS:
                continue
            for column, _ in SCALE_COLUMNS:
                if r[column] is not None:
                    data.scale_n[(column, name)] += 1
    for column, _ in SCALE_COLUMNS:  # binned a file at a time, on fixed edges
        for name in SCALE_POPULATIONS:
            values = [r[column] for r in rows if r["status"] in POPULATIONS[name] and r[column] is not None]
            binned = np.histogram(values, bins=SCALE_EDGES)[0]
            data.scale[(column, name)] = data.scale.get((column, name), np.zeros_like(binned)) + binned


def _records(fs: pafs.FileSystem, root: str) -> tuple[dict[str, dict | None], dict | None]:
    """The run record and the phases' done records (None where absent), and the manifest."""
    state: dict[str, dict | None] = {}
    for name in ("run", *PHASES):
        rel = LAYOUT.run_record if name == "run" else LAYOUT.done(name)
        if not exists(fs, join(root, rel)):
            state[name] = None
        elif name == "run":
            state[name] = read_run_record(fs, root)
        else:
            state[name] = read_done(fs, root, name)
    manifest = read_manifest(fs, root) if exists(fs, join(root, LAYOUT.manifest)) else None
    return state, manifest


def _decisions(fs: pafs.FileSystem, path: str) -> ds.Dataset | None:
    return ds.dataset(path, filesystem=fs, format="parquet") if exists(fs, path) else None


def _duplicates(decisions: ds.Dataset | None, shown: int) -> Duplicates:
    """Group sizes counted by Arrow (one entry per group), then the largest groups' rows read."""
    out = Duplicates()
    if decisions is None:
        return out
    sizes = ac.Declaration.from_sequence(
        [
            ac.Declaration("scan", ac.ScanNodeOptions(decisions, columns=["duplicate_of"])),
            ac.Declaration(
                "aggregate", ac.AggregateNodeOptions([("duplicate_of", "hash_count", None, "n")], keys=["duplicate_of"])
            ),
        ]
    ).to_table()
    out.groups = sizes.num_rows
    largest = sizes.sort_by([("n", "descending"), ("duplicate_of", "ascending")]).slice(0, shown)
    keys = largest.column("duplicate_of").to_pylist()
    members: dict[str, list[dict]] = {key: [] for key in keys}
    columns = ["source", "duplicate_of", "duplicate_signal"]
    for batch in decisions.to_batches(columns=columns):
        out.dropped += batch.num_rows
        out.by_signal.update(batch.column("duplicate_signal").to_pylist())
        picked = batch.filter(pc.is_in(batch.column("duplicate_of"), pa.array(keys, pa.string())))
        for d in picked.to_pylist():
            members[d["duplicate_of"]].append(d)
    out.shown = [(key, sorted(members[key], key=lambda d: d["source"])) for key in keys]
    return out


def _clusters(decisions: ds.Dataset | None, options: ReportOptions) -> Clusters:
    """Leaf cluster sizes (one entry per cluster), then the grids of the largest: selected images first."""
    out = Clusters()
    if decisions is None:
        return out
    sizes: Counter[int] = Counter()
    selected: Counter[int] = Counter()
    for batch in decisions.to_batches(columns=["cluster_ids", "selected"]):
        for ids, chosen in zip(batch.column("cluster_ids").to_pylist(), batch.column("selected").to_pylist()):
            leaf = ids[0] if ids else -1
            sizes[leaf] += 1
            selected[leaf] += chosen
            out.levels = max(out.levels, len(ids or []))
    out.images, out.count = sizes.total(), len(sizes)
    ordered = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))
    out.sizes = [(leaf, n, selected[leaf]) for leaf, n in ordered[: max(options.chart_clusters, options.clusters)]]
    grids: dict[int, list[tuple[bool, str, dict]]] = {leaf: [] for leaf, _ in ordered[: options.clusters]}
    for batch in decisions.to_batches(columns=["source", "cluster_ids", "selected"]):
        for d in batch.to_pylist():
            grid = grids.get(d["cluster_ids"][0] if d["cluster_ids"] else -1)
            if grid is None:
                continue
            grid.append((not d["selected"], d["source"], d))
            if len(grid) >= 2 * options.per_cluster:  # trimmed as it fills: never more than twice what it shows
                grid[:] = _first(grid, options.per_cluster)
    out.shown = {leaf: [d for *_, d in _first(grid, options.per_cluster)] for leaf, grid in grids.items()}
    return out


def _first(grid: list[tuple[bool, str, dict]], n: int) -> list[tuple[bool, str, dict]]:
    """A grid's first ``n`` decisions: selected ones first, then by source (unique, so dicts are never compared)."""
    return sorted(grid, key=lambda item: item[:2])[:n]
