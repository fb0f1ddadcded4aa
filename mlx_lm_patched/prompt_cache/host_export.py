"""Prompt caches copied to host memory, saved from any thread (the new
module ``mlx_lm/models/prompt_cache_host.py``).

Servers spill prompt caches to disk on a background thread, but
``save_prompt_cache`` evaluates MLX arrays, which must happen on the thread
that generates; and numpy has no bfloat16, so a naive ``np.array`` upcasts
or fails. ``prompt_cache_to_host`` copies any prompt cache's state to numpy
on the calling thread (bfloat16 as its uint16 bits, quantized caches as
their packed parts, nothing dequantized); ``HostPromptCache.save`` then
writes, without MLX, a ``.safetensors`` file that ``load_prompt_cache``
reads bit for bit, and ``prompt_cache_from_host`` rebuilds the cache
directly.
"""

from .._newmods import hooks, new_module
from .._registry import Patch

PATCH = Patch(
    "host_export",
    "prompt_cache_to_host / HostPromptCache.save: spill prompt caches to disk "
    "from any thread, bfloat16 and quantized caches bit-exact",
    new_module("mlx_lm.models.prompt_cache_host")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.prompt_cache_host",
        "HostPromptCache",
        "prompt_cache_state",
        "prompt_cache_to_host",
        "prompt_cache_from_host",
    ),
)
