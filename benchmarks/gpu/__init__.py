"""The GPU check's parts (``benchmarks/gpu_check.py`` runs them): one module per benchmark, the sizes they run at,
what a part writes while it runs, and the table of results."""
