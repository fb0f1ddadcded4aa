"""Patches to ``mlx_lm/server.py``: batching with ``--kv-bits``, the prompt
cache's budgets and tiers, failures, requests, HTTP, ``--max-kv-size``, models,
the warm-up."""
