"""Disk tier writes: how long ``DiskPromptCache.put`` holds the caller, and
how long a stopping server waits for what is queued.

An entry of ``--layers`` ``KVCache`` layers of 1 x ``--kv-heads`` x
``--tokens`` x ``--head-dim`` random ``--dtype`` keys and values (default:
16 x 8 x 8,000 x 128 bfloat16, 524 MB) is ``put`` ``--repeat`` times, each
under other tokens, the queue empty: ``put_ms`` is the median time ``put``
held the caller, ``write_s`` the median time until the file was written
(``flush``); ``host_copy_ms`` is what ``put`` took before it queued the
arrays themselves (``prompt_cache_to_host``, the copy it made). Then
``--queued`` entries are put at once and ``close(timeout=drain_seconds)``
is timed: ``drain_s``, what a server stopped with SIGTERM waits, and how
many entries were left unwritten or dropped (the queue holds ``1G``).

With ``--blocks N``, the entry is also inserted ``--repeat`` times into a
``DiskLRUPromptCache`` whose prompt cache shares blocks of ``N`` tokens
(``prompt_cache_blocks``), each under other tokens (every block new) and
then once more behind the same prefix (only the tail new):
``insert_ms`` / ``insert_shared_ms`` are the median time ``insert_cache``
held the caller (the copy into blocks and ``put``), ``insert_whole_ms``
the same with no blocks (an entry stored whole), and ``dir_bytes`` the
directory once everything is written.

    python -m mlx_lm_patched.bench disk_write [--blocks 64]
"""

import argparse
import os
import statistics
import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import (
    DiskLRUPromptCache,
    DiskPromptCache,
    KVCache,
    PromptBlocks,
    prompt_cache_to_host,
)

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit, header, parse_args

MODEL_KEY = ("bench", None, None)


def entry(args):
    cache = []
    for _ in range(args.layers):
        shape = (1, args.kv_heads, args.tokens, args.head_dim)
        c = KVCache()
        k, v = (mx.random.normal(shape).astype(tiny.DTYPES[args.dtype]) for _ in "kv")
        c.state = (k, v, args.tokens)
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def run(args):
    cache = entry(args)
    tokens = list(range(3, args.tokens + 3))
    t = time.perf_counter()
    host = prompt_cache_to_host(cache)
    host_copy_s = time.perf_counter() - t
    nbytes = host.nbytes
    del host
    puts, writes = [], []
    with tempfile.TemporaryDirectory(prefix="mlx-lm-patched-disk-write-") as d:
        tier = DiskPromptCache(d, max_bytes=2 * nbytes + (1 << 20))
        for i in range(args.repeat):
            t = time.perf_counter()
            tier.put(MODEL_KEY, [i] + tokens, cache)
            puts.append(time.perf_counter() - t)
            tier.flush()
            writes.append(time.perf_counter() - t)
        dropped = tier.dropped
        for i in range(args.queued):
            tier.put(MODEL_KEY, [args.repeat + i] + tokens, cache)
        # Counted from what put did: the writer may have taken some already.
        dropped = tier.dropped - dropped
        queued = args.queued - dropped
        t = time.perf_counter()
        left = tier.close(timeout=tier.drain_seconds)
        drain_s = time.perf_counter() - t
    blocks = inserts(args, cache, tokens) if args.blocks else {}
    return {
        **blocks,
        "entry_bytes": nbytes,
        "put_ms": round(1e3 * statistics.median(puts), 2),
        "put_ms_all": [round(1e3 * s, 2) for s in puts],
        "write_s": round(statistics.median(writes), 3),
        "write_bytes_per_s": round(nbytes / statistics.median(writes)),
        "host_copy_ms": round(1e3 * host_copy_s, 1),
        "queued": queued,
        "dropped": dropped,
        "drain_s": round(drain_s, 3),
        "drain_limit_s": DiskPromptCache.drain_seconds,
        "left_unwritten": left,
    }


def inserts(args, cache, tokens):
    """Milliseconds ``DiskLRUPromptCache.insert_cache`` held the caller, per
    side, and the bytes of the directory it wrote (see the module)."""
    times = {"insert_ms": [], "insert_whole_ms": [], "insert_shared_ms": []}
    with tempfile.TemporaryDirectory(prefix="mlx-lm-patched-disk-write-") as d:
        tier = DiskPromptCache(d)
        for i in range(args.repeat):
            sides = (("insert_ms", args.blocks), ("insert_whole_ms", 1 << 40))
            for j, (side, size) in enumerate(sides):
                lru = DiskLRUPromptCache(tier, max_size=2)
                lru._blocks = PromptBlocks(size)
                own = [j, i] + tokens[2:]  # the cache's tokens, this side's own
                t = time.perf_counter()
                lru.insert_cache(MODEL_KEY, own, cache)
                times[side].append(1e3 * (time.perf_counter() - t))
                if side == "insert_ms":  # the same prefix, another last token
                    t = time.perf_counter()
                    lru.insert_cache(MODEL_KEY, own[:-1] + [1], cache)
                    times["insert_shared_ms"].append(1e3 * (time.perf_counter() - t))
                tier.flush()
                del lru
        dir_bytes = sum(e.stat().st_size for e in os.scandir(d))
        tier.close()
    out = {k: round(statistics.median(v), 1) for k, v in times.items()}
    out.update({f"{k}_all": [round(x, 1) for x in v] for k, v in times.items()})
    return {"blocks": args.blocks, **out, "dir_bytes": dir_bytes}


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.disk_write",
        description="How long put holds the caller; how long a stop drains.",
    )
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--dtype", default="bfloat16", choices=list(tiny.DTYPES))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--queued", type=int, default=2)
    p.add_argument("--blocks", type=int, help="also time inserts with these blocks")
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out", help="also write the JSON here")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    applied = [n for n, s in mlx_lm_patched.status().items() if s["applied"]]
    keys = ("layers", "kv_heads", "head_dim", "tokens", "dtype", "repeat")
    result = {
        **header("disk_write", applied),
        **{k: getattr(args, k) for k in keys},
        **run(args),
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
