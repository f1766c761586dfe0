"""The survivors table: what the global phases know of every phase-1 survivor, partitioned on the output store.

The global phases never gather survivors in the driver. The first step of "dedup" (``survey``) writes, one Ray task
per partition, ``dedup/survivors/part-<i>.parquet``: partition ``i`` holds a contiguous run of committed input
shards (in shard-id order) of about ``dedup.rows_per_partition`` survivors, its rows in ``uid`` order. Every later
step reads these files (by column: the embedding column is only read where it is needed) and writes its own
partitioned files; the driver holds the list of partitions and per-partition or per-cluster summaries only.

``uid`` = (ordinal of the input shard among the committed shards, in id order) << 32 | (rank of the source within
the shard). It is unique, needs no coordination, and sorts like (shard_id, source): the order of the final shards.
"""

from __future__ import annotations

import pyarrow as pa

from common.layout import LAYOUT
from common.pdq import PDQ_BYTES

UID_SHIFT = 32


def survivors_schema(embedding_dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("uid", pa.int64(), nullable=False),
            pa.field("shard_id", pa.string(), nullable=False),
            pa.field("source", pa.string(), nullable=False),
            pa.field("key", pa.string()),
            pa.field("phash", pa.uint64()),  # null when the phash stage did not run
            pa.field("pdq", pa.binary(PDQ_BYTES)),
            # the sub-crops' PDQs (stages.phash.crop_boxes); null where not computed (an output scored before them)
            pa.field("pdq_crops", pa.binary()),
            pa.field("score", pa.float64()),  # the keep score (dedup.keep_score, first set); NaN when none is set
            pa.field("width", pa.int32()),
            pa.field("height", pa.int32()),
            pa.field("encoding_quality", pa.int8()),  # 1-100 (common.schema); null where unknown
            # an image of the release curated against (--against): kept over any new copy of it
            pa.field("released", pa.bool_(), nullable=False),
            pa.field("balance", pa.string()),  # the value of sample.balance_key as text; null without one
            pa.field("embedding", pa.list_(pa.float32(), embedding_dim)),  # L2-normalised
        ]
    )


def make_uid(shard_ordinal, rank):
    """uids from input-shard ordinals and ranks within the shard (numpy arrays or ints)."""
    return (shard_ordinal << UID_SHIFT) | rank


def shard_ordinal(uid):
    return uid >> UID_SHIFT


# --- the survey step: committed scored files -> survivor partitions ----------------------------------------------------


def plan_partitions(records: list[dict], rows_per_partition: int) -> list[list[tuple[int, dict]]]:
    """Contiguous runs of committed input shards (id order) of about ``rows_per_partition`` survivors each, every
    shard with its ordinal. Shards with no survivors keep their ordinal and join no partition."""
    ordered = sorted(records, key=lambda r: r["shard_id"])
    partitions: list[list[tuple[int, dict]]] = [[]]
    rows = 0
    for ordinal, record in enumerate(ordered):
        if not record["scored_files"]:
            continue
        if rows >= rows_per_partition:
            partitions.append([])
            rows = 0
        partitions[-1].append((ordinal, record))
        rows += record["kept"]
    return [p for p in partitions if p]


def partition_path(index: int) -> str:
    return LAYOUT.part(LAYOUT.survivors, index)


def _keep_score(table: pa.Table, columns: list[str]):
    """The first of ``columns`` set on each row, as float64 (NaN where none is)."""
    import numpy as np

    score = np.full(table.num_rows, np.nan)
    for name in reversed(columns):  # earlier columns win where set
        values = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        score = np.where(np.isnan(values), score, values)
    return score


def survey_partition(
    out_uri: str, shards: list[tuple[int, dict]], path: str, keep_score: list[str], balance_key: str | None, dim: int
) -> dict:
    """Write one survivor partition from its input shards' scored files; returns a receipt."""
    import numpy as np
    import pyarrow.compute as pc

    from common.schema import scored_schema
    from common.storage import join, resolve, write_parquet_atomic
    from curation.score.ledger import kept_sources, read_part

    fs, root = resolve(out_uri)
    columns = sorted(
        {"source", "key", "shard_id", "phash", "pdq", "pdq_crops", "width", "height", "encoding_quality", "embedding"}
        | set(keep_score)
        | ({balance_key} if balance_key else set())
    )
    scored = scored_schema(dim)
    pieces, missing_embedding = [], 0
    for ordinal, record in shards:
        parts = [read_part(fs, join(root, f), columns, scored) for f in record["scored_files"]]
        t = pa.concat_tables(parts)
        if "scores_files" in record:  # re-decided: its scored files hold the survivors of the thresholds it scored with
            t = t.filter(pc.is_in(t.column("source"), value_set=kept_sources(fs, root, record)))
        t = t.take(pc.sort_indices(t, [("source", "ascending")]))
        missing_embedding += t.column("embedding").null_count
        balance = pc.cast(t.column(balance_key), pa.string()) if balance_key else pa.nulls(t.num_rows, pa.string())
        pieces.append(
            pa.table(
                {
                    "uid": pa.array(make_uid(np.int64(ordinal), np.arange(t.num_rows, dtype=np.int64))),
                    "shard_id": t.column("shard_id"),
                    "source": t.column("source"),
                    "key": t.column("key"),
                    "phash": t.column("phash"),
                    "pdq": t.column("pdq"),
                    "pdq_crops": t.column("pdq_crops").cast(pa.binary()),
                    "score": pa.array(_keep_score(t, keep_score)),
                    "width": t.column("width"),
                    "height": t.column("height"),
                    "encoding_quality": t.column("encoding_quality"),
                    "released": pa.array(np.zeros(t.num_rows, bool)),
                    "balance": balance,
                    "embedding": t.column("embedding"),
                }
            )
        )
    target = survivors_schema(dim)
    table = pa.concat_tables([p.cast(target) for p in pieces]) if pieces else target.empty_table()
    if not missing_embedding:
        # lz4: the embeddings barely compress, and every later step reads them back
        write_parquet_atomic(fs, join(root, path), table, row_group_size=10_000, compression="lz4")
    return {"path": path, "rows": table.num_rows, "missing_embedding": missing_embedding}
