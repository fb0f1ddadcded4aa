"""rotating_prealloc: the ring is allocated once; bad trims raise."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_rotating_cache_allocates_the_ring_once(self):
        cache = RotatingKVCache(max_size=300)
        x = mx.random.uniform(shape=(1, 2, 5, 8))
        cache.update_and_fetch(x, x)
        self.assertEqual(cache.keys.shape, (1, 2, 300, 8))

        # Decoding past the ring writes in place: no step reallocates it.
        for _ in range(400):
            x = mx.random.uniform(shape=(1, 2, 1, 8))
            k, v = cache.update_and_fetch(x, x)
            mx.eval(k, v)
            self.assertEqual(cache.keys.shape, (1, 2, 300, 8))
        self.assertEqual(cache.offset, 405)

    def test_rotating_cache_bad_trims_raise(self):
        cache = RotatingKVCache(max_size=8)
        x = mx.random.uniform(shape=(1, 2, 6, 8))
        cache.update_and_fetch(x, x)
        with self.assertRaises(ValueError):
            cache.trim(-1)
        self.assertEqual(cache.trim(2), 2)
        self.assertEqual(cache.offset, 4)

        # Once the ring has wrapped, the trimmed tokens are overwritten.
        x = mx.random.uniform(shape=(1, 2, 12, 8))
        cache.update_and_fetch(x, x)
        self.assertFalse(cache.is_trimmable())
        with self.assertRaises(ValueError):
            cache.trim(1)
        self.assertEqual(cache.offset, 16)


ADD = {PROMPT_CACHE: [TestPromptCache]}
