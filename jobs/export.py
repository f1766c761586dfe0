"""Export curated shards to other formats; today WebDataset tars, the format NeMo, img2dataset and webdataset
loaders read.

    python -m jobs.export --shards <out>/shards --format webdataset --output <dir or s3://...> [--samples-per-tar N]

Each sample becomes ``<key>.<ext>``, the image's original bytes under the extension of their format (``.jpg``,
``.png``, ...; never re-encoded), ``<key>.json``, every other column of the shard (scores, boxes, head pose,
source; no image bytes) with the pool's metadata of the image as one object under ``metadata``, and its caption and class
as the pool's sample had them (``<key>.txt``, ``<key>.cls``: the metadata fields of those names). ``<key>`` is the image's sha256, made safe where a shard holds anything else. Tars are
``part-NNNNNN.tar``: one per shard the manifest lists, or ``N`` samples each (in the manifest's order), so
``part-{000000..000041}.tar`` names them all; ``manifest.json`` beside them lists each tar's samples, bytes and
sha256.

Only the shards ``manifest.json`` lists are read, a row group at a time. Each tar is written atomically and
recorded in ``_state/steps/export/tars/`` (a ``curation.steps.runner`` step); the same command again skips the tars
already written and redoes the rest, and an export with other shards or another ``--samples-per-tar`` rewrites the
folder's tars (one export per output folder at a time).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import re
import sys
import tarfile
from typing import IO, cast

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from PIL import Image, UnidentifiedImageError

from common import folders
from common.console import configure_console, exit_code_interruptible
from common.layout import LAYOUT
from common.ray_utils import init_ray
from common.storage import (
    StorageError,
    delete_quietly,
    exists,
    fixed_tarinfo,
    is_local,
    join,
    list_files,
    open_output_atomic,
    read_json,
    redact,
    remove_temporaries,
    resolve,
    write_json_atomic,
)
from common.watchdog import Watchdog, WatchdogSettings
from curation.phases.write.shards import plan_output_shards
from curation.records import manifest_advice
from curation.score.metadata import sidecars_of
from curation.steps.output import Output
from curation.steps.runner import StepRunner, task_step
from curation.steps.window import task_window

FORMATS = ("webdataset",)
_EXTENSIONS = {
    "JPEG": "jpg",
    "MPO": "jpg",
    "PNG": "png",
    "WEBP": "webp",
    "GIF": "gif",
    "TIFF": "tiff",
    "BMP": "bmp",
    "HEIF": "heic",
    "AVIF": "avif",
    "JPEG2000": "jp2",
}  # MPO: a JPEG stream with a second picture after it
_NOT_IN_KEY = re.compile(r"[^A-Za-z0-9_-]+")
log = logging.getLogger("jobs.export")  # by name: under `python -m jobs.export` this module is __main__


class ExportError(RuntimeError):
    """The export cannot run as asked; the message says why."""


def tar_name(index: int) -> str:
    return f"part-{index:06d}.tar"


def _json_value(value: object) -> str:
    """A column value JSON has no type for: bytes (a PDQ hash) as hex, anything else as text."""
    return value.hex() if isinstance(value, bytes) else str(value)


def wds_key(text: str | None, image: bytes) -> str:
    """A WebDataset sample key: a dot would split it from the extension and a '/' make it a path, so anything
    other than letters, digits, '_' and '-' is replaced and a hash of the original keeps it unique. A missing key
    is the sha256 of the image, as curated keys are."""
    if text is None:
        return hashlib.sha256(image).hexdigest()
    if not _NOT_IN_KEY.search(text) and 0 < len(text) <= 100:
        return text
    return f"{_NOT_IN_KEY.sub('_', text)[:64].strip('_') or 'x'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def image_extension(fmt: str | None, image: bytes) -> str:
    """The file extension of the image's format (the shard's ``format``, else read from the bytes' header)."""
    if fmt is None:
        try:
            with Image.open(io.BytesIO(image)) as im:
                fmt = im.format
        except (UnidentifiedImageError, OSError, ValueError):
            return "bin"
    if fmt in _EXTENSIONS:
        return _EXTENSIONS[fmt]
    registered = [ext for ext, name in Image.registered_extensions().items() if name == fmt]
    return registered[0].lstrip(".") if registered else "bin"


class _Hashing:
    """A write-only stream that passes bytes on and hashes and counts them (the tar's manifest entry)."""

    def __init__(self, out):
        self.out, self.digest, self.size = out, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.out.write(data)
        self.digest.update(data)
        self.size += len(data)
        return len(data)


def _row_slices(pf: pq.ParquetFile, start: int, stop: int):
    """Rows ``start:stop`` of a Parquet file as tables, one row group at a time."""
    offset = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        lo, hi = max(start, offset), min(stop, offset + n)
        if hi > lo:
            yield pf.read_row_group(rg).slice(lo - offset, hi - lo)
        offset += n


def merged_metadata(typed: dict | None, rest: str | None) -> dict:
    """A row's pool metadata as one object: the typed fields (nulls left out) and the JSON rest."""
    return {**{k: v for k, v in (typed or {}).items() if v is not None}, **(json.loads(rest) if rest else {})}


# Ray tasks, as the curation phases: under `ray job submit` every node of the cluster writes tars (near the object
# store the shards live on) and a local run gets a local Ray; a process pool would keep the work on one machine.
@ray.remote(num_cpus=0.5)
def _write_tar(shards_uri: str, files: list[str], pieces: list[tuple[int, int, int]], out_uri: str, name: str) -> dict:
    """One tar from ``pieces``, (index into ``files``, first row, end row) slices, in order; returns its entry."""
    in_fs, in_root = resolve(shards_uri)
    out_fs, out_root = resolve(out_uri)
    samples = skipped = 0
    seen: set[str] = set()
    with open_output_atomic(out_fs, join(out_root, name)) as stream:
        sink = _Hashing(stream)
        # USTAR, as the pool's tars: keys are short, and every WebDataset reader knows it
        # cast: a "w|" stream only calls write(), but typeshed asks every fileobj for read/seek/tell/close too
        with tarfile.open(fileobj=cast(IO[bytes], sink), mode="w|", format=tarfile.USTAR_FORMAT) as tar:
            for index, start, stop in pieces:
                pf = pq.ParquetFile(in_fs.open_input_file(join(in_root, files[index])))
                for table in _row_slices(pf, start, stop):
                    for row in table.to_pylist():
                        image = (row.pop("image") or {}).get("bytes")
                        if not image:  # nothing to export; counted, the rest goes on
                            skipped += 1
                            continue
                        key = wds_key(row.get("key"), image)
                        if key in seen:  # webdataset would merge two samples of one key
                            key = f"{key}-dup{samples}"
                        seen.add(key)
                        pool_metadata = merged_metadata(row.pop("metadata", None), row.pop("metadata_json", None))
                        meta = json.dumps({**row, "metadata": pool_metadata}, default=_json_value).encode()
                        sidecars = [(f"{key}.{ext}", data) for ext, data in sidecars_of(pool_metadata).items()]
                        for member, data in (
                            (f"{key}.{image_extension(row.get('format'), image)}", image),
                            (f"{key}.json", meta),
                            *sidecars,
                        ):
                            tar.addfile(fixed_tarinfo(member, len(data)), io.BytesIO(data))
                        samples += 1
    return {"file": name, "samples": samples, "skipped": skipped, "bytes": sink.size, "sha256": sink.digest.hexdigest()}


_Tars = task_step(folders.EXPORT_STEP, "tars", _write_tar)


def plan_tars(rows: list[int], samples_per_tar: int | None) -> list[list[tuple[int, int, int]]]:
    """Per tar, the (shard index, start, stop) slices it holds: one tar per non-empty shard, or ``samples_per_tar``
    samples each over the shards in order."""
    if samples_per_tar is None:
        return [[(k, 0, n)] for k, n in enumerate(rows) if n]
    return plan_output_shards(rows, samples_per_tar)


def read_source(shards_uri: str) -> dict:
    """The manifest of the curated shards to export."""
    fs, root = resolve(shards_uri)
    path = join(root, LAYOUT.manifest_name)
    if not exists(fs, path):
        raise ExportError(
            f"{redact(shards_uri)}: no {LAYOUT.manifest_name}; point --shards at a curated output's shards folder"
            + folders.shards_hint(shards_uri, "--shards")
        )
    return read_json(fs, path, fields={"shards": list}, advice=manifest_advice(fs, None))


def written(out_uri: str) -> str:
    """What an interrupted export keeps: the tars it wrote and recorded, which a rerun skips."""
    fs, root = resolve(out_uri)
    tars = len(list_files(fs, join(root, folders.EXPORT_RECORDS), ".json"))
    return f"{tars} tar(s) written and recorded in {redact(out_uri)}"


def _forget_lost(out: Output) -> None:
    """A tar's receipt counts only while the tar is there: the receipts of tars since removed are deleted, with the
    step's done record, so that the step writes those tars again."""
    there = {path.rpartition("/")[2] for path in list_files(out.fs, out.root, ".tar")}
    receipts = out.listed(folders.EXPORT_RECORDS, ".json")
    lost = [rel for rel in receipts if rel.rpartition("/")[2].removesuffix(".json") not in there]
    for rel in [*lost, LAYOUT.step_done(folders.EXPORT_PHASE, _Tars.name)] if lost else []:
        delete_quietly(out.fs, out.path(rel))


def export_webdataset(shards_uri: str, out_uri: str, samples_per_tar: int | None) -> dict:
    """Write the tars not yet written and the export's manifest; returns the manifest."""
    in_fs, in_root = resolve(shards_uri)
    out_fs, out_root = resolve(out_uri)
    # tasks run in other working directories (and on other nodes): give them local paths made absolute
    shards_uri = in_root if is_local(in_fs) else shards_uri
    out_uri = out_root if is_local(out_fs) else out_uri
    source = read_source(shards_uri)
    files = [s["file"] for s in source["shards"]]
    plan = plan_tars([s["rows"] for s in source["shards"]], samples_per_tar)
    settings = {
        "format": "webdataset",
        "samples_per_tar": samples_per_tar,
        "shards": [[s["file"], s["sha256"]] for s in source["shards"]],
    }
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    remove_temporaries(out_fs, out_root)  # tars a killed export left half-written
    out = Output.at(out_uri)
    _forget_lost(out)
    log.info(
        f"[export] {sum(s['rows'] for s in source['shards'])} samples of {len(files)} shards into {len(plan)} tars"
    )
    names = [tar_name(k) for k in range(len(plan))]
    calls = {name: (shards_uri, files, pieces, out_uri, name) for name, pieces in zip(names, plan)}
    runner = StepRunner(out, folders.EXPORT_PHASE, settings_hash, task_window(per_cpu=4))
    entries = runner.run(_Tars(calls))["receipts"]
    manifest = {
        "format": "webdataset",
        "settings_hash": settings_hash,
        "source_config_hash": source.get("config_hash"),
        "tars": entries,
        "totals": {
            "tars": len(entries),
            "samples": sum(t["samples"] for t in entries),
            "skipped": sum(t["skipped"] for t in entries),
            "bytes": sum(t["bytes"] for t in entries),
        },
    }
    write_json_atomic(out_fs, join(out_root, "manifest.json"), manifest)
    listed = {join(out_root, name) for name in names}
    for path in list_files(out_fs, out_root, ".tar"):  # an earlier export's tars beyond this one's
        if path not in listed and path.rpartition("/")[2].startswith("part-"):
            delete_quietly(out_fs, path)
    return manifest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shards", required=True, help="a curated output's shards folder, with its manifest.json (local or s3://)"
    )
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--output", required=True, help="folder for the tars (local or s3://)")
    p.add_argument(
        "--samples-per-tar", type=int, default=None, help="samples per tar (default: one tar per curated shard)"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument(
        "--watchdog-minutes", type=float, default=WatchdogSettings().minutes,
        help="minutes without a tar written before the job says what it waits for (0: never)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    return exit_code_interruptible("export", lambda: _export(args), lambda: written(args.output))


def _export(args: argparse.Namespace) -> int:
    try:  # before Ray starts and anything is written
        if args.samples_per_tar is not None and args.samples_per_tar < 1:
            raise ExportError("--samples-per-tar must be at least 1")
        read_source(args.shards)
        folders.refuse_other_kind(args.output, folders.EXPORT, "--output")
    except (ExportError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    init_ray(args.ray_address)
    try:
        with Watchdog("jobs.export", args.watchdog_minutes):
            manifest = export_webdataset(args.shards, args.output, args.samples_per_tar)
    except (ExportError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, pa.ArrowException, ray.exceptions.RayTaskError) as exc:
        # a listed shard that is missing or damaged: the tars written so far are kept for the next run
        print(f"error: {exc}\nthe tars written so far are kept; run the same command again to finish", file=sys.stderr)
        return 1
    totals = manifest["totals"]
    print(
        f"[export] {totals['samples']} samples in {totals['tars']} tars ({totals['bytes']} bytes) at {redact(args.output)}"
        + (f"; {totals['skipped']} rows without image bytes skipped" if totals["skipped"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
