"""prompt_cache_store: LRUPromptCache evicts through one method."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache


def filled_kv_cache(n_tokens, n_layers=2):
    cache = [KVCache() for _ in range(n_layers)]
    for c in cache:
        c.update_and_fetch(mx.ones((1, 2, n_tokens, 8)), mx.ones((1, 2, n_tokens, 8)))
    return cache


def test_every_eviction_goes_through_evict(patched):
    evicted = []

    class Spilling(LRUPromptCache):
        def _evict(self):
            evicted.append(super()._evict())
            return evicted[-1]

    lru = Spilling(max_size=2)
    for i in range(4):
        lru.insert_cache("m", [i, i + 10], filled_kv_cache(3))
    assert [tokens for _, tokens, _ in evicted] == [[0, 10], [1, 11]]
    per_entry = evicted[0][2].nbytes
    lru.trim_to(n_bytes=per_entry)
    assert [tokens for _, tokens, _ in evicted][2:] == [[2, 12]]
    assert len(lru) == 1 and lru.nbytes == per_entry
    assert lru.stats_by_type()["assistant"]["n_bytes"] == per_entry
