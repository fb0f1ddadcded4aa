"""max_kv_size: make_prompt_cache bounds models that build their own cache."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_make_prompt_cache_bounds_models_with_make_cache(self):
        class Model:
            layers = [None, None, None]

            def make_cache(self):
                return [
                    KVCache(),
                    RotatingKVCache(max_size=64),
                    RotatingKVCache(max_size=1024),
                ]

        full, small, large = make_prompt_cache(Model(), max_kv_size=512)
        self.assertIsInstance(full, RotatingKVCache)
        self.assertEqual((full.max_size, full.keep), (512, 4))
        self.assertEqual(small.max_size, 64)
        self.assertEqual(large.max_size, 512)

        # Without max_kv_size the model's caches are left as they are.
        full, small, large = make_prompt_cache(Model())
        self.assertIs(type(full), KVCache)
        self.assertEqual((small.max_size, large.max_size), (64, 1024))


ADD = {PROMPT_CACHE: [TestPromptCache]}
