"""batch_generator_kv_bits: BatchGenerator quantizes its caches like
generate_step."""

import unittest

GENERATE = "tests/test_generate.py"


class TestGenerate(unittest.TestCase):
    def test_batch_generator_quantizes_the_cache(self):
        gen = BatchGenerator(
            self.model, max_tokens=1, kv_bits=8, kv_group_size=64, quantized_kv_start=0
        )
        prompt = self.tokenizer.encode("Write a long story about a cat")
        gen.insert([prompt])

        for r in gen.next_generated():
            if r.finish_reason is not None:
                for cache in r.prompt_cache:
                    self.assertIsInstance(cache, QuantizedKVCache)
                    self.assertEqual((cache.bits, cache.group_size), (8, 64))

    def test_batch_of_one_with_kv_bits_matches_generate_step(self):
        prompt = self.tokenizer.encode("Write a long story about a cat")
        kv = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 4}
        expected = [
            t
            for t, _ in generate_step(mx.array(prompt), self.model, max_tokens=8, **kv)
        ]

        gen = BatchGenerator(self.model, max_tokens=8, **kv)
        gen.insert([prompt])
        tokens = []
        while responses := gen.next_generated():
            tokens += [r.token for r in responses]
        self.assertEqual(tokens, expected)


ADD = {GENERATE: [TestGenerate]}
EDIT = {
    GENERATE: [
        (
            "from mlx_lm.models.cache import KVCache, RotatingKVCache, "
            "make_prompt_cache\n",
            "from mlx_lm.models.cache import (\n"
            "    KVCache,\n"
            "    QuantizedKVCache,\n"
            "    RotatingKVCache,\n"
            "    make_prompt_cache,\n"
            ")\n",
        )
    ]
}
