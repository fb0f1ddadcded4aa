"""One attention call past a ring, each road through it: time and peak.

A prefill chunk of ``--queries`` queries over ``--keys`` keys (a 4096-slot
ring's window, ``--heads`` query heads over ``--kv-heads``) with the
boolean mask a ring gives, per head dim in ``--head-dims``:

- ``causal``: ``mask="causal"``, the fused kernel's best case (another mask);
- ``upstream``: upstream's ``scaled_dot_product_attention`` with the boolean
  mask (MLX CUDA converts it to full-size per-head arrays);
- ``patched``: the patched function (``attention_path`` says which road);
- ``blocks_eval``: the previous patched road, 256-query blocks with an
  ``mx.eval`` after each;
- ``blocks_chained``: the patched road where scores are materialised
  (``mx.depends``-chained blocks of an eighth of ``--max-scores``, no eval),
  forced whatever the backend;
- ``quantized_upstream`` / ``quantized_patched``: keys and values quantized
  to ``--kv-bits``, through each ``quantized_scaled_dot_product_attention``.

Times are the median of ``--reps`` calls after a warm-up; peaks are bytes
above what was allocated before the call; ``same_as_upstream`` compares
outputs bit for bit, ``max_abs_diff`` against upstream.

    python -m mlx_lm_patched.bench.attention [--small] [--out attention.json]
"""

import argparse
import functools
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import base
from tqdm import tqdm

import mlx_lm_patched
from mlx_lm_patched.kernels import bounded_attention, quantized_attention

from . import emit, header, parse_args


def inputs(args, D, dtype):
    B, H, KH, N, L = 1, args.heads, args.kv_heads, args.queries, args.keys
    q = mx.random.normal((B, H, N, D)).astype(dtype)
    k, v = (mx.random.normal((B, KH, L, D)).astype(dtype) for _ in range(2))
    qi, ki = mx.arange(L - N, L)[:, None], mx.arange(L)[None]
    mask = (ki <= qi) & ((ki < 4) | (ki > qi - (args.window - 4)))
    mx.eval(q, k, v, mask)
    return q, k, v, mask


def blocks(q, k, v, mask, scale, rows, evaluate):
    out = []
    for s in range(0, q.shape[2], rows):
        qb = q[..., s : s + rows, :]
        if out and not evaluate:
            qb = mx.depends(qb, out[-1])
        out.append(
            mx.fast.scaled_dot_product_attention(
                qb, k, v, scale=scale, mask=mask[..., s : s + rows, :]
            )
        )
        if evaluate:
            mx.eval(out[-1])
    return mx.concatenate(out, axis=2)


def measure(fn, reps):
    try:
        out = fn()
        mx.eval(out)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}, None
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    peak = mx.get_peak_memory() - before
    return {"ms": 1e3 * float(np.median(times)), "peak_mib": peak / 2**20}, out


def one_shape(args, D, dtype):
    from mlx_lm.models.bounded_attention import attention_path  # once patched

    q, k, v, mask = inputs(args, D, dtype)
    scale = D**-0.5
    upstream = mlx_lm_patched.get_original(
        "mlx_lm.models.base", "scaled_dot_product_attention"
    )
    patched = bounded_attention.scaled_dot_product_attention
    per_query = 4 * q.shape[0] * q.shape[1] * k.shape[2]
    chained_rows = max(1, args.max_scores // (8 * per_query))
    roads = {
        "causal": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal"
        ),
        "upstream": lambda: upstream(q, k, v, None, scale, mask),
        "patched": lambda: patched(q, k, v, None, scale, mask, None, args.max_scores),
        "blocks_eval": lambda: blocks(q, k, v, mask, scale, 256, True),
        "blocks_chained": lambda: blocks(q, k, v, mask, scale, chained_rows, False),
    }
    for bits in args.kv_bits:
        qk, qv = (mx.quantize(x, 64, bits) for x in (k, v))
        mx.eval(qk, qv)
        qup = mlx_lm_patched.get_original(
            "mlx_lm.models.base", "quantized_scaled_dot_product_attention"
        )
        qpa = quantized_attention.quantized_scaled_dot_product_attention
        for side, f in (("upstream", qup), ("patched", qpa)):
            roads[f"quantized{bits}_{side}"] = functools.partial(
                lambda f, qk, qv, bits: f(q * 1, qk, qv, scale, mask, 64, bits),
                f,
                qk,
                qv,
                bits,
            )
    result = {"path": attention_path(q, k, v, mask)}
    outs = {}
    for name, fn in tqdm(roads.items(), f"head dim {D}", unit="road", leave=False):
        result[name], outs[name] = measure(fn, args.reps)
    ref = outs["upstream"]
    for name, out in outs.items():
        if out is None or ref is None or name == "causal":
            continue
        result[name]["same_as_upstream"] = bool(mx.array_equal(out, ref).item())
        diff = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max()
        result[name]["max_abs_diff"] = float(diff.item())
    return result


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.attention",
        description="One attention call past a ring: each road's time and peak.",
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--small", action="store_true", help="CPU sizes")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--queries", type=int, default=2048)
    p.add_argument("--keys", type=int, default=6143)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--head-dims", type=ints, default=[128, 256])
    p.add_argument("--kv-bits", type=ints, default=[4, 8])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--max-scores", type=int, default=1 << 28, help="the patched scores budget"
    )
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    if args.small:  # CPU: float32 (its bfloat16 matmuls are slow), 32 MiB budget
        args.heads, args.kv_heads, args.queries, args.keys = 8, 2, 1024, 3071
        args.window, args.head_dims, args.kv_bits = 2048, [128], [8]
        args.dtype, args.reps, args.max_scores = "float32", 2, 1 << 25
    mlx_lm_patched.apply()
    result = {
        **header("attention", [p.name for p in mlx_lm_patched.PATCHES]),
        "config": vars(args),
        "backend": base.sdpa_backend(),
    }
    for D in args.head_dims:
        result[f"head_dim_{D}"] = one_shape(args, D, getattr(mx, args.dtype))
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
