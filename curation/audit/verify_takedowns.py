"""The audit's takedown checks: every recorded takedown finished, the files it replaced are gone once its grace has
passed, and no image a recorded list names is in a shard the manifest lists (``curation.audit.verify``)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.layout import LAYOUT
from common.storage import DamagedRecordError, exists, join
from common.takedown_lists import (
    PDQ_DISTANCE,
    PDQ_PREFIX,
    Listing,
    record_path,
    recorded_entries,
    takedown_records,
)


class TakedownCheck:
    """The takedowns recorded on the output at ``root``; findings go to ``problem`` (file, row, what) and ``damaged``
    (a record that cannot be read), counts to ``counts``."""

    def __init__(
        self,
        fs: pafs.FileSystem,
        root: str,
        problem: Callable[[str, int | None, str], None],
        damaged: Callable[[str, DamagedRecordError], None],
        counts: Counter,
    ):
        self.fs, self.root, self.problem, self.damaged, self.counts = fs, root, problem, damaged, counts
        self.records: list[dict] = []
        self.replaced: set[str] = set()  # files takedowns replaced: not strays (reported here when past their grace)

    def load(self) -> None:
        """Read the takedown records, and the files each replaced that may still be there (until its grace ends)."""
        try:
            records = takedown_records(self.fs, self.root)
        except DamagedRecordError as exc:
            self.damaged(LAYOUT.takedowns, exc)
            return
        now = dt.datetime.now(dt.UTC)
        for record in records:
            if record["status"] != "done":
                self.problem(
                    record_path(record["id"]),
                    None,
                    "a takedown that did not finish: run the same jobs.takedown command again",
                )
            self.records.append(record)
            if record.get("purged"):
                continue
            for replaced in record["superseded"]:
                self.replaced.add(replaced)
                if dt.datetime.fromisoformat(record["delete_after"]) > now:
                    self.counts["replaced_in_grace"] += 1
                elif exists(self.fs, join(self.root, replaced)):
                    self.problem(
                        replaced,
                        None,
                        f"replaced by takedown {record['id']} and kept past its grace ({record['delete_after']}): it "
                        "may hold a taken-down image; run jobs.takedown again to delete it",
                    )

    def check(self, manifest: dict) -> None:
        """No image a recorded list names is in a shard the manifest lists."""
        if not self.records:
            return
        lists = [
            (
                Listing(tuple(recorded_entries(self.fs, self.root, r).to_pylist()), r.get("distance", PDQ_DISTANCE)),
                r["id"],
            )
            for r in self.records
        ]
        hashed = any(listing.hashed for listing, _ in lists)
        for entry in manifest["shards"]:
            rel = f"{LAYOUT.shards}/{entry['file']}"
            path = join(self.root, rel)
            try:
                names = pq.read_schema(path, filesystem=self.fs).names
                wanted = ["key", "source", "metadata", "metadata_json"]
                if hashed:
                    wanted.append("pdq" if "pdq" in names else "image")
                table = pq.read_table(path, columns=[c for c in wanted if c in names], filesystem=self.fs)
            except Exception:  # noqa: BLE001 - missing or damaged shards are reported by check_shard
                continue
            for listing, list_id in lists:
                for row, named in enumerate(listing.named_by(table)):
                    if named is not None:
                        source = table.column("source")[row].as_py()
                        via = f" ({named})" if named.startswith(PDQ_PREFIX) else ""  # a copy: the hash it is near
                        self.problem(rel, row, f"holds {source}{via}, which takedown {list_id} removed")
