"""quantized_attention: attention over a quantized cache of any head dim,
in query blocks."""

import unittest

MODELS = "tests/test_models.py"


class TestModels(unittest.TestCase):
    def test_quantized_sdpa_head_dim_no_group_divides(self):
        # QuantizedKVCache pads head dim 80 to 96; attention pads the queries.
        cache = QuantizedKVCache(group_size=64, bits=8)
        k = 1e-1 * mx.random.normal(shape=(1, 2, 16, 80))
        v = 1e-1 * mx.random.normal(shape=(1, 2, 16, 80))
        qk, qv = cache.update_and_fetch(k, v)
        q = 1e-1 * mx.random.normal(shape=(1, 4, 16, 80))

        out = scaled_dot_product_attention(
            q, k, v, cache=None, scale=1.0, mask="causal"
        )
        qout = scaled_dot_product_attention(
            q, qk, qv, cache=cache, scale=1.0, mask="causal"
        )
        self.assertEqual(qout.shape, (1, 4, 16, 80))
        self.assertTrue(mx.allclose(out, qout, rtol=1e-2, atol=1e-2))

    def test_quantized_sdpa_in_query_blocks(self):
        cache = KVCache()
        k = 1e-1 * mx.random.normal(shape=(1, 2, 64, 32))
        v = 1e-1 * mx.random.normal(shape=(1, 2, 64, 32))
        cache.update_and_fetch(k, v)
        qk, qv = cache.to_quantized(group_size=32, bits=8).keys_and_values()
        q = 1e-1 * mx.random.normal(shape=(1, 4, 64, 32))

        whole = quantized_scaled_dot_product_attention(
            q, qk, qv, scale=1.0, mask="causal", group_size=32, bits=8
        )
        # Blocks of 8 queries: 4 heads x 64 keys x 8 rows x 4 bytes of scores.
        blocks = quantized_scaled_dot_product_attention(
            q, qk, qv, 1.0, "causal", group_size=32, bits=8, block_bytes=8192
        )
        self.assertTrue(mx.array_equal(whole, blocks))


ADD = {MODELS: [TestModels]}
EDIT = {
    MODELS: [
        (
            "from mlx_lm.models.base import create_causal_mask, "
            "scaled_dot_product_attention\n",
            "from mlx_lm.models.base import (\n"
            "    create_causal_mask,\n"
            "    quantized_scaled_dot_product_attention,\n"
            "    scaled_dot_product_attention,\n"
            ")\n",
        ),
        (
            "    KVCache,\n    RotatingKVCache,\n    make_prompt_cache,\n",
            "    KVCache,\n    QuantizedKVCache,\n    RotatingKVCache,\n"
            "    make_prompt_cache,\n",
        ),
    ]
}
