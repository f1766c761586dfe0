"""Phase 2, "dedup": pHash pairs (``phash_pairs``), embedding pairs (``embedding_pairs``), then connected components
with one survivor kept per component (``components``), all on the numpy kernels of ``kernels``."""
