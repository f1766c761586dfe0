"""The write phase as the runner's steps: the manifest of a run, a kill between units resumed from the receipts,
and each image's bytes kept once (in the final shards), a rewrite reading them again from the pool."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import REPO, CountedTask

from common import schema
from common.config import load_config
from common.layout import LAYOUT
from common.storage import DamagedRecordError, join, resolve, write_parquet_atomic
from curation.config import CurateConfig
from curation.phases.pipeline import GlobalPhases
from curation.phases.write import shards as ws
from curation.records import read_commits
from curation.score.ledger import read_part
from curation.score.originals import CHANGED, OriginalsMissing, SourceReader
from curation.steps.output import Output
from curation.steps.runner import StepRunner

LITE = str(REPO / "configs/curate/lite.yaml")
CURATED_WITH = ["write.rows_per_shard=4"]  # the settings of conftest's curated_run


def _write(out, overrides: list[str]) -> dict:
    """The write phase's manifest, through a runner of two tasks in flight."""
    cfg = load_config(CurateConfig, LITE, overrides)
    phases = GlobalPhases(cfg, Output.at(str(out)))
    partition_of = {r["shard_id"]: i for i, shards in enumerate(phases.partitions) for _, r in shards}
    runner = StepRunner(phases.output, "write", phases.phase_hash("write"), window=2)
    assert runner.phase_fingerprint == phases.phase_hash("write")
    originals = SourceReader(cfg.input, cfg.filters.max_file_bytes)  # a local pool: sources are its paths
    return ws.write_phase(runner, cfg, phases.records, partition_of, len(phases.partitions), originals)


def test_write_phase_resumes_a_kill_between_units_from_their_receipts(curated_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    published = json.loads((out / LAYOUT.manifest).read_text())

    # done with these settings: the manifest comes from the steps' records, and no task runs
    monkeypatch.setattr(ws._Ledger, "task", CountedTask(ws._write_ledger_group, kill_at=0))
    assert _write(out, CURATED_WITH) == published

    # other settings, one final-ledger task per input shard: killed at the fifth launch, three or four done
    rewrite = [*CURATED_WITH, "write.ledger_rows_per_task=1"]
    monkeypatch.setattr(ws._Ledger, "task", CountedTask(ws._write_ledger_group, kill_at=4))
    with pytest.raises(KeyboardInterrupt):
        _write(out, rewrite)
    kept = {p.name: p.read_bytes() for p in (out / LAYOUT.step_units("write", "ledger")).glob("*.json")}
    assert len(kept) in (3, 4)

    # the same command again runs only the units without a receipt, and writes the same files
    resumed = CountedTask(ws._write_ledger_group)
    monkeypatch.setattr(ws._Ledger, "task", resumed)
    manifest = _write(out, rewrite)
    assert resumed.launched == len(published["final_ledger"]) - len(kept)
    assert {
        p.name: p.read_bytes() for p in (out / LAYOUT.step_units("write", "ledger")).glob("*.json")
    }.items() >= kept.items()
    assert manifest["settings_hash"] != published["settings_hash"]
    assert manifest == {**published, "settings_hash": manifest["settings_hash"]}


def _images(folder) -> pa.Table:
    return pq.read_table(folder, columns=["key", "image"])


def _hashes_are_keys(table: pa.Table) -> bool:
    data = table.column("image").combine_chunks().field("bytes").to_pylist()
    return [hashlib.sha256(d).hexdigest() for d in data] == table.column("key").to_pylist()


def test_a_run_keeps_each_images_bytes_once_and_a_rewrite_reads_them_from_the_pool(curated_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    scored = _images(out / LAYOUT.scored)
    assert scored.num_rows and pc.all(pc.is_null(scored.column("image").combine_chunks().field("bytes"))).as_py()
    assert not (out / LAYOUT.scored_images).exists()  # deleted after the switch
    published = json.loads((out / LAYOUT.manifest).read_text())
    kept = pa.concat_tables([_images(out / LAYOUT.shards / s["file"]) for s in published["shards"]])
    assert _hashes_are_keys(kept)

    # the write phase again with other settings (--phases write): the kept images read from the pool and checked
    cfg = load_config(CurateConfig, LITE, [*CURATED_WITH[:-1], "write.rows_per_shard=2"])
    GlobalPhases(cfg, Output.at(str(out))).run("write")
    manifest = json.loads((out / LAYOUT.manifest).read_text())
    rewritten = pa.concat_tables([_images(out / LAYOUT.shards / s["file"]) for s in manifest["shards"]])
    assert len(manifest["shards"]) > len(published["shards"]) and rewritten.equals(kept)
    assert pc.all(pc.is_null(_images(out / LAYOUT.scored).column("image").combine_chunks().field("bytes"))).as_py()


def test_drop_bytes_deletes_the_image_files_or_rewrites_scored_parts_that_hold_their_bytes(curated_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(curated_run, out)
    cfg = load_config(CurateConfig, LITE, CURATED_WITH)
    files = sorted(f for r in read_commits(*resolve(str(out))).values() for f in r["scored_files"])
    bare = {f: (out / f).read_bytes() for f in files}  # as phase 1 writes them: no bytes, paths kept
    fs, root = resolve(str(out))
    reader = SourceReader(cfg.input, cfg.filters.max_file_bytes)

    def with_bytes(f: str) -> pa.Table:  # the scored part's rows with their bytes, read from the pool
        table = pq.read_table(out / f)
        found, problems = reader.read_verified(dict(zip(table["source"].to_pylist(), table["key"].to_pylist())))
        assert not problems
        image = pa.array(
            [
                {"bytes": found[s], "path": i["path"]}
                for s, i in zip(table["source"].to_pylist(), table["image"].to_pylist())
            ],
            schema.IMAGE_TYPE,
        )
        return table.set_column(table.schema.get_field_index("image"), table.schema.field("image"), image)

    # phase 1's image files beside the scored parts: read through them, then deleted; the scored parts untouched
    for f in files:
        write_parquet_atomic(
            fs, join(root, LAYOUT.images_of(f)), with_bytes(f).select(["source", "image"]), row_group_size=100
        )
    target = schema.scored_schema(cfg.embedding_dim)
    assert all(_hashes_are_keys(read_part(fs, join(root, f), ["key", "image"], target)) for f in files)
    assert ws._drop_scored_bytes._function(str(out), files, cfg.model_dump_json())["files"] == len(files)
    assert not any((out / LAYOUT.images_of(f)).exists() for f in files)
    assert {f: (out / f).read_bytes() for f in files} == bare

    # an output scored before the image files: its scored parts lose their bytes and keep every other column
    for f in files:
        write_parquet_atomic(fs, join(root, f), with_bytes(f), row_group_size=100)
    assert ws._drop_scored_bytes._function(str(out), files, cfg.model_dump_json())["files"] == len(files)
    for f in files:
        assert pq.read_table(out / f).equals(pq.read_table(pa.BufferReader(bare[f])))

    # an image file whose rows are not its scored part's is named, not read into the wrong rows
    f = max(files, key=lambda f: pq.read_metadata(out / f).num_rows)
    table = with_bytes(f).select(["source", "image"])
    assert table.num_rows > 1
    write_parquet_atomic(
        fs, join(root, LAYOUT.images_of(f)), table.take(list(range(table.num_rows))[::-1]), row_group_size=9
    )
    with pytest.raises(DamagedRecordError, match=re.escape(LAYOUT.images_of(f))):
        read_part(fs, join(root, f), ["source", "image"], target)


def test_bytes_the_pool_no_longer_holds_as_curated_stop_the_write_naming_them(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"edited since")
    (tmp_path / "c.jpg").write_bytes(b"c")
    sources = [str(tmp_path / n) for n in ("a.jpg", "b.jpg", "c.jpg")]
    table = pa.table(
        {
            "source": sources,
            "key": [hashlib.sha256(d).hexdigest() for d in (b"a", b"b", b"c")],
            "image": pa.array(
                [{"bytes": None, "path": "a.jpg"}, {"bytes": None, "path": "b.jpg"}, {"bytes": b"c", "path": "c.jpg"}],
                schema.IMAGE_TYPE,
            ),
        }
    )
    reader = SourceReader(pool=str(tmp_path))
    with pytest.raises(
        OriginalsMissing, match=f"files-000001: 2 images to write .* {re.escape(f'{sources[0]}: {CHANGED}')}"
    ):
        ws.with_originals(table, reader, "files-000001")
    (tmp_path / "a.jpg").write_bytes(b"a")  # the pool put back as it was curated
    (tmp_path / "b.jpg").write_bytes(b"b")
    assert _hashes_are_keys(ws.with_originals(table, reader, "files-000001"))
