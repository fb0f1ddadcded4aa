"""Soak: many decode steps on patched caches; memory must stay flat.

Cache-only, no model: ``--layers`` caches of ``--heads`` KV heads x
``--head-dim``, fed random keys and values (a pool of ``--pool`` steps made
up front, reused in turn); each step evaluates what the caches return and
their state, as ``mlx_lm.generate`` does (``--attend`` also attends one
random query per layer). Scenarios:

  rotating   ``RotatingKVCache(--max-size, --keep)``: prefill ``--prefill``
             tokens, then ``--steps`` single-token steps (the ring wraps)
  quantized  ``QuantizedKVCache(--group-size, --bits)`` reserved for
             ``--prefill + --steps`` tokens, prefill, then ``--steps`` steps
  quantized_ring  the rotating ring's prefill quantized with
             ``to_quantized(--group-size, --bits)`` (as ``generate --kv-bits``
             does), then ``--steps`` steps; skipped where upstream's
             ``RotatingKVCache.to_quantized`` raises

Active memory is read after the first decode step (``first``, every buffer
allocated), every ``--sample`` steps and after the last (``last``); ``peak``
is MLX's peak since the first step. A reallocation is a step after which a
layer's keys have another shape or buffer address. ``flat`` holds when no
sample exceeds ``first`` and nothing was reallocated.
"""

import argparse
import time

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

import mlx_lm_patched

from . import emit, header
from .memory import pointer


def make_caches(args, scenario):
    if scenario in ("rotating", "quantized_ring"):
        return [RotatingKVCache(args.max_size, args.keep) for _ in range(args.layers)]
    caches = [QuantizedKVCache(args.group_size, args.bits) for _ in range(args.layers)]
    for c in caches:
        c.reserve(args.prefill + args.steps)
    return caches


def random_steps(args, n, S):
    shape = (2 * args.layers, 1, args.heads, S, args.head_dim)
    kv = mx.random.normal(shape).astype(args.dtype)
    q = mx.random.normal((n, 1, args.heads, 1, args.head_dim)).astype(args.dtype)
    steps = [
        [(kv[2 * l] * (i + 1), kv[2 * l + 1] * (i + 1)) for l in range(args.layers)]
        for i in range(n)
    ]
    mx.eval(steps, q)
    return steps, q


def step(caches, kv, q, attend):
    """One update per layer, evaluated with the state as ``generate_step``
    does; with ``attend``, attended by one query (slow on the CPU)."""
    outs = []
    for c, (k, v) in zip(caches, kv):
        keys, values = c.update_and_fetch(k, v)
        if attend:
            keys = scaled_dot_product_attention(q, keys, values, c, 1.0, mask=None)
        outs.append(keys if attend else (keys, values))
    mx.eval(outs, [c.state for c in caches])


def buffers(caches):
    keys = [c.keys if isinstance(c.keys, mx.array) else c.keys[0] for c in caches]
    return [(tuple(k.shape), pointer(k)) for k in keys]


def run(args, scenario):
    caches = make_caches(args, scenario)
    (prefill,), _ = random_steps(args, 1, args.prefill)
    pool, queries = random_steps(args, args.pool, 1)
    step(caches, prefill, queries[0], args.attend)
    del prefill
    if scenario == "quantized_ring":
        try:
            caches = [c.to_quantized(args.group_size, args.bits) for c in caches]
        except NotImplementedError as e:  # no quantized ring patch applied
            return {"scenario": scenario, "skipped": str(e)}
    step(caches, pool[0], queries[0], args.attend)
    mx.clear_cache()
    mx.reset_peak_memory()
    first = mx.get_active_memory()
    seen, reallocations, samples, cache_max = buffers(caches), 0, [], 0
    tic = time.perf_counter()
    for i in range(1, args.steps):
        step(caches, pool[i % args.pool], queries[i % args.pool], args.attend)
        now = buffers(caches)
        reallocations += sum(a != b for a, b in zip(now, seen))
        seen = now
        if i % args.sample == 0 or i == args.steps - 1:
            samples.append(mx.get_active_memory())
            cache_max = max(cache_max, mx.get_cache_memory())
    seconds = time.perf_counter() - tic
    last = mx.get_active_memory()
    return {
        "scenario": scenario,
        "decode_steps": args.steps,
        "offset": caches[0].offset,
        "cache_nbytes": sum(c.nbytes for c in caches),
        "first_active": first,
        "last_active": last,
        "max_sampled_active": max(samples),
        "min_sampled_active": min(samples),
        "peak_active": mx.get_peak_memory(),
        "allocator_cache_last": mx.get_cache_memory(),
        "allocator_cache_max": cache_max,
        "reallocations": reallocations,
        "flat": max(samples) <= first and reallocations == 0,
        "seconds": round(seconds, 1),
        "steps_per_second": round((args.steps - 1) / seconds, 1),
    }


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench soak",
        description="Decode for many steps on patched caches; memory must stay flat.",
    )
    p.add_argument(
        "--scenarios", nargs="+", default=["rotating", "quantized", "quantized_ring"]
    )
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--prefill", type=int, default=1000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-size", type=int, default=1024)
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--attend",
        action="store_true",
        help="attend each step with one query (MLX's CPU attention: ~10 ms a layer)",
    )
    p.add_argument("--pool", type=int, default=16)
    p.add_argument("--sample", type=int, default=1000)
    p.add_argument("--out", help="also write the JSON here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.dtype = getattr(mx, args.dtype)
    applied = [n for n, s in mlx_lm_patched.status().items() if s["applied"]]
    result = {
        **header("soak", applied),
        "geometry": {
            k: getattr(args, k)
            for k in ("layers", "heads", "head_dim", "max_size", "keep", "prefill")
        },
        "quantization": {"group_size": args.group_size, "bits": args.bits},
        "dtype": str(args.dtype),
        "scenarios": {s: run(args, s) for s in args.scenarios},
    }
    ran = [r for r in result["scenarios"].values() if "skipped" not in r]
    result["all_flat"] = all(r["flat"] for r in ran)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
