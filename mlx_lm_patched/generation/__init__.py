"""Patches to ``mlx_lm/generate.py``: ``--kv-bits`` checked up front and in
``BatchGenerator``, drafts with bounded caches."""
