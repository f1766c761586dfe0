"""Phase 4, "write": the final shards and ledger (``shards``), the dataset card (``card``), and takedowns that rewrite
a published output (``takedown_run``) from lists whose records later writes and the audit apply (``takedown``)."""
