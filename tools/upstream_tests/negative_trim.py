"""negative_trim: a negative trim raises and changes nothing."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_negative_trim_raises(self):
        caches = [KVCache(), ChunkedKVCache(256), BatchKVCache(left_padding=[0])]
        for cache in caches:
            x = mx.random.uniform(shape=(1, 2, 10, 8))
            cache.update_and_fetch(x, x)
            offset = mx.array(cache.offset)
            with self.assertRaises(ValueError):
                cache.trim(-1)
            with self.assertRaises(ValueError):
                trim_prompt_cache([cache], -1)
            self.assertTrue(mx.array_equal(mx.array(cache.offset), offset))
            self.assertEqual(cache.trim(3), 3)


ADD = {PROMPT_CACHE: [TestPromptCache]}
