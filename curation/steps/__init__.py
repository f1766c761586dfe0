"""The one contract of curation work, below every phase: a ``Step`` is a list of units and the ``StepRunner``
(``runner``) owns their fingerprints, receipts, resume, progress and done records; ``window`` is the bounded task
window the units run through; ``output`` is a curation output resolved once where a job starts, and the claim of it
by one run's settings. The score phase (units: input shards) and every step of dedup, sample, write, the export and
the takedown run on it."""
