"""trim_prompt_cache: a wrapped ring trims exactly within its slack; beyond
it, upstream's contract (0, nothing changed)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)
from ringref import random_kv, same


def layers(slack, tokens=20):
    """A KVCache layer and a ring of 8 with ``slack``, fed ``tokens``."""
    cache = [KVCache(), RotatingKVCache(8, keep=2, slack=slack)]
    for c in cache:
        c.update_and_fetch(*random_kv(1, 1, tokens, 4))
    return cache


def test_can_trim_by_n_asks_every_layer_for_exact_trims():
    cache = layers(slack=3)
    assert not can_trim_prompt_cache(cache)  # upstream's question: any amount
    assert can_trim_prompt_cache(cache, 3) and not can_trim_prompt_cache(cache, 4)
    assert can_trim_prompt_cache(layers(slack=0, tokens=6), 6)


def test_a_trim_within_the_slack_takes_the_tokens_off_every_layer():
    cache = layers(slack=3)
    assert trim_prompt_cache(cache, 3) == 3
    assert [c.offset for c in cache] == [17, 17]


def test_a_trim_beyond_the_slack_returns_zero_and_changes_no_layer():
    cache = layers(slack=3)
    before = [(c.offset, mx.array(c.keys)) for c in cache]
    assert trim_prompt_cache(cache, 4) == 0
    assert all(c.offset == o and same(c.keys, k) for c, (o, k) in zip(cache, before))


def test_caches_that_never_trim_still_return_zero():
    cache = [ArraysCache(1), KVCache()]
    cache[1].update_and_fetch(*random_kv(1, 1, 5, 4))
    assert trim_prompt_cache(cache, 2) == 0 and cache[1].offset == 5


def test_upstream_returns_zero_for_a_wrapped_ring_and_keeps_its_tokens(upstream):
    from mlx_lm.models import cache as upstream_cache  # looked up reverted

    ring = upstream_cache.RotatingKVCache(8, keep=2)
    for _ in range(12):
        ring.update_and_fetch(*random_kv(1, 1, 1, 4))
    assert upstream_cache.trim_prompt_cache([ring], 2) == 0 and ring.offset == 12


def turns(model, slack):
    """A stored turn (prompt and answer), then the next turn's prompt: the
    answer's last 3 tokens re-rendered differently, a new user message.
    Returns how many tokens the prompt cache left to prefill, of how many,
    and whether greedy tokens from its cache equal a fresh prefill's."""
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
    from ringref import single_stream

    first = list(range(3, 83)) + list(range(200, 230))  # 110 > window 64
    second = first[:-3] + [7, 8, 9] + list(range(300, 320))
    cache = make_prompt_cache(model)
    for c in cache:
        if isinstance(c, RotatingKVCache):
            c.slack = slack
    model(mx.array(first)[None], cache=cache)
    store = LRUPromptCache()
    store.insert_cache("m", first, cache)
    fetched, rest = store.fetch_nearest_cache("m", second)
    fetched = fetched or make_prompt_cache(model)
    want, _ = single_stream(model, second, 8)
    got, _ = single_stream(model, rest, 8, cache=fetched)
    return len(rest), len(second), got == want


def test_a_wrapped_entry_with_slack_is_trimmed_back_to_the_common_prefix(
    load_tiny, patched
):
    model, _ = load_tiny("gemma3_text")
    left, total, same_tokens = turns(model, slack=8)
    assert left == 3 + 20 and same_tokens  # the re-rendered tail and new turn
    left, total, same_tokens = turns(model, slack=0)
    assert left == total and same_tokens  # no slack: all of it, as upstream
