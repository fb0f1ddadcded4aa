"""prompt_cache_store: entries hold the live tokens only, quantized at rest
with ``bits`` (but one every request takes, until ``rest``); every eviction
goes through ``_evict``."""

import unittest

SERVER = "tests/test_server.py"


class TestLRUPromptCache(unittest.TestCase):
    def test_entries_hold_the_live_tokens_only(self):
        cache = LRUPromptCache()
        model = ("test", None, None)
        x = mx.random.uniform(shape=(1, 2, 300, 8))
        kv, ring = KVCache(), RotatingKVCache(max_size=512)
        kv.update_and_fetch(x, x)
        ring.update_and_fetch(x, x)
        tokens = list(range(300))
        cache.insert_cache(model, tokens, [kv, ring])
        self.assertEqual(cache.nbytes, 2 * (300 + 300) * 2 * 8 * 4)

        c, t = cache.fetch_nearest_cache(model, tokens + [3])
        self.assertEqual(t, [3])
        self.assertTrue(mx.array_equal(c[0].keys_and_values()[0], x))
        self.assertTrue(mx.array_equal(c[1].state[0], x))

    def test_entries_quantized_at_rest(self):
        plain, at_rest = LRUPromptCache(), LRUPromptCache(bits=8)
        model = ("test", None, None)
        x = mx.random.uniform(shape=(1, 2, 300, 64)).astype(mx.bfloat16)
        kv = KVCache()
        kv.update_and_fetch(x, x)
        tokens = list(range(300))
        for cache in (plain, at_rest):
            cache.insert_cache(model, tokens, [kv])
        self.assertEqual(at_rest.nbytes, plain.nbytes)  # the newest, as computed
        at_rest.trim_to(n_bytes=plain.nbytes - 1)  # at rest, not evicted
        self.assertEqual(len(at_rest), 1)
        self.assertLessEqual(at_rest.nbytes, 0.55 * plain.nbytes)
        # rest (a server idle) does the same, and nothing once all rest
        rested = LRUPromptCache(bits=8)
        rested.insert_cache(model, tokens, [kv])
        self.assertTrue(rested.rest())
        self.assertFalse(rested.rest())
        self.assertEqual(rested.nbytes, at_rest.nbytes)

        c, t = at_rest.fetch_nearest_cache(model, tokens + [3])
        self.assertEqual(t, [3])
        self.assertIsInstance(c[0], KVCache)
        expected = mx.dequantize(*mx.quantize(x, bits=8), bits=8)
        self.assertTrue(mx.array_equal(c[0].keys_and_values()[0], expected))

    def test_an_entry_every_request_takes_stays_as_computed(self):
        cache = LRUPromptCache(bits=8)
        model = ("test", None, None)
        x = mx.random.uniform(shape=(1, 2, 301, 64)).astype(mx.bfloat16)
        system = list(range(300))

        def ring(n):  # wrapped: not trimmable, so not dropped as a prefix
            c = RotatingKVCache(max_size=64)
            c.update_and_fetch(x[:, :, :n], x[:, :, :n])
            return [c]

        cache.insert_cache(model, system, ring(300))
        taken = []
        for i in range(3):
            c, t = cache.fetch_nearest_cache(model, system + [1000 + i])
            self.assertEqual(t, [1000 + i])
            taken.append(c[0].state[0])
            cache.insert_cache(model, system + [1000 + i], ring(301))
        # Not quantized at rest while requests take it
        self.assertTrue(mx.array_equal(taken[0], taken[2]))

    def test_every_eviction_goes_through_evict(self):
        evicted = []

        class Spilling(LRUPromptCache):
            def _evict(self):
                evicted.append(super()._evict())
                return evicted[-1]

        cache = Spilling(max_size=2)
        model = ("test", None, None)
        for i in range(3):
            cache.insert_cache(model, [i], [MockCache("ab")])
        cache.trim_to(n_bytes=2)
        self.assertEqual([t for _, t, _ in evicted], [[0], [1]])
        self.assertEqual(evicted[0][2].nbytes, 2)


ADD = {SERVER: [TestLRUPromptCache]}
EDIT = {
    SERVER: [
        (
            "from mlx_lm.models.cache import KVCache, QuantizedKVCache\n",
            "from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache\n",
        )
    ]
}
