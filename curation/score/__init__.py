"""Phase 1, "score": the stage contract and its runner (``stage``), reading the pool (``pool``, ``metadata``), the
phase itself on Ray Data (``phase``) and the ledger every input ends in (``ledger``). Never imports the global
phases."""
