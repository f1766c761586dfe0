"""Phase 3, "sample": hierarchical k-means and balanced selection (``kmeans``) run over the survivors' partitions
(``cluster_sampling``: the plan and steps; ``tasks``: their Ray tasks; ``selection``: their arithmetic)."""
