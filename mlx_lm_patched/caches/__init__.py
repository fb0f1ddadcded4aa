"""Patches to the caches of ``mlx_lm/models/cache.py``: preallocated rings,
the finished ``QuantizedKVCache`` and its ring and batch forms, trims and
pipelined long chunks."""
