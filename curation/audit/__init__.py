"""Auditing curated output: ``verify`` re-checks shards, ledger and manifest against each other; ``report``
renders what a run kept and dropped as one HTML page."""
