"""The curation output's JSON records read back, each with what to do when it is damaged.

``common.storage.read_json`` checks a record's bytes and fields and names the file; this module knows what each
record is for, and so the advice that redoes exactly what it recorded with the flags ``jobs.curate`` has.

A damaged record is never taken for an absent one: an absent run record makes a rerun discard every result, an absent
commit record makes it score its shard again under later phases recorded as done on the old results, an absent done
record makes it redo a phase; each would redo or skip work without a word. Writes are atomic, so damage means the file
was changed after it was written, and only the person who can look at it should choose.
"""

from __future__ import annotations

import json

import pyarrow.fs as pafs

from common.layout import GLOBAL_PHASES, LAYOUT
from common.schema import SCHEMA_VERSION
from common.storage import (
    FieldTypes,
    check_fields,
    display_path,
    join,
    list_files,
    read_json,
    redact,
    resolve,
    without_credentials,
)

_NUMBER = (int, float)

COMMIT_FIELDS: dict[str, FieldTypes] = {
    "shard_id": str,
    "rows": int,
    "kept": int,
    "ledger_files": list,
    "scored_files": list,
    "results_hash": str,
}
RUN_FIELDS: dict[str, FieldTypes] = {"results_hash": str, "input": str}
SCORE_DONE_FIELDS: dict[str, FieldTypes] = {"shards": int, "inputs_this_run": int, "seconds": _NUMBER}
PHASE_DONE_FIELDS: dict[str, FieldTypes] = {"settings_hash": str, "seconds": _NUMBER}


def _shown(fs: pafs.FileSystem, root: str, rel: str) -> str:
    return display_path(fs, join(root, rel))


def _phase_records(fs: pafs.FileSystem, root: str, phases: tuple[str, ...]) -> str:
    """The done records of ``phases``, in one brace pattern a shell expands."""
    names = phases[0] if len(phases) == 1 else "{" + ",".join(phases) + "}"
    return f"{_shown(fs, root, LAYOUT.state)}/{names}.done.json"


def commit_files(fs: pafs.FileSystem, root: str) -> list[str]:
    """The paths of every committed input shard's commit record: the score step's unit records, or, in an output
    scored before the score phase ran on the step runner, the records of that layout (``_state/score/``)."""
    paths = list_files(fs, join(root, LAYOUT.score_commits), ".json")
    return paths or list_files(fs, join(root, LAYOUT.previous_score_commits), ".json")


def read_commit(fs: pafs.FileSystem, root: str, path: str) -> dict:
    """An input shard's commit record (phase score) at ``path``, one of ``commit_files``: the receipt of its unit."""
    shard_id = path.rsplit("/", 1)[-1].removesuffix(".json")
    later = _phase_records(fs, root, GLOBAL_PHASES)
    advice = (
        f"It is input shard {shard_id}'s commit record (phase score). To score that shard again, delete it and "
        f"{later} (so the later phases redo their work on its new results), then rerun the same command"
    )
    if path.startswith(join(root, LAYOUT.previous_score_commits) + "/"):
        return read_json(fs, path, fields=COMMIT_FIELDS, advice=advice)
    record = read_json(fs, path, fields=_STEP_FIELDS["unit"], advice=advice)
    check_fields(fs, path, record["receipt"], COMMIT_FIELDS, advice, within="receipt")
    return record["receipt"]


def read_commits(fs: pafs.FileSystem, root: str) -> dict[str, dict]:
    """Every committed input shard's commit record, by shard id (one per input shard: 10^5-10^6 small files at 1B
    images, read by the driver once per phase)."""
    return {r["shard_id"]: r for r in (read_commit(fs, root, p) for p in commit_files(fs, root))}


def input_name(input_uri: str) -> str:
    """How the run record names a pool: a URI without its query or credentials, a local pool by its absolute path."""
    return redact(input_uri) if "://" in input_uri else resolve(input_uri)[1]


def run_record(results_hash: str, input_uri: str, scoring: dict | None = None) -> dict:
    """The run record of curating ``input_uri`` with settings of ``results_hash``. ``input`` is what a resume must
    match; ``input_store`` reaches the pool again (the URI's query kept: endpoint, region, scheme; credentials
    dropped), so that the report can read rejected inputs back from their store. ``scoring``: what phase 1 scored
    with, kept while thresholds change (``curation.score.redecide.scoring_record``)."""
    name = input_name(input_uri)
    return {
        "results_hash": results_hash,
        "input": name,
        "input_store": without_credentials(input_uri) if "://" in input_uri else name,
        "schema_version": SCHEMA_VERSION,  # of the scored and ledger tables the run writes
        **({"scoring": scoring} if scoring is not None else {}),
    }


def read_run_record(fs: pafs.FileSystem, root: str, expected: dict | None = None) -> dict:
    """The record of which input and settings made the output; ``expected``: what this command would write there."""
    if expected is not None:
        fix = (
            f"If this command made the output, write it back as {json.dumps(expected, sort_keys=True)} and rerun to "
            "resume; otherwise rerun with --new-run"
        )
    else:
        fix = "Rerun jobs.curate with --new-run"
    return read_json(
        fs,
        join(root, LAYOUT.run_record),
        fields=RUN_FIELDS,
        advice=f"It records which input and settings made this output. {fix} to discard its results and start over",
    )


def read_done(fs: pafs.FileSystem, root: str, phase: str) -> dict:
    """A phase's done record, written when the phase completed."""
    if phase == "score":
        return read_json(
            fs,
            join(root, LAYOUT.done(phase)),
            fields=SCORE_DONE_FIELDS,
            advice=(
                "It is phase score's done record. Delete it and rerun the same command: phase score writes it again "
                "(committed input shards are not scored again)"
            ),
        )
    return read_json(
        fs,
        join(root, LAYOUT.done(phase)),
        fields=PHASE_DONE_FIELDS,
        advice=(
            f"It is phase {phase}'s done record. To redo phase {phase}, delete it and rerun the same command ({phase} "
            "keeps the partitions it wrote; the phases after it are redone)"
        ),
    )


_STEP_FIELDS: dict[str, dict[str, FieldTypes]] = {
    "started": {"fingerprint": str},
    "unit": {"fingerprint": str, "receipt": dict},
    "done": {"fingerprint": str, "stats": dict, "seconds": _NUMBER},
}


def read_step_record(fs: pafs.FileSystem, path: str, phase: str, kind: str) -> dict:
    """A global step's record (``curation.steps.runner``): ``kind`` is started, unit or done."""
    advice = {
        "started": "the step starts over (what it wrote so far is cleared)",
        "unit": "that unit is done again",
        "done": "the step runs again, keeping the units it recorded",
    }[kind]
    return read_json(
        fs,
        path,
        fields=_STEP_FIELDS[kind],
        advice=f"It is a {kind} record of a step of phase {phase}. Delete it and rerun the same command: {advice}",
    )


def step_advice(fs: pafs.FileSystem, root: str, phase: str) -> str:
    """What to do about a damaged record that a global phase keeps among its outputs (a plan, a settings spec)."""
    return (
        f"It is a record of phase {phase}'s progress. To redo phase {phase}, delete "
        f"{_shown(fs, root, LAYOUT.phase_steps(phase))} and rerun the same command: its steps start over and clear what "
        "they wrote, this file included"
    )


def manifest_advice(fs: pafs.FileSystem, root: str | None) -> str:
    """What to do about a damaged manifest; ``root``: the output's root, when the reader knows it (None: a shards
    folder read on its own)."""
    done = _shown(fs, root, LAYOUT.done("write")) if root is not None else "the output's _state/write.done.json"
    return (
        "It is the write phase's manifest, the commit point of the final shards. To write it again, delete it and "
        f"{done} and rerun the same jobs.curate command (the write phase rebuilds it from the units it recorded)"
    )


def read_manifest(fs: pafs.FileSystem, root: str, fields: dict[str, FieldTypes] | None = None) -> dict:
    """The output's manifest (``shards/manifest.json``)."""
    return read_json(fs, join(root, LAYOUT.manifest), fields=fields, advice=manifest_advice(fs, root))
