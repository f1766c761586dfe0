"""Phase 4, "write": the final shards and ledger (``shards``), the dataset card (``card``), and takedowns that rewrite
a published output (``takedown``)."""
