"""Phase 1, "score": the stage contract (``stage``) and its runner (``stage_runner``), reading the pool (``pool``,
``metadata``), the phase itself on Ray Data (``phase``) and the ledger every input ends in (``ledger``). Never imports
the global phases."""
