"""Quantized KV cache benchmark: upstream vs patched ``QuantizedKVCache``.

Prints one JSON object:

- ``bytes_per_token``: one layer's keys + values per token (``--heads`` KV
  heads of ``--head-dim``) for float16, 8-bit and 4-bit caches holding
  ``--tokens`` tokens after a 256-step prefill and a trim of 100 tokens: what
  the cache holds (``nbytes``, measured against ``mx.get_active_memory``) and
  what the live tokens need;
- ``quantize_s`` / ``dequantize_s``: ``KVCache.to_quantized`` of those tokens
  and back (``QuantizedKVCache.to_kv_cache``, upstream: ``mx.dequantize``);
- ``error``: mean and max absolute round-trip error on N(0, 1), group 64;
- ``prefill_peak_bytes``: peak active memory above the start while
  ``generate_step`` prefills a ``--prompt``-token prompt on a tiny bfloat16
  llama, unquantized and with ``kv_bits`` 8 and 4 (``quantized_kv_start=0``);
- ``upstream_defects``: what upstream does where the patch fixes something.

Upstream runs first (``mlx_lm_patched.revert("quantized_cache")``), then the
patch is applied again, in one process.
"""

import argparse
import gc
import time
from importlib.metadata import version

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit


def active():
    gc.collect()
    return mx.get_active_memory()


def normal(shape, dtype=mx.float16, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return mx.array(x).astype(dtype)


def filled_kv_cache(tokens, heads, head_dim, dtype=mx.float16, chunk=256):
    cache = KVCache()
    for i, start in enumerate(range(0, tokens, chunk)):
        n = min(chunk, tokens - start)
        cache.update_and_fetch(
            normal((1, heads, n, head_dim), dtype, 2 * i),
            normal((1, heads, n, head_dim), dtype, 2 * i + 1),
        )
        mx.eval(cache.keys, cache.values)
    return cache


def live_bytes(tokens, heads, head_dim, bits, dtype=mx.float16):
    if bits is None:
        return 2 * tokens * heads * head_dim * dtype.size
    q = mx.quantize(mx.zeros((1, heads, tokens, head_dim), dtype), 64, bits)
    return 2 * sum(x.nbytes for x in q)


def trimmed_cache(args, bits, patched):
    """``--tokens`` live tokens after a 256-step prefill and a 100-token trim."""
    cache = filled_kv_cache(args.tokens + 100, args.heads, args.head_dim)
    if bits is not None:
        keys, values = cache.keys_and_values()
        cache = QuantizedKVCache(group_size=64, bits=bits)
        for begin in range(0, args.tokens + 100, 256):
            cache.update_and_fetch(
                keys[..., begin : begin + 256, :], values[..., begin : begin + 256, :]
            )
            mx.eval(cache.keys, cache.values)
        del keys, values
    cache.trim(100)
    if patched and bits is not None:
        cache.compact()
    return cache


def bytes_per_token(args, patched):
    out = {}
    for bits in (None, 8, 4):
        start = active()
        cache = trimmed_cache(args, bits, patched)
        held = active() - start
        name = "float16" if bits is None else f"{bits}bit"
        live = live_bytes(args.tokens, args.heads, args.head_dim, bits)
        out[name] = {
            "held_per_token": held / args.tokens,
            "live_per_token": live / args.tokens,
            "nbytes_per_token": _outcome(lambda c=cache: c.nbytes / args.tokens),
        }
        del cache
    return out


def timed(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def conversions(args, patched):
    cache = filled_kv_cache(args.tokens, args.heads, args.head_dim)
    out = {"quantize_s": {}, "dequantize_s": {}}
    for bits in (8, 4):

        def quantize():
            q = cache.to_quantized(group_size=64, bits=bits)
            mx.eval(q.keys, q.values)
            return q

        out["quantize_s"][f"{bits}bit"], q = timed(quantize)

        def dequantize():
            if patched:
                kv = q.to_kv_cache()
                mx.eval(kv.keys, kv.values)
                return kv
            k, v = q.keys_and_values()
            k = mx.dequantize(*k, group_size=64, bits=bits)
            v = mx.dequantize(*v, group_size=64, bits=bits)
            mx.eval(k, v)
            return k, v

        out["dequantize_s"][f"{bits}bit"], _ = timed(dequantize)
    return out


def errors(args):
    x = normal((1, args.heads, args.tokens, args.head_dim), mx.float32, seed=7)
    out = {}
    for bits in (8, 4):
        y = mx.dequantize(*mx.quantize(x, 64, bits), 64, bits)
        d = mx.abs(y - x)
        out[f"{bits}bit"] = {"mean_abs": d.mean().item(), "max_abs": d.max().item()}
    return out


def prefill_peaks(args):
    config = tiny.model_config(
        "llama",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = tiny.build_model(config, dtype="bfloat16")
    prompt = mx.array(
        np.random.default_rng(0).integers(0, tiny.VOCAB_SIZE, args.prompt)
    )
    out = {}
    for bits in (None, 8, 4):
        mx.clear_cache()
        start = active()
        mx.reset_peak_memory()
        for _ in generate_step(
            prompt,
            model,
            max_tokens=2,
            kv_bits=bits,
            quantized_kv_start=0,
            prefill_step_size=args.prefill_step,
        ):
            pass
        out["bfloat16" if bits is None else f"{bits}bit"] = mx.get_peak_memory() - start
    return out


def upstream_defects():
    out = {}
    q = QuantizedKVCache()
    out["nbytes_when_empty"] = _outcome(lambda: q.nbytes)
    q.update_and_fetch(normal((1, 2, 10, 64)), normal((1, 2, 10, 64)))
    out["size_of_10_tokens"] = _outcome(q.size)
    out["trim_negative"] = _outcome(lambda: q.trim(-1))
    out["head_dim_96_group_64"] = _outcome(
        lambda: QuantizedKVCache(64, 8)
        .update_and_fetch(normal((1, 2, 3, 96)), normal((1, 2, 3, 96)))[0][0]
        .shape
    )
    return out


def _outcome(fn):
    try:
        result = fn()
        return list(result) if isinstance(result, tuple) else result
    except Exception as e:  # report, do not stop the benchmark
        return f"{type(e).__name__}: {str(e)[:100]}"


def run(args, patched):
    if patched:
        mlx_lm_patched.apply("quantized_cache")
    else:
        mlx_lm_patched.revert("quantized_cache")
    out = {"bytes_per_token": bytes_per_token(args, patched)}
    out.update(conversions(args, patched))
    out["prefill_peak_bytes"] = prefill_peaks(args)
    out["defects"] = upstream_defects()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mlx_lm_patched.bench quantized")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--prefill-step", type=int, default=256)
    args = parser.parse_args(argv)

    limit = mx.set_cache_limit(0)  # active memory counts exactly what is held
    was_applied = mlx_lm_patched._apply.is_applied("quantized_cache")
    try:
        result = {
            "mlx": version("mlx"),
            "mlx_lm": version("mlx-lm"),
            "device": str(mx.default_device()),
            "args": vars(args),
            "error": errors(args),
            "upstream": run(args, patched=False),
            "patched": run(args, patched=True),
        }
    finally:
        mx.set_cache_limit(limit)
        if not was_applied:
            mlx_lm_patched.revert("quantized_cache")
    emit(result, indent=2)
    return result


if __name__ == "__main__":
    main()
