"""Curating a new pool against a published release (``jobs.curate --against <release>``).

The release's kept images count as already chosen. The survey writes them, from the release's own survivor and
sample-decision partitions, as extra survivor partitions after the run's own (``dedup/survivors/part-<n + j>``):
their uids sit in a range of their own (``RELEASE_ORDINAL`` and up) and they are ``released``, so every step of
dedup sees them like any survivor and the keep rule, which ranks ``released`` first, keeps a release image over any
new copy of it, however large: a new image linked to one is ``duplicate`` with ``duplicate_of`` its key. A release
written before a survivor column existed (``encoding_quality``) is read with that column null. Sampling sees them as selected before it starts, so the
new images are balanced against the release's clusters; the write phase writes the run's own partitions only. The
run's manifest is the release's next version: ``version`` one more than the release's, ``previous`` naming it, and
training given the new output reads both (``pretrain.data`` follows ``previous``).

Sizes at 1B released images: one task per release partition (the size of a survivor partition); the driver holds
the release's partition count and its manifest's fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from hashlib import sha256

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.storage import exists, join, list_files, redact, resolve, write_parquet_atomic
from curation.phases.survivors import UID_SHIFT, partition_path, survivors_schema
from curation.records import read_manifest

# Release survivors' partition ordinals start here: far above any run's own shard count (2^30 input shards), so uids
# stay below 2^63 for up to 2^30 release partitions.
RELEASE_ORDINAL = 1 << 30
RELEASE_UID_MIN = RELEASE_ORDINAL << UID_SHIFT
RELEASE_SHARD_PREFIX = "release:"


class ReleaseError(ValueError):
    """The release cannot be curated against; the message says what to do."""


@dataclass(frozen=True)
class Release:
    uri: str
    partitions: int  # the release's survivor partitions
    version: int
    manifest_sha256: str
    embedding_model: str

    def previous(self) -> dict:
        """What the new output's manifest says of the release it follows."""
        return {"release": redact(self.uri), "version": self.version, "manifest_sha256": self.manifest_sha256}


def open_release(uri: str, embedding_model: str) -> Release:
    fs, root = resolve(uri)
    if not exists(fs, join(root, LAYOUT.manifest)):
        raise ReleaseError(f"--against {redact(uri)}: no {LAYOUT.manifest}; give a published curated output")
    manifest = read_manifest(fs, root)
    if manifest.get("embedding_model") != embedding_model:
        raise ReleaseError(
            f"--against {redact(uri)}: curated with embedding model {manifest.get('embedding_model')!r}, this run "
            f"uses {embedding_model!r}; near-duplicates are found by comparing embeddings of one model"
        )
    partitions = len(list_files(fs, join(root, LAYOUT.survivors), ".parquet"))
    if not partitions and manifest["totals"]["rows"]:
        raise ReleaseError(
            f"--against {redact(uri)}: no {LAYOUT.survivors}/ partitions; the release's dedup files are needed"
        )
    digest = sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return Release(uri, partitions, manifest.get("version", 1), digest, manifest["embedding_model"])


@ray.remote(num_cpus=0.5)
def survey_release_partition(release_uri: str, index: int, out_uri: str, path: str, dim: int) -> dict:
    """Write the kept images of the release's survivor partition ``index`` as the run's survivor file ``path``."""
    fs, root = resolve(release_uri)
    survivors = pq.read_table(join(root, partition_path(index)), filesystem=fs)
    decisions = join(root, LAYOUT.part(LAYOUT.sample_decisions, index))
    if exists(fs, decisions):
        picked = pq.read_table(decisions, columns=["uid", "selected"], filesystem=fs)
        chosen = picked.filter(picked.column("selected")).column("uid")
    else:  # every survivor of the partition was a duplicate
        chosen = pa.array([], pa.int64())
    table = survivors.filter(pc.is_in(survivors.column("uid"), value_set=chosen))  # in uid order, as written
    # uids of their own: ordinal RELEASE_ORDINAL + index, rank in the partition (the release's own uids may already
    # be a release's, when it was curated against another)
    uid = np.int64(RELEASE_ORDINAL + index) << UID_SHIFT | np.arange(table.num_rows, dtype=np.int64)
    table = table.set_column(0, "uid", pa.array(uid))
    table = table.set_column(
        1, "shard_id", pc.binary_join_element_wise(RELEASE_SHARD_PREFIX, table.column("shard_id"), "")
    )
    target = survivors_schema(dim)
    columns = {name: table.column(name) if name in table.column_names else None for name in target.names}
    columns["released"] = pa.array(np.ones(table.num_rows, bool))
    table = pa.table(
        [pa.nulls(table.num_rows, f.type) if columns[f.name] is None else columns[f.name] for f in target],
        names=target.names,
    )
    out_fs, out_root = resolve(out_uri)
    write_parquet_atomic(out_fs, join(out_root, path), table.cast(target), row_group_size=10_000, compression="lz4")
    return {"path": path, "rows": table.num_rows, "missing_embedding": 0}
