"""A curation output, resolved once where a job starts, and the claim a run lays on it.

``Output`` is the output's URI (what Ray tasks are handed: each resolves it once), filesystem and root; every path
under it is a ``common.layout.LAYOUT`` name joined with ``path``. ``claim_output`` records which run (input and
settings) owns the output and refuses to mix results of different settings in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.fs as pafs

from common.layout import LAYOUT
from common.storage import delete_quietly, exists, join, list_files, resolve, write_json_atomic
from curation.records import read_run_record, run_record


@dataclass(frozen=True)
class Output:
    """A curation output: its URI, filesystem and root. Paths are ``LAYOUT`` names joined to the root with ``path``."""

    uri: str
    fs: pafs.FileSystem
    root: str

    @classmethod
    def at(cls, uri: str) -> Output:
        fs, root = resolve(uri)
        return cls(uri, fs, root)

    def path(self, rel: str) -> str:
        return join(self.root, rel)

    def exists(self, rel: str) -> bool:
        return exists(self.fs, self.path(rel))

    def listed(self, folder: str, suffix: str = ".parquet") -> list[str]:
        """The files under ``folder``, relative to the root (sorted; bookkeeping names skipped)."""
        return [p[len(self.root) + 1 :] for p in list_files(self.fs, self.path(folder), suffix)]


class RunMismatch(RuntimeError):
    """The output folder holds a run made with different settings."""


def claim_output(
    out: Output, results_hash: str, input_uri: str, new_run: bool, scoring: dict | None = None
) -> dict | None:
    """Record which run owns ``out``; refuse to mix results of different settings in one output. ``scoring``: what
    phase 1 scores with (``curation.score.redecide.scoring_record``); an output scored alike whose thresholds differ
    is kept, and its run record returned: the caller re-decides it (``curation.score.redecide.apply_thresholds``).

    Deletes the results of an earlier run: call it holding the output's lease (``common.lease``)."""
    path = out.path(LAYOUT.run_record)
    record = run_record(results_hash, input_uri, scoring)  # no credentials in _state
    input_uri = record["input"]
    if exists(out.fs, path) and not new_run:
        run = read_run_record(out.fs, out.root, expected=record)
        alike = scoring is not None and (run.get("scoring") or {}).get("hash") == scoring["hash"]
        if run["results_hash"] != results_hash and alike and run["input"] == input_uri:
            return run
        if run["results_hash"] != results_hash or run["input"] != input_uri:
            raise RunMismatch(
                f"{out.uri} holds a run of input {run['input']} with config hash {run['results_hash']}; this command "
                f"has input {input_uri} and config hash {results_hash}. Rerun with the same input and settings to "
                "resume, choose another --output, or pass --new-run to discard the old results (a change of thresholds "
                "alone, filters.*, is re-decided in place; this one changes more, or the output predates that)."
            )
        if run.get("schema_version") != record["schema_version"]:
            # Its scored files lack columns the later phases read (encoding_quality since version 3).
            raise RunMismatch(
                f"{out.uri} was scored by an older version of the pipeline (tables of schema version "
                f"{run.get('schema_version', '2 or older')}; this one reads and writes version "
                f"{record['schema_version']}). Pass --new-run to score it again, or choose another --output."
            )
        if run.get("input_store") != record["input_store"]:  # the same pool reached anew (another endpoint)
            write_json_atomic(out.fs, path, {**run, "input_store": record["input_store"]})
        return None
    for top in (LAYOUT.scored, LAYOUT.scored_images, LAYOUT.ledger):
        delete_quietly(out.fs, out.path(top))
    state = out.path(LAYOUT.state)
    if exists(out.fs, state):  # all of it but the lease this run holds and the takedowns, which bind every run
        keep = {out.path(LAYOUT.lease), out.path(LAYOUT.takedowns)}
        for info in out.fs.get_file_info(pafs.FileSelector(state)):
            if info.path not in keep:
                delete_quietly(out.fs, info.path)
    write_json_atomic(out.fs, path, record)
    return None
