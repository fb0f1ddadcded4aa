"""Window checkpoints: a prompt that branches past a sliding window.

A tiny gemma3_text (``--window`` 256: sliding and full layers) prefills a
``--first`` (1,500) token prompt into ``LRUPromptCache``; a second prompt
shares its first ``--shared`` (1,200) tokens and goes on with 40 others.
Per side, the tokens the prompt cache leaves to prefill, and how far the
logits after prefilling them are from a fresh prefill of the second prompt
(max abs difference). Sides: ``upstream`` (every patch reverted), ``main``
(patched, no checkpoints) and ``checkpoints`` (patched, a checkpoint every
``--every`` tokens). The cost: the first prompt's prefill time with and
without checkpoints (median of ``--rounds``, taking turns) on the tiny
model and on a cache-only stack (``--layers`` rings of ``--ring`` slots, 8
KV heads of 128, float16, ``--tokens`` in 2048-token chunks: the window
copies alone, no model), and the bytes the checkpoints hold, also in an
entry kept at rest at 8 and 4 bits (``LRUPromptCache(bits=...)``).

    python -m mlx_lm_patched.bench.checkpoints [--rounds 5] [--out checkpoints.json]
"""

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit, header, parse_args


def rings(every):
    """``make_prompt_cache``'s arguments for rings checkpointing every
    ``every`` tokens (none: upstream's, which has no such argument)."""
    return {"checkpoint_every": every} if every else {}


def prefill(model, tokens, cache, step):
    y = mx.array(tokens)[None]
    while y.shape[1]:
        logits = model(y[:, :step], cache=cache)[:, -1]
        mx.eval(logits, [c.state for c in cache])
        y = y[:, step:]
    return logits


def branch(model, first, second, step, every=0):
    """Tokens left to prefill of ``second`` after ``first`` is cached (rings
    checkpointing every ``every`` tokens), the logits' distance from a fresh
    prefill, the checkpoints' bytes."""
    from mlx_lm.models.cache import make_prompt_cache  # patched or not

    cache = make_prompt_cache(model, **rings(every))
    prefill(model, first, cache, step)
    taken = sum(x.nbytes for c in cache for x in getattr(c, "checkpoints", ()))
    store = LRUPromptCache()
    store.insert_cache("m", first, cache)
    fetched, rest = store.fetch_nearest_cache("m", second)
    fetched = fetched or make_prompt_cache(model, **rings(every))
    logits = prefill(model, rest, fetched, step)
    fresh = prefill(model, second, make_prompt_cache(model), step)
    diff = mx.abs(logits - fresh).max().item()
    return {"left_to_prefill": len(rest), "max_abs_logit_diff": diff, "bytes": taken}


def timed(run, sides, rounds):
    """Median seconds of each side's ``run(its stride)``, the sides taking turns."""
    times = {n: [] for n in sides}
    for r in range(rounds + 1):  # round 0 warms up
        for n, stride in sides.items():
            tic = time.perf_counter()
            run(stride)
            if r:
                times[n].append(time.perf_counter() - tic)
    return {n: round(statistics.median(t), 4) for n, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--first", type=int, default=1500)
    p.add_argument("--shared", type=int, default=1200)
    p.add_argument("--every", type=int, default=512)
    p.add_argument("--step", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ring", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out")
    args = parse_args(p, argv)
    result = header("checkpoints", [p.name for p in mlx_lm_patched.PATCHES])
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    first = [(7 * j + 3) % 500 + 10 for j in range(args.first)]
    second = first[: args.shared] + [(11 * j + 5) % 500 + 10 for j in range(40)]
    with tempfile.TemporaryDirectory() as d:
        model, _ = load(
            str(tiny.make_model_dir(d, "gemma3_text", sliding_window=args.window))
        )
    sides = {"main": 0, "checkpoints": args.every}
    mlx_lm_patched.revert()
    result["upstream"] = branch(model, first, second, args.step)
    mlx_lm_patched.apply()
    for name, stride in sides.items():
        result[name] = branch(model, first, second, args.step, stride)

    def tiny_prefill(stride):
        prefill(model, first, make_prompt_cache(model, **rings(stride)), args.step)

    result["tiny_prefill_s"] = timed(tiny_prefill, sides, args.rounds)
    chunk = mx.random.normal((1, 8, 2048, 128)).astype(mx.float16)

    def stack_prefill(stride):
        stack = [
            RotatingKVCache(args.ring, checkpoint_every=stride)
            for _ in range(args.layers)
        ]
        for _ in range(args.tokens // 2048):
            for c in stack:
                c.update_and_fetch(chunk, chunk)
            mx.eval([c.keys for c in stack])
        result["stack_checkpoint_bytes"] = sum(c.nbytes for c in stack) - sum(
            c.keys.nbytes + c.values.nbytes for c in stack
        )

    result["stack_prefill_s"] = timed(stack_prefill, sides, args.rounds)
    stack = [
        RotatingKVCache(args.ring, checkpoint_every=args.every)
        for _ in range(args.layers)
    ]
    for _ in range(args.tokens // 2048):
        for c in stack:
            c.update_and_fetch(chunk, chunk)
    mx.eval([c.keys for c in stack])
    # The stack's checkpoints in an entry at rest: as they are, and quantized
    tokens = list(range(args.tokens))
    for bits in (None, 8, 4):
        store = LRUPromptCache(bits=bits)
        store.insert_cache("m", tokens, stack)
        store._settle()  # at rest, as a server's next request puts it
        entry = store._trie.get("m", tokens).prompt_cache
        held = sum(x.nbytes for c in entry for x in c.checkpoints)
        result[f"stack_checkpoint_bytes_at_rest_{bits or 16}_bits"] = held
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
