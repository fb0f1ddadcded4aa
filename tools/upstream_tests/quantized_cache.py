"""quantized_cache: QuantizedKVCache counts its live tokens and takes any
head dim."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_quantized_cache_size_is_the_live_token_count(self):
        cache = QuantizedKVCache(group_size=32, bits=8)
        self.assertEqual(cache.size(), 0)
        x = mx.random.uniform(shape=(1, 2, 10, 32))
        cache.update_and_fetch(x, x)
        self.assertEqual(cache.size(), 10)
        self.assertEqual(cache.trim(3), 3)
        self.assertEqual(cache.size(), 7)
        with self.assertRaises(ValueError):
            cache.trim(-1)
        self.assertEqual(cache.size(), 7)

    def test_quantized_cache_any_head_dim(self):
        # 96 is quantized in groups of 32, 80 zero-padded to 96.
        for head_dim in (80, 96):
            cache = QuantizedKVCache(group_size=64, bits=8)
            x = mx.random.uniform(shape=(1, 2, 5, head_dim), dtype=mx.bfloat16)
            cache.update_and_fetch(x, x)
            self.assertEqual(cache.size(), 5)
            keys = cache.to_kv_cache().keys
            self.assertEqual(keys.shape, x.shape)
            self.assertEqual(keys.dtype, mx.bfloat16)
            self.assertTrue(mx.allclose(keys, x, atol=1e-2))


ADD = {PROMPT_CACHE: [TestPromptCache]}
