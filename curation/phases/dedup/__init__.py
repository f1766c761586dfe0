"""Phase 2, "dedup": pHash pairs (``phash_pairs``, on the band kernel of ``phash_bands``), embedding pairs
(``embedding_pairs``), then connected components with one survivor kept per component (``components``, on the keep
rule of ``keep_rule``)."""
