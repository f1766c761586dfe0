"""Reading the ledger back and summarising it: what happened to every input, grouped by stage and reason."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common import schema
from common.layout import DOWNLOAD, GLOBAL_PHASES, LAYOUT, TAKEDOWN, funnel_phase
from common.storage import exists, join, resolve
from curation.records import read_commits, read_manifest


def committed_files(out_uri: str, kind: str) -> list[str]:
    """Paths (relative to the output root) of committed phase-1 files: kind is "ledger" or "scored"."""
    fs, root = resolve(out_uri)
    return sorted(f for record in read_commits(fs, root).values() for f in record[f"{kind}_files"])


def read_ledger(out_uri: str, columns: list[str] | None = None) -> pa.Table:
    """One row per input: the final ledger once the write phase is done (the files its manifest lists), else phase
    1's committed ledger."""
    fs, root = resolve(out_uri)
    if exists(fs, join(root, LAYOUT.done("write"))):
        entries = read_manifest(fs, root, fields={"final_ledger": list})["final_ledger"]
        files = [join(root, LAYOUT.final_ledger, e["file"]) for e in entries]
        return pa.concat_tables([pq.read_table(f, columns=columns, filesystem=fs) for f in files])
    tables = [
        pq.read_table(join(root, f), columns=columns, filesystem=fs) for f in committed_files(out_uri, LAYOUT.ledger)
    ]
    if not tables:
        return schema.ledger_schema().empty_table().select(columns or schema.ledger_schema().names)
    return pa.concat_tables(tables)


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
        f"{failed} of the inputs are URLs the pool's downloader tried and got no image from (its per-shard record, "
        "as img2dataset writes it): stage download, the downloader's status as the reason code."
    )


def funnel_of(ledger: pa.Table) -> Counter:
    """``<phase>/<stage>/<status>/<reason code>`` counts, as the manifest's funnel."""
    code = pc.fill_null(pc.utf8_slice_codeunits(ledger.column("reason"), 0, 10_000), "")
    codes = [c.split(":", 1)[0] for c in code.to_pylist()]
    stages = ledger.column("stage").to_pylist()
    statuses = ledger.column("status").to_pylist()
    return Counter(f"{funnel_phase(s)}/{s}/{st}/{c}" for s, st, c in zip(stages, statuses, codes))
