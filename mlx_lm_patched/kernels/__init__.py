"""Patches to the attention of ``mlx_lm/models/base.py``: bounded masked
attention, quantized attention, and the CUDA decode kernel over packed caches."""
