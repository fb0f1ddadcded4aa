"""Exact trims of wrapped rings; ``can_trim_prompt_cache(cache, n)``.

Upstream's ``trim_prompt_cache`` returns 0 and changes nothing when a cache
is not trimmable, which a wrapped ``RotatingKVCache`` (a sliding-window
layer, ``--max-kv-size``) never is: speculative decoding then keeps the
rejected draft tokens in the ring and its output drifts from the second to
fourth token on, silently. Prefix reuse of a stored entry fails on the same
wall (ml-explore/mlx-lm#980). The patched ring can step back ``slack``
tokens after a wrap (``RotatingKVCache(..., slack=n)``, see
``rotating_prealloc``); here ``trim_prompt_cache`` trims such a ring when
every layer can take ``num_tokens`` off exactly, and
``can_trim_prompt_cache(cache, num_tokens)`` asks whether it can. Where a
trim cannot be exact, upstream's contract holds: 0, nothing changed. A
count that is not an integer (``2.5`` left a float offset behind, ``nan``
and ``inf`` trimmed everything) raises ``ValueError``.
"""

from typing import Any, List, Optional

from .._registry import Patch, targets


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
    number of tokens that were trimmed. A wrapped ``RotatingKVCache`` trims
    within its slack; where a layer cannot take ``num_tokens`` off exactly,
    nothing is trimmed.

    Args:
        cache (List[Any]): The model's cache.
        num_tokens (int): The number of tokens to trim.

    Returns:
        (int): The number of tokens that were trimmed.
    """
    if not isinstance(num_tokens, int):
        raise ValueError(
            f"trim_prompt_cache: num_tokens must be an integer, got {num_tokens!r}"
        )
    if not can_trim_prompt_cache(cache, num_tokens) or len(cache) == 0:
        return 0
    return [c.trim(num_tokens) for c in cache][0]


PATCH = Patch(
    "ring_trim_slack",
    "trim_prompt_cache: a wrapped ring trims within its slack; "
    "can_trim_prompt_cache(cache, num_tokens)",
    targets("mlx_lm.models.cache", can_trim_prompt_cache, trim_prompt_cache),
    requires=("mlx_lm.models.cache:RotatingKVCache.trimmable_tokens",),
)
