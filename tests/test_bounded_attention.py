"""Array-masked attention in query blocks: same output, bounded scores."""

import mlx.core as mx
import pytest
from ringref import reference_mask

from mlx_lm_patched.bounded_attention import scaled_dot_product_attention


def inputs(B=1, H=8, N=512, L=1536, D=32):
    q, k, v = (mx.random.normal((B, H, n, D)) for n in (N, L, L))
    mask = reference_mask(L - N, N, 600, keep=4)  # a ring's window past the ring
    mx.eval(q, k, v, mask)
    return q, k, v, mask


def test_blocks_give_the_same_output_as_one_call():
    q, k, v, mask = inputs()
    whole = scaled_dot_product_attention(q, k, v, None, 0.2, mask)
    blocked = scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1 << 20)
    assert mx.allclose(whole, blocked, atol=1e-6).item()


@pytest.mark.parametrize("mask", ["causal", None])
def test_calls_without_an_array_mask_are_not_split(mask):
    q, k, v, _ = inputs(N=64, L=64)
    out = scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.array_equal(out, ref).item()


def peak_above_active(**kwargs):
    q, k, v, mask = inputs()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(scaled_dot_product_attention(q, k, v, None, 0.2, mask, **kwargs))
    return mx.get_peak_memory() - before


def test_blocked_call_holds_a_fraction_of_the_scores():
    scores = 4 * 8 * 512 * 1536  # float32, every head, query and key: 24 MiB
    whole = peak_above_active()
    blocked = peak_above_active(max_scores=scores // 8)
    assert whole >= scores
    assert blocked < whole / 2
