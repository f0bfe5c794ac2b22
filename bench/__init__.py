"""Benchmarks of slcompile: one script per scenario, each runnable on its own
(``python bench/train_bench.py``) or through ``python -m bench`` (see __main__.py)."""
