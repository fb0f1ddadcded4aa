"""A decode kernel over the packed quantized cache, CUDA only: the new
module ``mlx_lm/kernels/quantized_decode.py`` (its CUDA source in
``quantized_decode_source.py``, ``_partial.py``, ``_mma.py``).

Upstream's ``quantized_scaled_dot_product_attention`` fails on MLX's CUDA
backend (``quantized_matmul`` has no kernel for a cache's keys), and
dequantizing a layer's whole cache for one query decoded at 0.40x (8 bits)
the bfloat16 cache's speed. Decode steps (up to ``DECODE_MAX_QUERIES``
queries, bits 4 and 8, group sizes 32/64/128, head dims up to 128, mask
arrays or "causal") go through ``quantized_decode_attention``: a
flash-decoding ``mx.fast.cuda_kernel`` that reads the packed keys and
values in place, dequantizes them in registers, splits the keys into
ranges merged by a second kernel (or by the tensor-core kernel's last
block), and reads and writes a ``QuantizedKVCache``'s unquantized tail
itself; decode runs at 0.88-1.05x the bfloat16 cache's tokens per second.
``models/base.py`` imports it for ``quantized_attention``.
``MLX_LM_PATCHED_DECODE_KERNEL=0`` keeps the old road; Metal and CPU are
untouched. Measurements: docs/benchmarks.md, "The CUDA decode kernel".
"""

from .._newmods import hooks, new_module
from .._registry import Patch

PATCH = Patch(
    "quantized_decode_kernel",
    "quantized_decode_attention: a flash-decoding kernel over the packed "
    "quantized cache for CUDA decode steps",
    new_module("mlx_lm.kernels.quantized_decode_source")
    + new_module("mlx_lm.kernels.quantized_decode_partial")
    + new_module("mlx_lm.kernels.quantized_decode_mma")
    + new_module("mlx_lm.kernels.quantized_decode")
    + hooks(
        "mlx_lm.models.base",
        "mlx_lm.kernels.quantized_decode",
        "quantized_decode_attention",
        "use_decode_kernel",
    ),
)
