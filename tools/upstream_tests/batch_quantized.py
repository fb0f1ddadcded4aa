"""batch_quantized: quantized caches merge into a batch and come back out."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"


class TestPromptCache(unittest.TestCase):
    def test_batch_kv_cache_merges_quantized_caches(self):
        caches = []
        for n in (3, 7):
            c = QuantizedKVCache(group_size=32, bits=8)
            x = mx.random.uniform(shape=(1, 2, n, 32))
            c.update_and_fetch(x, x)
            caches.append(c)
        batch = BatchKVCache.merge(caches)
        self.assertIsInstance(batch, BatchQuantizedKVCache)
        self.assertEqual((batch.group_size, batch.bits), (32, 8))

        x = mx.random.uniform(shape=(2, 2, 1, 32))
        batch.update_and_fetch(x, x)
        for i, c in enumerate(caches):
            c.update_and_fetch(x[i : i + 1], x[i : i + 1])
            row = batch.extract(i)
            self.assertIsInstance(row, QuantizedKVCache)
            self.assertEqual(row.offset, c.offset)
            for a, b in zip(row.to_kv_cache().state, c.to_kv_cache().state):
                self.assertTrue(mx.array_equal(a, b))

    def test_batch_kv_cache_merges_quantized_and_unquantized(self):
        cache = KVCache()
        x = mx.random.uniform(shape=(1, 2, 5, 32))
        cache.update_and_fetch(x, x)
        quant_cache = QuantizedKVCache(group_size=32, bits=4)
        x = mx.random.uniform(shape=(1, 2, 3, 32))
        quant_cache.update_and_fetch(x, x)

        for caches in ([cache, quant_cache], [quant_cache, cache]):
            batch = BatchKVCache.merge(caches)
            self.assertIsInstance(batch, BatchQuantizedKVCache)
            self.assertEqual((batch.group_size, batch.bits), (32, 4))
            offsets = [batch.extract(i).offset for i in range(2)]
            self.assertEqual(offsets, [c.offset for c in caches])


ADD = {PROMPT_CACHE: [TestPromptCache]}
EDIT = {
    PROMPT_CACHE: [
        (
            "    BatchKVCache,\n    BatchRotatingKVCache,\n",
            "    BatchKVCache,\n    BatchQuantizedKVCache,\n    BatchRotatingKVCache,\n",
        )
    ]
}
