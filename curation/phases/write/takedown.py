"""The write phase's side of takedowns: the lists recorded on an output (``common.takedown_lists``) left out when its
shards and ledger are written again (``Takedowns``), and a taken-down image's mark in the ledger: status
``taken_down``, stage ``takedown``, the reason naming the list, the date and the entry that named it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from common import schema
from common.layout import TAKEDOWN
from common.takedown_lists import PDQ_DISTANCE, Listing, recorded_entries, takedown_records


@dataclass(frozen=True)
class Takedowns:
    """The lists recorded on an output, applied when its shards and ledger are written again."""

    lists: tuple[tuple[Listing, str], ...] = ()  # (what the list names, ledger reason) per takedown

    def without(self, table: pa.Table) -> pa.Table:
        """``table`` (rows with key, source, metadata_json and pdq) without the rows a list names."""
        for listing, _ in self.lists:
            table = table.filter(pa.array(~listing.rows(table)))
        return table

    def mark(self, ledger: pa.Table) -> pa.Table:
        """Kept ledger rows a list names, as taken down (the reason naming the list and the entry)."""
        for listing, reason in self.lists:
            named = zip(ledger.column("source").to_pylist(), listing.named_by(ledger), strict=True)
            ledger = mark_taken_down(ledger, {s: f"{reason}: {e}" for s, e in named if e is not None})
        return ledger


def applied_takedowns(fs, root: str) -> Takedowns:
    """The recorded lists, each with the keys it removed: an image a ``pdq:`` line named when the takedown ran stays
    out of a rewrite even where the rows carry no hash to match (an output scored before the ``pdq`` column)."""
    lists = []
    for record in takedown_records(fs, root):
        entries = recorded_entries(fs, root, record).to_pylist() + [r["key"] for r in record["removed"] if r["key"]]
        listing = Listing(tuple(sorted(set(entries))), record.get("distance", PDQ_DISTANCE))
        lists.append((listing, taken_down_reason(record["list"], record["id"], record["at"])))
    return Takedowns(tuple(lists))


def taken_down_reason(lst_name: str, list_id: str, at: str) -> str:
    return f"taken_down: listed in {lst_name} (list {list_id}, {at[:10]})"


def mark_taken_down(ledger: pa.Table, reasons: dict[str, str]) -> pa.Table:
    """Kept ledger rows of the sources ``reasons`` names, as taken down with each one's reason."""
    if not reasons:
        return ledger
    at = pc.index_in(ledger.column("source"), value_set=pa.array(list(reasons), pa.string()))
    hit = pc.and_(pc.is_valid(at), pc.equal(ledger.column("status"), schema.KEPT))
    reason = pa.array(list(reasons.values()), pa.string()).take(at.combine_chunks())
    for name, value in (("status", schema.TAKEN_DOWN), ("stage", TAKEDOWN), ("reason", reason)):
        column = ledger.column(name)
        ledger = ledger.set_column(
            ledger.schema.get_field_index(name), ledger.schema.field(name), pc.if_else(hit, value, column)
        )
    return ledger
