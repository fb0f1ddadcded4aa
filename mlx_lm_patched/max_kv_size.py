"""``make_prompt_cache(model, max_kv_size)`` bounds every model's cache.

Upstream honours ``max_kv_size`` only for models without ``make_cache``;
llama, gemma3, mistral and most others build their own caches and silently
ignore it, so ``generate --max-kv-size 512`` grows the cache without bound.
Here, when the caller asks for a bound, full-attention ``KVCache`` layers
become ``RotatingKVCache(max_kv_size, keep=4)`` (what upstream gives models
without ``make_cache``), sliding layers keep their window unless it is
larger than ``max_kv_size``, and every other cache is left as it is. Which
layers changed is logged once per model class and change.
"""

from typing import Any, List, Optional

import mlx.nn as nn

from ._registry import Patch, Target, pasted_into

# Written as they would read in mlx_lm/models/cache.py, and run there
# (``KVCache`` and ``RotatingKVCache`` are that module's).

_bounded_logged = set()  # (model class, changes) already logged


def _bound_layers(model, cache: List[Any], max_kv_size: int):
    """Bound ``model``'s ``cache`` in place to ``max_kv_size`` tokens a layer;
    log which layers changed, once per model class and change."""
    import logging

    changed = []
    for i, c in enumerate(cache):
        if type(c) is KVCache:
            cache[i] = RotatingKVCache(max_size=max_kv_size, keep=4)
            changed.append(f"{i}: KVCache -> RotatingKVCache({max_kv_size}, keep=4)")
        elif type(c) is RotatingKVCache and c.max_size > max_kv_size:
            cache[i] = RotatingKVCache(max_size=max_kv_size, keep=c.keep)
            changed.append(
                f"{i}: RotatingKVCache({c.max_size}) -> "
                f"RotatingKVCache({max_kv_size}, keep={c.keep})"
            )
    key = (type(model).__qualname__, tuple(changed))
    if changed and key not in _bounded_logged:
        _bounded_logged.add(key)
        logging.getLogger(__name__).info(
            "max_kv_size=%d: bounded %d of %d cache layers of %s (%s)",
            max_kv_size,
            len(changed),
            len(cache),
            type(model).__qualname__,
            "; ".join(changed),
        )


def make_prompt_cache(
    model: nn.Module,
    max_kv_size: Optional[int] = None,
) -> List[Any]:
    """
    Construct the model's cache for use in generation.

    This function will defer the cache construction to the model if it has a
    ``make_cache`` method, otherwise it will make a default KV cache.

    Args:
        model (nn.Module): The language model.
        max_kv_size (Optional[int]): If provided, full-attention layers use a
            ``RotatingKVCache`` of ``max_kv_size`` tokens (keeping the first
            4) and sliding layers a window no larger than ``max_kv_size``.
    """
    if hasattr(model, "make_cache"):
        cache = model.make_cache()
        if max_kv_size is not None:
            _bound_layers(model, cache, max_kv_size)
        return cache

    num_layers = len(model.layers)
    if max_kv_size is not None:
        return [
            RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(num_layers)
        ]
    else:
        return [KVCache() for _ in range(num_layers)]


PATCH = Patch(
    "max_kv_size",
    "make_prompt_cache: honour max_kv_size for models with make_cache",
    [
        Target("mlx_lm.models.cache", "_bounded_logged", _bounded_logged, None),
        Target(
            "mlx_lm.models.cache",
            "_bound_layers",
            pasted_into("mlx_lm.models.cache", _bound_layers),
            None,
        ),
        Target(
            "mlx_lm.models.cache",
            "make_prompt_cache",
            pasted_into("mlx_lm.models.cache", make_prompt_cache),
            "ae8ee8ce5ac6",
        ),
    ],
    uses={
        "mlx_lm.models.cache": (
            "Any",
            "KVCache",
            "List",
            "Optional",
            "RotatingKVCache",
            "nn",
        )
    },
)
