"""Reading the ledger back and summarising it: what happened to every input, grouped by stage and reason."""

from __future__ import annotations

import posixpath
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common import schema
from common.layout import DOWNLOAD, GLOBAL_PHASES, LAYOUT, TAKEDOWN, funnel_phase
from common.storage import DAMAGED_RECORD_ADVICE, DamagedRecordError, exists, join, open_parquet, resolve
from curation.records import read_commits, read_manifest
from curation.score.read_parquet import layout_problem
from curation.score.sources import parse_source


def committed_files(out_uri: str, kind: str) -> list[str]:
    """Paths (relative to the output root) of committed phase-1 files: kind is "ledger" or "scored"."""
    fs, root = resolve(out_uri)
    return sorted(f for record in read_commits(fs, root).values() for f in record[f"{kind}_files"])


def read_ledger(out_uri: str, columns: list[str] | None = None) -> pa.Table:
    """One row per input: the final ledger once the write phase is done (the files its manifest lists), else phase
    1's committed ledger."""
    tables = list(iter_ledger(out_uri, columns))
    if not tables:
        return schema.ledger_schema().empty_table().select(columns or schema.ledger_schema().names)
    return pa.concat_tables(tables)


def iter_ledger(out_uri: str, columns: list[str] | None = None) -> Iterator[pa.Table]:
    """The ledger of ``read_ledger`` one file at a time, for readers that hold a summary rather than every row."""
    fs, root = resolve(out_uri)
    if exists(fs, join(root, LAYOUT.done("write"))):
        entries = read_manifest(fs, root, fields={"final_ledger": list})["final_ledger"]
        files = [join(root, LAYOUT.final_ledger, e["file"]) for e in entries]
    else:
        files = [join(root, f) for f in committed_files(out_uri, LAYOUT.ledger)]
    for f in files:
        yield pq.read_table(f, columns=columns, filesystem=fs)


def reason_code(reason: str | None) -> str:
    return (reason or "").split(":", 1)[0]


def summary_table(ledger: pa.Table) -> str:
    """A plain-text funnel: inputs, kept, and rejected/errored counts per stage and reason code."""
    status = ledger.column("status").to_pylist()
    stage = ledger.column("stage").to_pylist()
    reason = ledger.column("reason").to_pylist()
    total = len(status)
    kept = sum(s == schema.KEPT for s in status)
    groups = Counter((s, st, reason_code(r)) for s, st, r in zip(status, stage, reason) if s != schema.KEPT)
    width = max([len("inputs")] + [len(f"{st} / {code}") for _, st, code in groups]) + 2
    pct = lambda n: f"{100.0 * n / total:5.1f}%" if total else "    -"  # noqa: E731
    lines = [f"{'inputs':<{width}}{total:>8}", f"{'kept':<{width}}{kept:>8}  {pct(kept)}"]
    for (status_, st, code), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0])):
        label = f"{st} / {code}" + (" (error)" if status_ == schema.ERROR else "")
        lines.append(f"{label:<{width}}{n:>8}  {pct(n)}")
    return "\n".join(lines)


# Columns of the ledger ``likely_causes`` reads.
CAUSE_COLUMNS = ["source", "status", "stage", "reason", "width", "height"]
MOST = 0.5  # share of the inputs past which one reason names the pool's likely fault
NEARLY_ALL = 0.9  # share of the images with a size that must be too small, and of them at one size, to say so


def likely_causes(ledger: pa.Table, min_short_side: int) -> list[str]:
    """What is likely wrong with a pool (or its settings) when one reason dominates its ledger, one line each: Parquet
    files left unread for their columns, inputs that are not images, images too small at one size (a crawl resized
    on download). The console's summary and the audit report both show these. ``ledger``: ``CAUSE_COLUMNS``."""
    counts = CauseCounts()
    counts.add(ledger)
    return counts.causes(min_short_side)


class CauseCounts:
    """What ``likely_causes`` counts, added up one part of the ledger at a time (``CAUSE_COLUMNS``)."""

    def __init__(self) -> None:
        self.total = self.sized = 0
        self.problems: Counter[str] = Counter()  # why unread Parquet files were not read
        self.not_images: Counter[str] = Counter()  # file suffixes of the inputs that are not images
        self.sides: Counter[int] = Counter()  # short sides of the images too small

    def add(self, ledger: pa.Table) -> None:
        self.total += ledger.num_rows
        rejected = ledger.filter(
            pc.and_(pc.equal(ledger["status"], schema.REJECTED), pc.equal(ledger["stage"], "decode"))
        )
        reasons = rejected.column("reason").to_pylist()
        codes = [reason_code(r) for r in reasons]
        self.problems.update(p for p in map(layout_problem, reasons) if p)
        sources = rejected.column("source").to_pylist()
        self.not_images.update(_suffix(s) for s, code in zip(sources, codes) if code == "not_an_image")
        self.sized += int(pc.sum(pc.and_(pc.is_valid(ledger["width"]), pc.is_valid(ledger["height"]))).as_py() or 0)
        small = rejected.filter(pa.array([c == "too_small" for c in codes], pa.bool_()))
        sizes = zip(small.column("width").to_pylist(), small.column("height").to_pylist())
        self.sides.update(min(w, h) for w, h in sizes if w is not None and h is not None)

    def causes(self, min_short_side: int) -> list[str]:
        total, sized, problems, sides = self.total, self.sized, self.problems, self.sides
        causes = []
        if problems and sum(problems.values()) > MOST * total:
            problem, n = problems.most_common(1)[0]
            causes.append(f"{n} Parquet file{'s' if n > 1 else ''} unread: {problem}")
        not_images = self.not_images.total()
        if not_images > MOST * total:
            kinds = self.not_images.most_common()
            shown = ", ".join(f"{kind} {n}" for kind, n in kinds[:5]) + (", ..." if len(kinds) > 5 else "")
            causes.append(
                f"{_of(not_images, total, 'input')} not images ({shown}): --input should hold images, as files, "
                "Parquet files with an image column or WebDataset tars"
            )
        if sides and sides.total() >= NEARLY_ALL * sized:
            side, n = sides.most_common(1)[0]
            if n >= NEARLY_ALL * sized:
                causes.append(
                    f"{_of(n, sized, 'image')} {side} px on the short side: downloaded at {side} px? re-download at "
                    f">= {min_short_side} (img2dataset --resize_mode no) or set filters.min_short_side"
                )
            else:
                causes.append(
                    f"{_of(sides.total(), sized, 'image')} under {min_short_side} px on the short side ({min(sides)} "
                    f"to {max(sides)} px): find larger copies or set filters.min_short_side"
                )
        return causes


def _of(n: int, total: int, noun: str) -> str:
    """``all 53 images are``, ``50 of 53 images are``, ``the one image is``."""
    if total == 1:
        return f"the one {noun} is"
    return f"all {total} {noun}s are" if n == total else f"{n} of {total} {noun}s are"


def _suffix(source: str) -> str:
    """An input's file suffix, lower case: of the file, or of the tar member."""
    return posixpath.splitext(parse_source(source).leaf)[1].lower() or "no suffix"


@dataclass
class FunnelStep:
    phase: str
    stage: str
    reached: int
    outcomes: list[tuple[str, str, int]]  # (status, reason code, count) of images that stopped here


def stopped_by_stage(rows: Iterable[dict]) -> dict[str, Counter]:
    """Per stage, (status, reason code) counts of the ledger rows that stopped there."""
    stopped: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        if r["status"] != schema.KEPT:
            stopped[r["stage"]][(r["status"], reason_code(r["reason"]))] += 1
    return stopped


def stopped_in_funnel(funnel: dict[str, int]) -> dict[str, Counter]:
    """``stopped_by_stage`` from a manifest's funnel (``<phase>/<stage>/<status>/<reason code>`` counts)."""
    stopped: dict[str, Counter] = defaultdict(Counter)
    for name, n in funnel.items():
        _, stage, status, code = name.split("/", 3)
        if status != schema.KEPT:
            stopped[stage][(status, code)] += n
    return stopped


def funnel_steps(stopped: dict[str, Counter], total: int, stage_order: Sequence[str]) -> list[FunnelStep]:
    """How many of ``total`` inputs reached each stage and phase, and what stopped there (by status and reason
    code): the downloader's failures where the pool recorded them, scoring stages in ``stage_order``, then any other
    scoring stage that stopped images, then the global phases."""
    before = [DOWNLOAD] if DOWNLOAD in stopped else []
    after = [*GLOBAL_PHASES, *([TAKEDOWN] if TAKEDOWN in stopped else [])]
    not_scoring = {DOWNLOAD, *after}
    scoring = [s for s in stage_order if s not in not_scoring]
    scoring += sorted(s for s in stopped if s not in scoring and s not in not_scoring)
    remaining, steps = total, []
    for stage in [*before, *scoring, *after]:
        counts = stopped.get(stage, Counter())
        outcomes = [(status, code, n) for (status, code), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        steps.append(FunnelStep(funnel_phase(stage), stage, remaining, outcomes))
        remaining -= sum(n for *_, n in outcomes)
    return steps


def download_note(steps: Sequence[FunnelStep]) -> str:
    """What a funnel's first stage means when it is the download ("" when the pool recorded no failed download)."""
    failed = sum(n for step in steps if step.stage == DOWNLOAD for *_, n in step.outcomes)
    if not failed:
        return ""
    return (
        f"{failed} of the inputs {'is a URL' if failed == 1 else 'are URLs'} the pool's downloader tried and got no "
        "image from (its per-shard record, as img2dataset writes it): stage download, the downloader's status as the "
        "reason code."
    )


def funnel_of(ledger: pa.Table) -> Counter:
    """``<phase>/<stage>/<status>/<reason code>`` counts, as the manifest's funnel."""
    code = pc.fill_null(pc.utf8_slice_codeunits(ledger.column("reason"), 0, 10_000), "")
    codes = [c.split(":", 1)[0] for c in code.to_pylist()]
    stages = ledger.column("stage").to_pylist()
    statuses = ledger.column("status").to_pylist()
    return Counter(f"{funnel_phase(s)}/{s}/{st}/{c}" for s, st, c in zip(stages, statuses, codes))


def read_part(fs, path: str, columns: list[str], target: pa.Schema) -> pa.Table:
    """The ``columns`` of a phase-1 part (scored or ledger). A stage's column the file lacks (written before the stage
    wrote it, as the ``pdq_crops`` or ``nsfw_score`` of an older output) is read as nulls of its type in ``target``;
    any other missing column raises. A scored part's ``image`` holds its bytes while its image file
    (``LAYOUT.images_of``) does, null once they are dropped (and as stored by outputs that kept them inline)."""
    with open_parquet(fs, path) as f:
        have = set(f.schema_arrow.names)
        added = {c.name for c in schema.stage_columns()} & (set(columns) - have)
        t = f.read(columns=[c for c in columns if c not in added])
    for name in sorted(added):
        t = t.append_column(target.field(name), pa.nulls(t.num_rows, target.field(name).type))
    if "image" in columns and t.num_rows:  # a scored part: the ledger's have no image
        t = _with_image_bytes(fs, path, t)
    return t.select(columns)


def _with_image_bytes(fs, path: str, t: pa.Table) -> pa.Table:
    """``t`` (rows of the scored part ``path``, in its order) with the bytes of its image file, when it has one."""
    images_path = LAYOUT.images_of(path)
    if not exists(fs, images_path):
        return t
    with open_parquet(fs, images_path) as f:
        images = f.read(columns=["source", "image"])
    same = len(images) == len(t) and ("source" not in t.column_names or images["source"].equals(t["source"]))
    if not same:
        raise DamagedRecordError(
            images_path, f"its rows are not those of the scored part {path}", DAMAGED_RECORD_ADVICE
        )
    return t.set_column(t.schema.get_field_index("image"), t.schema.field("image"), images.column("image"))


def kept_sources(fs, root: str, record: dict) -> pa.Array:
    """The sources an input shard's commit record keeps: the kept rows of its ledger files."""
    tables = [pq.read_table(join(root, f), columns=["source", "status"], filesystem=fs) for f in record["ledger_files"]]
    ledger = pa.concat_tables(tables)
    return ledger.filter(pc.equal(ledger.column("status"), schema.KEPT)).column("source").combine_chunks()
