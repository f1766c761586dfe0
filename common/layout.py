"""The layout of a curation output: every folder, commit and done record, the phase order and the manifest.

Curation writes it, the audit, the report and the ledger reader check it, and training reads its manifest; all of them
ask ``LAYOUT`` for a path or a phase name, so renaming a folder is a change here and nowhere else. Paths are relative
to the output root (join them with ``common.storage.join``); names starting with ``_`` are bookkeeping that readers
listing data files skip. Every file one step writes and another step, the audit or a reader opens is named here; a
step's scratch files inside its own work folder (``dedup/components/``, ``sample/work/``, a pair folder's
``_shuffle/``) are the step's to name.

    _state/lease.json                       the output's lease (common.lease)
    _state/inputs.parquet                   the input shards the first run listed, pinned for every resume
    _state/run.json                         the run's input and results hash
    _state/<phase>.done.json                a phase's record, written last
    _state/steps/<phase>/<step>.started.json   a step's fingerprint, written when it starts (curation.steps.runner)
    _state/steps/<phase>/<step>/<unit>.json    the receipt of each finished unit of the step
    _state/steps/score/shards/<shard_id>.json  phase 1's commit record of an input shard (its unit receipt)
    _state/steps/<phase>/<step>.done.json      the step's stats, written last
    _state/takedown/<list id>.json          a takedown: the list, who, when, what it removed, the files it replaced
    _state/takedown/<list id>.entries.parquet   the list's entries (keys, sources, URLs), which no version may hold
    scored/<shard_id>/part-*.parquet        phase 1's kept rows, with scores, hashes and embeddings (image bytes null)
    scored_images/<shard_id>/part-*.parquet   their image bytes (``source``, ``image``, row for row), deleted once the
                                            write phase has switched to the final shards: each image's bytes once
    ledger/<shard_id>/part-*.parquet        phase 1's ledger rows: one per input
    dedup/...                               phase 2's partitions (survivors, pairs, components, decisions)
    sample/...                              phase 3's partitions (work, hierarchy, decisions)
    shards/part-NNNNN-<sha256>.parquet      the final curated shards
    shards/manifest.json                    the current shards and final-ledger files: the commit point of "write"
    final_ledger/<shard_id>-<sha256>.parquet   the ledger with every phase applied
    report/                                 the HTML report (jobs.report)
    README.md                               the dataset card (curation.phases.write.card): what load_dataset("<out>") reads
"""

from __future__ import annotations

PHASES = ("score", "dedup", "sample", "write")
GLOBAL_PHASES = PHASES[1:]
TAKEDOWN = "takedown"  # the step after publishing that removes images (jobs.takedown): a stage of its own in funnels
# The step before scoring: a URL of the pool's downloader record (img2dataset's) that brought no image; the first
# stage of a funnel, so that the ledger accounts for the whole URL list.
DOWNLOAD = "download"


def funnel_phase(stage: str | None) -> str:
    """The phase a ledger row's stage belongs to in a funnel: the download, a global phase, the takedown, or score."""
    return stage if stage in GLOBAL_PHASES or stage in (TAKEDOWN, DOWNLOAD) else "score"


class OutputLayout:
    state = "_state"
    lease = "_state/lease.json"
    listing = "_state/inputs.parquet"
    run_record = "_state/run.json"
    score_commits = "_state/steps/score/shards"  # the score phase's one step: its units are the input shards
    # Where outputs scored before the score phase ran on the step runner keep their commit records: still read
    # (curation.records.commit_files), and moved to ``score_commits`` when such a run resumes.
    previous_score_commits = "_state/score"
    takedowns = "_state/takedown"

    scored = "scored"
    scored_images = "scored_images"
    ledger = "ledger"

    def images_of(self, scored_file: str) -> str:
        """The file of the image bytes of the scored part ``scored_file`` (relative to the output root, or a path
        under it: the answer is of the same kind)."""
        parts = scored_file.split("/")
        if len(parts) < 3 or parts[-3] != self.scored:
            raise ValueError(f"not a scored part: {scored_file}")
        return "/".join([*parts[:-3], self.scored_images, *parts[-2:]])

    survivors = "dedup/survivors"
    phash_pairs = "dedup/pairs/phash"
    embedding_pairs = "dedup/pairs/embedding"
    embedding_buckets = "dedup/embedding_buckets"
    embedding_plan = "dedup/embedding_plan"  # centroids.npy, buckets.json (the bucket of each cluster)
    components = "dedup/components"
    dedup_decisions = "dedup/decisions"

    sample_hierarchy = "sample/hierarchy.parquet"
    sample_work = "sample/work"
    sample_decisions = "sample/decisions"

    shards = "shards"
    manifest_name = "manifest.json"  # inside the shards folder, which is what training is pointed at
    manifest = f"{shards}/{manifest_name}"
    final_ledger = "final_ledger"
    report = "report"
    card = "README.md"
    shard_glob = f"{shards}/part-*.parquet"  # the final shards and nothing else (not the manifest, not _tmp- files)

    # --- phases ---------------------------------------------------------------------------------------------------

    @staticmethod
    def needs(phase: str) -> str:
        """The phase that must be complete before ``phase`` runs."""
        return PHASES[PHASES.index(phase) - 1]

    @staticmethod
    def from_phase_on(phase: str) -> tuple[str, ...]:
        """``phase`` and the global phases after it: what rerunning ``phase`` invalidates."""
        return GLOBAL_PHASES[GLOBAL_PHASES.index(phase) :]

    def done(self, phase: str) -> str:
        return f"{self.state}/{phase}.done.json"

    steps = "_state/steps"

    def step_started(self, phase: str, step: str) -> str:
        return f"{self.steps}/{phase}/{step}.started.json"

    def step_done(self, phase: str, step: str) -> str:
        return f"{self.steps}/{phase}/{step}.done.json"

    def step_units(self, phase: str, step: str) -> str:
        """The folder of a global step's unit receipts."""
        return f"{self.steps}/{phase}/{step}"

    def step_unit(self, phase: str, step: str, unit: str) -> str:
        return f"{self.steps}/{phase}/{step}/{unit}.json"

    def phase_folders(self, phase: str) -> tuple[str, ...]:
        """What a global phase writes beside its records: where a killed write (or a task attempt that Ray retried)
        leaves a torn ``_tmp-`` file for the phase's next run to remove."""
        return {"dedup": ("dedup",), "sample": ("sample",), "write": (self.shards, self.final_ledger)}[phase]

    def phase_steps(self, phase: str) -> str:
        """Every step record of a global phase."""
        return f"{self.steps}/{phase}"

    # --- files ----------------------------------------------------------------------------------------------------

    def score_commit(self, shard_id: str) -> str:
        return f"{self.score_commits}/{shard_id}.json"

    @staticmethod
    def part(folder: str, index: int) -> str:
        """Partition ``index`` of a partitioned folder (survivors, decisions, pairs, work)."""
        return f"{folder}/part-{index:06d}.parquet"

    @staticmethod
    def pair_part(folder: str, partition: int) -> str:
        """Partition ``partition`` of a pair folder (``phash_pairs``, ``embedding_pairs``), which components read."""
        return f"{folder}/part-{partition:05d}.parquet"

    def takedown_record(self, list_id: str) -> str:
        return f"{self.takedowns}/{list_id}.json"

    def takedown_entries(self, list_id: str) -> str:
        return f"{self.takedowns}/{list_id}.entries.parquet"

    def dedup_decision(self, index: int) -> str:
        """The dropped survivors of survivor partition ``index``, with the key each duplicates."""
        return self.part(self.dedup_decisions, index)

    def sample_decision(self, index: int) -> str:
        """Every dedup survivor of survivor partition ``index``, with its cluster ids and whether it is selected."""
        return self.part(self.sample_decisions, index)


LAYOUT = OutputLayout()
