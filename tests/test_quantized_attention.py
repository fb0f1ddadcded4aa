"""Quantized attention in query blocks: bit-identical to upstream, and a
quantized prefill that peaks no higher than the bfloat16 one."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from ringref import (
    active,
    fake_backend,
    pipeline_calls,
    random_kv,
    same,
    single_stream,
)

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

pytestmark = pytest.mark.usefixtures("patched", "exact_active_memory", "cpu_device")


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


# Backends: CUDA's quantized_matmul has no kernel for a cache's sliced buffers.


def no_quantized_matmul(monkeypatch):
    """``mx.quantized_matmul`` failing as MLX CUDA's does on a cache slice."""

    def fail(x, w, *args, **kwargs):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(mx, "quantized_matmul", fail)


@pytest.mark.parametrize("n_q_heads, mask", [(4, "causal"), (8, "array"), (2, None)])
@pytest.mark.parametrize("D", [64, 80])
def test_cuda_attends_over_dequantized_keys_without_quantized_matmul(
    monkeypatch, n_q_heads, mask, D
):
    """Within float32 rounding of upstream (CPU), which multiplies the
    quantized keys directly; 80 is zero-padded to 128 by the cache."""
    rng = np.random.default_rng(n_q_heads)
    queries = mx.array(rng.standard_normal((1, n_q_heads, 37, D), dtype=np.float32))
    k, v = random_kv(1, 2, 60, D)
    width = 128 if D == 80 else D
    pad = [(0, 0)] * 3 + [(0, width - D)]
    keys, values = (mx.quantize(mx.pad(x, pad), 64, 8) for x in (k, v))
    if mask == "array":
        mask = mx.array(rng.standard_normal((1, 1, 37, 60), dtype=np.float32)) > 0
    upstream = mlx_lm_patched.get_original(
        "mlx_lm.models.base", "quantized_scaled_dot_product_attention"
    )
    want = upstream(mx.pad(queries, pad) * 1, keys, values, 0.1, mask, 64, 8)[..., :D]
    fake_backend(monkeypatch, "cuda")
    no_quantized_matmul(monkeypatch)
    got = quantized_scaled_dot_product_attention(
        queries * 1, keys, values, 0.1, mask, 64, 8
    )
    assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5).item()


def test_cuda_schedules_each_attention_and_waits_for_the_previous_one(monkeypatch):
    """Prefill chunk or decode step, a call's output is scheduled with a
    one-element marker; each call then waits for the previous call's marker,
    never for its own output."""
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 96, 64))
    fake_backend(monkeypatch, "cuda")
    calls = pipeline_calls(monkeypatch)
    for L in (1, 2, 1):
        queries = mx.ones((1, 8, L, 64))
        quantized_scaled_dot_product_attention(queries, keys, values, 0.1, None)
    out, marker = (1, 8, 1, 64), (1, 1, 1, 1)
    assert calls == [
        ("async_eval", [out, marker]),
        ("async_eval", [(1, 8, 2, 64), marker]),
        ("eval", [marker]),
        ("async_eval", [out, marker]),
        ("eval", [marker]),
    ]


@pytest.mark.parametrize("kv_bits", [4, 8])
def test_kv_bits_generates_upstream_s_tokens_without_quantized_matmul(
    monkeypatch, kv_bits
):
    """CUDA's road (dequantized keys, fused attention) on a tiny float32 llama,
    prefilled in chunks: the same greedy tokens as upstream's road on CPU."""
    model = tiny.build_model(tiny.model_config("llama", head_dim=64))
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 200))

    kw = dict(kv_bits=kv_bits, quantized_kv_start=0, prefill_step_size=64)
    want = single_stream(model, prompt, 30, **kw)[0]
    fake_backend(monkeypatch, "cuda")
    no_quantized_matmul(monkeypatch)
    assert single_stream(model, prompt, 30, **kw)[0] == want


def test_blocked_quantized_attention_compiles_and_has_no_sync(monkeypatch):
    """``mx.eval`` would raise inside ``mx.compile``; none is called either."""
    rng = np.random.default_rng(0)
    queries = mx.array(rng.standard_normal((1, 8, 64, 64), dtype=np.float32))
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 96, 64))
    mask = mx.array(rng.standard_normal((1, 1, 64, 96), dtype=np.float32)) > 0

    def f(queries, keys, values, mask):
        return quantized_scaled_dot_product_attention(
            queries * 1, keys, values, 0.1, mask, 64, 8, block_bytes=1 << 14
        )

    evals, evaluate = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(a) or evaluate(*a))
    lazy = f(queries, keys, values, mask)
    assert not evals
    assert same(mx.compile(f)(queries, keys, values, mask), lazy)


def test_blocked_quantized_attention_holds_about_its_budget():
    rng = np.random.default_rng(0)
    queries = mx.array(rng.standard_normal((1, 8, 512, 64), dtype=np.float32))
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 1536, 64))
    mx.eval(queries, keys, values)
    scores = 4 * 8 * 512 * 1536

    def peak(block_bytes):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(
            quantized_scaled_dot_product_attention(
                queries * 1, keys, values, 0.1, "causal", 64, 8, block_bytes
            )
        )
        return mx.get_peak_memory() - before

    whole, blocked = peak(scores), peak(scores // 4)
    assert whole >= scores
    assert blocked <= whole / 2


@pytest.mark.parametrize("name, evals", [("cpu", 0), ("metal", 4), ("cuda", 0)])
def test_each_backend_s_road_and_its_evals(monkeypatch, name, evals):
    """CPU: chained blocks, no eval; Metal: blocks of a power of two queries,
    each evaluated; CUDA: dequantized keys through fused attention, the
    output evaluated (one layer's dequantized keys in flight).
    CPU and Metal give upstream's output bit for bit."""
    rng = np.random.default_rng(0)
    queries = mx.array(rng.standard_normal((1, 8, 64, 64), dtype=np.float32))
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 96, 64))
    mask = mx.array(rng.standard_normal((1, 1, 64, 96), dtype=np.float32)) > 0
    upstream = mlx_lm_patched.get_original(
        "mlx_lm.models.base", "quantized_scaled_dot_product_attention"
    )
    want = upstream(queries * 1, keys, values, 0.1, mask, 64, 8)
    fake_backend(monkeypatch, name)
    calls, evaluate = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: calls.append(a) or evaluate(*a))
    budget = 4 * 8 * 96 * 24  # 24 queries' scores: blocks of 16 on Metal
    got = quantized_scaled_dot_product_attention(
        queries * 1, keys, values, 0.1, mask, 64, 8, block_bytes=budget
    )
    assert len(calls) == evals
    if name == "cuda":
        assert mx.allclose(got, want, atol=1e-5).item()
    else:
        assert same(got, want)


def test_query_heads_sharing_a_kv_head_do_not_copy_its_keys():
    """A decode step over a long 8-bit cache, 4 query heads a KV head: the
    call holds less than one copy of the layer's quantized keys and values
    (upstream broadcasts them over the query heads: 4 copies)."""
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 4096, 64))
    queries = mx.ones((1, 8, 1, 64))
    mx.eval(keys, values, queries)
    cache_bytes = sum(x.nbytes for x in (*keys, *values))

    def peak(attention):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(attention(queries * 1, keys, values, 0.1, None, 64, 8))
        return mx.get_peak_memory() - before

    upstream = mlx_lm_patched.get_original(
        "mlx_lm.models.base", "quantized_scaled_dot_product_attention"
    )
    assert peak(upstream) > 3 * cache_bytes
    assert peak(quantized_scaled_dot_product_attention) < cache_bytes


@pytest.mark.parametrize("name, rows", [("cpu", 4), ("metal", 1)])
def test_a_decode_step_s_query_heads_are_rows_on_cpu_only(monkeypatch, name, rows):
    """CPU multiplies the 4 query heads of a KV head as 4 rows of one matrix
    (no broadcast keys to copy); Metal keeps upstream's one-row products over
    broadcast keys, whose kernel (``qvm``) it picks by the rows."""
    keys, values = (mx.quantize(x, 64, 8) for x in random_kv(1, 2, 96, 64))
    fake_backend(monkeypatch, name)
    shapes, multiply = [], mx.quantized_matmul
    monkeypatch.setattr(
        mx,
        "quantized_matmul",
        lambda x, *a, **k: shapes.append(x.shape) or multiply(x, *a, **k),
    )
    quantized_scaled_dot_product_attention(
        mx.ones((1, 8, 1, 64)), keys, values, 0.1, None
    )
    assert [s[-2] for s in shapes] == [rows, rows]
