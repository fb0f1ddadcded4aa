"""``qdecode``'s old road and cache builder, and its GPU timings of a
decode step's attention (the ``attention`` and ``steps`` parts): the kernel at several settings, the old road, and
fused attention over a bfloat16 cache, each layer taking the last one's
output as in a model."""

import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

from mlx_lm_patched.kernels import quantized_decode_kernel as qa

from .e2e import _fresh


def old_road(queries, q_keys, q_values, scale, mask, group_size, bits):
    D = queries.shape[-1]
    keys, values = (
        mx.dequantize(*x, group_size=group_size, bits=bits, dtype=queries.dtype)
        for x in (q_keys, q_values)
    )
    keys, values = keys[..., :D], values[..., :D]
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask = mx.where(mask, 0, mx.finfo(queries.dtype).min).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask
    )


def _rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()


def _cache(rng, B, n_kv, kL, D, gs, bits, dtype=mx.bfloat16):
    width = (D + 31) // 32 * 32 if D % gs else D
    kv = []
    for _ in range(2):
        key = mx.random.key(int(rng.integers(0, 1 << 30)))
        x = mx.random.normal((B, n_kv, kL, width), key=key)
        if width > D:
            x[..., D:] = 0
        # A preallocated buffer's slice, as a cache hands it out.
        buf = mx.quantize(
            mx.pad(x, [(0, 0), (0, 0), (0, 256), (0, 0)]).astype(dtype), gs, bits
        )
        kv.append(tuple(a[..., :kL, :] for a in buf))
    return kv


def _time(fn, iters=40):
    mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(iters):
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return float(np.median(times))


def _host_and_eval(fn, iters=20):
    """Median ms to build ``fn``'s graph (the host alone), then to evaluate
    the built graph."""
    host, run = [], []
    mx.eval(fn())
    for _ in range(iters):
        mx.synchronize()
        tic = time.perf_counter()
        outs = fn()
        toc = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        host.append(toc - tic)
        run.append(time.perf_counter() - toc)
    return 1e3 * float(np.median(host)), 1e3 * float(np.median(run))


def _chained(attend, q, caches):
    """32 layers' attention, each layer's queries the last one's output (as
    in a model, one layer's kernels run after the last one's)."""

    def run():
        x = q
        for k, v in caches:
            x = attend(x, k, v)
        return [x]

    return run


def attention(args):
    rng = np.random.default_rng(1)
    out, layers = {}, 32
    for kL in args.prompts:
        res = {}
        bf16 = [
            [mx.random.normal((1, 8, kL, 128)).astype(mx.bfloat16) for _ in range(2)]
            for _ in range(layers)
        ]
        q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
        mx.eval(bf16, q)

        def sdpa(x, k, v, mask=None):
            return mx.fast.scaled_dot_product_attention(x, k, v, scale=0.088, mask=mask)

        res["bf16_sdpa"] = 1e3 * _time(_chained(sdpa, q, bf16)) / layers
        host, run = _host_and_eval(_chained(sdpa, q, bf16))
        res["bf16_sdpa_host"], res["bf16_sdpa_eval"] = host / layers, run / layers
        del bf16
        for bits in (8, 4):
            caches = [_cache(rng, 1, 8, kL, 128, 64, bits) for _ in range(layers)]
            mx.eval(caches)

            def old(x, k, v, mask=None):
                return old_road(x, k, v, 0.088, mask, 64, bits)

            def kernel(x, k, v, mask=None):
                return qa.quantized_decode_attention(x, k, v, 0.088, mask, 64, bits)

            res[f"q{bits}_old"] = 1e3 * _time(_chained(old, q, caches)) / layers
            host, run = _host_and_eval(_chained(kernel, q, caches))
            res[f"q{bits}_kernel_host"] = host / layers
            res[f"q{bits}_kernel_eval"] = run / layers
            default = _settings()
            for kt, blocks, pf in VARIANTS:
                _settings(kt, blocks, pf)
                ms = 1e3 * _time(_chained(kernel, q, caches)) / layers
                res[f"q{bits}_kernel_{kt}_{blocks}_{int(pf)}"] = ms
            _settings(*default)
            for L in (2, 4, 8):
                qL = mx.random.normal((1, 32, L, 128)).astype(mx.bfloat16)
                m = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
                run = _chained(lambda x, k, v: kernel(x, k, v, "causal"), qL, caches)
                res[f"q{bits}_kernel_L{L}"] = 1e3 * _time(run) / layers
                run = _chained(lambda x, k, v: old(x, k, v, m), qL, caches)
                res[f"q{bits}_old_L{L}"] = 1e3 * _time(run) / layers
            del caches
            _fresh()
        out[str(kL)] = {k: round(v, 4) for k, v in res.items()}
        print(f"[qdecode] attention {kL} {out[str(kL)]}", file=sys.stderr, flush=True)
    return out


# The kernel's settings tried: keys per iteration, target blocks, prefetch.
VARIANTS = [(4, 256, 1), (2, 256, 0), (4, 512, 1), (4, 128, 1)]


def _settings(kt=None, blocks=None, pf=None):
    """Set the kernel's settings (those given); return them as they were."""
    was = base.DECODE_KEYS_PER_ITER, base.DECODE_BLOCKS, base.DECODE_PREFETCH
    if kt is not None:
        base.DECODE_KEYS_PER_ITER, base.DECODE_BLOCKS = kt, blocks
        base.DECODE_PREFETCH = bool(pf)
    return was


def _fastest(timings):
    """The kernel's settings of least total time over the lengths and bits
    measured."""
    total = {}
    for res in timings.values():
        for name, ms in res.items():
            if "_kernel_" in name and name.count("_") == 4:
                key = tuple(int(x) for x in name.split("_")[-3:])
                total[key] = total.get(key, 0.0) + ms
    return min(total, key=total.get)


def layer_steps(args):
    """A decode step's caches and attention alone: 32 layers' update and
    attention over ``kL`` tokens (one new token a layer), ms a step, each
    step evaluated (``synced``) or scheduled while the last runs
    (``pipelined``, as ``generate_step``); ``update`` leaves attention out."""
    from mlx_lm.models import cache as cache_module

    out = {}
    for kL in sorted({args.prompts[0], args.prompts[-1]}):
        for side, bits in (("bf16", None), ("q8", 8), ("q4", 4)):
            res = {}
            for what in ("update", "attention"):
                if bits is None:
                    caches = [cache_module.KVCache() for _ in range(args.layers)]
                else:
                    caches = [
                        cache_module.QuantizedKVCache(group_size=64, bits=bits)
                        for _ in range(args.layers)
                    ]
                for c in caches:
                    kv = mx.random.normal((2, 1, 8, kL, 128)).astype(mx.bfloat16)
                    c.update_and_fetch(kv[0], kv[1])
                    mx.eval(c.state)
                new = mx.random.normal((2, 1, 8, 1, 128)).astype(mx.bfloat16)
                q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
                mx.eval(new, q)

                def step():
                    outs = []
                    for c in caches:
                        k, v = c.update_and_fetch(new[0], new[1])
                        if what == "update":
                            outs.append((k, v))
                        else:
                            outs.append(
                                base.scaled_dot_product_attention(
                                    q, k, v, c, scale=0.088, mask=None
                                )
                            )
                    return outs

                synced = _time(step, 20)
                mx.synchronize()
                prev = step()
                mx.async_eval(prev)
                tic = time.perf_counter()
                for _ in range(20):
                    nxt = step()
                    mx.async_eval(nxt)
                    mx.eval(prev)
                    prev = nxt
                mx.eval(prev)
                pipelined = (time.perf_counter() - tic) / 20
                res[f"{what}_synced_ms"] = round(1e3 * synced, 3)
                res[f"{what}_pipelined_ms"] = round(1e3 * pipelined, 3)
                caches = prev = nxt = None  # freed before the next side
                _fresh()
            out[f"{kL}_{side}"] = res
            print(f"[qdecode] steps {kL} {side} {res}", file=sys.stderr, flush=True)
    return out
