"""quantized_ring: RotatingKVCache.to_quantized, and generation with both
kv_bits and max_kv_size."""

import unittest

PROMPT_CACHE = "tests/test_prompt_cache.py"
GENERATE = "tests/test_generate.py"


class TestPromptCache(unittest.TestCase):
    def test_rotating_cache_to_quantized(self):
        cache = RotatingKVCache(max_size=8, keep=2)
        x = mx.random.uniform(shape=(1, 2, 12, 32))
        cache.update_and_fetch(x, x)
        quant_cache = cache.to_quantized(group_size=32, bits=8)
        self.assertEqual(quant_cache.offset, 12)
        self.assertEqual((quant_cache.max_size, quant_cache.keep), (8, 2))

        # The same ring: its keys differ from the unquantized ones only by
        # quantization error, and a chunk gets the same mask.
        x = mx.random.uniform(shape=(1, 2, 1, 32))
        k, v = cache.update_and_fetch(x, x)
        qk, qv = quant_cache.update_and_fetch(x, x)
        mask, qmask = cache.make_mask(3), quant_cache.make_mask(3)
        self.assertTrue(mx.array_equal(mask, qmask))
        qk = mx.dequantize(*qk, group_size=32, bits=8)
        self.assertEqual(qk.shape, k.shape)
        self.assertTrue(mx.allclose(qk, k, atol=1e-2))


class TestGenerate(unittest.TestCase):
    def test_generate_step_quantizes_a_rotating_cache(self):
        prompt = mx.array(self.tokenizer.encode("Write a long story about a cat"))
        cache = make_prompt_cache(self.model, max_kv_size=16)
        tokens = [
            t
            for t, _ in generate_step(
                prompt,
                self.model,
                max_tokens=8,
                prompt_cache=cache,
                kv_bits=8,
                quantized_kv_start=0,
            )
        ]
        self.assertEqual(len(tokens), 8)
        for c in cache:
            self.assertEqual((c.bits, c.max_size), (8, 16))
            self.assertLessEqual(c.keys[0].shape[2], 16)


ADD = {PROMPT_CACHE: [TestPromptCache], GENERATE: [TestGenerate]}
EDIT = {
    GENERATE: [
        (
            "from mlx_lm.models.cache import KVCache, RotatingKVCache\n",
            "from mlx_lm.models.cache import KVCache, RotatingKVCache, "
            "make_prompt_cache\n",
        )
    ]
}
