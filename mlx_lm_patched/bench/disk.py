"""Disk tier: restoring a long prefix from ``DiskPromptCache`` vs prefilling it.

A random-weight llama of ``--layers`` x ``--hidden`` (``--heads`` query and
``--kv-heads`` KV heads of ``--head-dim``; ``--intermediate``, ``--vocab``)
prefills ``--prefix`` tokens in ``--chunk``-token steps, as
``generate_step`` does; the cache goes to a ``DiskPromptCache`` in a
temporary directory (``put`` on this thread, then the writer thread).
``restore`` is a fresh ``DiskPromptCache`` on that directory (the scan a
restart does) and ``get`` of the prefix plus ``--question`` new tokens,
evaluated; with ``--cold`` (the default) the file is first dropped from the
page cache, so it is read from the disk (``page_cache_drop`` says how:
``drop_caches``, ``os.sync()`` then ``/proc/sys/vm/drop_caches`` as root, or
else ``fadvise``, ``posix_fadvise(DONTNEED)`` on the file). ``bound`` is the
physical bound: the same file read cold by a plain parallel reader (the
tier's threads and chunk size, no checksum, no MLX). ``cost_model`` is what
a ``DiskLRUPromptCache`` that measured this prefill and this restore
chooses for the same prompt (``restore`` or ``recompute``), and the times it
expects. Both caches then decode ``--decode`` greedy tokens after the
question: ``same_tokens`` compares them. With ``--bits 8`` or ``4`` the
file holds the entry quantized at rest, as ``--prompt-cache-bits`` keeps it,
and the restore dequantizes it (``same_tokens`` then compares with the
unquantized cache). With ``--blocks N`` the entry is first cut into blocks
of N tokens, as the server's prompt cache holds it, so it is written as
block files and an entry file (``files``), and the plain reader reads them
all. Patched only: upstream has no disk tier.

    python -m mlx_lm_patched.bench.disk                      # CPU, 8 x 512
    python -m mlx_lm_patched.bench.disk --device gpu --layers 32 --hidden 4096 \\
        --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 \\
        --vocab 128256 --dtype bfloat16                      # Llama-8B shape
"""

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.models.prompt_cache_blocks import PromptBlocks
from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit, header, parse_args

MODEL_KEY = ("bench", None, None)


def build_model(args):
    config = tiny.model_config(
        "llama",
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.prefix + args.question + args.decode + 1,
    )
    return tiny.build_model(config, seed=0, dtype=args.dtype)


def prefill(model, tokens, chunk):
    cache = make_prompt_cache(model)
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[s : s + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def greedy(model, cache, tokens, n):
    steps = generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=cache)
    return [int(t) for t, _ in steps]


def drop_from_page_cache(directory):
    """Drop the files in ``directory`` from the page cache; say how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def read_parallel(paths, threads, chunk):
    """Read the files ``paths`` whole, each into one buffer, ``chunk`` bytes
    a read in ``threads`` threads: no checksum, no MLX. Returns the bytes
    read."""
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    views = [memoryview(np.empty(os.fstat(fd).st_size, np.uint8)) for fd in fds]

    def read(job):
        fd, view, at = job
        part, done = view[at : at + chunk], 0
        while done < len(part):
            done += os.preadv(fd, [part[done:]], at + done) or len(part)
        return done

    jobs = [(fd, v, at) for fd, v in zip(fds, views) for at in range(0, len(v), chunk)]
    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(read, jobs))
    finally:
        for fd in fds:
            os.close(fd)


def run(args):
    model = build_model(args)
    rng = mx.random.randint(3, args.vocab, (args.prefix + args.question,))
    tokens = rng.tolist()
    prefix, question = tokens[: args.prefix], tokens[args.prefix :]

    prefill(model, prefix[:64], args.chunk)  # warm-up
    t = time.perf_counter()
    cache = prefill(model, prefix, args.chunk)
    prefill_s = time.perf_counter() - t

    # Quantized at rest (--bits): the entry the server's prompt cache keeps.
    store = LRUPromptCache(bits=args.bits, group_size=args.group_size)
    entry = store._quantized([store._at_rest(c) for c in cache]) if args.bits else cache
    if args.blocks:
        entry = PromptBlocks(args.blocks).share(MODEL_KEY, prefix, entry)

    with tempfile.TemporaryDirectory(prefix="mlx-lm-patched-disk-") as d:
        tier = DiskPromptCache(d)
        t = time.perf_counter()
        tier.put(MODEL_KEY, prefix, entry)
        put_s = time.perf_counter() - t
        tier.flush()
        write_s = time.perf_counter() - t
        tier.close()
        file_bytes = tier.nbytes
        files = [os.path.join(d, n) for n in os.listdir(d) if n[0] != "."]
        dropped = drop_from_page_cache(d) if args.cold else None

        tier = DiskPromptCache(d)
        tier.read_threads = args.read_threads
        t = time.perf_counter()
        restored, rest = tier.get(MODEL_KEY, prefix + question)
        restored = store._working(restored)
        mx.eval([c.state for c in restored])
        restore_s = time.perf_counter() - t

        if args.cold:
            drop_from_page_cache(d)
        t = time.perf_counter()
        read_parallel(files, args.read_threads, tier.read_chunk)
        bound_s = time.perf_counter() - t

        # What the cost model, having measured both, chooses for this prompt.
        lru = DiskLRUPromptCache(tier, bits=args.bits, group_size=args.group_size)
        lru.observe_prefill(args.prefix, prefill_s)
        read_rate, prefill_rate = tier.read_rate, lru.prefill_rate
        chosen, _ = lru.fetch_nearest_cache(MODEL_KEY, prefix + question)

    expected = greedy(model, cache, question, args.decode)
    got = greedy(model, restored, rest, args.decode)
    return {
        "prefill_s": round(prefill_s, 4),
        "prefill_tokens_per_s": round(args.prefix / prefill_s, 1),
        "put_s": round(put_s, 4),
        "write_s": round(write_s, 4),
        "restore_s": round(restore_s, 4),
        "file_bytes": file_bytes,
        "files": len(files),
        "restore_bytes_per_s": round(file_bytes / restore_s),
        "restore_speedup": round(prefill_s / restore_s, 2),
        "page_cache_drop": dropped,
        "read_threads": args.read_threads,
        "bound_s": round(bound_s, 4),
        "bound_bytes_per_s": round(file_bytes / bound_s),
        "restore_vs_bound": round(restore_s / bound_s, 2),
        "cost_model": {
            "read_bytes_per_s": round(read_rate),
            "prefill_tokens_per_s": round(prefill_rate, 1),
            "expected_restore_s": round(file_bytes / read_rate, 4),
            "expected_prefill_s": round(args.prefix / prefill_rate, 4),
            "choice": "recompute" if chosen is None else "restore",
        },
        "tokens_left_to_prefill": len(rest),
        "same_tokens": got == expected,
        "tokens": got,
    }


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.disk",
        description="Restore a long prefix from the disk tier vs prefill it.",
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=list(tiny.DTYPES))
    p.add_argument("--prefix", type=int, default=7000)
    p.add_argument("--question", type=int, default=16)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop the file from the page cache before restoring (default: on)",
    )
    p.add_argument(
        "--read-threads",
        type=int,
        default=DiskPromptCache.read_threads,
        help="threads a restore and the plain reader read with",
    )
    p.add_argument(
        "--bits",
        type=int,
        choices=[4, 8],
        help="keep the entry quantized at rest, as --prompt-cache-bits does",
    )
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument(
        "--blocks",
        type=int,
        metavar="N",
        help="cut the entry into blocks of N tokens first, as the server's "
        "prompt cache does: block files and an entry file",
    )
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out", help="also write the JSON here")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    applied = [n for n, s in mlx_lm_patched.status().items() if s["applied"]]
    keys = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")
    result = {
        **header("disk", applied),
        "model": {k: getattr(args, k) for k in keys + ("vocab", "dtype")},
        "prefix": args.prefix,
        "question": args.question,
        "chunk": args.chunk,
        "cold": args.cold,
        "bits": args.bits,
        "blocks": args.blocks,
        **run(args),
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
