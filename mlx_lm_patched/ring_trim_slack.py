"""Trims that cannot be exact raise; ``can_trim_prompt_cache(cache, n)``.

Upstream's ``trim_prompt_cache`` returns 0 and changes nothing when a cache
is not trimmable, which a wrapped ``RotatingKVCache`` (a sliding-window
layer, ``--max-kv-size``) never is: speculative decoding then keeps the
rejected draft tokens in the ring and its output drifts from the second to
fourth token on, silently. Prefix reuse of a stored entry fails on the same
wall (ml-explore/mlx-lm#980). The patched ring can step back ``slack``
tokens after a wrap (``RotatingKVCache(..., slack=n)``, see
``rotating_prealloc``); here ``can_trim_prompt_cache(cache, num_tokens)``
asks whether every layer can take ``num_tokens`` off exactly, and
``trim_prompt_cache`` raises a ``ValueError``, changing nothing, where a
layer that trims cannot. Caches that never trim (``ArraysCache`` & co.)
keep upstream's ``return 0``.
"""

from typing import Any, List, Optional

from ._registry import Patch, Target, pasted_into


# Written as they read in mlx_lm/models/cache.py, and run there.
def can_trim_prompt_cache(cache: List[Any], num_tokens: Optional[int] = None) -> bool:
    """
    Check if model's cache can be trimmed (by ``num_tokens`` exactly, if given).
    """
    if num_tokens is None:
        return all(c.is_trimmable() for c in cache)
    return all(
        (
            num_tokens <= c.trimmable_tokens()
            if hasattr(c, "trimmable_tokens")
            else c.is_trimmable()
        )
        for c in cache
    )


def trim_prompt_cache(cache: List[Any], num_tokens: int) -> List[Any]:
    """
    Trim the model's cache by the given number of tokens.

    This function will trim the cache if possible (in-place) and return the
    number of tokens that were trimmed. A cache that trims but cannot take
    ``num_tokens`` off exactly (a wrapped ``RotatingKVCache`` beyond its
    slack) raises a ``ValueError`` and is left unchanged.

    Args:
        cache (List[Any]): The model's cache.
        num_tokens (int): The number of tokens to trim.

    Returns:
        (int): The number of tokens that were trimmed.
    """
    trims = [c.is_trimmable() or hasattr(c, "trimmable_tokens") for c in cache]
    if not all(trims) or len(cache) == 0:
        return 0
    if not can_trim_prompt_cache(cache, num_tokens):
        held = min(
            c.trimmable_tokens() for c in cache if hasattr(c, "trimmable_tokens")
        )
        raise ValueError(
            f"trim_prompt_cache: cannot take {num_tokens} tokens off exactly: a "
            f"rotating cache has wrapped and can put back {held} (its slack)"
        )
    return [c.trim(num_tokens) for c in cache][0]


PATCH = Patch(
    "ring_trim_slack",
    "trim_prompt_cache: a trim a wrapped ring cannot do exactly raises; "
    "can_trim_prompt_cache(cache, num_tokens)",
    [
        Target("mlx_lm.models.cache", name, pasted_into("mlx_lm.models.cache", f), fp)
        for name, f, fp in (
            ("can_trim_prompt_cache", can_trim_prompt_cache, "840a6f74cafc"),
            ("trim_prompt_cache", trim_prompt_cache, "bec42e4c8029"),
        )
    ],
    requires=("mlx_lm.models.cache:RotatingKVCache.trimmable_tokens",),
    uses={"mlx_lm.models.cache": ("Any", "List", "Optional")},
)
