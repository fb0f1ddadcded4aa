"""kvcache_pipeline: a long chunk's update is scheduled a layer at a time."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_kv_cache_pipelines_long_chunks(self):
        for make in (KVCache, lambda: BatchKVCache(left_padding=[0])):
            scheduled, schedule = [], mx.async_eval
            mx.async_eval = lambda *a: scheduled.append(len(a)) or schedule(*a)
            try:
                caches = [make() for _ in range(3)]
                for n in (1024, 1023, 1):  # a long chunk, a short one, a decode step
                    x = mx.random.uniform(shape=(1, 2, n, 8))
                    for c in caches:
                        c.update_and_fetch(x, x)
            finally:
                mx.async_eval = schedule
            # Each layer's keys, values and a one-element marker, once a layer.
            self.assertEqual(scheduled, [3, 3, 3])


ADD = {PROMPT_CACHE: [TestPromptCache]}
