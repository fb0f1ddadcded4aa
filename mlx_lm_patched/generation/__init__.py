"""Patches to ``mlx_lm/generate.py``: ``--kv-bits`` checked up front and in
``BatchGenerator``, drafts with bounded caches, a split of every row that
moves its batch, a row's first token before the next step."""
