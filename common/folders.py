"""What a folder holds, told by the record each job writes there first.

A job checks the folders it is given before it writes anything: a curation into a copy of a training run, or a
training run named after a curated output, would mix one job's files into another's (and the first write, a lease or
a run record, would make the corrected command be refused). ``refuse_other_kind`` names the folder and what it holds;
``shards_hint`` turns a curated output given where its shards folder is wanted into the flag to pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

from common.layout import LAYOUT
from common.storage import StorageError, exists, join, redact, resolve

TRAINING_RUN_RECORD = "run.json"  # <storage>/<name>/run.json: what a training run trains (training.runner)
# jobs.export runs one step, "tars", and records each tar it wrote in <out>/_state/steps/export/tars/
EXPORT_PHASE, EXPORT_STEP = "export", "tars"
EXPORT_RECORDS = LAYOUT.step_units(EXPORT_PHASE, EXPORT_STEP)


@dataclass(frozen=True)
class Kind:
    """A kind of folder: what to call it, and the files any one of which says a folder is of that kind."""

    what: str
    markers: tuple[str, ...]


CURATED = Kind("a curated output (jobs.curate --output)", (LAYOUT.run_record, LAYOUT.manifest))
TRAINING_RUN = Kind("a training run (jobs.pretrain / jobs.finetune)", (TRAINING_RUN_RECORD,))
# _state/export: where an export recorded its tars before its step records
EXPORT = Kind("a WebDataset export (jobs.export --output)", (EXPORT_RECORDS, join(LAYOUT.state, "export")))
LABELLED = Kind("labelled shards (jobs.make_synthetic --out)", (join("train", LAYOUT.manifest_name),))
# after EXPORT, whose folder holds a manifest.json too
SHARDS = Kind("the shards folder of a curated output", (LAYOUT.manifest_name,))
KINDS = (CURATED, TRAINING_RUN, EXPORT, LABELLED, SHARDS)
RUNS = Kind("a folder of training runs (--storage)", ())  # no record of its own: any other kind is refused


class FolderError(StorageError):
    """A folder given to a job holds another kind of output; the message names it and what it holds."""


def _holds(fs: pafs.FileSystem, root: str, kind: Kind) -> bool:
    return any(exists(fs, join(root, marker)) for marker in kind.markers)


def require_folder(uri: str) -> None:
    """Raise ``FolderError`` unless ``uri`` is a folder."""
    fs, root = resolve(uri)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise FolderError(f"no such folder: {redact(uri)}")


def refuse_other_kind(uri: str, expected: Kind, flag: str) -> None:
    """Raise ``FolderError`` when ``uri`` (given as ``flag``) is a file, or a folder of another kind than
    ``expected``; a missing or empty folder, or one of ``expected``'s kind, passes."""
    fs, root = resolve(uri)
    if fs.get_file_info(root).type == pafs.FileType.File:
        raise FolderError(f"{flag} {redact(uri)} is a file; give a folder")
    if _holds(fs, root, expected):
        return
    other = next((kind for kind in KINDS if kind is not expected and _holds(fs, root, kind)), None)
    if other is not None:
        raise FolderError(
            f"{flag} {redact(uri)} holds {other.what}, not {expected.what}; this job writes nothing there. "
            "Give another folder"
        )


def shards_hint(uri: str, flag: str) -> str:
    """For a message about ``uri`` lacking a manifest: the flag to pass when it is a curated output, whose shards
    folder holds the manifest; empty otherwise."""
    fs, root = resolve(uri)
    if not exists(fs, join(root, LAYOUT.manifest)):
        return ""
    return f"; {redact(uri)} is a curated output: pass {flag} {join(redact(uri), LAYOUT.shards)}"
