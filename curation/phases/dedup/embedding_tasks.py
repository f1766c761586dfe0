"""The Ray tasks of the embedding pair search and the files they share: the plan task (a uniform sample, the
centroids, the bucket of each cluster), one assign task per survivor file (its rows written to the buckets of their
home and probed clusters), one search task per bucket (its pairs). ``curation.phases.dedup.embedding_pairs`` runs
them as steps; the maths is ``curation.phases.dedup.embedding_clusters``."""

from __future__ import annotations

import io
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from common.layout import LAYOUT
from common.storage import (
    delete_quietly,
    exists,
    join,
    read_json,
    resolve,
    write_bytes_atomic,
    write_json_atomic,
    write_parquet_atomic,
)
from curation.phases.dedup import chance
from curation.phases.dedup.embedding_clusters import (
    Centroids,
    Layout,
    ProbeRule,
    SearchSettings,
    cluster_pairs,
    concat_pairs,
    nearest,
    plan_clusters,
    sample_quotas,
    sample_rows,
)
from curation.phases.dedup.link_rule import (
    NO_PDQ,
    PDQ_WORDS,
    LinkRule,
    crop_distances_of,
    pair_distances,
    pdq_words,
)
from curation.steps.window import run_tasks, task_window

PAIRS_DIR, BUCKETS_DIR, PLAN_DIR = LAYOUT.embedding_pairs, LAYOUT.embedding_buckets, LAYOUT.embedding_plan
CENTROIDS_FILE, BUCKETS_FILE = f"{PLAN_DIR}/centroids.npy", f"{PLAN_DIR}/buckets.json"
CHANCE_FILE = f"{PLAN_DIR}/chance.json"  # the sample's histograms (curation.phases.dedup.chance.ChanceSample)
PAIRS_SCHEMA = pa.schema(
    [
        pa.field("a", pa.int64(), nullable=False),
        pa.field("b", pa.int64(), nullable=False),
        pa.field("similarity", pa.float32(), nullable=False),
        pa.field("distance", pa.uint8(), nullable=False),  # pHash Hamming distance; 65 where a pHash is missing
        # the PDQ crop distance (link_rule.crop_distances); 257 where a hash is missing or no region measures it
        pa.field("crop_distance", pa.uint16(), nullable=False),
    ]
)


def pairs_path(bucket: int) -> str:
    return LAYOUT.pair_part(PAIRS_DIR, bucket)


def bucket_path(bucket: int, file_index: int) -> str:
    return f"{BUCKETS_DIR}/b{bucket:05d}/part-{file_index:06d}.arrow"


def _matrix(column: pa.ChunkedArray) -> np.ndarray:
    """A fixed-size list column as an (rows, size) array."""
    column = column.combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)


def _write_arrow(fs, path: str, table: pa.Table) -> None:
    """An intermediate as an Arrow IPC file: written and read at memory speed (Parquet's encoding of the float
    embeddings cost more than the search, for files deleted minutes later)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    write_bytes_atomic(fs, path, sink.getvalue())


def _read_arrow(fs, path: str) -> pa.Table:
    with fs.open_input_file(path) as f:
        return pa.ipc.open_file(f).read_all()


# --- plan -----------------------------------------------------------------------------------------------------------


def _hashes(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A ``phash`` column as uint64 values (0 where null) and whether each is set."""
    column = column.combine_chunks()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return column.fill_null(0).to_numpy().astype(np.uint64), valid


def _crop_hashes(pdq: pa.ChunkedArray, crops: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``pdq`` and ``pdq_crops`` columns as (rows, 4) and (rows, K, 4) uint64 words, and whether each row has
    both; K is what the longest value holds (0 where none is set), and a row with fewer is not compared on them."""
    whole, has_pdq = pdq_words(pdq)
    crops = crops.combine_chunks()
    lengths = pc.binary_length(crops).fill_null(0).to_numpy(zero_copy_only=False)
    width = int(lengths.max()) if lengths.size else 0
    full = has_pdq & (lengths == width) & (width > 0)
    k = width // (PDQ_WORDS * 8)
    sub = np.zeros((len(crops), k, PDQ_WORDS), np.uint64)
    if k and full.any():
        set_ = lengths > 0
        if (lengths[set_] == width).all():  # the set values lie one after another: read in place, not cast
            wide = np.int64 if pa.types.is_large_binary(crops.type) else np.int32
            offsets = np.frombuffer(crops.buffers()[1], wide)[crops.offset : crops.offset + len(crops) + 1]
            data = np.frombuffer(crops.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
            block = data.view(np.uint64).reshape(-1, k, PDQ_WORDS)
            if set_.all():
                sub = block  # read-only, as the search only reads it
            else:
                sub[np.flatnonzero(set_)] = block
        else:
            words, _ = pdq_words(crops.filter(pa.array(full)).cast(pa.binary(width)))
            sub[full] = words.reshape(-1, k, PDQ_WORDS)
    return whole, sub, full


@ray.remote(num_cpus=1)
def _sample_file(
    out_uri: str, path: str, file_index: int, quota: int, seed: int
) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, int]]]:
    fs, root = resolve(out_uri)
    with fs.open_input_file(join(root, path)) as f:
        survivors = pq.ParquetFile(f)
        table = survivors.read(columns=["embedding", "phash", "pdq"])
        # the sub-crop PDQs (1 KiB a row) are only counted, on the first row group: the estimate compares whole PDQs
        first = survivors.read_row_group(0, columns=["pdq_crops"]).column(0) if survivors.num_row_groups else None
    crops = (pc.max(pc.binary_length(first)).as_py() or 0) if first is not None else 0
    rows = np.sort(np.random.default_rng([seed, file_index]).choice(table.num_rows, quota, replace=False))
    table = table.take(pa.array(rows, pa.int64()))
    pdq = (*pdq_words(table.column("pdq")), crops // (PDQ_WORDS * 8))
    return file_index, (_matrix(table.column("embedding")), *_hashes(table.column("phash")), pdq)


def _draw_sample(
    out_uri: str, files: list[str], counts: np.ndarray, size: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, chance.PdqSample]:
    """A uniform sample of the survivors: embeddings, pHashes, whether each pHash is set, and their PDQs (with the
    sub-crop hashes per survivor, the most any sampled file holds)."""
    fs, root = resolve(out_uri)
    quotas = sample_quotas(counts, size)
    dim = pq.read_schema(join(root, files[0]), filesystem=fs).field("embedding").type.list_size
    rows = int(quotas.sum())
    sample, hashes, hashed = np.empty((rows, dim), np.float32), np.zeros(rows, np.uint64), np.zeros(rows, bool)
    pdq, with_pdq = np.zeros((rows, PDQ_WORDS), np.uint64), np.zeros(rows, bool)
    offsets = np.concatenate([[0], np.cumsum(quotas)])
    calls = [
        (lambda i=i, f=f, q=q: _sample_file.remote(out_uri, f, i, int(q), seed))
        for i, (f, q) in enumerate(zip(files, quotas))
        if q
    ]
    crop_count = 0
    for i, (x, h, valid, (words, has_pdq, crops)) in run_tasks(calls, task_window()):
        at = slice(offsets[i], offsets[i + 1])
        sample[at], hashes[at], hashed[at], pdq[at], with_pdq[at] = x, h, valid, words, has_pdq
        crop_count = max(crop_count, crops)
    return sample, hashes, hashed, chance.PdqSample(pdq, with_pdq, crop_count)


@ray.remote(num_cpus=1)
def make_plan(
    out_uri: str,
    files: list[str],
    counts: np.ndarray,
    layout: Layout,
    probes: ProbeRule,
    chance_pairs: int = chance.RANDOM_PAIRS,
) -> dict:
    """Sample, train the centroids (written to ``CENTROIDS_FILE``), pack the clusters into buckets (the bucket of
    each cluster written to ``BUCKETS_FILE``), measure the sample's chance histograms (``CHANCE_FILE``); returns the
    plan's stats and log lines. A Ray task, so that the driver never holds the training sample."""
    n = int(counts.sum())
    sample, hashes, hashed, pdq = _draw_sample(out_uri, files, counts, sample_rows(n, layout), layout.seed)
    centroids, bucket_of, stats = plan_clusters(sample, n, len(files), layout, probes)
    home = nearest(sample, centroids)
    measured = chance.measure(
        n, hashes, hashed, sample, home, stats["rows_per_survivor"], chance_pairs, layout.seed, pdq
    )
    fs, root = resolve(out_uri)
    buf = io.BytesIO()
    np.save(buf, centroids)
    write_bytes_atomic(fs, join(root, CENTROIDS_FILE), buf.getvalue())
    write_json_atomic(fs, join(root, BUCKETS_FILE), {"bucket_of": bucket_of.tolist()})
    write_json_atomic(fs, join(root, CHANCE_FILE), measured.to_json())
    return stats


def read_chance(fs, root: str) -> chance.ChanceSample:
    """The chance histograms ``make_plan`` measured."""
    return chance.ChanceSample.from_json(read_json(fs, join(root, CHANCE_FILE)))


def read_plan(fs, root: str) -> tuple[np.ndarray, np.ndarray]:
    """The centroids and the bucket of each cluster, as ``make_plan`` wrote them."""
    with fs.open_input_stream(join(root, CENTROIDS_FILE)) as f:
        centroids = np.load(io.BytesIO(f.read()))
    plan = read_json(fs, join(root, BUCKETS_FILE), fields={"bucket_of": list})
    return centroids, np.asarray(plan["bucket_of"], np.int32)


# --- assign ---------------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=1)
def assign_file(
    out_uri: str, path: str, file_index: int, shared: tuple[Centroids, np.ndarray], probes: ProbeRule
) -> dict:
    """Write this file's rows to every bucket, in bucket order; returns rows written.

    Skipped when the last bucket's file exists: an earlier attempt wrote it after the others."""
    centroids, bucket_of = shared
    buckets = int(bucket_of.max()) + 1
    fs, root = resolve(out_uri)
    if exists(fs, join(root, bucket_path(buckets - 1, file_index))):
        return {"rows": 0, "cpu_s": 0.0}
    start = time.process_time()
    columns = ["uid", "phash", "pdq", "pdq_crops", "embedding"]
    table = pq.read_table(join(root, path), columns=columns, filesystem=fs)
    uid = table.column("uid").to_numpy()
    ranked = probes.ranked(_matrix(table.column("embedding")), centroids)
    item, rank = np.nonzero(ranked >= 0)  # one row per (survivor, cluster it is searched in)
    cluster = ranked[item, rank]
    order = np.lexsort((uid[item], cluster, bucket_of[cluster]))
    item, rank, cluster = item[order], rank[order], cluster[order]
    bounds = np.searchsorted(bucket_of[cluster], np.arange(buckets + 1))
    rows = pa.table(
        {
            "cluster": pa.array(cluster, pa.int32()),
            "uid": pa.array(uid[item], pa.int64()),
            "home": pa.array(rank == 0),
            "ranked": pa.FixedSizeListArray.from_arrays(pa.array(ranked[item].ravel()), ranked.shape[1]),
            "phash": table.column("phash").take(pa.array(item, pa.int64())),
            "pdq": table.column("pdq").take(pa.array(item, pa.int64())),
            "pdq_crops": table.column("pdq_crops").take(pa.array(item, pa.int64())),
            "embedding": table.column("embedding").take(pa.array(item, pa.int64())),
        }
    )
    for b in range(buckets):  # bucket b holds rows [bounds[b], bounds[b + 1])
        _write_arrow(fs, join(root, bucket_path(b, file_index)), rows.slice(bounds[b], bounds[b + 1] - bounds[b]))
    return {"rows": int(bounds[-1] - bounds[0]), "cpu_s": time.process_time() - start}


# --- search ---------------------------------------------------------------------------------------------------------


def _read_bucket(fs, root: str, bucket: int, n_files: int) -> tuple[np.ndarray, pa.Table]:
    """A bucket's embeddings as one array and its other columns, holding the embeddings about once in memory."""
    files = [_read_arrow(fs, join(root, bucket_path(bucket, f))) for f in range(n_files)]
    rows = pa.concat_tables([t.drop_columns(["embedding"]) for t in files])
    x = np.empty((rows.num_rows, files[0].schema.field("embedding").type.list_size), np.float32)
    at = 0
    while files:  # each file's buffers are freed once copied
        embedding = files.pop(0).column("embedding")
        x[at : at + len(embedding)] = _matrix(embedding)
        at += len(embedding)
    return x, rows


def _distances(
    rows: pa.Table, uid: np.ndarray, a: np.ndarray, b: np.ndarray, crops: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The pHash distance and, when ``crops``, the crop distance of each pair (a, b) of uids of ``rows``
    (``NO_HASH`` where a pHash is missing; ``NO_PDQ`` where a PDQ is, and for every crop distance when not
    ``crops``)."""
    hashes, valid = _hashes(rows.column("phash"))
    order = np.argsort(uid, kind="stable")
    at_a, at_b = order[np.searchsorted(uid[order], a)], order[np.searchsorted(uid[order], b)]
    distance = pair_distances(hashes[at_a], hashes[at_b], valid[at_a], valid[at_b])
    if not crops:
        return distance, np.full(distance.shape, NO_PDQ, np.int16)
    whole, sub, full = _crop_hashes(rows.column("pdq"), rows.column("pdq_crops"))
    return distance, crop_distances_of(whole, sub, full, at_a, at_b)


@ray.remote(num_cpus=1)
def search_bucket(out_uri: str, bucket: int, n_files: int, s: SearchSettings) -> dict:
    """Write the pairs of one bucket, then delete its rows. Skipped when its pair file exists (an earlier attempt
    wrote it, and may have deleted the rows)."""
    fs, root = resolve(out_uri)
    out = join(root, pairs_path(bucket))
    if exists(fs, out):
        return {"pairs": pq.read_metadata(out, filesystem=fs).num_rows, "skipped": True}
    start = time.process_time()
    x, rows = _read_bucket(fs, root, bucket, n_files)
    cluster, uid = rows.column("cluster").to_numpy(), rows.column("uid").to_numpy()
    home, ranked = rows.column("home").to_numpy(zero_copy_only=False), _matrix(rows.column("ranked"))
    order = np.lexsort((uid, ~home, cluster))  # per cluster: home rows, then probe rows, by uid (a fixed order)
    found, largest = [], 0
    for part in np.split(order, np.flatnonzero(np.diff(cluster[order])) + 1) if order.size else []:
        found.append(cluster_pairs(x[part], uid[part], home[part], ranked[part], s))  # gathered while searched
        largest = max(largest, int(home[part].sum()))
    a, b, sim = concat_pairs(found)
    rule = LinkRule(s.confirm)
    distance, crop = _distances(rows, uid, a, b, rule.needs_crops)
    if s.confirm:  # the joint regions of the link rule: the pHash confirms the embedding
        linked = rule.confirmed(distance, sim, crop)
        a, b, sim, distance, crop = a[linked], b[linked], sim[linked], distance[linked], crop[linked]
    order = np.lexsort((b, a))  # clusters own disjoint pairs: sorting is all that is left
    pairs = pa.table(
        {
            "a": a[order],
            "b": b[order],
            "similarity": sim[order],
            "distance": distance[order].astype(np.uint8),
            "crop_distance": crop[order].astype(np.uint16),
        },
        schema=PAIRS_SCHEMA,
    )
    write_parquet_atomic(fs, out, pairs, row_group_size=1 << 20)
    delete_quietly(fs, join(root, BUCKETS_DIR, f"b{bucket:05d}"))
    return {
        "pairs": pairs.num_rows,
        "skipped": False,
        "rows": len(x),
        "largest_cluster": largest,
        "cpu_s": time.process_time() - start,
    }


@ray.remote(num_cpus=0.25)
def write_no_pairs(out_uri: str) -> dict:
    """The one pair file of fewer than two survivors: empty."""
    fs, root = resolve(out_uri)
    write_parquet_atomic(fs, join(root, pairs_path(0)), PAIRS_SCHEMA.empty_table(), row_group_size=1)
    return {"pairs": 0, "skipped": False, "rows": 0, "largest_cluster": 0, "cpu_s": 0.0}
