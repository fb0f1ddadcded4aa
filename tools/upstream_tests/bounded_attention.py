"""bounded_attention: array-masked attention in query blocks, the scores
held at once bounded; the unfused road MLX's own composition."""

import unittest

MODELS = "tests/test_models.py"


class TestModels(unittest.TestCase):
    def test_sdpa_array_mask_bounds_the_scores(self):
        q = mx.random.normal(shape=(1, 4, 512, 32))
        k = mx.random.normal(shape=(1, 4, 1024, 32))
        v = mx.random.normal(shape=(1, 4, 1024, 32))
        mask = mx.random.uniform(shape=(1, 1, 512, 1024)) > 0.5
        mask[..., -1] = True
        mx.eval(q, k, v, mask)
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
        mx.eval(expected)

        # All the scores take 8 MiB; at most 1 MiB of them at once.
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        out = scaled_dot_product_attention(
            q, k, v, cache=None, scale=1.0, mask=mask, max_scores=1 << 20
        )
        mx.eval(out)
        self.assertLess(mx.get_peak_memory() - active, 4 << 20)
        self.assertTrue(mx.array_equal(out, expected))

    def test_sdpa_unfused_is_mlx_fallback(self):
        from mlx_lm.models.bounded_attention import unfused

        q = mx.random.normal(shape=(2, 8, 37, 64)).astype(mx.bfloat16)
        k = mx.random.normal(shape=(2, 2, 300, 64)).astype(mx.bfloat16)
        v = mx.random.normal(shape=(2, 2, 300, 64)).astype(mx.bfloat16)
        mask = mx.random.uniform(shape=(2, 1, 37, 300)) > 0.3
        mask[..., 0] = True
        with mx.stream(mx.cpu):
            expected = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=0.125, mask=mask
            )
            out = unfused(q, k, v, 0.125, mask)
            self.assertTrue(mx.array_equal(out, expected))


ADD = {MODELS: [TestModels]}
