"""generate_kv_checks: bad kv_bits or kv_group_size fail before the first
token, not when the cache reaches quantized_kv_start."""

import unittest

GENERATE = "tests/test_generate.py"


class TestGenerate(unittest.TestCase):
    def test_generate_step_checks_kv_quantization_first(self):
        prompt = mx.array(self.tokenizer.encode("hello"))
        for kv in ({"kv_bits": 16}, {"kv_bits": 4, "kv_group_size": 48}):
            with self.assertRaisesRegex(ValueError, "must be"):
                next(generate_step(prompt, self.model, max_tokens=1, **kv))


ADD = {GENERATE: [TestGenerate]}
