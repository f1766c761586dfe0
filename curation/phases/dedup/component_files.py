"""The files and placement of dedup's components step (``curation.phases.dedup.components``): the schemas of its
work files, the survivor files' uid ranges, and which partition, file and file group a uid belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.layout import LAYOUT
from common.storage import join
from curation.steps.window import map_footers

WORK_DIR, DECISIONS_DIR = LAYOUT.components, LAYOUT.dedup_decisions
SURVIVOR_COLUMNS = ["uid", "shard_id", "source", "key", "score", "width", "height", "encoding_quality", "released"]

EDGES = pa.schema([("src", pa.int64()), ("dst", pa.int64()), ("code", pa.int8())])
ADJACENCY = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
HOOKS = pa.schema([("node", pa.int64()), ("hook", pa.int64())])  # a node and the node it hooked to
MESSAGES = pa.schema([("node", pa.int64()), ("neighbour_hook", pa.int64())])
LABELS = pa.schema([("node", pa.int64()), ("label", pa.int64())])
GROUP_EDGES = pa.schema([("lo", pa.int64()), ("hi", pa.int64()), ("code", pa.int8())])
MEMBERS = pa.schema(
    [
        ("uid", pa.int64()),
        ("shard_id", pa.string()),
        ("source", pa.string()),
        ("key", pa.string()),
        ("score", pa.float64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("encoding_quality", pa.int8()),
        ("released", pa.bool_()),
    ]
)
DECISIONS = pa.schema(
    [
        ("uid", pa.int64()),
        ("source", pa.string()),
        ("shard_id", pa.string()),
        ("key", pa.string()),
        ("duplicate_of", pa.string()),
        ("duplicate_signal", pa.string()),
    ]
)


class ComponentsError(RuntimeError):
    """The components cannot be computed as asked (rounds exhausted, uids that are no survivor's)."""


# ---------------------------------------------------------------------------------------------------------------
# Where things live
# ---------------------------------------------------------------------------------------------------------------


def mix64(x: np.ndarray | int) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit words that scatters neighbouring uids."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def priority(uid: np.ndarray, round_number: int) -> np.ndarray:
    """A node's priority in a round: distinct uids never tie, and the order is fresh every round."""
    return mix64(np.asarray(uid).astype(np.uint64) ^ mix64(round_number))


@dataclass(frozen=True)
class Layout:
    """Node partitions (hash of the uid), survivor files (uid ranges, from the files' statistics) and file groups
    (runs of ``files_per_task`` files: the unit of the ``members`` and ``write`` tasks)."""

    n_parts: int
    group_of_file: np.ndarray  # of every survivor file
    first_uid: np.ndarray  # of each non-empty survivor file, increasing
    last_uid: np.ndarray
    file_index: np.ndarray  # those files' positions in the survivor list

    @property
    def n_groups(self) -> int:
        return int(self.group_of_file.max()) + 1 if self.group_of_file.size else 0

    def files_of_group(self, group: int) -> np.ndarray:
        return np.flatnonzero(self.group_of_file == group)

    def part_of(self, uid: np.ndarray) -> np.ndarray:
        return (mix64(uid) % np.uint64(self.n_parts)).astype(np.int64)

    def group_of(self, uid: np.ndarray) -> np.ndarray:
        return self.group_of_file[self.file_of(uid)]

    def file_of(self, uid: np.ndarray) -> np.ndarray:
        uid = np.asarray(uid, np.int64)
        pos = np.searchsorted(self.first_uid, uid, side="right") - 1
        outside = (pos < 0) | (uid > self.last_uid[np.maximum(pos, 0)]) if self.first_uid.size else uid == uid
        if outside.any():
            raise ComponentsError(f"pair uid {int(uid[outside][0])} lies in no survivor file's uid range")
        return self.file_index[pos]


def _uid_range(fs, path: str) -> tuple[int, int] | None:
    """First and last uid of a survivor file from its row-group statistics (or its uid column without them)."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        if meta.num_rows == 0:
            return None
        leaf = [meta.schema.column(c).path for c in range(meta.num_columns)].index("uid")
        stats = [meta.row_group(g).column(leaf).statistics for g in range(meta.num_row_groups)]
        if all(s is not None and s.has_min_max for s in stats):
            return min(int(s.min) for s in stats), max(int(s.max) for s in stats)
        bounds = pc.min_max(pf.read(columns=["uid"]).column("uid"))
        return int(bounds["min"].as_py()), int(bounds["max"].as_py())


def layout_of(fs, root: str, survivor_files: Sequence[str], n_parts: int, files_per_task: int) -> Layout:
    ranges = map_footers(lambda f: _uid_range(fs, join(root, f)), survivor_files)
    held = [(i, r) for i, r in enumerate(ranges) if r is not None]
    first = np.asarray([r[0] for _, r in held], np.int64)
    last = np.asarray([r[1] for _, r in held], np.int64)
    if np.any(first[1:] <= last[:-1]):
        bad = int(np.flatnonzero(first[1:] <= last[:-1])[0])
        raise ComponentsError(
            f"survivor files {survivor_files[held[bad][0]]} and {survivor_files[held[bad + 1][0]]} are not in uid order"
        )
    groups = np.arange(len(survivor_files)) // files_per_task
    return Layout(n_parts, groups, first, last, np.asarray([i for i, _ in held], np.int64))
