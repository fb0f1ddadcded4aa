"""Decode cost of a ring with slack: one cache-only decode step.

``--layers`` rings of ``--max-size`` slots (``keep=4``), wrapped by a
prefill of ``--max-size + 100`` tokens, then decode steps: per layer
``update_and_fetch`` of one token and the fused single-query attention over
what it returns, one ``mx.eval`` per step. Sides: upstream's
``RotatingKVCache`` (its original methods), the patched ring without slack,
and with each ``--slack`` (an undo copy of ``slack`` tokens every ``slack``
steps). The sides take turns, ``--steps`` steps each per round over
``--rounds`` rounds, so a busy machine slows them alike. Times are the
median and the mean step in ms (the mean counts the copy steps);
``ring_buffers`` counts the distinct key buffers the first layer's ring had
during decode (1: written in place).

    python -m mlx_lm_patched.bench.slack [--rounds 5] [--out slack.json]
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

import mlx_lm_patched
from mlx_lm_patched import _registry
from mlx_lm_patched.caches import rotating_prealloc

from . import emit, header, parse_args


def upstream_ring():
    """``RotatingKVCache`` running the upstream methods the patch replaces."""
    originals = {
        t.attr: _registry.get_original(t.owner, t.attr)
        for t in rotating_prealloc.PATCH.targets
        if t.fingerprint is not None and t.owner.endswith(":RotatingKVCache")
    }
    return type("UpstreamRotatingKVCache", (RotatingKVCache,), originals)


def side(args, make):
    """Wrapped rings of every layer, and a closure running one decode step."""
    dtype = getattr(mx, args.dtype)
    KH, D = args.kv_heads, args.head_dim
    caches = [make() for _ in range(args.layers)]
    prefill = mx.random.normal((1, KH, args.max_size + 100, D)).astype(dtype)
    for c in caches:
        c.update_and_fetch(prefill, prefill)
    mx.eval([c.keys for c in caches])
    new = mx.random.normal((1, KH, 1, D)).astype(dtype)
    q = mx.random.normal((1, args.heads, 1, D)).astype(dtype)

    def step():
        out = []
        for c in caches:
            k, v = c.update_and_fetch(new, new)
            out.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0))
        mx.eval(out)
        keys = caches[0].keys
        return np.frombuffer(memoryview(keys), dtype=np.uint8).ctypes.data

    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--max-size", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slack", type=int, nargs="+", default=[4, 8, 32])
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out")
    args = parse_args(p, argv)
    result = header("slack", [p.name for p in mlx_lm_patched.PATCHES])
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    Upstream, n = upstream_ring(), args.max_size
    makers = {"upstream": lambda: Upstream(n, keep=4)}
    for s in [0, *args.slack]:
        makers[f"patched_slack_{s}"] = lambda s=s: RotatingKVCache(n, keep=4, slack=s)
    steps = {name: side(args, make) for name, make in makers.items()}
    times = {name: [] for name in steps}
    buffers = {name: set() for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            step()  # warm-up after the other sides ran
            for _ in range(args.steps):
                tic = time.perf_counter()
                buffers[name].add(step())
                times[name].append(1e3 * (time.perf_counter() - tic))
    for name in steps:
        result[name] = {
            "median_step_ms": round(statistics.median(times[name]), 4),
            "mean_step_ms": round(statistics.mean(times[name]), 4),
            "ring_buffers": len(buffers[name]),
        }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
