"""Attention over an array mask: fused where the backend fuses it, in chained
query blocks where it materialises the scores (the new module
``mlx_lm/models/bounded_attention.py``).

An array mask (a rotating cache's window once a chunk runs past the ring, a
batch's padding) takes a different road through
``mx.fast.scaled_dot_product_attention`` on each MLX backend (``mlx/fast.cpp``
and ``backend/{cuda,metal}/scaled_dot_product_attention.cpp``):

- CUDA: cuDNN takes an additive mask fused, but MLX turns a boolean mask into
  one through two ``full_like`` arrays of the broadcast shape, every head. On
  an H100, one 2048-query x 6143-key call with 32 heads (bfloat16, head dim
  128) took 3.1 ms and 1,552 MiB that way; the same mask made additive here,
  in the query dtype (0 where visible, the dtype's minimum elsewhere), takes
  1.3 ms and 40 MiB (the mask and the output), with the same output bit for
  bit (``mask="causal"``: 0.69 ms), and 0.77 ms with its rows padded to 16
  bytes. A model gives every layer the same mask; it is made additive once
  (``additive_mask``), not once a layer: with no sync inside the model, a
  chunk's layers are all in flight at once (0.5 GiB less at the peak of a
  2048-token chunk past a 4096-slot ring).
- CUDA, small scores: a call of at most 16 queries (a prompt sent again), or
  of at most 1,024 queries over at most 4,096 keys (a chunk through a sliding
  window's layer), its scores at most 2**27 (a batch's rows and heads
  together), is composed as MLX composes what no kernel fuses (``unfused``,
  bit for bit its fallback). MLX records cuDNN's calls as CUDA
  graph nodes it cannot update, so every commit holding one is instantiated
  anew, and cuDNN builds a graph for each new shape: on an H200 a Gemma-3
  agent turn's 580-token chunk took 91 ms with cuDNN at every layer, 66 ms
  with the window's layers unfused (docs/serving.md).
- Metal: the fused kernel applies boolean and additive masks itself (head
  dims 64, 72, 80, 96, 128 past 8 queries): the mask goes there as it is.
- CPU, and what no fused kernel takes (float32 or head dims over 128 on CUDA,
  other head dims on Metal): every call materialises its scores, so past
  ``max_scores`` bytes of them the queries go through in blocks.

On CPU each block depends on the previous one's output (``mx.depends``) and
nothing is evaluated: lazily, MLX would compute every block's scores before
any softmax (its graph is scheduled breadth first); chained, it runs a few
tasks ahead of those finished (``MAX_ACTIVE_TASKS``, ``mlx/transforms.cpp``),
about six blocks, so a block is an eighth of the budget. The peak stayed
within the budget (a 1024 x 3072 float32 call, 16 heads: 65 MiB for a 96 MiB
budget, against 198 MiB unblocked) and the function runs under
``mx.compile``. A GPU encodes every block before the first one has run, so
there a chain bounds nothing (H100, 2048 x 6143 keys, 32 heads, head dim
256: 864 MiB chained, 832 MiB unblocked): each block is evaluated (165 MiB,
10.8 ms against 7.2 ms unblocked), in blocks of a power of two queries (with
341-query blocks cuBLAS rounded differently from the unblocked call). No
fused road evaluates anything.

``sdpa_backend()`` names the backend and ``attention_path()`` the road a call
takes; tests fake the first.
"""

from typing import TYPE_CHECKING, Optional

import mlx.core as mx

from .._newmods import hooks, new_module
from .._registry import Patch, pasted_into, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.bounded_attention import bounded_attention


def scaled_dot_product_attention(
    queries,
    keys,
    values,
    cache,
    scale: float,
    mask: Optional[mx.array],
    sinks: Optional[mx.array] = None,
    max_scores: int = 1 << 28,
) -> mx.array:
    if hasattr(cache, "bits"):
        if sinks is not None:
            raise ValueError("Quantized SDPA does not support attention sinks.")
        return quantized_scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            group_size=cache.group_size,
            bits=cache.bits,
        )
    return bounded_attention(queries, keys, values, scale, mask, sinks, max_scores)


# Written as it reads in mlx_lm/models/base.py, and run from there.
scaled_dot_product_attention = pasted_into(
    "mlx_lm.models.base", scaled_dot_product_attention
)

PATCH = Patch(
    "bounded_attention",
    "scaled_dot_product_attention: array masks fused where the backend can "
    "(additive on CUDA, unfused where the scores are small), chained query "
    "blocks of bounded scores elsewhere",
    new_module("mlx_lm.models.bounded_attention")
    + hooks(
        "mlx_lm.models.base", "mlx_lm.models.bounded_attention", "bounded_attention"
    )
    + targets("mlx_lm.models.base", scaled_dot_product_attention),
)
