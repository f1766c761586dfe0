"""Data that tests, demos and benchmarks make: the bundled sample pool of real photos, a hostile-input corpus,
synthetic humanoids with exact labels, and random-init model weights in the real model stores' layouts.

Jobs and tests import these; the curation, pretraining and fine-tuning code never does.
"""
