"""Quantized attention in query blocks: bit-identical to upstream, and a
quantized prefill that peaks no higher than the bfloat16 one."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from ringref import active, random_kv, same

import mlx_lm_patched
from mlx_lm_patched import tiny

pytestmark = pytest.mark.usefixtures("patched", "exact_active_memory")


@pytest.mark.parametrize("n_q_heads, mask", [(4, "causal"), (8, "array"), (2, None)])
def test_attention_in_query_blocks_is_bit_identical_to_upstream(n_q_heads, mask):
    rng = np.random.default_rng(n_q_heads)
    queries = mx.array(rng.standard_normal((1, n_q_heads, 37, 64), dtype=np.float32))
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 60, 64))
    if mask == "array":
        mask = mx.array(rng.standard_normal((1, 1, 37, 60), dtype=np.float32))
    upstream = mlx_lm_patched.get_original(
        "mlx_lm.models.base", "quantized_scaled_dot_product_attention"
    )
    want = upstream(queries * 1, keys, values, 0.1, mask, 64, 8)
    got = quantized_scaled_dot_product_attention(
        queries * 1, keys, values, 0.1, mask, 64, 8, block_bytes=3000
    )
    assert same(got, want)


def prefill_peak(model, prompt, kv_bits):
    mx.clear_cache()
    base = active()
    mx.reset_peak_memory()
    steps = generate_step(
        prompt,
        model,
        max_tokens=2,
        kv_bits=kv_bits,
        quantized_kv_start=0,
        prefill_step_size=128,
    )
    for _ in steps:
        pass
    return mx.get_peak_memory() - base


def test_quantized_prefill_peak_is_not_above_bfloat16():
    config = tiny.model_config(
        "llama",
        hidden_size=128,
        num_key_value_heads=4,
        head_dim=64,
        num_attention_heads=4,
    )
    model = tiny.build_model(config, dtype="bfloat16")
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 320))
    bf16 = prefill_peak(model, prompt, None)
    assert prefill_peak(model, prompt, 8) <= bf16
    assert prefill_peak(model, prompt, 4) <= bf16
