"""The global phases over every phase-1 survivor: ``dedup``, ``sample`` and ``write``, as Ray tasks over partitions
on the output store, sequenced by ``pipeline``, each a short list of ``curation.steps`` steps; ``routed`` the shuffle
files between their steps; ``survivors`` the table they start from; ``release`` what a run curated against a
published release adds; ``reference`` single-process implementations the tests check the phases against."""
